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

Peak memory of one step of each kind, measured as ``benchmark_backbone.py`` does (its probe
is used): on CUDA ``max_memory_allocated`` over the step minus what was allocated before it;
on a CPU each kind runs in a fresh subprocess that takes one warm-up step on a small input
(thread pools, kernels and the optimizer state are then resident), frees the gradients,
reads ``VmRSS``, resets the peak and reads ``VmHWM`` after one full-size step, with glibc's
mmap threshold fixed so that resident memory follows live tensors. Both figures include the
gradients of what trains.

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
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from linvit_mm.utils.benchmark import (add_training_step_args, check_training_step_args,
                                       quiet_mmengine_logs, synchronise)

TARGET_TIME_RATIO = 1.3
TARGET_MEMORY_RATIO = 0.6
IMAGENET_MEAN = [123.675, 116.28, 103.53]
IMAGENET_STD = [58.395, 57.12, 57.375]
KINDS = ('plain', 'align')


def _benchmark_backbone():
    """``tools/analysis_tools/benchmark_backbone.py``, whose CPU memory probe this tool uses."""
    path = Path(__file__).with_name('benchmark_backbone.py')
    spec = importlib.util.spec_from_file_location('linvit_benchmark_backbone', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- models and data
def data_preprocessor(num_classes):
    return dict(type='ClsDataPreprocessor', num_classes=num_classes, mean=IMAGENET_MEAN,
                std=IMAGENET_STD, to_rgb=True)


def student_cfg(args):
    return dict(type='LinearViT', arch=args.arch, attn_type=args.attn_type,
                img_size=args.img_size, patch_size=args.patch_size)


def build_plain(args):
    from mmpretrain.registry import MODELS

    from linvit_mm.models import LinearViT
    cfg = dict(
        type='ImageClassifier', backbone=student_cfg(args), neck=None,
        head=dict(type='VisionTransformerClsHead', num_classes=args.num_classes,
                  in_channels=LinearViT.resolve_arch(args.arch)['embed_dims'],
                  loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original')),
        data_preprocessor=data_preprocessor(args.num_classes))
    model = MODELS.build(cfg)
    with quiet_mmengine_logs():
        model.init_weights()
    return model.to(args.device).train()


def build_align(args, teacher_checkpoint):
    from mmpretrain.registry import MODELS
    teacher = dict(type='LinearViT', arch=args.arch, attn_type='softmax',
                   img_size=args.img_size, patch_size=args.patch_size,
                   init_cfg=dict(type='Pretrained', checkpoint=teacher_checkpoint))
    model = MODELS.build(dict(type='AttentionAligner', backbone=student_cfg(args),
                              teacher=teacher, layers=args.layers,
                              data_preprocessor=data_preprocessor(args.num_classes)))
    with quiet_mmengine_logs():
        model.init_weights()
    return model.to(args.device).train()


def write_teacher(args, folder):
    """Random Softmax weights of the student's arch (the aligner needs a teacher checkpoint)."""
    from linvit_mm.models import LinearViT
    cfg = dict(student_cfg(args), attn_type='softmax')
    cfg.pop('type')
    path = os.path.join(folder, 'softmax_teacher.pth')
    torch.save(LinearViT(**cfg).state_dict(), path)
    return path


def build(kind, args, folder):
    return build_plain(args) if kind == 'plain' else build_align(args, write_teacher(args,
                                                                                     folder))


def build_optim_wrapper(model, args):
    from mmengine.optim import AmpOptimWrapper, OptimWrapper

    from linvit_mm.engine import CPUAmpOptimWrapper
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.05)
    if not args.amp:
        return OptimWrapper(optimizer)
    if torch.device(args.device).type == 'cuda':
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


def timed_step(model, data, optim_wrapper, device):
    synchronise(device)
    start = time.perf_counter()
    outputs = model.train_step(data, optim_wrapper)
    synchronise(device)
    return time.perf_counter() - start, outputs


# ---------------------------------------------------------------- time
def benchmark_time(args, log=print):
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        models = {kind: build(kind, args, folder) for kind in KINDS}
    wrappers = {kind: build_optim_wrapper(model, args) for kind, model in models.items()}
    data = random_batch(args.batch_size, args.img_size, args.num_classes)
    samples = {kind: [] for kind in KINDS}
    pair_ratios, last_losses = [], {}
    for pair in range(args.warmup + args.iters):
        order = KINDS if pair % 2 == 0 else KINDS[::-1]
        times = {}
        for kind in order:
            times[kind], outputs = timed_step(models[kind], data, wrappers[kind], args.device)
            last_losses[kind] = {k: float(torch.as_tensor(v).detach())
                                 for k, v in outputs.items()}
        if 'loss_align' not in last_losses['align']:
            raise RuntimeError('the alignment step returned no loss_align: the measurement '
                               'would be meaningless')
        if pair >= args.warmup:
            for kind in KINDS:
                samples[kind].append(times[kind])
            pair_ratios.append(times['align'] / times['plain'])
            log(f'pair {pair - args.warmup + 1:3d}/{args.iters}: plain '
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


# ---------------------------------------------------------------- memory
def probe_step_peak(kind, args):
    """Runs inside the fresh subprocess (CPU): one step's peak RSS over RSS just before it."""
    backbone = _benchmark_backbone()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        model = build(kind, args, folder)
    optim_wrapper = build_optim_wrapper(model, args)
    warm_side = backbone.PROBE_GRID * args.patch_size
    model.train_step(random_batch(1, warm_side, args.num_classes), optim_wrapper)
    data = random_batch(args.batch_size, args.img_size, args.num_classes)
    optim_wrapper.zero_grad()
    gc.collect()
    before_kib = backbone._status_kib('VmRSS')
    backbone._reset_peak_rss()
    if backbone._status_kib('VmHWM') > before_kib + 1024:
        raise RuntimeError('resetting VmHWM through /proc/self/clear_refs had no effect; this '
                           'kernel cannot measure a step peak this way (use --device cuda)')
    model.train_step(data, optim_wrapper)
    peak_kib = backbone._status_kib('VmHWM')
    return dict(peak_mib=(peak_kib - before_kib) / 1024, rss_before_mib=before_kib / 1024)


def cpu_step_peak_mib(kind, args, argv):
    threshold = str(_benchmark_backbone().MMAP_THRESHOLD)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=threshold, MALLOC_TRIM_THRESHOLD_=threshold)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, '--probe-memory', kind]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f'memory probe of the {kind} step failed (exit '
                           f'{result.returncode}):\n{result.stderr[-3000:]}')
    return json.loads(result.stdout.strip().splitlines()[-1])['peak_mib']


def cuda_step_peak_mib(kind, args):
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        model = build(kind, args, folder)
    optim_wrapper = build_optim_wrapper(model, args)
    data = random_batch(args.batch_size, args.img_size, args.num_classes)
    model.train_step(data, optim_wrapper)  # optimizer state and kernels in place
    optim_wrapper.zero_grad()
    device = torch.device(args.device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    model.train_step(data, optim_wrapper)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del model, optim_wrapper
    gc.collect()
    torch.cuda.empty_cache()
    return peak / 2**20


def benchmark_memory(args, argv):
    if torch.device(args.device).type == 'cuda':
        peaks = {kind: cuda_step_peak_mib(kind, args) for kind in KINDS}
    else:
        peaks = {kind: cpu_step_peak_mib(kind, args, argv) for kind in KINDS}
    return dict(plain_peak_mib=peaks['plain'], align_peak_mib=peaks['align'],
                memory_ratio=peaks['align'] / peaks['plain'])


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
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe_memory:
        print(json.dumps(probe_step_peak(args.probe_memory, args)))
        return None
    result = benchmark_time(args)
    if not args.no_memory:
        result.update(benchmark_memory(args, argv))
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
