"""The staged recipe: checkpoint records, the strict LinearViT loader, block and LoRA merging.

Attention alignment (``AttentionAligner``), feature alignment (``FeatureAligner``) and
fine-tuning (dense or with mmpretrain's ``LoRAModel``) hand checkpoints from one stage to the
next; this package holds what they share. Importing it registers the ``LinearViTCheckpoint``
initialiser; ``linvit_mm.engine``, which every config imports, imports it.

The recipes that compare them at small scale (``tools/demo.py``,
``tools/analysis_tools/benchmark_recipes.py``): their stages and budgets in :mod:`.recipes`,
the demo's ViT shapes in :mod:`.demo_sources`, the running of the stages in
:mod:`.demo_stages`.
"""
from .block_merge import merge_aligned_blocks
from .loading import LinearViTCheckpointInit, load_linear_vit_checkpoint
from .files import check_output_path, read_checkpoint
from .lora import (LORA_TARGETS, find_lora_models, linear_layer_names, lora_base_digest,
                   lora_record, lora_record_differences, merge_lora_checkpoint,
                   merged_state_dict, unmatched_lora_targets)
from .record import (RECORD_KEY, checkpoint_record, describe_linear_vit, find_linear_vits,
                     model_record)
from .demo_sources import SOURCES, DemoConfigs, reshape_for_source
from .demo_stages import InProcessTools, Trained, run_recipe
from .recipes import DEMO_RECIPES, RECIPES, recipe_stages, split_budget, stage_options, summarise

__all__ = ['DEMO_RECIPES', 'DemoConfigs', 'InProcessTools', 'LORA_TARGETS', 'RECIPES',
           'RECORD_KEY', 'SOURCES', 'LinearViTCheckpointInit', 'Trained', 'check_output_path',
           'checkpoint_record', 'describe_linear_vit', 'find_linear_vits', 'find_lora_models',
           'linear_layer_names', 'load_linear_vit_checkpoint', 'lora_base_digest',
           'lora_record', 'lora_record_differences', 'merge_aligned_blocks',
           'merge_lora_checkpoint', 'merged_state_dict', 'model_record', 'read_checkpoint',
           'recipe_stages', 'reshape_for_source', 'run_recipe', 'split_budget',
           'stage_options', 'summarise', 'unmatched_lora_targets']
