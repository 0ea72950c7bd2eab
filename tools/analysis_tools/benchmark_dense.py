#!/usr/bin/env python
"""Backbone + neck cost of the dense configs: plain ViT pyramid vs ViT-Adapter, Softmax global
vs Softmax windowed vs every linear operator global, forward and training step, side by side.

For each input size (default 1333 x 800, the Mask R-CNN 1x scale, padded to 1344 x 800 as
mmdet pads to 32, and 512 x 512, the ADE20K crop), each neck (``plain``:
``LinearViTPlainPyramid``; ``adapter``: ``LinearViTAdapter`` with the defaults of its width)
and each attention variant (``softmax``: global; ``softmax-win``: 14 x 14 windows in every
block but the last of each quarter, as the plain Softmax detection config and ViT-Adapter's
DeiT detectors; every other operator global), batch 1, float32:

* ``forward``: ``eval()`` under ``no_grad``;
* ``train``: ``train()``, forward and backward of the mean of the four maps (no optimizer
  step: its cost is per parameter, not per token);
* ``saved MB``: the activations autograd keeps for the backward of that training step (the
  bytes of the distinct storages packed by ``saved_tensors_hooks``, the model's weights left
  out), the training memory that grows with the tokens; on CUDA also the peak allocated
  memory of the step.

Repetitions are interleaved (every repetition runs every model once, the order rotated), so
load from other jobs hits all of them alike; times are medians over ``--repeats`` after
``--warmup``. Ratios are to the global Softmax row of the same neck and size (``x`` > 1:
faster or smaller), and ``adapter / plain`` compares the necks for one variant.

Example::

    python tools/analysis_tools/benchmark_dense.py --arch tiny --repeats 1 --warmup 1
    python tools/analysis_tools/benchmark_dense.py --arch base --device cuda --repeats 10
"""
# Declared before the first import: linvit_mm, imported first, then chooses this process's
# CPU threading before torch loads (see linvit_mm/cpu_threads.py; the user's variables win).
LINVIT_MM_TOOL = True
import linvit_mm  # noqa: E402,F401  isort: skip
import argparse
from datetime import datetime, timezone

import torch

from linvit_mm.models.attention import attention_types
from linvit_mm.utils.benchmark import parse_arch
from linvit_mm.utils.benchmark.dense import NECKS, SIZES, benchmark


def _f(value, spec):
    return '-' if value is None else format(value, spec)


def format_table(rows):
    cuda = any(row['peak_mb'] is not None for row in rows)
    head = ('| size | neck | attention | forward ms | x | train ms | x | saved MB | x | '
            + ('peak MB | ' if cuda else '') + 'adapter / plain (fwd, train, saved) |')
    lines = [head, '|' + '---|' * (head.count('|') - 1)]
    for r in rows:
        ratio = ('-' if r['adapter_over_plain_forward'] is None else
                 f"{r['adapter_over_plain_forward']:.2f}, {r['adapter_over_plain_train']:.2f}, "
                 f"{r['adapter_over_plain_saved']:.2f}")
        lines.append(
            f"| {r['size']} ({r['tokens']} tok) | {r['neck']} | {r['variant']} | "
            f"{r['forward_ms']:.0f} | {_f(r['forward_x'], '.2f')} | {r['train_ms']:.0f} | "
            f"{_f(r['train_x'], '.2f')} | {r['saved_mb']:.0f} | {_f(r['saved_x'], '.2f')} | "
            + (f"{_f(r['peak_mb'], '.0f')} | " if cuda else '') + f'{ratio} |')
    return '\n'.join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--arch', default='small', type=parse_arch,
                        help='LinearViT arch name or a JSON dict (default: small)')
    operators = attention_types()
    parser.add_argument('--operators', nargs='+', default=operators,
                        help=f'operators (default: all: {" ".join(operators)}); softmax adds '
                        f'its windowed variant')
    parser.add_argument('--necks', nargs='+', default=list(NECKS), choices=NECKS)
    parser.add_argument('--sizes', nargs='+', default=[f'{w}x{h}' for w, h in SIZES],
                        help='WxH input sizes before padding to 32 (default: 1333x800 512x512)')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--warmup', type=int, default=1)
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--threads', type=int, default=None)
    args = parser.parse_args(argv)
    unknown = [op for op in args.operators if op not in operators]
    if unknown:
        parser.error(f'unknown operators {unknown}; valid: {", ".join(operators)}')
    try:
        args.sizes = [tuple(int(v) for v in s.lower().split('x')) for s in args.sizes]
    except ValueError:
        parser.error(f'--sizes are WxH, got {args.sizes}')
    if any(len(s) != 2 or min(s) < 1 for s in args.sizes):
        parser.error(f'--sizes are WxH with positive sides, got {args.sizes}')
    if args.repeats < 1 or args.warmup < 0:
        parser.error('--repeats must be >= 1, --warmup >= 0')
    if torch.device(args.device).type == 'cuda' and not torch.cuda.is_available():
        parser.error('--device cuda: CUDA is not available on this machine')
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f'backbone + neck, arch {args.arch}, batch 1, fp32, {args.device}, '
          f'{torch.get_num_threads()} threads, {args.repeats} repeats after {args.warmup} '
          f'warm-up ({datetime.now(timezone.utc).isoformat(timespec="seconds")})')
    rows = []
    for size in args.sizes:
        rows += benchmark(size, args.arch, args.operators, args.necks, args.device,
                          args.repeats, args.warmup)
    print()
    print(format_table(rows))
    return rows


if __name__ == '__main__':
    main()
