"""Export of LinearViT models (``linvit_mm.deployment.export``): every registered operator
through ``torch.export`` and ONNX (onnxruntime) with a dynamic image size, against eager."""
import subprocess
import sys

import pytest
import torch
from mmpretrain.models import ImageClassifier

from linvit_mm.deployment import (check_inputs, compare_with_eager, export_onnx, export_program,
                                  run_onnx, run_program)
from linvit_mm.models.attention import attention_types
from linvit_mm.models.backbones import LinearViT

ARCH = dict(embed_dims=32, num_layers=1, num_heads=2, feedforward_channels=64)
SHAPE = (64, 64)
TOLERANCE = 1e-5


def tiny_vit(attn_type, **kwargs):
    torch.manual_seed(0)
    return LinearViT(arch=ARCH, attn_type=attn_type, img_size=SHAPE, **kwargs).eval()


def odd_grid_images(batch=1):
    """A 5 x 3 grid: rows and columns that MHLA's 2 x 2 blocks pad, a single image."""
    return torch.randn(batch, 3, 80, 48, generator=torch.Generator().manual_seed(3))


def assert_matches_eager(model, run, inputs):
    comparisons = compare_with_eager(model, run, inputs)
    assert len(comparisons) == len(inputs)
    for comparison in comparisons:
        assert comparison.max_abs_error <= TOLERANCE, str(comparison)


@pytest.mark.parametrize('attn_type', attention_types())
def test_every_operator_survives_torch_export_at_any_size(attn_type):
    """One program for every multiple of the patch size and every batch: the example, a
    batch of 3 at 80 x 96 and a single 80 x 48 image all match eager."""
    model = tiny_vit(attn_type)
    program = export_program(model, SHAPE, batch_size=2, dynamic=True)
    inputs = check_inputs(model, SHAPE, batch_size=2, dynamic=True) + [odd_grid_images()]
    assert [tuple(images.shape) for images in inputs[1:]] == [(3, 3, 80, 96), (1, 3, 80, 48)]
    assert_matches_eager(model, run_program(program), inputs)


@pytest.mark.parametrize('attn_type', attention_types())
def test_every_operator_survives_onnx_export_at_any_size(attn_type, tmp_path):
    model = tiny_vit(attn_type)
    path = tmp_path / f'{attn_type}.onnx'
    export_onnx(model, SHAPE, path, batch_size=2, dynamic=True)
    inputs = check_inputs(model, SHAPE, batch_size=2, dynamic=True) + [odd_grid_images()]
    assert_matches_eager(model, run_onnx(path), inputs)


def graph_targets(program):
    """What the nodes of a program call, nested graphs (e.g. autocast regions) included."""
    return {str(node.target) for module in program.graph_module.modules()
            if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes}


@pytest.mark.parametrize('fmt', ['torch-export', 'onnx'])
def test_a_hybrid_exports_at_any_size(fmt, tmp_path):
    """Blocks of different operators (MHLA then ViT^3) in one graph."""
    torch.manual_seed(0)
    model = LinearViT(arch=dict(ARCH, num_layers=2), attn_type=dict(default='ttt', mhla=[0]),
                      img_size=SHAPE).eval()
    assert model.attn_types == ['mhla', 'ttt']
    if fmt == 'onnx':
        export_onnx(model, SHAPE, tmp_path / 'hybrid.onnx', batch_size=2, dynamic=True)
        run = run_onnx(tmp_path / 'hybrid.onnx')
    else:
        run = run_program(export_program(model, SHAPE, batch_size=2, dynamic=True))
    inputs = check_inputs(model, SHAPE, batch_size=2, dynamic=True) + [odd_grid_images()]
    assert_matches_eager(model, run, inputs)


def test_ttt_program_calls_the_kernels_and_portable_one_only_pytorch():
    model = tiny_vit('ttt')
    program = export_program(model, SHAPE)
    assert {'linvit_mm.ttt_inner_forward.default',
            'linvit_mm.depthwise3x3.default'} <= graph_targets(program)
    # each parameter once (the backbone is not held twice by the exported module)
    assert len(program.state_dict) == len(model.state_dict())
    portable = export_program(model, SHAPE, portable=True)
    assert not [t for t in graph_targets(portable) if t.startswith('linvit_mm.')]
    assert_matches_eager(model, run_program(portable), check_inputs(model, SHAPE))


def test_saved_programs_load_and_the_portable_one_without_linvit_mm(tmp_path):
    model = tiny_vit('ttt')
    images = check_inputs(model, SHAPE)[0]
    with torch.no_grad():
        expected = model(images)[0]
    for portable in (False, True):
        path = tmp_path / f'ttt_portable_{portable}.pt2'
        torch.export.save(export_program(model, SHAPE, portable=portable), path)
        loaded = torch.export.load(path)
        torch.testing.assert_close(loaded.module()(images)[0], expected, rtol=0, atol=TOLERANCE)
    torch.save(images, tmp_path / 'images.pt')
    torch.save(expected, tmp_path / 'expected.pt')
    script = ('import sys, torch\n'
              f'program = torch.export.load({str(path)!r})\n'
              f'out = program.module()(torch.load({str(tmp_path / "images.pt")!r}))[0]\n'
              f'torch.testing.assert_close(out, torch.load({str(tmp_path / "expected.pt")!r}),'
              f' rtol=0, atol={TOLERANCE})\n'
              "assert not [m for m in sys.modules if m.startswith('linvit_mm')]\n")
    subprocess.run([sys.executable, '-c', script], check=True, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize('attn_type', ['mhla', 'ttt'])
def test_exporting_twice_leaves_eager_outputs_real(attn_type):
    """The sin-cos position embedding is cached for eager calls only: a traced table never
    enters the cache, so a second export works and eager calls still get real tensors."""
    model = tiny_vit(attn_type)
    images = check_inputs(model, SHAPE)[0]
    with torch.no_grad():
        before = model(images)[0]
    for dynamic in (False, True):
        export_program(model, SHAPE, batch_size=2, dynamic=dynamic)
        export_program(model, SHAPE, batch_size=2, dynamic=dynamic)
    with torch.no_grad():
        after = model(images)[0]
    assert type(after) is torch.Tensor
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_classifier_exports_its_logits():
    classifier = ImageClassifier(
        backbone=dict(type='LinearViT', arch=ARCH, attn_type='relu', img_size=SHAPE),
        head=dict(type='LinearClsHead', num_classes=5, in_channels=32)).eval()
    program = export_program(classifier, SHAPE, batch_size=2, dynamic=True)
    inputs = check_inputs(classifier, SHAPE, batch_size=2, dynamic=True)
    assert_matches_eager(classifier, run_program(program), inputs)
    assert program.module()(inputs[1]).shape == (3, 5)


def test_bad_requests_are_refused_before_tracing():
    model = tiny_vit('relu')
    with pytest.raises(ValueError, match=r'not a multiple of the patch size 16 \(sides \[70\]\)'):
        export_program(model, (64, 70))
    with pytest.raises(ValueError, match='batch of 2 or more.*got batch 1'):
        export_program(model, SHAPE, dynamic=True)
    with pytest.raises(ValueError, match=r'at least 2 x 2 \(32 px\).*\(16, 64\)'):
        export_program(model, (16, 64), batch_size=2, dynamic=True)
    with pytest.raises(ValueError, match='eval mode'):
        export_program(model.train(), SHAPE)
    with pytest.raises(TypeError, match='whose backbone is one; Linear has Linear'):
        export_program(torch.nn.Linear(2, 2), SHAPE)
