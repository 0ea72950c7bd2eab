"""Operations of the attention operators that are more than a line of PyTorch.

``ttt_step`` and ``linear_attention`` define operators of the ``linvit_mm`` namespace
(``torch.ops.linvit_mm``), which ``torch.compile`` keeps as single nodes. ``torch.export``
keeps ViT^3's inner step too, and ``torch_forms`` is the table that decomposes it into PyTorch
operations; the fused kernels are never exported (the PyTorch form is traced instead).
"""
from .depthwise import (correlate3x3_reference, depthwise3x3_reference, depthwise3x3_tokens,
                        kernel_taps, position_code)
from .forms import torch_forms
from .ttt_step import ttt_inner_step

__all__ = ['correlate3x3_reference', 'depthwise3x3_reference', 'depthwise3x3_tokens',
           'kernel_taps', 'position_code', 'torch_forms', 'ttt_inner_step']
