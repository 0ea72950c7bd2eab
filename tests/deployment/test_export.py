"""Export of LinearViT models (``linvit_mm.deployment.export``): every registered operator
through ``torch.export`` and ONNX (onnxruntime) with a dynamic image size, against eager."""
import subprocess
import sys

import pytest
import torch
from mmpretrain.models import ImageClassifier

from linvit_mm.deployment import (check_inputs, compare_with_eager, export_program,
                                  program_to_onnx, run_onnx, run_program)
from linvit_mm.models.attention import attention_types
from linvit_mm.models.backbones import LinearViT

ARCH = dict(embed_dims=32, num_layers=1, num_heads=2, feedforward_channels=64)
SHAPE = (64, 64)
TOLERANCE = 1e-5
# Each ONNX graph costs seconds to trace and translate, so the operators are translated in
# two hybrids rather than in one graph each; every block's output is an output of the graph,
# so each operator is checked on its own block. Two, as a hybrid keeps one class-token
# convention: the operators that carry a class token, and those that pool the patch tokens
# (MHLA then ViT^3, also the hybrid case below).
FAMILIES = {'class-token': ('softmax', 'elu', 'hedgehog', 'inline', 'relu'),
            'pooled': ('mhla', 'ttt')}


def tiny_vit(attn_type, **kwargs):
    torch.manual_seed(0)
    return LinearViT(arch=ARCH, attn_type=attn_type, img_size=SHAPE, **kwargs).eval()


def hybrid_vit(names):
    """One block of each of ``names``, in order, every block's output returned."""
    layout = dict(default=names[-1], **{name: [i] for i, name in enumerate(names[:-1])})
    torch.manual_seed(0)
    return LinearViT(arch=dict(ARCH, num_layers=len(names)), attn_type=layout, img_size=SHAPE,
                     out_indices=list(range(len(names)))).eval()


def odd_grid_images(batch=1):
    """A 5 x 3 grid: rows and columns that MHLA's 2 x 2 blocks pad, a single image."""
    return torch.randn(batch, 3, 80, 48, generator=torch.Generator().manual_seed(3))


def dynamic_inputs(model):
    inputs = check_inputs(model, SHAPE, batch_size=2, dynamic=True) + [odd_grid_images()]
    assert [tuple(images.shape) for images in inputs[1:]] == [(3, 3, 80, 96), (1, 3, 80, 48)]
    return inputs


def assert_matches_eager(model, run, inputs):
    comparisons = compare_with_eager(model, run, inputs)
    assert len(comparisons) == len(inputs)
    for comparison in comparisons:
        assert comparison.max_abs_error <= TOLERANCE, str(comparison)


def made_once(make):
    """``key -> make(key)``, made on the first call for a key; a failure is raised again to
    every later caller instead of being retried."""
    made = {}

    def get(key):
        if key not in made:
            try:
                made[key] = make(key), None
            except Exception as error:  # raised again below, to every caller
                made[key] = None, error
        value, error = made[key]
        if error is not None:
            raise error
        return value

    return get


@pytest.fixture(scope='module')
def single_exports():
    """``attn_type -> (model, eager output, program)``: a one-block model, its output on the
    example before any export, and its dynamic program, once for the module."""

    def make(attn_type):
        model = tiny_vit(attn_type)
        with torch.no_grad():
            before = model(check_inputs(model, SHAPE)[0])[0]
        return model, before, export_program(model, SHAPE, batch_size=2, dynamic=True)

    return made_once(make)


@pytest.fixture(scope='module')
def hybrid_exports(tmp_path_factory):
    """``family -> (model, program, run_onnx)``: the hybrid of a family of :data:`FAMILIES`,
    its dynamic ``torch.export`` program and that program's ONNX graph, once for the
    module."""

    def make(family):
        model = hybrid_vit(FAMILIES[family])
        program = export_program(model, SHAPE, batch_size=2, dynamic=True)
        path = tmp_path_factory.mktemp('onnx') / f'{family}.onnx'
        program_to_onnx(program, path)
        return model, program, run_onnx(path)

    return made_once(make)


@pytest.fixture(scope='module')
def ttt_programs():
    """A ttt model and its static programs, with linvit_mm's operators and portable."""
    model = tiny_vit('ttt')
    return model, export_program(model, SHAPE), export_program(model, SHAPE, portable=True)


