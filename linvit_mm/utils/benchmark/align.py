"""The attention-alignment benchmark (``benchmark_align.py``): an ``AttentionAligner`` step
against a plain classifier step of the same student, time in alternating pairs and peak
memory.

``options``: a namespace with the fields of :data:`.steps.STEP_OPTIONS` and ``layers``
(``iters`` and ``warmup`` too for the timing)."""
import gc
import statistics
import tempfile
import types

import torch

from .memory import PROBE_GRID, cuda_step_peak_mib, rss_step_peak, run_probe
from .steps import (build_classifier, build_optim_wrapper, data_preprocessor, detached_losses,
                    random_batch, step_options, student_cfg, timed_step,
                    write_random_teacher)

KINDS = ('plain', 'align')


def _student(options):
    return student_cfg(options.arch, options.attn_type, options.img_size, options.patch_size)


def build_plain(options):
    return build_classifier(options.arch, options.attn_type, options.img_size,
                            options.patch_size, options.num_classes, options.device)


def build_align(options, teacher_checkpoint):
    from mmpretrain.registry import MODELS

    from .common import quiet_mmengine_logs
    teacher = dict(_student(options), attn_type='softmax',
                   init_cfg=dict(type='Pretrained', checkpoint=teacher_checkpoint))
    model = MODELS.build(dict(type='AttentionAligner', backbone=_student(options),
                              teacher=teacher, layers=options.layers,
                              data_preprocessor=data_preprocessor(options.num_classes)))
    with quiet_mmengine_logs():
        model.init_weights()
    return model.to(options.device).train()


def build(kind, options):
    if kind == 'plain':
        return build_plain(options)
    with tempfile.TemporaryDirectory() as folder:
        return build_align(options, write_random_teacher(options.arch, options.img_size,
                                                         options.patch_size, folder))


def benchmark_time(options, log=print):
    """Steps alternate plain, align, align, plain, ... on one fixed batch; medians, minima
    and the median of the per-pair ratios ``align / plain``."""
    torch.manual_seed(0)
    models = {kind: build(kind, options) for kind in KINDS}
    wrappers = {kind: build_optim_wrapper(model, options.device, options.amp)
                for kind, model in models.items()}
    data = random_batch(options.batch_size, options.img_size, options.num_classes)
    samples = {kind: [] for kind in KINDS}
    pair_ratios, last_losses = [], {}
    for pair in range(options.warmup + options.iters):
        order = KINDS if pair % 2 == 0 else KINDS[::-1]
        times = {}
        for kind in order:
            times[kind], outputs = timed_step(models[kind], data, wrappers[kind],
                                              options.device)
            last_losses[kind] = detached_losses(outputs)
        if 'loss_align' not in last_losses['align']:
            raise RuntimeError('the alignment step returned no loss_align: the measurement '
                               'would be meaningless')
        if pair >= options.warmup:
            for kind in KINDS:
                samples[kind].append(times[kind])
            pair_ratios.append(times['align'] / times['plain'])
            log(f'pair {pair - options.warmup + 1:3d}/{options.iters}: plain '
                f'{times["plain"] * 1e3:8.1f} ms   align {times["align"] * 1e3:8.1f} ms')
    medians = {kind: statistics.median(samples[kind]) for kind in KINDS}
    return dict(
        plain_ms=medians['plain'] * 1e3, align_ms=medians['align'] * 1e3,
        plain_min_ms=min(samples['plain']) * 1e3, align_min_ms=min(samples['align']) * 1e3,
        pair_ratio=statistics.median(pair_ratios),
        ratio=medians['align'] / medians['plain'],
        min_ratio=min(samples['align']) / min(samples['plain']),
        last_losses=last_losses,
        plain_samples_ms=[t * 1e3 for t in samples['plain']],
        align_samples_ms=[t * 1e3 for t in samples['align']])


def probe_step_peak(kind, options, threads=None):
    """Runs inside the fresh process (CPU): one ``kind`` step's peak resident set over the
    resident set just before it, after a warm-up step on a small input. ``options`` may be
    the dict of a namespace (as :func:`cpu_step_peak_mib` sends it)."""
    if isinstance(options, dict):
        options = types.SimpleNamespace(**options)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build(kind, options)
    optim_wrapper = build_optim_wrapper(model, options.device, options.amp)
    warm_side = PROBE_GRID * options.patch_size
    model.train_step(random_batch(1, warm_side, options.num_classes), optim_wrapper)
    data = random_batch(options.batch_size, options.img_size, options.num_classes)
    optim_wrapper.zero_grad()
    peak, _ = rss_step_peak(lambda: model.train_step(data, optim_wrapper))
    return peak


def cpu_step_peak_mib(kind, options):
    return run_probe(f'{__name__}:probe_step_peak', f'of the {kind} step', kind=kind,
                     options=vars(step_options(options, 'layers')),
                     threads=torch.get_num_threads())['peak_mib']


def cuda_step_peak_mib_of(kind, options):
    torch.manual_seed(0)
    model = build(kind, options)
    optim_wrapper = build_optim_wrapper(model, options.device, options.amp)
    data = random_batch(options.batch_size, options.img_size, options.num_classes)
    model.train_step(data, optim_wrapper)  # optimizer state and kernels in place
    optim_wrapper.zero_grad()
    peak = cuda_step_peak_mib(lambda: model.train_step(data, optim_wrapper), options.device)
    del model, optim_wrapper
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def benchmark_memory(options):
    """Each kind's step peak (CUDA allocator, or a fresh process on a CPU) and their ratio."""
    measure = (cuda_step_peak_mib_of if torch.device(options.device).type == 'cuda'
               else cpu_step_peak_mib)
    peaks = {kind: measure(kind, options) for kind in KINDS}
    return dict(plain_peak_mib=peaks['plain'], align_peak_mib=peaks['align'],
                memory_ratio=peaks['align'] / peaks['plain'])
