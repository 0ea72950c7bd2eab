"""tools/deployment/export.py: a config (and checkpoint) to a checked ``.pt2`` or ``.onnx``
file, on the tiny test classifier."""
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

from linvit_mm.deployment import run_onnx
from linvit_mm.deployment.export import build_model

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
# The ONNX cases export a one-block classifier: the tool does the same for any depth, and the
# ONNX translation takes time for every node of the graph.
ONE_BLOCK = ['--cfg-options', 'model.backbone.arch.num_layers=1']


@pytest.fixture(scope='module')
def tool():
    path = REPO / 'tools' / 'deployment' / 'export.py'
    spec = importlib.util.spec_from_file_location('export_tool', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
    """A checkpoint of the tiny classifier whose weights are not the random init's, and the
    classifier holding them."""
    cfg = Config.fromfile(TINY_CONFIG)
    cfg.model.backbone.arch.num_layers = 1
    model = build_model(cfg)
    assert len(model.backbone.layers) == 1
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * .1)
    path = tmp_path_factory.mktemp('ckpt') / 'tiny.pth'
    torch.save({'state_dict': model.state_dict(), 'meta': {}}, path)
    return path, model


@pytest.mark.slow
def test_onnx_of_the_classifier_with_checkpoint_any_size(tool, checkpoint, tmp_path, capsys):
    path, trained = checkpoint
    out = tmp_path / 'tiny.onnx'
    assert tool.main([str(TINY_CONFIG), str(path), '--format', 'onnx', '--shape', '32', '48',
                      '--dynamic', '--out', str(out), *ONE_BLOCK]) == 0
    log = capsys.readouterr().out
    assert 'Exporting the classifier (logits) with --format onnx, dynamic shape, traced on ' \
        '2x3x32x48' in log
    assert log.count('Check against eager, input ') == 2 and 'input 3x3x40x64' in log
    assert f'wrote {out}' in log and 'Max error' in log
    assert sorted(p.name for p in tmp_path.iterdir()) == ['tiny.onnx']
    images = torch.randn(5, 3, 56, 24)
    with torch.no_grad():
        expected = trained(images, mode='tensor')
    logits, = run_onnx(out)(images)
    assert logits.shape == (5, 6)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_torch_export_of_a_ttt_backbone(tool, tmp_path, capsys):
    out = tmp_path / 'backbone.pt2'
    assert tool.main([str(TINY_CONFIG), '--format', 'torch-export', '--shape', '32',
                      '--backbone', '--out', str(out), '--cfg-options',
                      'model.backbone.attn_type=ttt']) == 0
    log = capsys.readouterr().out
    assert 'Exporting the backbone (LinearViT, ttt) with --format torch-export, static shape, ' \
        'traced on 1x3x32x32' in log
    # the program convolves tap by tap where eager code calls F.conv2d: float32 rounding apart
    error = re.search(r'max \|exported - eager\| = (\S+) ', log)
    assert error and float(error.group(1)) < 1e-5, log
    program = torch.export.load(out)
    assert any(str(node.target) == 'linvit_mm.ttt_inner_forward.default'
               for module in program.graph_module.modules()
               if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes)


def test_a_failed_check_writes_nothing(tool, tmp_path, capsys):
    out = tmp_path / 'tiny.onnx'
    assert tool.main([str(TINY_CONFIG), '--format', 'onnx', '--shape', '32', '--out', str(out),
                      '--tolerance', '1e-30', *ONE_BLOCK]) == 1
    assert 'more than --tolerance 1e-30: nothing written' in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize('argv,message', [
    (['--format', 'onnx', '--shape', '32', '--out', 'x.pt2'], 'a onnx file ends with .onnx'),
    (['--format', 'onnx', '--shape', '32', '--portable', '--out', 'x.onnx'],
     '--portable concerns --format torch-export'),
    (['--format', 'onnx', '--shape', '32', '32', '32', '--out', 'x.onnx'],
     r'--shape takes one or two positive sizes \(H W\), got \[32, 32, 32\]'),
    (['missing.pth', '--format', 'onnx', '--shape', '32', '--out', 'x.onnx'],
     "checkpoint 'missing.pth' does not exist"),
])
def test_bad_arguments_are_refused(tool, argv, message, capsys):
    with pytest.raises(SystemExit):
        tool.parse_args([str(TINY_CONFIG)] + argv)
    assert re.search(message, capsys.readouterr().err)


def test_an_out_that_is_a_directory_is_refused_before_export(tool, tmp_path, capsys):
    out = tmp_path / 'tiny.onnx'
    out.mkdir()
    with pytest.raises(SystemExit):
        tool.main([str(TINY_CONFIG), '--format', 'onnx', '--shape', '32', '--out', str(out)])
    assert f"--out '{out}' is a directory; give the file to write, e.g. {out}/model.onnx" \
        in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [out] and list(out.iterdir()) == []


def test_shape_off_the_patch_grid_is_refused_before_export(tool, tmp_path):
    with pytest.raises(ValueError, match=r'not a multiple of the patch size 8 \(sides \[36\]\)'):
        tool.main([str(TINY_CONFIG), '--format', 'onnx', '--shape', '32', '36', '--out',
                   str(tmp_path / 'x.onnx')])
    assert list(tmp_path.iterdir()) == []


def nan_checkpoint(checkpoint, tmp_path):
    path, trained = checkpoint
    state = {key: value.clone() for key, value in trained.state_dict().items()}
    state['backbone.layers.0.ffn.layers.1.weight'][0, 0] = float('nan')
    nan_path = tmp_path / 'nan.pth'
    torch.save({'state_dict': state, 'meta': {}}, nan_path)
    return nan_path


def test_non_finite_weights_are_refused_by_name_and_a_nan_check_never_passes(
        tool, checkpoint, tmp_path, capsys):
    nan_path = nan_checkpoint(checkpoint, tmp_path)
    out = tmp_path / 'nan.pt2'
    with pytest.raises(ValueError, match=r'(?s)1 tensor\(s\) hold non-finite.*'
                       r'backbone.layers.0.ffn.layers.1.weight: 1 NaN of .*--allow-non-finite'):
        tool.main([str(TINY_CONFIG), str(nan_path), '--format', 'torch-export', '--shape', '32',
                   '--out', str(out), *ONE_BLOCK])
    assert not out.exists()
    # opted out, the export runs, and its NaN error against eager fails the check
    assert tool.main([str(TINY_CONFIG), str(nan_path), '--format', 'torch-export', '--shape',
                      '32', '--out', str(out), '--allow-non-finite', *ONE_BLOCK]) == 1
    assert 'nothing written' in capsys.readouterr().err
    assert not out.exists()
