"""--amp means bf16 wherever the device computes in it; fp16 only on GPUs without bf16 or when
asked (--amp-dtype fp16)."""
import importlib.util
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

from linvit_mm.engine import launch

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'


def tool(name):
    spec = importlib.util.spec_from_file_location(f'amp_{name}', REPO / 'tools' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize('cuda, bf16_supported, requested, expected', [
    (False, False, None, torch.bfloat16),
    (True, True, None, torch.bfloat16),
    (True, False, None, torch.float16),
    (True, True, 'fp16', torch.float16),
    (True, False, 'bf16', torch.bfloat16),
], ids=['cpu', 'ampere', 'volta', 'asked-fp16', 'asked-bf16'])
def test_amp_dtype_is_bf16_where_the_device_has_it(monkeypatch, cuda, bf16_supported, requested,
                                                   expected):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: cuda)
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda *a, **k: bf16_supported)
    assert launch.amp_dtype(requested) == expected


def test_fp16_on_a_cpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    with pytest.raises(ValueError, match='--amp-dtype fp16 needs CUDA'):
        launch.amp_dtype('fp16')


@pytest.mark.parametrize('bf16_supported, requested, dtype, loss_scale', [
    (True, None, 'bfloat16', None), (False, None, 'float16', 'dynamic'),
    (True, 'fp16', 'float16', 'dynamic')], ids=['bf16', 'old-gpu', 'asked-fp16'])
def test_train_amp_on_cuda_configures_the_wrapper(monkeypatch, bf16_supported, requested, dtype,
                                                  loss_scale):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda *a, **k: bf16_supported)
    cfg = Config.fromfile(str(TINY_CONFIG))
    note = launch.configure_amp(cfg, requested)
    assert cfg.optim_wrapper.type == 'AmpOptimWrapper' and cfg.optim_wrapper.dtype == dtype
    assert cfg.optim_wrapper.get('loss_scale') == loss_scale
    assert note == f'--amp: {dtype} autocast on CUDA'


def test_amp_dtype_needs_amp(capsys):
    for name in ('train', 'test'):
        argv = [str(TINY_CONFIG)] + (['x.pth'] if name == 'test' else []) + ['--amp-dtype',
                                                                            'fp16']
        with pytest.raises(SystemExit):
            tool(name).parse_args(argv)
        assert '--amp-dtype chooses the dtype of --amp: give --amp too' in capsys.readouterr().err
