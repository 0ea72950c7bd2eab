"""tools/model_converters/linvit_to_timm.py: a config and checkpoint to a timm model file,
checked against the LinearViT, on the tiny test classifier."""
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

from linvit_mm.deployment import load_timm_vit
from linvit_mm.deployment.export import build_model

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'


@pytest.fixture(scope='module')
def tool():
    path = REPO / 'tools' / 'model_converters' / 'linvit_to_timm.py'
    spec = importlib.util.spec_from_file_location('linvit_to_timm', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_classifier_with_checkpoint_and_operator_settings(tool, tmp_path, capsys):
    options = ['model.backbone.attn_type=mhla', 'model.backbone.attn_cfg.num_blocks=[1,2]']
    cfg = Config.fromfile(TINY_CONFIG)
    cfg.merge_from_dict(dict(item.split('=') for item in options[:1]))
    cfg.model.backbone.attn_cfg = dict(num_blocks=[1, 2])
    trained = build_model(cfg)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(torch.randn_like(param) * .1)
    checkpoint, out = tmp_path / 'mhla.pth', tmp_path / 'mhla_timm.pth'
    torch.save({'state_dict': trained.state_dict()}, checkpoint)
    assert tool.main([str(TINY_CONFIG), str(checkpoint), str(out), '--cfg-options',
                      *options]) == 0
    log = capsys.readouterr().out
    assert "Converted the classifier (mhla) to timm VisionTransformer(global_pool='avg', " \
        'num_classes=6, dynamic_img_size=False)' in log
    assert 'Check against the LinearViT, input 1x3x32x32: max |exported - eager| = ' in log
    timm_model = load_timm_vit(out)
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(timm_model(images), trained(images, mode='tensor'),
                                   rtol=0, atol=1e-5)


def test_backbone_for_any_image_size(tool, tmp_path, capsys):
    out = tmp_path / 'backbone.pth'
    assert tool.main([str(TINY_CONFIG), str(out), '--backbone', '--dynamic-img-size',
                      '--cfg-options', 'model.backbone.pos_embed_antialias=True']) == 0
    log = capsys.readouterr().out
    assert log.count('Check against the LinearViT') == 2 and 'input 1x3x40x48' in log
    assert load_timm_vit(out)(torch.randn(1, 3, 24, 56)).shape == (1, 32)


@pytest.mark.parametrize('options, message', [
    (['--cfg-options', 'model.backbone.attn_type=relu+softmax@0'],
     r"a hybrid of \['relu', 'softmax'\]: timm builds every block's attention from one "
     r'attn_layer class'),
    (['--dynamic-img-size'], 'dynamic_img_size: timm resamples the position embedding'),
], ids=['hybrid', 'dynamic-img-size'])
def test_what_timm_cannot_express_is_one_line_and_exit_2(tool, tmp_path, capsys, options,
                                                         message):
    assert tool.main([str(TINY_CONFIG), str(tmp_path / 'x.pth'), *options]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and 'Traceback' not in err
    assert re.match('linvit_to_timm: error: not convertible to a timm VisionTransformer: '
                    + message, err)
    assert list(tmp_path.iterdir()) == []


def test_refusals_write_nothing(tool, tmp_path):
    out = tmp_path / 'x.pth'
    with pytest.raises(SystemExit):
        tool.parse_args([str(TINY_CONFIG), 'a.pth', 'b.pth', 'c.pth'])
    with pytest.raises(SystemExit):
        tool.parse_args([str(TINY_CONFIG), str(tmp_path / 'missing.pth'), str(out)])
    assert list(tmp_path.iterdir()) == []


def test_non_finite_weights_are_refused_and_never_copied(tool, tmp_path, capsys):
    model = build_model(Config.fromfile(TINY_CONFIG))
    state = model.state_dict()
    state['backbone.cls_token'][..., 0] = float('inf')
    checkpoint, out = tmp_path / 'inf.pth', tmp_path / 'inf_timm.pth'
    torch.save({'state_dict': state}, checkpoint)
    with pytest.raises(ValueError, match=r'backbone.cls_token: 1 Inf of 32'):
        tool.main([str(TINY_CONFIG), str(checkpoint), str(out)])
    assert not out.exists()
    assert tool.main([str(TINY_CONFIG), str(checkpoint), str(out), '--allow-non-finite']) == 1
    assert 'The timm model differs' in capsys.readouterr().err and not out.exists()
