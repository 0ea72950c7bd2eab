"""tools/model_converters/linear_release_to_linvit.py: a release file in, a LinearViT
checkpoint out that loads strictly and computes the official forward; errors named, nothing
written."""
import importlib.util
from pathlib import Path

import pytest
import torch

import linvit_mm.staged  # noqa: F401  (registers LinearViTCheckpoint)
from linvit_mm.models import LinearViT
from linvit_mm.testing import assert_rel_close

REPO = Path(__file__).resolve().parents[2]


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = load('linear_release_to_linvit', 'tools/model_converters/linear_release_to_linvit.py')
# The release layouts and the transcriptions of the official forwards.
releases = load('linear_release_layouts', 'tests/transfer/test_linear_releases.py')


@pytest.mark.parametrize('family', ['vit3', 'inline', 'mhla'])
def test_release_converts_and_loads(family, tmp_path, capsys):
    state = releases.release_state(family)
    src, out = tmp_path / 'release.pth', tmp_path / 'out' / 'linvit.pth'
    torch.save({'model': state, 'epoch': 299}, src)
    heads = releases.NUM_HEADS[family]
    assert tool.main([str(src), str(out)] + (['--num-heads', str(heads)] if heads else [])) == 0
    printed = capsys.readouterr().out
    assert f"'attn_type': '{ {'vit3': 'ttt', 'inline': 'inline', 'mhla': 'mhla'}[family] }'" \
        in printed
    assert "'type': 'LinearViTCheckpoint'" in printed
    converted = releases.convert_linear_release(state, num_heads=heads)
    cfg = {k: v for k, v in converted.model_cfg.items() if k != 'type'}
    vit = LinearViT(**cfg, init_cfg=dict(type='LinearViTCheckpoint', checkpoint=str(out)))
    vit.init_weights()
    vit = vit.double().eval()
    x = releases.images()
    with torch.no_grad():
        assert_rel_close(vit(x)[0], releases.OFFICIAL[family](x, state)[0], 1e-6,
                         'converted model vs the official forward')


def test_errors_are_named_and_nothing_is_written(tmp_path, capsys):
    state = releases.release_state('inline')
    state['blocks.0.attn.extra'] = torch.zeros(2)
    src, out = tmp_path / 'release.pth', tmp_path / 'linvit.pth'
    torch.save(state, src)
    assert tool.main([str(src), str(out)]) == 1
    assert 'blocks.0.attn.extra' in capsys.readouterr().err
    assert not out.exists()
    assert tool.main([str(tmp_path / 'missing.pth'), str(out)]) == 1
    assert 'can not be found' in capsys.readouterr().err
    assert tool.main([str(src), str(tmp_path)]) == 1
    assert 'is a directory' in capsys.readouterr().err
