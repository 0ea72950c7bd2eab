#!/usr/bin/env python
"""Benchmark the LinearViT backbone: every attention operator side by side, one run.

For each input size (default 224, 512, 1024, 2048 px: 196 to 16384 patch tokens) and
each registered operator (softmax, elu, relu, inline, hedgehog, mhla, ttt) at batch 1,
float32, the tool measures

* forward latency: ``eval()`` under ``no_grad``;
* training-step latency: ``train()``, forward plus backward of a scalar loss (the
  mean of every output), gradients set to ``None`` before each step, outside the timer;
* peak memory of a training step (see below).

On a GPU, ``--device cuda --amp --batch-size 64`` times what training there runs: bf16
autocast at a training batch, the Softmax reference on FlashAttention only (SDPA restricted to
its flash kernel: the run fails rather than time a slower kernel), relu / elu / hedgehog /
inline on their fused kernels. ``--amp`` and ``--batch-size`` are GPU options. ``--compile``
times every model through ``torch.compile`` (inductor; compiled in the warm-up). Each row also
counts what one training step launches (CUDA kernels on a GPU, from ``torch.profiler``; ATen
operator calls on a CPU) and what its forward saves for the backward (``saved MiB``: every
distinct storage autograd keeps, the weights left out; the same count on every device).

Repetitions are interleaved: every repetition runs every operator once, in an order
rotated by one per repetition, so background load on a shared machine hits all
operators alike. Latencies are medians over ``--repeats`` repetitions that follow
``--warmup`` untimed ones.

Peak memory
    CUDA: ``torch.cuda.max_memory_allocated()`` over the step minus
    ``torch.cuda.memory_allocated()`` just before it. CPU: each (operator, size) step
    runs in a fresh subprocess that builds the model, runs one untimed training step
    on a 2 x 2-patch input (so thread pools, oneDNN primitives and library code pages
    are already resident), frees its gradients, reads ``VmRSS`` from
    ``/proc/self/status``, resets the peak (``5`` into ``/proc/self/clear_refs``),
    runs the step at full size and reads ``VmHWM``; the figure is ``VmHWM - VmRSS``.
    The subprocess fixes glibc's mmap threshold (``MALLOC_MMAP_THRESHOLD_``), which
    otherwise grows as large blocks are freed and keeps freed tensors in the heap; with
    it fixed, every tensor above 128 KiB is mapped on allocation and unmapped on free,
    so resident memory follows live tensors and the figure is the step's activations,
    gradients and kernel workspaces, not the Python process or the model weights.
    Both figures include the parameter gradients (a ViT-S has 22 M parameters, 84 MiB).

Multiply-accumulate counts (the speed-up bound)
    ``mac_bound = MACs(softmax) / MACs(operator)`` at the same input, counted from the
    built modules' shapes by ``linvit_mm.utils.complexity.count_macs``, whose docstring
    gives the conventions: every ``nn.Linear`` and ``nn.Conv2d`` from its shape, each
    operator's attention core from its class's ``core_macs`` (the formula is beside it),
    the patch embedding once; pointwise maps count zero. ``tools/analysis_tools/
    get_flops.py`` reports the same counts through mmengine's analysis.

    The bound in the table is that of the whole backbone, the thing timed. For relu,
    ViT-S, the per-block ratios (``mac_bound(..., blocks_only=True)``) are 2.70 at 4096
    tokens and 7.89 at 16384; with the patch embedding they are 2.68 and 7.80.

Targets
    Checked at the end of a run, their thresholds in ``linvit_mm.utils.benchmark.targets``:
    each operator's speed-up at 4096 and 16384 tokens reaches its share of the MAC bound
    (``BOUND_FRACTION_TARGETS``), at 196 tokens it is at most 1.1x slower than softmax, and
    its step's peak memory grows at most 4.5x from 4096 to 16384 tokens.

Hybrids
    ``--operators`` also takes a hybrid in the compact form ``LinearViT.attn_type`` reports,
    e.g. ``relu+softmax@0,11`` (relu, Softmax in blocks 0 and 11). ``count_macs`` sums its
    blocks, each by its own operator, so its MAC bound is that of the mix. Its target: at
    4096 and 16384 tokens it takes at most ``HYBRID_EXCESS`` (1.1) times what its MAC bound
    predicts, softmax's time over the bound. The verdict also gives its time over what its
    blocks' operators predict, each block charged its operator's measured time per block
    (``sum_op n_op / L * t(op)``, with the single-operator rows of the same size): the cost of
    mixing them, apart from how close each operator gets to its own bound.

Example::

    python tools/analysis_tools/benchmark_backbone.py --threads 2 --repeats 3
    python tools/analysis_tools/benchmark_backbone.py --device cuda --repeats 20
    python tools/analysis_tools/benchmark_backbone.py --operators softmax relu hedgehog \
        relu+softmax@0,11 --sizes 1024 2048
    python tools/analysis_tools/benchmark_backbone.py --operators softmax mhla mhla-offnorm \
        mhla-official --sizes 224 1024 2048

Operator forms
    ``--operators`` also takes the names of ``OPERATOR_VARIANTS``: ``mhla-offnorm`` (mhla
    with the authors' normaliser) and ``mhla-official`` (the authors' module: their
    normaliser, its own LayerNorm, RMSNorm of q and k, 4 x 4 blocks, no qkv bias).
    python tools/analysis_tools/benchmark_backbone.py --busy-neighbour

Busy neighbour (``--busy-neighbour``)
    The demo teacher stage's training step under the OpenMP policy of a plain script (torch
    default), under the one linvit_mm's tools choose (``linvit_mm.cpu_threads``) and with one
    thread, each idle and beside a single-threaded spinning process pinned to the last usable
    CPU; each run in a fresh interpreter, since libgomp reads its variables when torch loads.
    ``--neighbour-rounds R`` repeats the sweep R times, interleaved, and reports medians.
"""
# Declared before the first import: linvit_mm, imported first, then chooses this process's
# CPU threading before torch loads (see linvit_mm/cpu_threads.py; the user's variables win).
LINVIT_MM_TOOL = True
import linvit_mm  # noqa: E402,F401  isort: skip
import argparse
import csv
import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path

