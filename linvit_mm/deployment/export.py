"""Export of LinearViT models with ``torch.export`` and to ONNX, checked against eager.

What is exported is an images-to-outputs module (:class:`ImageModel`): a LinearViT
backbone (its tuple of outputs) or an mmpretrain classifier (its logits, as
``model(images, mode='tensor')`` returns them). Images are what the data preprocessor
produces (normalised, ``(B, C, H, W)`` float32); the preprocessing itself is not part of
the graph, as in mmdeploy's ``tensor`` inputs.

* :func:`export_program`: a ``torch.export`` program. It keeps linvit_mm's operators
  (``torch.ops.linvit_mm.*``, ViT^3's inner step) as nodes, so loading it with
  ``torch.export.load`` needs ``import linvit_mm.ops`` first; ``portable=True`` replaces
  them by their PyTorch forms (``linvit_mm.ops.torch_forms``) and the program loads with
  PyTorch alone.
* :func:`export_onnx`: the portable program translated by ``torch.onnx.export``
  (``dynamo=True``), checked with onnxruntime; :func:`program_to_onnx` does the
  translation for a program already exported.
* ``dynamic=True``: batch, height and width are symbols; height and width take any
  multiple of the patch size (``torch.export.Dim`` for the patch grid, times the patch
  size), so one graph serves every image size, square or not. The model code takes the
  same path for every size while traced (``linvit_mm.utils.tracing``).

Every export is checked against the eager model (:func:`compare_with_eager`): on the
example images and, for a dynamic export, on a second batch size and a non-square size
that is not the example's.
"""
import sys
from typing import NamedTuple

import torch
from torch import nn

FORMATS = ('torch-export', 'onnx')


def find_linear_vit(model):
    """The LinearViT of ``model`` (itself, or its ``backbone``); a clear error otherwise."""
    from ..models.backbones import LinearViT
    backbone = getattr(model, 'backbone', model)
    if not isinstance(backbone, LinearViT):
        raise TypeError(f'export takes a LinearViT or a model whose backbone is one; '
                        f'{type(model).__name__} has {type(backbone).__name__}')
    return backbone


class ImageModel(nn.Module):
    """``images -> outputs`` of a LinearViT backbone or an mmpretrain classifier: the one
    signature an exported graph has.

    A classifier (a model with ``extract_feat`` and ``head``, such as mmpretrain's
    ``ImageClassifier``) gives its logits, ``model(images, mode='tensor')``; a backbone its
    tuple of outputs.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.is_classifier = model is not find_linear_vit(model)
        self.training = model.training

    @property
    def backbone(self):
        # not a second attribute: the program would hold every parameter twice
        return find_linear_vit(self.model)

    @property
    def patch_size(self):
        return self.backbone.patch_size

    @property
    def in_channels(self):
        return self.backbone.patch_embed.projection.in_channels

    def forward(self, images):
        if self.is_classifier:
            return self.model(images, mode='tensor')
        return self.model(images)


def as_image_model(model):
    return model if isinstance(model, ImageModel) else ImageModel(model)


def check_shape(shape, patch_size):
    """``(H, W)`` as ints; each a positive multiple of ``patch_size``, or a clear error."""
    if len(shape) != 2 or not all(isinstance(side, int) and side > 0 for side in shape):
        raise ValueError(f'the image shape is (H, W) in pixels, got {shape!r}')
    bad = [side for side in shape if side % patch_size]
    if bad:
        raise ValueError(f'the image shape {tuple(shape)} is not a multiple of the patch size '
                         f'{patch_size} (sides {bad}); the patch embedding would drop the '
                         f'remainder. Use multiples of {patch_size}')
    return tuple(shape)


def example_images(image_model, shape, batch_size=1, seed=0):
    """Normal-distributed ``(batch_size, C, H, W)`` float32 images (the preprocessed scale)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, image_model.in_channels, *shape, generator=generator)


