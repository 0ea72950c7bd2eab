"""The staged recipe: checkpoint records, the strict LinearViT loader, block and LoRA merging.

Attention alignment (``AttentionAligner``), feature alignment (``FeatureAligner``) and
fine-tuning (dense or with mmpretrain's ``LoRAModel``) hand checkpoints from one stage to the
next; this package holds what they share. Importing it registers the ``LinearViTCheckpoint``
initialiser; ``linvit_mm.engine``, which every config imports, imports it.
"""
from .block_merge import merge_aligned_blocks
from .loading import LinearViTCheckpointInit, load_linear_vit_checkpoint
from .files import check_output_path, read_checkpoint
from .lora import (LORA_TARGETS, find_lora_models, linear_layer_names, lora_base_digest,
                   lora_record, lora_record_differences, merge_lora_checkpoint,
                   merged_state_dict, unmatched_lora_targets)
from .record import (RECORD_KEY, checkpoint_record, describe_linear_vit, find_linear_vits,
                     model_record)

__all__ = ['LORA_TARGETS', 'RECORD_KEY', 'LinearViTCheckpointInit', 'check_output_path',
           'checkpoint_record', 'describe_linear_vit', 'find_linear_vits', 'find_lora_models',
           'linear_layer_names', 'load_linear_vit_checkpoint', 'lora_base_digest',
           'lora_record', 'lora_record_differences', 'merge_aligned_blocks',
           'merge_lora_checkpoint', 'merged_state_dict', 'model_record', 'read_checkpoint',
           'unmatched_lora_targets']
