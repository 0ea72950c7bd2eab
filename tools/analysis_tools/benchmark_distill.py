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
import statistics
import textwrap
import time
import types
from datetime import datetime, timezone

import torch

from linvit_mm.utils.benchmark import (ForwardClock, add_training_step_args,
                                       check_training_step_args, quiet_mmengine_logs,
                                       synchronise)

TARGET_RATIO = 1.35
IMAGENET_MEAN = [123.675, 116.28, 103.53]
IMAGENET_STD = [58.395, 57.12, 57.375]


def build_classifier(arch, attn_type, img_size, patch_size, num_classes, device):
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS

    from linvit_mm.models import LinearViT  # importing registers it
    cfg = dict(
        type='ImageClassifier',
        backbone=dict(type='LinearViT', arch=arch, attn_type=attn_type, img_size=img_size,
                      patch_size=patch_size),
        neck=None,
        head=dict(type='VisionTransformerClsHead', num_classes=num_classes,
                  in_channels=LinearViT.resolve_arch(arch)['embed_dims'],
                  loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original')),
        data_preprocessor=dict(type='ClsDataPreprocessor', num_classes=num_classes,
                               mean=IMAGENET_MEAN, std=IMAGENET_STD, to_rgb=True))
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        model = MODELS.build(cfg)
    with quiet_mmengine_logs():
        model.init_weights()
    return model.to(device).train()


def build_optim_wrapper(model, device, amp):
    from mmengine.optim import AmpOptimWrapper, OptimWrapper

    from linvit_mm.engine import CPUAmpOptimWrapper
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    if not amp:
        return OptimWrapper(optimizer)
    if torch.device(device).type == 'cuda':
        return AmpOptimWrapper(optimizer=optimizer, loss_scale='dynamic')
    return CPUAmpOptimWrapper(optimizer=optimizer)


def random_batch(batch_size, img_size, num_classes, seed=0):
    """What a dataloader yields: uint8 images and data samples with labels."""
    from mmpretrain.structures import DataSample
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch_size, 3, img_size, img_size), dtype=torch.uint8,
                           generator=generator)
    labels = torch.randint(0, num_classes, (batch_size, ), generator=generator)
    return dict(inputs=list(images),
                data_samples=[DataSample().set_gt_label(int(label)) for label in labels])


def setup_hook(model, arch, img_size, patch_size, loss_weight):
    """The real hook, set up as the Runner would: ``before_train`` on the built model."""
    from mmengine.logging import MMLogger

    from linvit_mm.engine import AttentionDistillHook
    teacher_cfg = dict(type='LinearViT', arch=arch, attn_type='softmax', img_size=img_size,
                       patch_size=patch_size)
    hook = AttentionDistillHook(teacher=teacher_cfg, loss_weight=loss_weight)
    # A Runner holds the model, its logger and the loop counters the hook reads.
    runner = types.SimpleNamespace(model=model, logger=MMLogger.get_current_instance(),
                                   epoch=0, iter=0)
    with quiet_mmengine_logs():  # the teacher's init_weights dump
        hook.before_train(runner)
    return hook, runner


def timed_step(model, data, optim_wrapper, device, hook=None, runner=None):
    """One ``train_step``; with ``hook``, wrapped in the Runner's per-iteration calls."""
    synchronise(device)
    start = time.perf_counter()
    if hook is not None:
        hook.before_train_iter(runner, runner.iter, data)
    outputs = model.train_step(data, optim_wrapper)
    if hook is not None:
        hook.after_train_iter(runner, runner.iter, data, outputs)
        runner.iter += 1
    synchronise(device)
    elapsed = time.perf_counter() - start
    if hook is not None and 'loss_distill' not in outputs:
        raise RuntimeError('the distillation step returned no loss_distill: the hook did '
                           'not run, so the measurement would be meaningless')
    return elapsed, outputs


def benchmark(args, log=print):
    device = args.device
    torch.manual_seed(0)
    model = build_classifier(args.arch, args.attn_type, args.img_size, args.patch_size,
                             args.num_classes, device)
    optim_wrapper = build_optim_wrapper(model, device, args.amp)
    hook, runner = setup_hook(model, args.arch, args.img_size, args.patch_size,
                              args.loss_weight)
    teacher_clock = ForwardClock([hook.teacher], device)
    data = random_batch(args.batch_size, args.img_size, args.num_classes)

    without, with_hook, teacher, pair_ratios = [], [], [], []
    last_losses = {}
    try:
        for pair in range(args.warmup + args.iters):
            timed = pair >= args.warmup
            order = ('without', 'with') if pair % 2 == 0 else ('with', 'without')
            times = {}
            for kind in order:
                if kind == 'with':
                    times[kind], outputs = timed_step(model, data, optim_wrapper, device,
                                                      hook, runner)
                    teacher_s = teacher_clock.take()
                    last_losses = {k: float(torch.as_tensor(v).detach())
                                   for k, v in outputs.items()}
                else:
                    times[kind], _ = timed_step(model, data, optim_wrapper, device)
                    if teacher_clock.take():
                        raise RuntimeError('the teacher ran in a step without distillation')
            if timed:
                without.append(times['without'])
                with_hook.append(times['with'])
                teacher.append(teacher_s)
                pair_ratios.append(times['with'] / times['without'])
                log(f'pair {pair - args.warmup + 1:3d}/{args.iters}: without '
                    f'{times["without"] * 1e3:8.1f} ms   with {times["with"] * 1e3:8.1f} ms   '
                    f'teacher {teacher_s * 1e3:7.1f} ms')
    finally:
        teacher_clock.remove()
        hook.after_train(runner)

    median_without = statistics.median(without)
    median_with = statistics.median(with_hook)
    median_teacher = statistics.median(teacher)
    pair_ratio = statistics.median(pair_ratios)
    return dict(
        without_ms=median_without * 1e3,
        with_ms=median_with * 1e3,
        teacher_ms=median_teacher * 1e3,
        ratio=median_with / median_without,
        pair_ratio=pair_ratio,
        min_ratio=min(with_hook) / min(without),
        without_min_ms=min(without) * 1e3,
        with_min_ms=min(with_hook) * 1e3,
        teacher_fraction=median_teacher / median_with,
        teacher_share_of_overhead=median_teacher / max(median_with - median_without, 1e-12),
        other_overhead_ms=(median_with - median_without - median_teacher) * 1e3,
        passed=pair_ratio <= TARGET_RATIO,
        last_losses=last_losses,
        without_samples_ms=[t * 1e3 for t in without],
        with_samples_ms=[t * 1e3 for t in with_hook],
    )


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
