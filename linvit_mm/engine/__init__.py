"""Runner-side pieces: the distillation and finite-loss hooks, optimizer wrappers and
constructors, the FSDP strategy and block wrap policy (registered in mmengine's root registries on
import, so every scope finds them) and the atomic checkpoint file backend
(``backend_args=dict(backend='atomic_local')``).
"""
from .fileio import AtomicLocalBackend
from .fsdp_strategy import ParamGroupFSDPStrategy
from .fsdp_wrap import linvit_block_wrap_policy
from .hooks import AttentionDistillHook, FiniteLossHook
from .optim_wrapper import CPUAmpOptimWrapper
from .optimizers import BackboneLayerDecayOptimWrapperConstructor
from .sharded_optim_wrapper import ShardedOptimWrapper
from .strict_load import ModelRecordHook

__all__ = ['AtomicLocalBackend', 'AttentionDistillHook',
           'BackboneLayerDecayOptimWrapperConstructor', 'CPUAmpOptimWrapper', 'FiniteLossHook',
           'ModelRecordHook', 'ParamGroupFSDPStrategy', 'ShardedOptimWrapper',
           'linvit_block_wrap_policy']
