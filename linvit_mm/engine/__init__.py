"""Runner-side pieces: the distillation and finite-loss hooks, optimizer wrappers and
constructors (registered in mmengine's root registries on import, so every scope finds
them) and the atomic checkpoint file backend (``backend_args=dict(backend='atomic_local')``).
"""
from .fileio import AtomicLocalBackend
from .hooks import AttentionDistillHook, FiniteLossHook
from .optim_wrapper import CPUAmpOptimWrapper
from .optimizers import BackboneLayerDecayOptimWrapperConstructor

__all__ = ['AtomicLocalBackend', 'AttentionDistillHook',
           'BackboneLayerDecayOptimWrapperConstructor', 'CPUAmpOptimWrapper', 'FiniteLossHook']
