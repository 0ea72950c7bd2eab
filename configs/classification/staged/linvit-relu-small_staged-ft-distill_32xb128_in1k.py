# Staged recipe, stage 3 with the paper's joint attention distillation (AttentionDistillHook,
# lambda 50) beside the supervised fine-tuning of the aligned relu ViT-S. Other sizes: the
# same two lines on their *_staged-ft_* config.
_base_ = ['./linvit-relu-small_staged-ft_32xb128_in1k.py']

custom_hooks = [{{_base_.distill_hook}}]
