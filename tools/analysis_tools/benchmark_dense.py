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
import statistics
import time
from datetime import datetime, timezone

import torch

from linvit_mm.models.attention import attention_types
from linvit_mm.utils.benchmark import (padded, parse_arch, quiet_mmengine_logs, rotated,
                                       synchronise)

NECKS = ('plain', 'adapter')
WINDOWED = 'softmax-win'
WINDOW_SIZE = 14
SIZES = ((1333, 800), (512, 512))


def variants(operators):
    """``softmax``, ``softmax-win`` and the other operators, in that order."""
    names = ['softmax', WINDOWED] if 'softmax' in operators else []
    return names + [op for op in operators if op != 'softmax']


def windowed_blocks(num_layers):
    """Every block but the last of each quarter (0, 1, 3, 4, 6, 7, 9, 10 of 12)."""
    quarter = max(num_layers // 4, 1)
    return [i for i in range(num_layers) if (i + 1) % quarter]


def build(neck, variant, arch, device):
    from linvit_mm.models import LinearViT, LinearViTAdapter, LinearViTPlainPyramid
    attn_type = 'softmax' if variant == WINDOWED else variant
    vit = dict(arch=arch, attn_type=attn_type, img_size=224)
    sizes = LinearViT.resolve_arch(arch)
    if variant == WINDOWED:
        vit.update(window_size=WINDOW_SIZE,
                   window_block_indexes=windowed_blocks(sizes['num_layers']))
    if neck == 'plain':
        model = LinearViTPlainPyramid(vit=vit)
    else:
        # ViT-Adapter's settings of its widths; another width: one deformable head per ViT head
        heads, ratio = LinearViTAdapter.DEFORM_DEFAULTS.get(sizes['embed_dims'],
                                                            (sizes['num_heads'], 1.0))
        model = LinearViTAdapter(vit=vit, deform_num_heads=heads, deform_ratio=ratio)
    with quiet_mmengine_logs():
        model.init_weights()
    return model.to(device)


@torch.no_grad()
def time_forward(model, images, device):
    model.eval()
    synchronise(device)
    start = time.perf_counter()
    model(images)
    synchronise(device)
    return time.perf_counter() - start


def time_train_step(model, images, device):
    """Wall time of forward + backward, and the bytes autograd saved for the backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    storages = {}
    # the weights autograd keeps are the model's own, not activations
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[(storage.data_ptr(), tensor.device)] = storage.nbytes()
        return tensor

    if torch.device(device).type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
    synchronise(device)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outs = model(images)
        loss = sum(out.float().mean() for out in outs)
    loss.backward()
    synchronise(device)
    elapsed = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device)
            if torch.device(device).type == 'cuda' else None)
    return elapsed, sum(storages.values()), peak


def benchmark(size, arch, operators, necks, device, repeats, warmup, log=print):
    width, height = size
    torch.manual_seed(0)
    images = torch.randn(1, 3, padded(height), padded(width), device=device)
    keys = [(neck, variant) for neck in necks for variant in variants(operators)]
    models = {key: build(*key, arch, device) for key in keys}
    forward = {key: [] for key in keys}
    train = {key: [] for key in keys}
    saved, peak = {}, {}
    for rep in range(warmup + repeats):
        for key in rotated(keys, rep):
            f = time_forward(models[key], images, device)
            t, saved[key], peak[key] = time_train_step(models[key], images, device)
            if rep >= warmup:
                forward[key].append(f)
                train[key].append(t)
        if rep >= warmup:
            log(f'{width}x{height} repeat {rep - warmup + 1}/{repeats} done')
    patch = models[keys[0]].vit.patch_size
    rows = []
    for neck, variant in keys:
        key = (neck, variant)
        rows.append(dict(size=f'{width}x{height}', neck=neck, variant=variant,
                         tokens=(padded(height) // patch) * (padded(width) // patch),
                         forward_ms=statistics.median(forward[key]) * 1e3,
                         train_ms=statistics.median(train[key]) * 1e3,
                         saved_mb=saved[key] / 2**20,
                         peak_mb=None if peak[key] is None else peak[key] / 2**20))
    add_ratios(rows)
    return rows


def add_ratios(rows):
    """``*_x``: the global Softmax row of the same neck and size over this one;
    ``adapter_over_plain_*``: the adapter row over the plain row of the same variant."""
    index = {(r['size'], r['neck'], r['variant']): r for r in rows}
    for row in rows:
        reference = index.get((row['size'], row['neck'], 'softmax'))
        plain = index.get((row['size'], 'plain', row['variant']))
        for field in ('forward_ms', 'train_ms', 'saved_mb'):
            name = field.split('_')[0]
            row[f'{name}_x'] = reference[field] / row[field] if reference else None
            row[f'adapter_over_plain_{name}'] = (
                row[field] / plain[field] if plain and row['neck'] == 'adapter' else None)


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
