"""Custom autograd operations of the attention operators and their C++ CPU halves.

``set_cpu_kernels`` switches between the C++ kernels and their PyTorch forms (the same
computation) for every operation here. The kernels run as operators of the ``linvit_mm``
namespace (``torch.ops.linvit_mm``), which ``torch.export`` keeps as nodes; ``torch_forms``
is the table that decomposes them into their PyTorch forms.
"""
from .depthwise import (conv_tokens, correlate3x3_reference, correlate_tokens,
                        depthwise3x3_reference, depthwise_conv2d, kernel_taps, position_code)
from .extension import cpu_kernels, set_cpu_kernels, torch_forms, use_cpu_kernels
from .ttt_step import ttt_inner_step

__all__ = ['conv_tokens', 'correlate3x3_reference', 'correlate_tokens', 'cpu_kernels',
           'depthwise3x3_reference', 'depthwise_conv2d', 'kernel_taps', 'position_code',
           'set_cpu_kernels', 'torch_forms', 'ttt_inner_step', 'use_cpu_kernels']
