#!/usr/bin/env python
"""Cost of the attention-alignment step (stage 1 of the staged recipe) against a plain step.

Two models of the same student LinearViT, each with its ``OptimWrapper(AdamW)``, run
``model.train_step(data, optim_wrapper)`` (the call mmengine's train loop makes) on one fixed
random batch:

* **plain**: an mmpretrain ``ImageClassifier`` (student, ``VisionTransformerClsHead``,
  ``ClsDataPreprocessor``): forward, loss, backward and update of every weight;
* **align**: an ``AttentionAligner`` of that student and a Softmax teacher of its arch: the
  teacher's forward under ``no_grad`` up to the last aligned block, each student block's
  position encoding, ``ln1`` and attention on the teacher's block input, the MSE, the
  backward through the attention alone and the update of the attention weights.

Steps alternate A B A B ... with the order swapped every pair, as in
``benchmark_distill.py``, so load from other jobs hits both alike; reported are the median of
the per-pair ratios ``align / plain`` (``pair_ratio``, the figure checked against the target),
the ratio of medians and the ratio of minima.

Peak memory of one step of each kind, measured as ``benchmark_backbone.py`` does (the probes
of ``linvit_mm.utils.benchmark.memory``): on CUDA ``max_memory_allocated`` over the step minus
what was allocated before it; on a CPU each kind runs in a fresh subprocess that takes one
warm-up step on a small input (thread pools, kernels and the optimizer state are then
resident), frees the gradients, reads ``VmRSS``, resets the peak and reads ``VmHWM`` after one
full-size step, with glibc's mmap threshold fixed so that resident memory follows live
tensors. Both figures include the gradients of what trains.

Weights are random (the cost does not depend on their values); both models keep training
through the run.

Targets: ``pair_ratio <= 1.3`` and ``memory_ratio <= 0.6`` (ViT-S, 224 px).

Example::

    python tools/analysis_tools/benchmark_align.py                  # ViT-S relu, batch 8, 224
    python tools/analysis_tools/benchmark_align.py --attn-type ttt --threads 2 --iters 20
"""
# Declared before the first import: linvit_mm, imported first, then chooses this process's
# CPU threading before torch loads (see linvit_mm/cpu_threads.py; the user's variables win).
LINVIT_MM_TOOL = True
import linvit_mm  # noqa: E402,F401  isort: skip
import argparse
import json
from datetime import datetime, timezone

import torch

from linvit_mm.utils.benchmark import add_training_step_args, check_training_step_args
from linvit_mm.utils.benchmark.align import (KINDS, benchmark_memory, benchmark_time,
                                             probe_step_peak)
from linvit_mm.utils.benchmark.targets import ALIGN_MEMORY_RATIO, ALIGN_TIME_RATIO

# The names the tool's JSON record and report have always used.
TARGET_TIME_RATIO = ALIGN_TIME_RATIO
TARGET_MEMORY_RATIO = ALIGN_MEMORY_RATIO


# ---------------------------------------------------------------- report
def format_report(args, result):
    lines = [
        f'Attention alignment step vs a plain training step: {args.attn_type} student, arch '
        f'{args.arch}, batch {args.batch_size} x {args.img_size}px, '
        f'{"amp" if args.amp else "fp32"}, {args.device}, {torch.get_num_threads()} threads, '
        f'{args.iters} pairs after {args.warmup} warm-up pairs',
        '',
        '| step | median ms | min ms | peak MiB |',
        '|---|---:|---:|---:|',
    ]
    for kind in KINDS:
        peak = result.get(f'{kind}_peak_mib')
        lines.append(f'| {kind} | {result[f"{kind}_ms"]:.1f} | {result[f"{kind}_min_ms"]:.1f} | '
                     f'{"-" if peak is None else f"{peak:.0f}"} |')
    lines += [
        '',
        f'time align/plain: median of per-pair ratios {result["pair_ratio"]:.3f}, ratio of '
        f'medians {result["ratio"]:.3f}, ratio of minima {result["min_ratio"]:.3f}',
        f'target: per-pair ratio <= {TARGET_TIME_RATIO}: '
        f'{"PASS" if result["pair_ratio"] <= TARGET_TIME_RATIO else "FAIL"}',
    ]
    if 'memory_ratio' in result:
        lines.append(f'peak memory align/plain {result["memory_ratio"]:.3f}; target <= '
                     f'{TARGET_MEMORY_RATIO}: '
                     f'{"PASS" if result["memory_ratio"] <= TARGET_MEMORY_RATIO else "FAIL"}')
    return '\n'.join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Cost of the attention-alignment step against a plain training step')
    add_training_step_args(parser, iters=20, pair='one plain step, one alignment step')
    parser.add_argument('--layers', type=int, nargs='+', default=None,
                        help='blocks to align (default: all)')
    parser.add_argument('--no-memory', action='store_true', help='skip the peak memory')
    parser.add_argument('--json', dest='json_path', default=None,
                        help='also write the result (with every sample) to this JSON file')
    parser.add_argument('--probe-memory', choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_training_step_args(parser, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe_memory:
        print(json.dumps(probe_step_peak(args.probe_memory, args)))
        return None
    result = benchmark_time(args)
    if not args.no_memory:
        result.update(benchmark_memory(args))
    print()
    print(format_report(args, result))
    if args.json_path:
        record = dict(vars(args), threads=torch.get_num_threads(),
                      date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
                      torch=torch.__version__, target_time_ratio=TARGET_TIME_RATIO,
                      target_memory_ratio=TARGET_MEMORY_RATIO, **result)
        with open(args.json_path, 'w') as f:
            json.dump(record, f, indent=1)
    return result


if __name__ == '__main__':
    main()
