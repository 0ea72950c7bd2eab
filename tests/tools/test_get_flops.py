"""tools/analysis_tools/get_flops.py: mmpretrain's command line and output, linvit_mm's counts,
on the tiny test classifier and the demo's mmdet and mmseg configs."""
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

from linvit_mm.models.attention import attention_class
from linvit_mm.utils.complexity import count_macs

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
DEMO = REPO / 'configs' / 'demo'


@pytest.fixture(scope='module')
def tool():
    path = REPO / 'tools' / 'analysis_tools' / 'get_flops.py'
    spec = importlib.util.spec_from_file_location('get_flops', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def norm_flops(backbone, image_shape):
    """mmengine's LayerNorm count (5 per element), which the MAC count leaves out."""
    elements = []
    handles = [m.register_forward_pre_hook(lambda m, args: elements.append(args[0].numel()))
               for m in backbone.modules() if isinstance(m, torch.nn.LayerNorm)]
    with torch.no_grad():
        backbone(torch.randn(1, *image_shape))
    for handle in handles:
        handle.remove()
    return 5 * sum(elements)


@pytest.mark.parametrize('attn_type', ['softmax', 'relu', 'ttt'])
def test_classifier_prints_upstream_report_with_linvit_counts(tool, capsys, attn_type):
    results = tool.main([str(TINY_CONFIG), '--shape', '40', '--cfg-options',
                         f'model.backbone.attn_type={attn_type}'])
    out = capsys.readouterr().out
    # mmpretrain's report: the model tree, the table, then the summary block
    assert re.search(r'Input shape: \(3, 40, 40\)\nFlops: \S+\nParams: \S+\nActivation: \S+\n',
                     out)
    assert f'Flops: {results["flops_str"]}\n' in out
    assert '| module' in out and '|    backbone.layers.0 ' in out
    assert f'(attn): {attention_class(attn_type).__name__}(' in out
    assert '!!!Only the backbone network is counted in FLOPs analysis.' in out
    cfg = Config.fromfile(TINY_CONFIG)
    cfg.model.backbone.attn_type = attn_type
    from mmpretrain.registry import MODELS
    backbone = MODELS.build(cfg.model.backbone)
    backbone.eval()
    assert results['flops'] == count_macs(backbone, 40)['total'] + norm_flops(backbone,
                                                                              (3, 40, 40))


def test_two_sizes_are_height_and_width(tool, capsys):
    tool.main([str(TINY_CONFIG), '--shape', '24', '48'])
    assert 'Input shape: (3, 24, 48)' in capsys.readouterr().out


@pytest.mark.parametrize('config, shape, counted', [
    ('mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py', (3, 64, 96), 'LinearViTAdapter'),
    ('upernet_linvit-adapter-relu-mini_mini-ade.py', (3, 64, 96), 'LinearViTAdapter'),
    ('upernet_linvit-plain-relu-mini_mini-ade.py', (3, 64, 96), 'LinearViTPlainPyramid'),
], ids=['mmdet-pads-to-32', 'mmseg-pads-to-32', 'mmseg-plain'])
def test_dense_configs_count_the_backbone(tool, capsys, config, shape, counted):
    results = tool.main([str(DEMO / config), '--shape', '50', '70'])
    out = capsys.readouterr().out
    assert f'Input shape: {shape}' in out
    assert f'!!!Only the backbone network ({counted}) is counted in FLOPs analysis.' in out
    assert '(attn): ReLUAttention(' in results['out_arch']
    # the ViT's blocks, counted like the backbone benchmark counts them, and the neck's own
    # parts (the adapter's deformable attention, convolutions) on top
    adapter, _ = tool.build_analysed_model(Config.fromfile(DEMO / config))
    assert results['flops'] > count_macs(adapter.vit, shape[1:])['blocks'] > 0


@pytest.mark.parametrize('argv, message', [
    (['--shape', '1', '2', '3'], 'one or two positive sizes'),
    (['--shape', '0'], 'one or two positive sizes'),
], ids=['three-sizes', 'zero'])
def test_bad_shape_is_refused(tool, capsys, argv, message):
    with pytest.raises(SystemExit):
        tool.parse_args([str(TINY_CONFIG), *argv])
    assert message in capsys.readouterr().err


def test_unknown_scope_is_refused(tool):
    cfg = Config.fromfile(TINY_CONFIG)
    cfg.default_scope = 'mmaction'
    with pytest.raises(ValueError, match="default_scope 'mmaction'"):
        tool.build_analysed_model(cfg)
