#!/usr/bin/env python
"""Benchmark LinearViTAdapter (ViT-Adapter + LinearViT) forward for every attention operator.

The cost target: at detection size (1333 x 800) the adapter + backbone forward of each
linear operator is faster than that of the Softmax one (global attention), measured side
by side.

For each operator (softmax, elu, relu, inline, mhla, ttt) a ``LinearViTAdapter`` with
the ViT-Adapter defaults of its width (ViT-Adapter-S for ``--arch small``: deformable
heads 6, ratio 1.0, 4 points, ConvFFN 0.25, extra extractors, ViT features added, the
ViT built for 224 px and its learned position embedding interpolated to the grid) is
run in ``eval()`` under ``no_grad``, batch 1, float32, on a random image of
``--size W H``, padded bottom/right to a multiple of 32 as mmdet's
``DetDataPreprocessor`` (``pad_size_divisor=32``) does: 1333 x 800 becomes 1344 x 800,
a 84 x 50 grid of 4200 patch tokens.

Repetitions are interleaved: every repetition runs every operator once, the order
rotated by one per repetition, so load from other jobs on a shared machine hits all
operators alike; times are medians over ``--repeats`` repetitions after ``--warmup``.

The time is split by forward hooks on the twelve ViT blocks (``vit.layers``), which the
adapter calls one group at a time: ``vit_blocks_ms`` is their summed wall time inside
the adapter forward, ``adapter_ms`` everything else (spatial prior module, patch
embedding, injectors, extractors, output upsampling and norms). With ``--csv`` the rows
go to that file and a bar chart of the split to a PNG beside it.

Example::

    python tools/analysis_tools/benchmark_adapter.py --threads 2
    python tools/analysis_tools/benchmark_adapter.py --device cuda --repeats 20
"""
# Declared before the first import: linvit_mm, imported first, then chooses this process's
# CPU threading before torch loads (see linvit_mm/cpu_threads.py; the user's variables win).
LINVIT_MM_TOOL = True
import linvit_mm  # noqa: E402,F401  isort: skip
import argparse
import csv
import os.path as osp
from datetime import datetime, timezone

import torch

from linvit_mm.models.attention import attention_types
from linvit_mm.utils.benchmark import padded, parse_arch
from linvit_mm.utils.benchmark.adapter import benchmark
from linvit_mm.utils.benchmark.targets import adapter_target as evaluate_target

CSV_COLUMNS = ('operator', 'width', 'height', 'padded_width', 'padded_height', 'patch_tokens',
               'total_ms', 'vit_blocks_ms', 'adapter_ms', 'speedup', 'speedup_vit_blocks',
               'total_samples_ms', 'repeats', 'warmup', 'threads', 'device')


def _fmt(value, spec):
    return '-' if value is None else format(value, spec)


def format_table(rows):
    lines = ['| operator | adapter + backbone ms | ViT blocks ms | adapter rest ms | '
             'speed-up vs softmax | ViT-block speed-up |',
             '|---|---:|---:|---:|---:|---:|']
    for row in rows:
        lines.append(f'| {row["operator"]} | {row["total_ms"]:.0f} | {row["vit_blocks_ms"]:.0f} '
                     f'| {row["adapter_ms"]:.0f} | {_fmt(row["speedup"], ".2f")} | '
                     f'{_fmt(row["speedup_vit_blocks"], ".2f")} |')
    return '\n'.join(lines)


def write_csv(rows, path, repeats, warmup, device):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, 'total_samples_ms': ' '.join(
                f'{t:.1f}' for t in row['total_samples_ms']), 'repeats': repeats,
                'warmup': warmup, 'threads': torch.get_num_threads(), 'device': device})


def plot(rows, path, title):
    """Forward time per operator, split into the ViT blocks and the adapter's own parts,
    each bar labelled with its speed-up over softmax."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    operators = [row['operator'] for row in rows]
    blocks = [row['vit_blocks_ms'] for row in rows]
    rest = [row['total_ms'] - row['vit_blocks_ms'] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(rows) + 1.6))
    ax.barh(operators, blocks, label='ViT blocks')
    ax.barh(operators, rest, left=blocks, label='adapter (spatial prior, injectors, '
            'extractors, ...)')
    for index, row in enumerate(rows):
        label = f'{row["total_ms"]:.0f} ms'
        if row['speedup'] is not None:
            label += f'  ({row["speedup"]:.2f}x)'
        ax.text(row['total_ms'], index, '  ' + label, va='center', fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel('forward time (ms, median)')
    ax.set_xlim(0, max(row['total_ms'] for row in rows) * 1.35)
    ax.legend(loc='lower right', fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='LinearViTAdapter forward time per attention operator, side by side')
    parser.add_argument('--size', nargs=2, type=int, default=(1333, 800), metavar=('W', 'H'),
                        help='image width and height before padding to a multiple of 32 '
                        '(default: 1333 800, the Mask R-CNN 1x scale)')
    parser.add_argument('--arch', default='small', type=parse_arch,
                        help='LinearViT arch name or a JSON dict (default: small)')
    operators = attention_types()
    parser.add_argument('--operators', nargs='+', default=operators,
                        help=f'operators to compare (default: all: {" ".join(operators)})')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--warmup', type=int, default=1)
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--threads', type=int, default=None,
                        help='torch intra-op threads (default: torch default)')
    parser.add_argument('--csv', dest='csv_path', default=None,
                        help='write the rows here, and a bar chart beside it (same name, .png)')
    args = parser.parse_args(argv)
    unknown = [op for op in args.operators if op not in operators]
    if unknown:
        parser.error(f'unknown operators {unknown}; valid: {", ".join(operators)}')
    if len(set(args.operators)) != len(args.operators):
        parser.error(f'--operators lists an operator twice: {args.operators}')
    if args.repeats < 1 or args.warmup < 0 or min(args.size) < 1:
        parser.error('--repeats and --size must be >= 1, --warmup >= 0')
    if torch.device(args.device).type == 'cuda' and not torch.cuda.is_available():
        parser.error('--device cuda: CUDA is not available on this machine')
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    width, height = args.size
    print(f'LinearViTAdapter forward, arch {args.arch}, {width}x{height} padded to '
          f'{padded(width)}x{padded(height)}, batch 1, fp32, eval/no_grad, {args.device}, '
          f'{torch.get_num_threads()} threads, {args.repeats} repeats after {args.warmup} '
          f'warm-up ({datetime.now(timezone.utc).isoformat(timespec="seconds")})')
    rows = benchmark(args.operators, args.arch, args.size, args.device, args.repeats,
                     args.warmup)
    print()
    print(f'{rows[0]["patch_tokens"]} patch tokens')
    print(format_table(rows))
    passed, lines = evaluate_target(rows)
    print()
    print('\n'.join(lines))
    if passed is not None:
        print(f'target (every linear operator faster than softmax): '
              f'{"PASS" if passed else "FAIL"}')
    if args.csv_path:
        write_csv(rows, args.csv_path, args.repeats, args.warmup, args.device)
        png_path = osp.splitext(args.csv_path)[0] + '.png'
        plot(rows, png_path, f'LinearViTAdapter {args.arch}, {width}x{height} (padded '
             f'{padded(width)}x{padded(height)}), batch 1, fp32, {args.device}, '
             f'{torch.get_num_threads()} threads')
        print(f'wrote {args.csv_path} and {png_path}')
    return rows, passed


if __name__ == '__main__':
    main()
