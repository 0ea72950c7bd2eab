#!/usr/bin/env python
"""Export the LinearViT model of a config with ``torch.export`` or to ONNX, checked against eager.

    python tools/deployment/export.py CONFIG [CHECKPOINT] --format {torch-export,onnx}
        --shape H [W] --out FILE [--dynamic] [--backbone] [--portable] [--batch-size N]
        [--tolerance T] [--cfg-options k=v ...]

What is exported (``linvit_mm.deployment.export``): an mmpretrain config's classifier (its
logits) or, with ``--backbone``, its LinearViT backbone (the backbone's outputs); for mmdet
and mmseg configs the backbone, which must be a LinearViT. The graph takes preprocessed
images, ``(B, 3, H, W)`` float32 as the config's data preprocessor makes them (normalised,
padded); preprocessing is not part of it. Without CHECKPOINT the model keeps its random
initialisation.

* ``--format torch-export``: a ``.pt2`` file (``torch.export.save``). Load it with
  ``torch.export.load`` after ``import linvit_mm.ops``, which registers the linvit_mm
  operators it calls; ``--portable`` writes their PyTorch forms instead, and the file loads
  with PyTorch alone.
* ``--format onnx``: a ``.onnx`` file (``torch.onnx.export(..., dynamo=True)`` of the portable
  program), checked with onnxruntime.
* ``--dynamic``: batch, height and width are symbols: any batch and any multiple of the patch
  size (grids of at least 2 x 2 patches; MHLA: blocks of at least 2 x 2 patches); the export
  traces with ``--shape`` and a batch of 2 or more.

The file is checked before it is written: the exported model and the eager one run the same
random images (``--shape``; with ``--dynamic`` also a batch one larger of a grid one patch
taller and two wider), and the tool prints the largest difference of their outputs. If it
exceeds ``--tolerance`` times the largest output, it exits with status 1 and writes nothing.

Example::

    python tools/deployment/export.py \\
        configs/classification/imagenet/linvit-relu-small_fullcopy-distill_32xb128_in1k.py \\
        work_dirs/relu-small/epoch_30.pth --format onnx --shape 224 224 --dynamic \\
        --out relu-small.onnx
"""
import argparse
import os
import os.path as osp
import sys
import tempfile

SUFFIXES = {'torch-export': '.pt2', 'onnx': '.onnx'}


def parse_args(argv=None):
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser(
        description='Export a LinearViT model with torch.export or to ONNX, checked against '
        'eager')
    parser.add_argument('config', help='config file path')
    parser.add_argument('checkpoint', nargs='?', help='checkpoint file (default: random init)')
    parser.add_argument('--format', required=True, choices=sorted(SUFFIXES),
                        help='torch-export: a .pt2 program; onnx: an ONNX graph')
    parser.add_argument('--shape', type=int, nargs='+', required=True,
                        help='input image size in pixels: H W, or one size for a square image')
    parser.add_argument('--out', required=True, help='the file to write (.pt2 or .onnx)')
    parser.add_argument('--dynamic', action='store_true',
                        help='symbolic batch, height and width (multiples of the patch size)')
    parser.add_argument('--backbone', action='store_true',
                        help='mmpretrain configs: export the backbone instead of the classifier')
    parser.add_argument('--portable', action='store_true',
                        help='torch-export: PyTorch operators only (the file loads without '
                        'linvit_mm); ONNX always is')
    parser.add_argument('--batch-size', type=int,
                        help='images per batch to trace with (default: 1, or 2 with --dynamic)')
    parser.add_argument('--tolerance', type=float, default=1e-4,
                        help='largest allowed |exported - eager|, relative to the largest '
                        'output (default: 1e-4)')
    parser.add_argument('--allow-non-finite', action='store_true',
                        help='go on with NaN / Inf weights in the checkpoint (refused by '
                        'default; the check against eager still fails on a NaN error)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value (xxx=[a,b] for lists)')
    args = parser.parse_args(argv)
    if len(args.shape) == 1:
        args.shape = args.shape * 2
    if len(args.shape) != 2 or min(args.shape) < 1:
        parser.error(f'--shape takes one or two positive sizes (H W), got {args.shape}')
    suffix = SUFFIXES[args.format]
    if osp.isdir(args.out):
        parser.error(f'--out {args.out!r} is a directory; give the file to write, e.g. '
                     f'{osp.join(args.out, "model" + suffix)}')
    if not args.out.endswith(suffix):
        parser.error(f'--out {args.out!r}: a {args.format} file ends with {suffix}')
    if args.portable and args.format == 'onnx':
        parser.error('--portable concerns --format torch-export (ONNX holds PyTorch forms '
                     'always)')
    if args.batch_size is None:
        args.batch_size = 2 if args.dynamic else 1
    if args.batch_size < 1 or args.tolerance <= 0:
        parser.error(f'--batch-size must be >= 1 and --tolerance > 0, got {args.batch_size} and '
                     f'{args.tolerance}')
    if args.checkpoint is not None and not osp.isfile(args.checkpoint):
        parser.error(f'checkpoint {args.checkpoint!r} does not exist')
    out_dir = osp.dirname(osp.abspath(args.out))
    if not osp.isdir(out_dir):
        parser.error(f'--out {args.out!r}: the directory {out_dir} does not exist')
    if not os.access(out_dir, os.W_OK | os.X_OK):
        parser.error(f'--out {args.out!r}: the directory {out_dir} is not writable')
    return args


