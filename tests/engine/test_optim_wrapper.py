"""CPUAmpOptimWrapper: bf16 autocast on CPU, and the warning where the CPU has no bf16."""
import builtins
import io
import logging

import pytest
import torch
from mmengine.logging import MMLogger

from linvit_mm.engine import optim_wrapper
from linvit_mm.engine.optim_wrapper import CPUAmpOptimWrapper, cpu_has_native_bf16


@pytest.fixture
def log_records():
    records = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    logger = MMLogger.get_instance('test_optim_wrapper')  # the current MMLogger from here on
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def build():
    model = torch.nn.Linear(8, 4)
    return model, CPUAmpOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize('native_bf16', [False, True, None])
def test_warns_at_build_only_where_the_cpu_has_no_native_bf16(monkeypatch, log_records,
                                                              native_bf16):
    monkeypatch.setattr(optim_wrapper, 'cpu_has_native_bf16', lambda: native_bf16)
    build()
    warnings = [r.getMessage() for r in log_records if r.levelno == logging.WARNING]
    if native_bf16 is False:
        assert warnings == [optim_wrapper.SLOW_BF16_WARNING]
        assert 'about 10x slower than in fp32' in warnings[0] and '--amp' in warnings[0]
    else:
        assert warnings == []


def test_forward_runs_in_bf16_and_the_step_in_fp32():
    model, wrapper = build()
    with wrapper.optim_context(model):
        out = model(torch.randn(2, 8))
    assert out.dtype == torch.bfloat16
    wrapper.update_params(out.float().sum())
    assert model.weight.dtype == torch.float32 and model.weight.grad is None  # zeroed


def test_probe_asks_onednn():
    expected = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_has_native_bf16() is bool(expected)


@pytest.mark.parametrize('flags, expected', [
    ('fpu sse2 avx avx2 fma', False),  # AVX2 only: emulated bf16
    ('fpu avx2 avx512f avx512bw avx512vl', True),
    ('fpu avx2 avx512f avx512bw avx512_bf16 amx_bf16', True),
    (None, None),  # no /proc/cpuinfo: cannot tell
])
def test_probe_falls_back_to_cpu_flags(monkeypatch, flags, expected):
    def no_probe():
        raise RuntimeError('no such op')

    monkeypatch.setattr(torch.ops.mkldnn, '_is_mkldnn_bf16_supported', no_probe)
    real_open = builtins.open

    def fake_open(file, *args, **kwargs):
        if file != '/proc/cpuinfo':
            return real_open(file, *args, **kwargs)
        if flags is None:
            raise FileNotFoundError(file)
        return io.StringIO(f'processor\t: 0\nflags\t\t: {flags}\n')

    monkeypatch.setattr(builtins, 'open', fake_open)
    assert cpu_has_native_bf16() is expected
