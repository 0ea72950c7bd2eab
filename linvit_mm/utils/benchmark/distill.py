"""The attention-distillation benchmark (``benchmark_distill.py``): a classifier step with
:class:`AttentionDistillHook` working against one with it switched off, in alternating pairs.

``options``: a namespace with the fields of :data:`.steps.STEP_OPTIONS`, ``loss_weight``,
``iters`` and ``warmup``."""
import statistics
import tempfile
import types

import torch

from .common import ForwardClock, quiet_mmengine_logs
from .steps import (build_classifier, build_optim_wrapper, detached_losses, random_batch,
                    timed_step, write_random_teacher)
from .targets import DISTILL_TIME_RATIO


def setup_hook(model, arch, img_size, patch_size, loss_weight):
    """The real hook, set up as the Runner would: ``before_train`` on the built model, its
    Softmax teacher loading random weights (:func:`.steps.write_random_teacher`)."""
    from mmengine.logging import MMLogger

    from linvit_mm.engine import AttentionDistillHook
    # A Runner holds the model, its logger and the loop counters the hook reads.
    runner = types.SimpleNamespace(model=model, logger=MMLogger.get_current_instance(),
                                   epoch=0, iter=0)
    with tempfile.TemporaryDirectory() as folder:
        teacher_cfg = dict(type='LinearViT', arch=arch, attn_type='softmax', img_size=img_size,
                           patch_size=patch_size, init_cfg=dict(
                               type='Pretrained',
                               checkpoint=write_random_teacher(arch, img_size, patch_size,
                                                               folder)))
        hook = AttentionDistillHook(teacher=teacher_cfg, loss_weight=loss_weight)
        with quiet_mmengine_logs():  # the teacher's init_weights dump
            hook.before_train(runner)
    return hook, runner


def distill_step(model, data, optim_wrapper, device, hook, runner):
    """:func:`.steps.timed_step` with the hook; refused when the hook added no loss."""
    elapsed, outputs = timed_step(model, data, optim_wrapper, device, hook, runner)
    if 'loss_distill' not in outputs:
        raise RuntimeError('the distillation step returned no loss_distill: the hook did '
                           'not run, so the measurement would be meaningless')
    return elapsed, outputs


def benchmark(options, log=print):
    """Pairs of steps without and with the hook, the order swapped every pair; medians,
    minima, the teacher forward's share and the median per-pair ratio with its verdict."""
    device = options.device
    torch.manual_seed(0)
    model = build_classifier(options.arch, options.attn_type, options.img_size,
                             options.patch_size, options.num_classes, device)
    optim_wrapper = build_optim_wrapper(model, device, options.amp)
    hook, runner = setup_hook(model, options.arch, options.img_size, options.patch_size,
                              options.loss_weight)
    teacher_clock = ForwardClock([hook.teacher], device)
    data = random_batch(options.batch_size, options.img_size, options.num_classes)

    without, with_hook, teacher, pair_ratios = [], [], [], []
    last_losses = {}
    try:
        for pair in range(options.warmup + options.iters):
            order = ('without', 'with') if pair % 2 == 0 else ('with', 'without')
            times = {}
            for kind in order:
                if kind == 'with':
                    times[kind], outputs = distill_step(model, data, optim_wrapper, device,
                                                        hook, runner)
                    teacher_s = teacher_clock.take()
                    last_losses = detached_losses(outputs)
                else:
                    times[kind], _ = timed_step(model, data, optim_wrapper, device)
                    if teacher_clock.take():
                        raise RuntimeError('the teacher ran in a step without distillation')
            if pair >= options.warmup:
                without.append(times['without'])
                with_hook.append(times['with'])
                teacher.append(teacher_s)
                pair_ratios.append(times['with'] / times['without'])
                log(f'pair {pair - options.warmup + 1:3d}/{options.iters}: without '
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
        passed=pair_ratio <= DISTILL_TIME_RATIO,
        last_losses=last_losses,
        without_samples_ms=[t * 1e3 for t in without],
        with_samples_ms=[t * 1e3 for t in with_hook],
    )