import torch

from linvit_mm.cpu_threads import usable_cores, usable_cpus
from linvit_mm.models.attention import attention_types
from linvit_mm.models.backbones.hybrid import describe_attn_types, resolve_attn_types
from linvit_mm.utils.benchmark import (NEIGHBOUR_STEP, NEIGHBOUR_STEPS, NEIGHBOUR_WARMUP,
                                       format_neighbour_table, neighbour_policies, parse_arch,
                                       run_neighbour_benchmark)
from linvit_mm.utils.benchmark.backbone import (OPERATOR_VARIANTS, REFERENCE, add_ratios,
                                                benchmark_size, cpu_train_peak_mib,
                                                probe_train_peak)
from linvit_mm.utils.benchmark.targets import (BOUND_TARGET_TOKENS, MEMORY_PAIR, SMALL_TOKENS,
                                               evaluate_targets)

DEFAULT_SIZES = (224, 512, 1024, 2048)
CSV_COLUMNS = ('size', 'patch_tokens', 'tokens', 'operator', 'fwd_ms', 'train_ms', 'peak_mib',
               'speedup_fwd', 'speedup_train', 'mac_bound', 'fwd_pct_of_bound',
               'train_pct_of_bound', 'gmacs', 'fwd_cpu_ms', 'train_cpu_ms', 'cpu_speedup_fwd',
               'cpu_speedup_train', 'fwd_samples_ms', 'train_samples_ms', 'repeats',
               'warmup', 'threads', 'background_cores', 'retakes', 'device', 'memory_method',
               'batch_size', 'precision', 'mode', 'launches', 'saved_mib')


def _fmt(value, spec):
    """``format(value, spec)``; a missing value is a ``-`` of the same width."""
    if value is None:
        width = spec.split('.')[0]
        return format('-', f'>{width}') if width else '-'
    return format(value, spec)