def test_the_onnx_families_hold_every_operator_once():
    names = [name for family in FAMILIES.values() for name in family]
    assert sorted(names) == sorted(attention_types())
    # the families' hybrids build, so each family shares one class-token convention
    assert [hybrid_vit(family).attn_types for family in FAMILIES.values()] == \
        [list(family) for family in FAMILIES.values()]


@pytest.mark.parametrize('attn_type', attention_types())
def test_every_operator_survives_torch_export_at_any_size(attn_type, single_exports):
    """One program for every multiple of the patch size and every batch: the example, a
    batch of 3 at 80 x 96 and a single 80 x 48 image all match eager."""
    model, _, program = single_exports(attn_type)
    assert_matches_eager(model, run_program(program), dynamic_inputs(model))


@pytest.mark.slow  # each family's ONNX graph: 20-40 s on 2 cores
@pytest.mark.parametrize('attn_type', attention_types())
def test_every_operator_survives_onnx_export_at_any_size(attn_type, hybrid_exports):
    """The block of ``attn_type`` in its family's ONNX graph matches eager on the inputs of
    the torch.export case."""
    family = next((name for name, family in FAMILIES.items() if attn_type in family), None)
    assert family is not None, f'{attn_type!r} is in none of FAMILIES: add it to one'
    model, _, run = hybrid_exports(family)
    block = FAMILIES[family].index(attn_type)
    assert model.attn_types[block] == attn_type
    for images in dynamic_inputs(model):
        with torch.no_grad():
            expected = model(images)
        got = run(images)
        assert len(got) == len(expected)
        assert got[block].shape == expected[block].shape
        error = (got[block].double() - expected[block].double()).abs().max().item()
        assert error <= TOLERANCE, \
            f'{attn_type} (block {block}), input {tuple(images.shape)}: max error {error:.3g}'


def graph_targets(program):
    """What the nodes of a program call, nested graphs (e.g. autocast regions) included."""
    return {str(node.target) for module in program.graph_module.modules()
            if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes}


@pytest.mark.slow  # shares the ONNX families' exports above
@pytest.mark.parametrize('fmt', ['torch-export', 'onnx'])
def test_a_hybrid_exports_at_any_size(fmt, hybrid_exports):
    """Blocks of different operators (MHLA then ViT^3) in one graph."""
    model, program, onnx_run = hybrid_exports('pooled')
    assert model.attn_types == ['mhla', 'ttt']
    run = onnx_run if fmt == 'onnx' else run_program(program)
    assert_matches_eager(model, run, dynamic_inputs(model))


def test_ttt_program_calls_the_inner_step_and_portable_one_only_pytorch(ttt_programs):
    model, program, portable = ttt_programs
    targets = graph_targets(program)
    assert 'linvit_mm.ttt_inner_forward.default' in targets
    # the position code's convolution is traced tap by tap: no operator of ours
    assert [t for t in targets if t.startswith('linvit_mm.')] == [
        'linvit_mm.ttt_inner_forward.default']
    # each parameter once (the backbone is not held twice by the exported module)
    assert len(program.state_dict) == len(model.state_dict())
    assert not [t for t in graph_targets(portable) if t.startswith('linvit_mm.')]
    assert_matches_eager(model, run_program(portable), check_inputs(model, SHAPE))


@pytest.mark.slow
def test_saved_programs_load_and_the_portable_one_without_linvit_mm(ttt_programs, tmp_path):
    model, program, portable_program = ttt_programs
    images = check_inputs(model, SHAPE)[0]
    with torch.no_grad():
        expected = model(images)[0]
    for portable, exported in ((False, program), (True, portable_program)):
        path = tmp_path / f'ttt_portable_{portable}.pt2'
        torch.export.save(exported, path)
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
def test_exporting_twice_leaves_eager_outputs_real(attn_type, single_exports):
    """The sin-cos position embedding is cached for eager calls only: a traced table never
    enters the cache, so a second export works and eager calls still get real tensors."""
    # after the eager call, the fixture exported the model once with dynamic shapes
    model, before, _ = single_exports(attn_type)
    export_program(model, SHAPE, batch_size=2)
    export_program(model, SHAPE, batch_size=2)
    export_program(model, SHAPE, batch_size=2, dynamic=True)
    with torch.no_grad():
        after = model(check_inputs(model, SHAPE)[0])[0]
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