def export_checked(model, args, directory):
    """Export into ``directory`` (the file named like ``--out``) and compare with eager;
    the comparisons."""
    import torch

    from linvit_mm.deployment import (check_inputs, compare_with_eager, export_onnx,
                                      export_program, run_onnx, run_program)
    shape = tuple(args.shape)
    path = osp.join(directory, osp.basename(args.out))
    if args.format == 'onnx':
        export_onnx(model, shape, path, batch_size=args.batch_size, dynamic=args.dynamic)
        run = run_onnx(path)
    else:
        program = export_program(model, shape, batch_size=args.batch_size, dynamic=args.dynamic,
                                 portable=args.portable)
        torch.export.save(program, path)
        run = run_program(torch.export.load(path))
    inputs = check_inputs(model, shape, batch_size=args.batch_size, dynamic=args.dynamic)
    return compare_with_eager(model, run, inputs)


def main(argv=None):
    args = parse_args(argv)
    from mmengine.config import Config

    from linvit_mm.deployment.export import ImageModel, build_model, within_tolerance
    cfg = Config.fromfile(args.config)
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    model = ImageModel(build_model(cfg, args.checkpoint, backbone=args.backbone,
                        allow_non_finite=args.allow_non_finite))
    what = 'classifier (logits)' if model.is_classifier else \
        f'backbone ({type(model.backbone).__name__}, {model.backbone.attn_type})'
    print(f'Exporting the {what} with --format {args.format}, '
          f'{"dynamic" if args.dynamic else "static"} shape, traced on '
          f'{args.batch_size}x{model.in_channels}x{args.shape[0]}x{args.shape[1]}')
    out_dir = osp.dirname(osp.abspath(args.out))
    # written beside --out and moved into place once checked, so a failed check (or a crash)
    # leaves no file behind, and files the graph refers to (ONNX external data) move with it
    with tempfile.TemporaryDirectory(dir=out_dir, prefix='.export-') as directory:
        comparisons = export_checked(model, args, directory)
        if not within_tolerance(comparisons, args.tolerance, 'eager',
                                'The exported model differs from eager'):
            return 1
        for name in os.listdir(directory):
            os.replace(osp.join(directory, name), osp.join(out_dir, name))
    print(f'Max error {max(c.max_abs_error for c in comparisons):.3g} '
          f'(relative {max(c.relative_error for c in comparisons):.3g}); wrote {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