def format_table(rows, size):
    """One size's table; ``cpu x`` columns are the speed-ups in process CPU time."""
    group = [row for row in rows if row['size'] == size]
    if not group:
        return ''
    load = group[0].get('background_cores')
    load = '' if load is None else f'; other processes kept {load:.2f} cores busy meanwhile'
    retakes = sum(row.get('retakes') or 0 for row in group)
    load += f' ({retakes} pairs retaken)' if retakes else ''
    width = max(9, *(len(row['operator']) for row in group))
    head = (f'{size}x{size} px, {group[0]["patch_tokens"]} patch tokens, median of '
            f'{group[0].get("repeats", "?")}{load}\n'
            f'{"operator":{width}s} {"fwd ms":>10s} {"train ms":>10s} {"peak MiB":>9s} '
            f'{"saved MiB":>9s} '
            f'{"x fwd":>7s} {"x train":>7s} {"MAC bound":>9s} {"fwd/bnd":>8s} {"trn/bnd":>8s} '
            f'{"cpu x fwd":>9s} {"cpu x trn":>9s} {"launches":>8s}')
    lines = [head, '-' * len(head.splitlines()[1])]
    for row in group:
        lines.append(f'{row["operator"]:{width}s} {row["fwd_ms"]:10.1f} {row["train_ms"]:10.1f} '
                     f'{_fmt(row["peak_mib"], "9.1f")} {_fmt(row.get("saved_mib"), "9.1f")} '
                     f'{_fmt(row["speedup_fwd"], "6.2f")}x '
                     f'{_fmt(row["speedup_train"], "6.2f")}x {_fmt(row["mac_bound"], "8.2f")}x '
                     f'{_fmt(row["fwd_pct_of_bound"], "7.0f")}% '
                     f'{_fmt(row["train_pct_of_bound"], "7.0f")}% '
                     f'{_fmt(row["cpu_speedup_fwd"], "8.2f")}x '
                     f'{_fmt(row["cpu_speedup_train"], "8.2f")}x '
                     f'{_fmt(row.get("launches"), "8d")}')
    return '\n'.join(lines)


def format_targets(results):
    """The checked targets, one per line; those the run could not check, in one line."""
    checked = [result for result in results if result[1] != 'SKIP']
    lines = ['CPU checks (fp32, batch 1, ViT-S; informational, the speed targets are GPU '
             'figures):']
    lines += [f'  {verdict:5s}  {name}: {detail}' for name, verdict, detail in checked]
    skipped = len(results) - len(checked)
    if skipped:
        tokens = sorted({SMALL_TOKENS, *BOUND_TARGET_TOKENS, *MEMORY_PAIR})
        lines.append(f'  {skipped} {"target" if skipped == 1 else "targets"} not checked: '
                     f'they need softmax and the {", ".join(map(str, tokens))}-token sizes '
                     f'(224, 1024, 2048 px at patch 16), with peak memory')
    return '\n'.join(lines)


