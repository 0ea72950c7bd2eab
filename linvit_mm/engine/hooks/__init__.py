from .attention_distill_hook import AttentionDistillHook

__all__ = ['AttentionDistillHook']
