"""Analyses of a trained student against its Softmax teacher, behind the analysis tools
(``tools/analysis_tools/attention_fidelity.py``, ``select_hybrid_blocks.py``): loading the
pair, their per-block agreement, and DtR's selection of the blocks that keep Softmax."""
from .fidelity import (IMAGE_SUFFIXES, Agreement, BlockRecorder, compare_blocks, image_files,
                       packed_samples, preprocessed_batches, uses_patch_tokens_only)
from .hybrid_selection import (CRITERIA, AttentionSwap, Evaluator, best_subsets, build_hybrid,
                               check_budget, check_pair, cost_key, criterion_delta,
                               greedy_replace, hybrid_attn_type, hybrid_config_text,
                               hybrid_state, validation_batches)
from .student_teacher import (DISTILL_HOOK, backbone_of, backbone_state_from, build_model,
                      build_teacher, find_distill_hook, load_config, load_student,
                      load_teacher_weights)

__all__ = [
    'CRITERIA', 'DISTILL_HOOK', 'IMAGE_SUFFIXES', 'Agreement', 'AttentionSwap', 'BlockRecorder',
    'Evaluator', 'backbone_of', 'backbone_state_from', 'best_subsets', 'build_hybrid',
    'build_model', 'build_teacher', 'check_budget', 'check_pair', 'compare_blocks',
    'cost_key', 'criterion_delta', 'find_distill_hook', 'greedy_replace', 'hybrid_attn_type',
    'hybrid_config_text', 'hybrid_state', 'image_files', 'load_config', 'load_student',
    'load_teacher_weights', 'packed_samples', 'preprocessed_batches', 'uses_patch_tokens_only',
    'validation_batches'
]
