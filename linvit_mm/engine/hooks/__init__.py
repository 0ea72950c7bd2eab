from .attention_distill_hook import AttentionDistillHook
from .finite_loss_hook import FiniteLossHook

__all__ = ['AttentionDistillHook', 'FiniteLossHook']
