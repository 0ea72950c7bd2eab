"""bf16 mixed precision for CPU runs (``--amp`` on a machine without CUDA)."""
from contextlib import contextmanager

import torch
from mmengine.optim import OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS


@OPTIM_WRAPPERS.register_module()
class CPUAmpOptimWrapper(OptimWrapper):
    """Runs the forward under ``torch.autocast('cpu', dtype=bfloat16)``.

    mmengine's ``AmpOptimWrapper`` refuses to start without an accelerator. bf16
    keeps float32's exponent range, so no loss scaling is needed; parameters,
    gradients and optimizer state stay float32.
    """

    def __init__(self, *args, dtype=torch.bfloat16, **kwargs):
        super().__init__(*args, **kwargs)
        if dtype not in (torch.bfloat16, 'bfloat16'):
            raise ValueError(f'CPU autocast here supports bfloat16 only, got {dtype}')
        self.cast_dtype = torch.bfloat16

    @contextmanager
    def optim_context(self, model):
        with super().optim_context(model), torch.autocast('cpu', dtype=self.cast_dtype):
            yield