def dynamic_shapes(image_model):
    """``torch.export`` dynamic shapes: batch, and the patch grid's rows and columns times the
    patch size."""
    from torch.export import Dim
    patch = image_model.patch_size
    return {'images': {0: Dim('batch', min=1), 2: patch * Dim('grid_h', min=2),
                       3: patch * Dim('grid_w', min=2)}}


def _trace_example(image_model, shape, batch_size, dynamic):
    if dynamic and (batch_size < 2 or min(shape) < 2 * image_model.patch_size):
        # torch.export specialises sizes 0 and 1, so a symbol needs an example of 2 or more
        raise ValueError(f'a dynamic export traces with a batch of 2 or more and a patch grid '
                         f'of at least 2 x 2 ({2 * image_model.patch_size} px), got batch '
                         f'{batch_size} and {tuple(shape)}')
    return example_images(image_model, shape, batch_size)


def export_program(model, shape, batch_size=1, dynamic=False, portable=False):
    """``torch.export`` program of ``model`` (a LinearViT, a classifier with one, or an
    :class:`ImageModel`) on ``batch_size`` images of ``shape`` ``(H, W)``.

    ``dynamic``: batch, height and width symbolic (``batch_size >= 2`` and a grid of at
    least 2 x 2 to trace with). ``portable``: linvit_mm's operators replaced by their
    PyTorch forms. The model must be in eval mode (dropout and drop-path are traced as
    they are set).
    """
    from ..ops import torch_forms
    image_model = as_image_model(model)
    shape = check_shape(shape, image_model.patch_size)
    if image_model.training:
        raise ValueError('export a model in eval mode (model.eval()): in training mode '
                         'dropout and drop-path would be part of the graph')
    images = _trace_example(image_model, shape, batch_size, dynamic)
    with torch.no_grad():
        program = torch.export.export(image_model, (images, ),
                                      dynamic_shapes=dynamic_shapes(image_model) if dynamic
                                      else None)
    if portable:
        program = program.run_decompositions(torch_forms())
    return program


def export_onnx(model, shape, path, batch_size=1, dynamic=False, opset_version=None):
    """Write the ONNX graph of ``model`` to ``path``: the portable ``torch.export`` program
    (see :func:`export_program`) translated by ``torch.onnx.export``. Returns the
    ``ONNXProgram``."""
    program = export_program(model, shape, batch_size, dynamic=dynamic)
    return program_to_onnx(program, path, opset_version)


def program_to_onnx(program, path, opset_version=None):
    """Write the ONNX graph of a program of :func:`export_program` to ``path``: its
    portable form translated by ``torch.onnx.export``, what :func:`export_onnx` writes for
    the same arguments. A program already exported (and checked) for ``torch.export``
    thereby gives its ONNX graph without being traced again. Returns the ``ONNXProgram``."""
    from ..ops import torch_forms
    program = program.run_decompositions(torch_forms())
    onnx_program = torch.onnx.export(program, f=None, dynamo=True, optimize=True,
                                     opset_version=opset_version, verbose=False)
    onnx_program.save(str(path))
    return onnx_program


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    raise TypeError(f'the model returned {type(output).__name__}; export needs tensors or '
                    f'tuples of tensors')


class Comparison(NamedTuple):
    """How far an exported model's outputs are from the eager model's on one input."""

    input_shape: tuple
    max_abs_error: float
    max_abs_output: float

    @property
    def relative_error(self):
        return self.max_abs_error / max(self.max_abs_output, torch.finfo(torch.float32).tiny)

    def __str__(self):
        return (f'input {"x".join(map(str, self.input_shape))}: max |exported - eager| = '
                f'{self.max_abs_error:.3g} (outputs up to {self.max_abs_output:.3g}, relative '
                f'{self.relative_error:.3g})')


def check_inputs(image_model, shape, batch_size=1, dynamic=False):
    """The images an export is checked on: the example and, for a dynamic export, one more
    batch of another size and shape (a grid one patch taller and two wider)."""
    image_model = as_image_model(image_model)
    inputs = [example_images(image_model, shape, batch_size, seed=1)]
    if dynamic:
        patch = image_model.patch_size
        other = (shape[0] + patch, shape[1] + 2 * patch)
        inputs.append(example_images(image_model, other, batch_size + 1, seed=2))
    return inputs


