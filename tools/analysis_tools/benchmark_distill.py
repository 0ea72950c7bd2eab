#!/usr/bin/env python
"""Cost of attention distillation: a training step with and without AttentionDistillHook.

An mmpretrain ``ImageClassifier`` (LinearViT student, ``VisionTransformerClsHead``,
``ClsDataPreprocessor``) and an ``OptimWrapper(AdamW)`` run
``model.train_step(data, optim_wrapper)``, the call mmengine's train loop makes, on one
fixed random batch. The real :class:`AttentionDistillHook` is set up once
(``before_train`` on a minimal runner: it builds the frozen Softmax teacher and attaches
its forward hooks to the student), then steps alternate:

* **without**: the hook is attached but switched off (no ``before_train_iter``), the
  state of a run after ``stop_iter``: its forward hooks return at once, no teacher runs,
  no loss is added;
* **with**: ``before_train_iter``, the step, ``after_train_iter``, all inside the timer,
  as the Runner calls them: the teacher forward on the preprocessed batch, recording of
  both models' attention outputs, ``loss_distill`` and its backward.

So the two kinds of step differ by the hook's work only. Steps alternate A B A B ... with
the order swapped every pair (A B, B A, ...), so load from other jobs on a shared machine
hits both alike. Three ratios are reported:

* ``pair_ratio``: the median over pairs of ``with / without``, each pair measured back to
  back. Load that changes slower than a pair cancels in it, so it is the figure the
  target is checked against;
* ``ratio``: ``median(with) / median(without)``;
* ``min_ratio``: ``min(with) / min(without)``, the cost with the least interference.

On an idle machine the three agree; when they do not, the machine was busy. The teacher
forward is timed by hooks on the teacher itself.

The weights are random (cost does not depend on their values); the student keeps
training through the run, identically for both kinds of step.

The target: ``pair_ratio <= 1.35``. With ``--json`` the result (every sample included)
goes to that file and a plot of the steps to a PNG beside it.

Example::

    python tools/analysis_tools/benchmark_distill.py                 # ViT-S relu, batch 8, 224
    python tools/analysis_tools/benchmark_distill.py --device cuda --batch-size 64 --amp
"""
# Declared before the first import: linvit_mm, imported first, then chooses this process's
# CPU threading before torch loads (see linvit_mm/cpu_threads.py; the user's variables win).
LINVIT_MM_TOOL = True
import linvit_mm  # noqa: E402,F401  isort: skip
import argparse
import json
import os.path as osp
import textwrap
from datetime import datetime, timezone

import torch

from linvit_mm.utils.benchmark import add_training_step_args, check_training_step_args
from linvit_mm.utils.benchmark.distill import benchmark
from linvit_mm.utils.benchmark.targets import DISTILL_TIME_RATIO

# The name the tool's JSON record and report have always used.
TARGET_RATIO = DISTILL_TIME_RATIO


def format_report(args, result):
    threads = torch.get_num_threads()
    lines = [
        f'AttentionDistillHook cost: {args.attn_type} student, softmax teacher, arch '
        f'{args.arch}, batch {args.batch_size} x {args.img_size}px, '
        f'{"bf16/fp16 amp" if args.amp else "fp32"}, {args.device}, {threads} threads, '
        f'{args.iters} pairs after {args.warmup} warm-up pairs',
        '',
        '| step | median ms | min ms |',
        '|---|---:|---:|',
        f'| without hook | {result["without_ms"]:.1f} | {result["without_min_ms"]:.1f} |',
        f'| with hook | {result["with_ms"]:.1f} | {result["with_min_ms"]:.1f} |',
        f'| - teacher forward | {result["teacher_ms"]:.1f} | |',
        f'| - rest of the hook (recording, loss, its backward) | '
        f'{result["other_overhead_ms"]:.1f} | |',
        '',
        f'ratio with/without: median of per-pair ratios {result["pair_ratio"]:.3f}, '
        f'ratio of medians {result["ratio"]:.3f}, ratio of minima {result["min_ratio"]:.3f}',
        f'teacher forward: {100 * result["teacher_fraction"]:.1f}% of a step with the hook, '
        f'{100 * result["teacher_share_of_overhead"]:.0f}% of the added time',
        f'target: per-pair ratio <= {TARGET_RATIO}: {"PASS" if result["passed"] else "FAIL"}',
    ]
    return '\n'.join(lines)


def plot(result, path, title):
    """Left: every timed pair's two steps. Right: the median step without the hook beside
    the median step with it, split into the teacher forward and the rest of the hook."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, (ax_pairs, ax_split) = plt.subplots(1, 2, figsize=(10, 3.8),
                                             gridspec_kw=dict(width_ratios=(2, 1)))
    pairs = range(1, len(result['without_samples_ms']) + 1)
    ax_pairs.plot(pairs, result['without_samples_ms'], marker='o', label='without hook')
    ax_pairs.plot(pairs, result['with_samples_ms'], marker='s', label='with hook')
    ax_pairs.set_xlabel('timed pair')
    ax_pairs.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_pairs.set_ylabel('training step (ms)')
    ax_pairs.set_ylim(bottom=0)
    ax_pairs.grid(alpha=.3)
    ax_pairs.legend(fontsize=8)
    base, teacher = result['without_ms'], result['teacher_ms']
    rest = max(result['with_ms'] - base - teacher, 0.)
    ax_split.bar(['without', 'with'], [base, base], label='step without the hook')
    ax_split.bar(['with'], [teacher], bottom=[base], label='teacher forward')
    ax_split.bar(['with'], [rest], bottom=[base + teacher], label='rest of the hook')
    ax_split.text(1, result['with_ms'], f'{result["pair_ratio"]:.2f}x per pair', ha='center',
                  va='bottom', fontsize=9)
    ax_split.set_ylabel('median step (ms)')
    ax_split.set_ylim(0, result['with_ms'] * 1.6)  # room for the legend above the bars
    ax_split.legend(fontsize=7, loc='upper left')
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Training-step cost of AttentionDistillHook, measured side by side')
    add_training_step_args(parser, iters=30, pair='one step without, one with the hook')
    parser.add_argument('--loss-weight', type=float, default=50.0)
    parser.add_argument('--json', dest='json_path', default=None,
                        help='also write the result (with every sample) to this JSON file, '
                        'and a plot beside it (same name, .png)')
    args = parser.parse_args(argv)
    check_training_step_args(parser, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = benchmark(args)
    print()
    print(format_report(args, result))
    if args.json_path:
        record = dict(vars(args), arch=args.arch, threads=torch.get_num_threads(),
                      date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
                      torch=torch.__version__, target_ratio=TARGET_RATIO, **result)
        with open(args.json_path, 'w') as f:
            json.dump(record, f, indent=1)
        png_path = osp.splitext(args.json_path)[0] + '.png'
        plot(result, png_path, f'AttentionDistillHook: {args.attn_type} student, arch '
             f'{args.arch}, batch {args.batch_size} x {args.img_size}px, '
             f'{"amp" if args.amp else "fp32"}, {args.device}, {torch.get_num_threads()} threads')
        print(f'wrote {args.json_path} and {png_path}')
    return result


if __name__ == '__main__':
    main()
