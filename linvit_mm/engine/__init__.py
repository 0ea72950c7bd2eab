"""Runner-side pieces: the distillation hook and optimizer wrappers (registered on import)."""
from .hooks import AttentionDistillHook
from .optim_wrapper import CPUAmpOptimWrapper

__all__ = ['AttentionDistillHook', 'CPUAmpOptimWrapper']