def compare_with_eager(model, run_exported, inputs):
    """:class:`Comparison` of ``run_exported(images) -> outputs`` with the eager model on each
    of ``inputs``; outputs are matched in order (a tuple's tensors flattened)."""
    image_model = as_image_model(model)
    comparisons = []
    for images in inputs:
        with torch.no_grad():
            expected = _tensors(image_model(images))
        got = _tensors(run_exported(images))
        if [t.shape for t in got] != [t.shape for t in expected]:
            raise AssertionError(f'the exported model gave outputs of shapes '
                                 f'{[tuple(t.shape) for t in got]} where the eager model gives '
                                 f'{[tuple(t.shape) for t in expected]}')
        error = max((g.double() - e.double()).abs().max().item() for g, e in zip(got, expected))
        scale = max(e.abs().max().item() for e in expected)
        comparisons.append(Comparison(tuple(images.shape), error, scale))
    return comparisons


def within_tolerance(comparisons, tolerance, against, mismatch):
    """Print each :class:`Comparison` (``Check against {against}, ...``) and whether the worst
    relative error is at most ``tolerance``; if not, say so on stderr as ``{mismatch} by ...``
    (the tools then write nothing)."""
    for comparison in comparisons:
        print(f'Check against {against}, {comparison}')
    worst = max(c.relative_error for c in comparisons)
    if not worst <= tolerance:  # a NaN error fails too
        print(f'{mismatch} by {worst:.3g} of the largest output, more than --tolerance '
              f'{tolerance:g}: nothing written', file=sys.stderr)
        return False
    return True


DENSE_SCOPES = ('mmdet', 'mmseg')


def build_model(cfg, checkpoint=None, backbone=False, allow_non_finite=False):
    """The model of an mmpretrain, mmdet or mmseg config (an mmengine ``Config``) to export,
    in eval mode, with the ``checkpoint``'s weights (strictly; random init without one).

    A checkpoint with NaN or Inf weights is refused (``ValueError`` naming the tensors) before
    it is loaded, unless ``allow_non_finite`` (for inspecting a diverged run).

    mmpretrain: the classifier, or with ``backbone`` its backbone; mmdet / mmseg: the
    backbone (the detector's or segmentor's heads and test-time logic are not exported).
    The backbone must be a LinearViT (see :func:`find_linear_vit`).
    """
    from mmengine.registry import MODELS, init_default_scope
    from mmengine.runner.checkpoint import _load_checkpoint, _load_checkpoint_to_model

    from linvit_mm.transfer.formats import refuse_non_finite_checkpoint

    import linvit_mm.models  # noqa: F401  (registers LinearViT and the operators)
    scope = cfg.get('default_scope', 'mmpretrain')
    if scope not in ('mmpretrain', ) + DENSE_SCOPES:
        raise ValueError(f'default_scope {scope!r}: export takes mmpretrain, mmdet and mmseg '
                         f'configs')
    init_default_scope(scope)
    model = MODELS.build(cfg.model)
    find_linear_vit(model)  # refuses other backbones before the checkpoint is read
    if checkpoint is not None:
        loaded = _load_checkpoint(checkpoint, map_location='cpu')
        if not allow_non_finite:
            refuse_non_finite_checkpoint(loaded, checkpoint, advice=(
                'Nothing was written; pass --allow-non-finite to go on anyway (to inspect a '
                'diverged run).'))
        _load_checkpoint_to_model(model, loaded, strict=True)
    if backbone or scope in DENSE_SCOPES:
        model = model.backbone
    return model.eval()


def run_program(program):
    """``images -> outputs`` of a ``torch.export`` program."""
    module = program.module()
    return lambda images: module(images)


def run_onnx(path):
    """``images -> outputs`` of an ONNX file under onnxruntime (CPU)."""
    import onnxruntime
    session = onnxruntime.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    name = session.get_inputs()[0].name
    return lambda images: [torch.from_numpy(out) for out in
                           session.run(None, {name: images.numpy()})]