def write_csv(rows, path, extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            record = {**row, **extra, 'gmacs': row['macs'] / 1e9,
                      'fwd_samples_ms': ';'.join(f'{v:.2f}' for v in row['fwd_samples_ms']),
                      'train_samples_ms': ';'.join(f'{v:.2f}' for v in row['train_samples_ms'])}
            writer.writerow({key: record.get(key) for key in CSV_COLUMNS})


def plot(rows, path, title):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    panels = [('fwd_ms', 'forward latency (ms)'), ('train_ms', 'training step (ms)'),
              ('peak_mib', 'training-step peak memory (MiB)')]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    operators = list(dict.fromkeys(row['operator'] for row in rows))
    for ax, (key, label) in zip(axes, panels):
        for op in operators:
            points = sorted((row['patch_tokens'], row[key]) for row in rows
                            if row['operator'] == op and row[key] is not None)
            if points:
                ax.plot(*zip(*points), marker='o', label=op,
                        linestyle='--' if op == REFERENCE else '-')
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel('patch tokens')
        ax.set_ylabel(label)
        ax.grid(True, which='both', alpha=.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_neighbour_policy(text):
    """``--neighbour-policy``: ``LABEL:VAR=VALUE[,VAR=VALUE...]`` as ``(label, {VAR: VALUE})``."""
    label, sep, assignments = text.partition(':')
    pairs = [item.partition('=') for item in assignments.split(',')] if sep else []
    if not label or not pairs or any(not name or not eq for name, eq, _ in pairs):
        raise argparse.ArgumentTypeError(
            f'{text!r} is not LABEL:VAR=VALUE[,VAR=VALUE...] (e.g. spin1000:GOMP_SPINCOUNT=1000)')
    return label, {name: value for name, _, value in pairs}


def busy_neighbour_main(args):
    """The ``--busy-neighbour`` comparison: every policy idle and beside a spinning process."""
    policies = neighbour_policies()
    for label, variables in args.neighbour_policy:
        policies[label] = dict(policies['torch default'], **variables)
    try:
        load = f'{os.getloadavg()[0]:.2f}'
    except (AttributeError, OSError):
        load = 'unknown'
    print(f'Busy-neighbour benchmark {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}: '
          f'{NEIGHBOUR_STEP}, mean of {args.neighbour_steps} steps after '
          f'{args.neighbour_warmup}, median of {args.neighbour_rounds} round(s); '
          f'usable CPUs {usable_cpus()} ({usable_cores()} cores), '
          f'neighbour pinned to CPU {max(usable_cpus())}; 1-minute load average at start '
          f'{load}; torch={torch.__version__}', flush=True)
    rows = run_neighbour_benchmark(policies, args.neighbour_steps, args.neighbour_warmup,
                                   log=lambda msg: print(msg, flush=True),
                                   rounds=args.neighbour_rounds)
    print()
    print(format_neighbour_table(rows))
    print('\nx idle: over the same policy idle; x 1 thr: over one thread, idle; x default: '
          'over torch default, same neighbour')
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Latency, training-step latency and peak memory of LinearViT per '
                    'attention operator, against softmax and its MAC-count bound.')
    operators = attention_types()
    parser.add_argument('--operators', nargs='+', default=operators,
                        help=f'operators to compare (default: all of {", ".join(operators)}; '
                             f'{REFERENCE} is the reference of every ratio), hybrids such '
                             f'as relu+softmax@0,11 (relu, Softmax in blocks 0 and 11), and '
                             f'the operator forms {", ".join(OPERATOR_VARIANTS)}')
    parser.add_argument('--sizes', nargs='+', type=int, default=list(DEFAULT_SIZES),
                        help='square input sizes in px (multiples of the patch size)')
    parser.add_argument('--arch', default='small',
                        help='LinearViT arch name (tiny, small, base) or a JSON dict with '
                             'embed_dims, num_layers, num_heads, feedforward_channels')
    parser.add_argument('--device', default='cpu', help='cpu or cuda[:index]')
    parser.add_argument('--batch-size', type=int, default=1,
                        help='images per step (with --device cuda; the CPU tables are batch 1)')
    parser.add_argument('--amp', action='store_true',
                        help='with --device cuda: bf16 autocast, Softmax on FlashAttention only '
                             '(the run fails if SDPA cannot take it)')
    parser.add_argument('--compile', action='store_true',
                        help='time every model through torch.compile (inductor); the models '
                             'compile during the warm-up, which then needs at least 1')
    parser.add_argument('--repeats', type=int, default=5, help='timed repetitions (median)')
    parser.add_argument('--warmup', type=int, default=1, help='untimed repetitions first')
    parser.add_argument('--large-from', type=int, default=None,
                        help='patch-token count from which --large-repeats/--large-warmup '
                             'apply (for the sizes where softmax takes minutes on a CPU)')
    parser.add_argument('--large-repeats', type=int, default=None)
    parser.add_argument('--large-warmup', type=int, default=None)
    parser.add_argument('--threads', type=int, default=None,
                        help='torch intra-op threads (default: OMP_NUM_THREADS, which the '
                             'tool sets to the usable cores where the user has not)')
    parser.add_argument('--max-background', type=float, default=None,
                        help='on a shared machine: retake a timed forward + training-step pair '
                             'during which other processes kept more than this many cores '
                             'busy (read from /proc/stat), after waiting for a quiet moment')
    parser.add_argument('--max-retakes', type=int, default=3,
                        help='retakes per pair with --max-background; the last take is kept')
    parser.add_argument('--no-memory', action='store_true',
                        help='skip the peak-memory measurement')
    parser.add_argument('--out-dir', default='work_dirs/benchmark')
    parser.add_argument('--probe-memory', metavar='OPERATOR', help=argparse.SUPPRESS)
    neighbour = parser.add_argument_group(
        'busy neighbour', 'instead of the operator tables: the demo teacher stage\'s training '
        'step (LinearViT 4 blocks, width 96, batch 32 at 64 px, AdamW) under each threading '
        'policy, idle and beside a single-threaded spinning process this tool starts, each in '
        'a fresh interpreter; --operators, --sizes and --arch do not apply')
    neighbour.add_argument('--busy-neighbour', action='store_true',
                           help='run this comparison and print its table')
    neighbour.add_argument('--neighbour-steps', type=int, default=NEIGHBOUR_STEPS,
                           help=f'timed steps, their mean is reported (default {NEIGHBOUR_STEPS})')
    neighbour.add_argument('--neighbour-warmup', type=int, default=NEIGHBOUR_WARMUP,
                           help=f'untimed steps first (default {NEIGHBOUR_WARMUP})')
    neighbour.add_argument('--neighbour-policy', action='append', default=[],
                           type=parse_neighbour_policy, metavar='LABEL:VAR=VALUE[,VAR=VALUE]',
                           help='one more policy: the torch default environment plus these '
                                'variables, e.g. spin1000:GOMP_SPINCOUNT=1000 (repeatable)')
    neighbour.add_argument('--neighbour-rounds', type=int, default=1,
                           help='repeat the whole sweep this many times, interleaved, and '
                                'report each row\'s median (default 1)')
    args = parser.parse_args(argv)
    args.arch = parse_arch(args.arch)
    from linvit_mm.models.backbones.linear_vit import LinearViT
    try:
        depth = LinearViT.resolve_arch(args.arch)['num_layers']
        # a hybrid as LinearViT.attn_type writes it, so rows and models agree on its name
        args.operators = [op if op in OPERATOR_VARIANTS
                          else describe_attn_types(resolve_attn_types(op, depth))
                          for op in args.operators]
    except (TypeError, ValueError) as err:
        parser.error(f'--operators: {err}')
    if args.repeats < 1 or args.warmup < 0:
        parser.error('--repeats must be >= 1 and --warmup >= 0')
    if args.compile and (args.warmup < 1 or args.large_warmup == 0):
        parser.error('--compile needs a warm-up of at least 1 (--warmup, --large-warmup): '
                     'the models compile there, outside the timed repetitions')
    arch = LinearViT.resolve_arch(args.arch)
    sizes = {key: arch[key] for key in ('embed_dims', 'num_layers', 'num_heads',
                                        'feedforward_channels')}
    if min(sizes.values()) < 1 or sizes['embed_dims'] % sizes['num_heads']:
        parser.error(f'--arch: every size must be >= 1 and num_heads must divide embed_dims, '
                     f'got {sizes}')
    patch = arch.get('patch_size', 16)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    wrong = [size for size in args.sizes if size < patch or size % patch]
    if wrong:
        parser.error(f'--sizes {wrong}: each size must be a positive multiple of the patch size '
                     f'{patch} px')
    if (args.large_from is not None and args.large_from < 0) or (
            args.large_repeats is not None and args.large_repeats < 1) or (
            args.large_warmup is not None and args.large_warmup < 0):
        parser.error('--large-from must be >= 0, --large-repeats >= 1 and --large-warmup >= 0')
    if args.batch_size < 1:
        parser.error(f'--batch-size must be >= 1, got {args.batch_size}')
    if (args.amp or args.batch_size != 1) and not args.device.startswith('cuda'):
        parser.error('--amp and --batch-size are GPU options (--device cuda): the CPU tables '
                     'are batch 1 in fp32, and the CPU memory probe measures batch 1')
    if args.threads is not None and args.threads < 1:
        parser.error(f'--threads must be >= 1, got {args.threads}')
    if args.max_background is not None and not (
            math.isfinite(args.max_background) and args.max_background >= 0):
        parser.error(f'--max-background is a number of busy cores >= 0, got '
                     f'{args.max_background} (a quiet moment below it could never come)')
    if args.max_retakes < 0:
        parser.error(f'--max-retakes must be >= 0, got {args.max_retakes}')
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        parser.error(f'--out-dir {args.out_dir!r} is a file, not a directory')
    if args.neighbour_steps < 1 or args.neighbour_warmup < 0 or args.neighbour_rounds < 1:
        parser.error('--neighbour-steps and --neighbour-rounds must be >= 1 and '
                     '--neighbour-warmup >= 0')
    if args.threads is None:
        # OMP_NUM_THREADS: the user's, or one per usable core (linvit_mm.cpu_threads)
        args.threads = torch.get_num_threads()
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.busy_neighbour:
        return busy_neighbour_main(args)
    if args.probe_memory:
        print(json.dumps(probe_train_peak(args.probe_memory, args.arch, args.sizes[0],
                                          args.threads)))
        return None
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('--device cuda given, but torch sees no CUDA device')
    if device.type not in ('cpu', 'cuda'):
        raise SystemExit(f'--device must be cpu or cuda[:index], got {args.device!r}')
    operators = list(dict.fromkeys(args.operators))
    memory_method = ('none' if args.no_memory else
                     'cuda max_memory_allocated' if device.type == 'cuda' else
                     'fresh subprocess, VmHWM - VmRSS')
    started = datetime.now(timezone.utc)
    print(f'LinearViT benchmark {started:%Y-%m-%d %H:%M UTC}: arch={args.arch} device={device} '
          f'threads={args.threads} repeats={args.repeats} warmup={args.warmup} '
          f'batch={args.batch_size} {"bf16 autocast" if args.amp else "fp32"} '
          f'{"compiled" if args.compile else "eager"} torch={torch.__version__}', flush=True)
    rows = []
    for size in args.sizes:
        patch_tokens = (size // 16)**2
        large = args.large_from is not None and patch_tokens >= args.large_from
        repeats = args.large_repeats if large and args.large_repeats else args.repeats
        warmup = (args.large_warmup if large and args.large_warmup is not None
                  else args.warmup)
        print(f'[{size}px] timing {", ".join(operators)}: {repeats} repeats after {warmup} '
              f'warm-up', flush=True)
        size_rows = benchmark_size(size, operators, args.arch, device, repeats, warmup,
                                   log=lambda msg: print(msg, flush=True),
                                   max_background=args.max_background,
                                   max_retakes=args.max_retakes, batch_size=args.batch_size,
                                   amp=args.amp, compile=args.compile)
        for row in size_rows:
            row.update(repeats=repeats, warmup=warmup)
        if device.type == 'cpu' and not args.no_memory:
            for row in size_rows:
                row['peak_mib'] = cpu_train_peak_mib(row['operator'], args.arch, size,
                                                     args.threads)
                print(f'  {size}px {row["operator"]:8s} train peak {row["peak_mib"]:.1f} MiB',
                      flush=True)
        rows += size_rows
    add_ratios(rows)
    print()
    for size in args.sizes:
        print(format_table(rows, size) + '\n')
    out_dir = Path(args.out_dir)
    extra = dict(threads=args.threads, device=str(device), memory_method=memory_method)
    write_csv(rows, out_dir / 'benchmark_backbone.csv', extra)
    precision = 'bf16 autocast' if args.amp else 'fp32'
    plot(rows, out_dir / 'benchmark_backbone.png',
         f'LinearViT {args.arch}, batch {args.batch_size}, {precision}, '
         f'{"compiled" if args.compile else "eager"}, {device}'
         + ('' if device.type == 'cuda' else f', {args.threads} threads'))
    print(format_targets(evaluate_targets(rows)))
    elapsed = (datetime.now(timezone.utc) - started).total_seconds()
    print(f'\nwrote {out_dir / "benchmark_backbone.csv"} and {out_dir / "benchmark_backbone.png"}'
          f' ({elapsed / 60:.1f} min)')
    return rows


if __name__ == '__main__':
    main()
