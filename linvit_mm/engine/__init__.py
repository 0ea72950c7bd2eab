"""Runner-side pieces: the distillation hook, optimizer wrappers and constructors
(registered in mmengine's root registries on import, so every scope finds them)."""
from .hooks import AttentionDistillHook
from .optim_wrapper import CPUAmpOptimWrapper
from .optimizers import BackboneLayerDecayOptimWrapperConstructor

__all__ = ['AttentionDistillHook', 'BackboneLayerDecayOptimWrapperConstructor',
           'CPUAmpOptimWrapper']
