"""The C++ kernels' build, switch and fallback (``ops/extension.py``)."""
import warnings

import pytest
import torch

import linvit_mm.ops.extension as extension
from linvit_mm.ops import (conv_tokens, correlate3x3_reference, correlate_tokens, cpu_kernels,
                           depthwise3x3_reference, set_cpu_kernels, ttt_inner_step,
                           use_cpu_kernels)
from linvit_mm.testing import assert_rel_close


def test_failed_build_warns_once_and_falls_back(monkeypatch, inner_step_inputs):
    monkeypatch.setattr(extension, '_extension', extension._UNLOADED)

    def no_compiler(*args, **kwargs):
        raise RuntimeError('no C++ compiler here')

    monkeypatch.setattr('torch.utils.cpp_extension.load', no_compiler)
    with pytest.warns(UserWarning, match='could not be built.*no C\\+\\+ compiler here'):
        assert cpu_kernels() is None
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert cpu_kernels() is None  # asked once only
        hw = (3, 3)
        x = torch.randn(1, 9, 4, dtype=torch.float64)
        taps = torch.randn(1, 9, 4, dtype=torch.float64)
        assert_rel_close(conv_tokens(x, taps, hw), depthwise3x3_reference(x, taps, hw), 1e-15)
        assert_rel_close(correlate_tokens(x, x, hw), correlate3x3_reference(x, x, hw), 1e-15)
        qkv, w1, w2, w3 = inner_step_inputs(0, hw)
        ttt_inner_step(qkv, w1, w2, w3, 2, 0, hw, 1.).sum().backward()


def test_environment_switch_skips_the_build(monkeypatch):
    monkeypatch.setattr(extension, '_extension', extension._UNLOADED)
    monkeypatch.setenv('LINVIT_MM_CPU_KERNELS', '0')
    monkeypatch.setattr('torch.utils.cpp_extension.load', lambda *a, **k: pytest.fail('built'))
    assert cpu_kernels() is None
    assert not use_cpu_kernels(torch.randn(2))


def test_set_cpu_kernels_switches_and_restores(kernels):
    x = torch.randn(2, 3)
    previous = set_cpu_kernels(False)
    try:
        assert not use_cpu_kernels(x)
        with set_cpu_kernels(True) as was_enabled:
            assert not was_enabled and use_cpu_kernels(x)
        assert not use_cpu_kernels(x)
    finally:
        set_cpu_kernels(previous)


def test_kernels_apply_to_cpu_float_tensors_with_unit_channel_stride(kernels):
    assert use_cpu_kernels(torch.randn(2, 3), torch.randn(3, dtype=torch.float64))
    assert not use_cpu_kernels(torch.randn(2, 3, dtype=torch.bfloat16))
    assert not use_cpu_kernels(torch.randn(2, 3).t())
    if torch.cuda.is_available():
        assert not use_cpu_kernels(torch.randn(2, 3, device='cuda'))
