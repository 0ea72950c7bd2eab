"""Small compute kernels of the attention operators (C++ on the CPU, PyTorch elsewhere)."""
from .depthwise import (conv_tokens, correlate3x3_reference, correlate_tokens,
                        depthwise3x3_reference, kernel_taps, position_code)
from .extension import cpu_kernels, use_cpu_kernels

__all__ = ['conv_tokens', 'correlate3x3_reference', 'correlate_tokens', 'cpu_kernels',
           'depthwise3x3_reference', 'kernel_taps', 'position_code', 'use_cpu_kernels']
