#!/usr/bin/env python
"""Benchmark the LinearViT backbone: every attention operator side by side, one run.

For each input size (default 224, 512, 1024, 2048 px: 196 to 16384 patch tokens) and
each registered operator (softmax, elu, relu, inline, hedgehog, mhla, ttt) at batch 1,
float32, the tool measures

* forward latency: ``eval()`` under ``no_grad``;
* training-step latency: ``train()``, forward plus backward of a scalar loss (the
  mean of every output), gradients set to ``None`` before each step, outside the timer;
* peak memory of a training step (see below).

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
"""
# Declared before the first import: linvit_mm, imported first, then chooses this process's
# CPU threading before torch loads (see linvit_mm/cpu_threads.py; the user's variables win).
LINVIT_MM_TOOL = True
import linvit_mm  # noqa: E402,F401  isort: skip
import argparse
import csv
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from linvit_mm.models.attention import attention_types
from linvit_mm.models.attention.mhla import OFFICIAL_IMAGENET
from linvit_mm.models.backbones.hybrid import (describe_attn_types, parse_attn_spec,
                                               resolve_attn_types)
from linvit_mm.cpu_threads import usable_cores, usable_cpus
from linvit_mm.utils.benchmark import (NEIGHBOUR_STEP, NEIGHBOUR_STEPS, NEIGHBOUR_WARMUP,
                                       format_neighbour_table, neighbour_policies, parse_arch,
                                       quiet_mmengine_logs, rotated,
                                       run_neighbour_benchmark, synchronise)
from linvit_mm.utils.complexity import count_macs, patch_grid

DEFAULT_SIZES = (224, 512, 1024, 2048)
REFERENCE = 'softmax'
CSV_COLUMNS = ('size', 'patch_tokens', 'tokens', 'operator', 'fwd_ms', 'train_ms', 'peak_mib',
               'speedup_fwd', 'speedup_train', 'mac_bound', 'fwd_pct_of_bound',
               'train_pct_of_bound', 'gmacs', 'fwd_cpu_ms', 'train_cpu_ms', 'cpu_speedup_fwd',
               'cpu_speedup_train', 'fwd_samples_ms', 'train_samples_ms', 'repeats',
               'warmup', 'threads', 'background_cores', 'retakes', 'device', 'memory_method')
# Targets (CPU, fp32, batch 1, ViT-S); the fraction of the MAC bound is each operator's
# ``bound_fraction_target``.
BOUND_TARGET_TOKENS = (4096, 16384)
SMALL_TOKENS, SMALL_SLOWDOWN = 196, 1.1
MEMORY_PAIR, MEMORY_GROWTH = (4096, 16384), 4.5
HYBRID_EXCESS = 1.1
# Above glibc's default threshold, below every activation of interest.
MMAP_THRESHOLD = 128 * 1024
PROBE_GRID = 2  # patches per side of the subprocess's warm-up input
# Forms of an operator measured under their own names beside its default form:
# name -> (operator, extra LinearViT arguments).
OPERATOR_VARIANTS = {
    'mhla-offnorm': ('mhla', dict(attn_cfg=dict(normaliser='official'))),
    'mhla-official': ('mhla', dict(attn_cfg=OFFICIAL_IMAGENET, qkv_bias=False)),
}


# ---------------------------------------------------------------- model construction
def build_backbone(attn_type, arch, size, patch_size=16, init=True):
    """A LinearViT for ``size``-px inputs; ``init`` runs the DeiT initialisation (values
    only matter for timing through denormals and the like, never for MAC counts)."""
    from linvit_mm.models.backbones.linear_vit import LinearViT
    attn_type, extra = OPERATOR_VARIANTS.get(attn_type, (attn_type, {}))
    model = LinearViT(arch=arch, attn_type=attn_type, img_size=size, patch_size=patch_size,
                      **extra)
    if not init:
        return model
    with quiet_mmengine_logs():
        model.init_weights()
    return model


# ---------------------------------------------------------------- MAC counting
def mac_bound(attn_type, size, arch='small', patch_size=16, blocks_only=False):
    """``MACs(softmax) / MACs(attn_type)`` for a LinearViT at ``size`` px.

    ``blocks_only`` leaves the patch embedding out (the per-block ratio).
    """
    key = 'blocks' if blocks_only else 'total'
    macs = {op: count_macs(build_backbone(op, arch, size, patch_size, init=False), size)[key]
            for op in (REFERENCE, attn_type)}
    return macs[REFERENCE] / macs[attn_type]


# ---------------------------------------------------------------- timing
def scalar_loss(outputs):
    return sum(out.float().mean() for out in outputs)


class Stopwatch:
    """Wall time and this process's CPU time (all threads) of a block, in ms.

    Wall time is the latency the tables report. CPU time is a diagnostic for shared
    machines: a thread that waits for a core, or for a peer that waits for one, adds
    wall time but little CPU time.
    """

    def __init__(self, device):
        self.device = device
        self.wall_ms = self.cpu_ms = None

    def __enter__(self):
        synchronise(self.device)
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        synchronise(self.device)
        self.wall_ms = (time.perf_counter() - self._wall) * 1e3
        self.cpu_ms = (time.process_time() - self._cpu) * 1e3


def time_forward(model, images):
    model.eval()
    with torch.no_grad(), Stopwatch(images.device) as watch:
        model(images)
    return watch


def time_train_step(model, images):
    model.train()
    model.zero_grad(set_to_none=True)
    with Stopwatch(images.device) as watch:
        scalar_loss(model(images)).backward()
    return watch


def cuda_train_peak_mib(model, images):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(images.device)
    torch.cuda.reset_peak_memory_stats(images.device)
    before = torch.cuda.memory_allocated(images.device)
    scalar_loss(model(images)).backward()
    torch.cuda.synchronize(images.device)
    peak = torch.cuda.max_memory_allocated(images.device) - before
    model.zero_grad(set_to_none=True)
    return peak / 2**20


# ---------------------------------------------------------------- CPU peak memory
def _status_kib(field):
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    raise RuntimeError(f'/proc/self/status has no {field} line')


def _reset_peak_rss():
    # Linux >= 4.0: writing 5 resets VmHWM to the current VmRSS.
    with open('/proc/self/clear_refs', 'w') as clear_refs:
        clear_refs.write('5')


def probe_train_peak(attn_type, arch, size, threads):
    """Runs inside the fresh subprocess: the step's peak RSS over RSS just before it."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_backbone(attn_type, arch, size)
    warm_side = PROBE_GRID * model.patch_size
    time_train_step(model, torch.randn(1, 3, warm_side, warm_side))
    images = torch.randn(1, 3, size, size)
    model.zero_grad(set_to_none=True)
    gc.collect()
    before_kib = _status_kib('VmRSS')
    _reset_peak_rss()
    if _status_kib('VmHWM') > before_kib + 1024:
        raise RuntimeError('resetting VmHWM through /proc/self/clear_refs had no effect; this '
                           'kernel cannot measure a step peak this way (use --device cuda)')
    step_ms = time_train_step(model, images).wall_ms
    peak_kib = _status_kib('VmHWM')
    return dict(peak_mib=(peak_kib - before_kib) / 1024, rss_before_mib=before_kib / 1024,
                step_ms=step_ms)


def cpu_train_peak_mib(attn_type, arch, size, threads):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD),
               MALLOC_TRIM_THRESHOLD_=str(MMAP_THRESHOLD))
    cmd = [sys.executable, os.path.abspath(__file__), '--probe-memory', attn_type,
           '--arch', json.dumps(arch) if isinstance(arch, dict) else arch,
           '--sizes', str(size), '--threads', str(threads)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f'memory probe for {attn_type} at {size}px failed '
                           f'(exit {result.returncode}):\n{result.stderr[-3000:]}')
    return json.loads(result.stdout.strip().splitlines()[-1])['peak_mib']


# ---------------------------------------------------------------- background load
class BackgroundLoad:
    """CPU cores other processes kept busy, on average, between ``start`` and ``stop``.

    Busy time of the whole machine (``/proc/stat``) minus this process's own CPU time
    (all its threads, and its finished children), over the wall time. On a shared
    machine this says how much of the timing ran beside someone else's work; ``None``
    where ``/proc/stat`` does not exist.
    """

    def __init__(self):
        self.ticks_per_s = os.sysconf('SC_CLK_TCK') if hasattr(os, 'sysconf') else 100
        self._start = None

    @staticmethod
    def _machine_busy_ticks():
        with open('/proc/stat') as stat:
            user, nice, system, idle, iowait, irq, softirq, steal = map(
                int, stat.readline().split()[1:9])
        return user + nice + system + irq + softirq + steal

    @staticmethod
    def _own_cpu_s():
        times = os.times()
        return times.user + times.system + times.children_user + times.children_system

    def start(self):
        try:
            self._start = (time.perf_counter(), self._machine_busy_ticks(), self._own_cpu_s())
        except OSError:
            self._start = None

    def stop(self):
        if self._start is None:
            return None
        wall0, busy0, own0 = self._start
        busy_s = (self._machine_busy_ticks() - busy0) / self.ticks_per_s
        own_s = self._own_cpu_s() - own0
        return max(0., busy_s - own_s) / max(time.perf_counter() - wall0, 1e-9)


def wait_for_quiet(max_background, timeout_s, window_s=2.):
    """Sleep in ``window_s`` steps until other processes keep at most ``max_background``
    cores busy over one window, or ``timeout_s`` passes; returns the last reading."""
    deadline = time.perf_counter() + timeout_s
    while True:
        load = BackgroundLoad()
        load.start()
        time.sleep(window_s)
        busy = load.stop()
        if busy is None or busy <= max_background or time.perf_counter() >= deadline:
            return busy


# ---------------------------------------------------------------- the run
def benchmark_size(size, operators, arch, device, repeats, warmup, log=print,
                   max_background=None, max_retakes=0, quiet_timeout_s=900.):
    """Interleaved timings of every operator at one size; returns one dict per operator.

    With ``max_background``, a timed (forward, training step) pair during which other
    processes kept more cores busy than that is thrown away and taken again, after
    waiting for a quiet moment, up to ``max_retakes`` times; the last take is kept
    whatever its load. ``retakes`` in the result counts them.
    """
    torch.manual_seed(0)
    models = {op: build_backbone(op, arch, size).to(device) for op in operators}
    images = torch.randn(1, 3, size, size, device=device)
    samples = {(op, key): [] for op in operators
               for key in ('fwd_ms', 'train_ms', 'fwd_cpu_ms', 'train_cpu_ms')}
    cuda_peak = {}
    retakes = dict.fromkeys(operators, 0)
    busy_core_s = timed_s = 0.  # other processes' load over the kept pairs, time-weighted
    for rep in range(warmup + repeats):
        for op in rotated(operators, rep):
            for attempt in range(max_retakes + 1):
                pair_load = BackgroundLoad()
                pair_load.start()
                fwd = time_forward(models[op], images)
                train = time_train_step(models[op], images)
                models[op].zero_grad(set_to_none=True)
                busy = pair_load.stop()
                if (rep < warmup or max_background is None or busy is None
                        or busy <= max_background or attempt == max_retakes):
                    break
                retakes[op] += 1
                log(f'  {size}px {op:8s} retake: other processes kept {busy:.2f} cores busy '
                    f'(fwd {fwd.wall_ms:.1f} ms, train {train.wall_ms:.1f} ms)')
                wait_for_quiet(max_background, quiet_timeout_s)
            if rep >= warmup:
                if busy is not None:
                    pair_s = (fwd.wall_ms + train.wall_ms) / 1e3
                    busy_core_s += busy * pair_s
                    timed_s += pair_s
                for key, value in (('fwd_ms', fwd.wall_ms), ('train_ms', train.wall_ms),
                                   ('fwd_cpu_ms', fwd.cpu_ms), ('train_cpu_ms', train.cpu_ms)):
                    samples[op, key].append(value)
            log(f'  {size}px {"warm-up" if rep < warmup else f"rep {rep - warmup + 1}"} '
                f'{op:8s} fwd {fwd.wall_ms:10.1f} ms  train {train.wall_ms:10.1f} ms  '
                f'(cpu {fwd.cpu_ms:10.1f} / {train.cpu_ms:10.1f} ms)'
                + ('' if busy is None else f'  others {busy:.2f} cores'))
    background_cores = busy_core_s / timed_s if timed_s else None
    if device.type == 'cuda':
        cuda_peak = {op: cuda_train_peak_mib(models[op], images) for op in operators}
    first = models[operators[0]]
    hw_shape = patch_grid(first, size)
    rows = []
    for op in operators:
        macs = count_macs(models[op], size)['total']
        rows.append(dict(size=size, patch_tokens=hw_shape[0] * hw_shape[1],
                         tokens=models[op].num_extra_tokens + hw_shape[0] * hw_shape[1],
                         operator=op, block_operators=models[op].attn_types,
                         peak_mib=cuda_peak.get(op), macs=macs,
                         fwd_samples_ms=samples[op, 'fwd_ms'],
                         train_samples_ms=samples[op, 'train_ms'],
                         background_cores=background_cores, retakes=retakes[op],
                         **{key: statistics.median(samples[op, key])
                            for key in ('fwd_ms', 'train_ms', 'fwd_cpu_ms', 'train_cpu_ms')}))
    del models
    gc.collect()
    return rows


def add_ratios(rows):
    """Speed-ups and MAC bounds against the softmax row of the same size, in place."""
    by_size = {}
    for row in rows:
        by_size.setdefault(row['size'], {})[row['operator']] = row
    for group in by_size.values():
        ref = group.get(REFERENCE)
        for row in group.values():
            if ref is None:
                row.update(speedup_fwd=None, speedup_train=None, mac_bound=None,
                           fwd_pct_of_bound=None, train_pct_of_bound=None,
                           cpu_speedup_fwd=None, cpu_speedup_train=None)
                continue
            row['speedup_fwd'] = ref['fwd_ms'] / row['fwd_ms']
            row['speedup_train'] = ref['train_ms'] / row['train_ms']
            row['cpu_speedup_fwd'] = ref['fwd_cpu_ms'] / row['fwd_cpu_ms']
            row['cpu_speedup_train'] = ref['train_cpu_ms'] / row['train_cpu_ms']
            row['mac_bound'] = ref['macs'] / row['macs']
            row['fwd_pct_of_bound'] = 100 * row['speedup_fwd'] / row['mac_bound']
            row['train_pct_of_bound'] = 100 * row['speedup_train'] / row['mac_bound']
    return rows


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
            f'{"x fwd":>7s} {"x train":>7s} {"MAC bound":>9s} {"fwd/bnd":>8s} {"trn/bnd":>8s} '
            f'{"cpu x fwd":>9s} {"cpu x trn":>9s}')
    lines = [head, '-' * len(head.splitlines()[1])]
    for row in group:
        lines.append(f'{row["operator"]:{width}s} {row["fwd_ms"]:10.1f} {row["train_ms"]:10.1f} '
                     f'{_fmt(row["peak_mib"], "9.1f")} {_fmt(row["speedup_fwd"], "6.2f")}x '
                     f'{_fmt(row["speedup_train"], "6.2f")}x {_fmt(row["mac_bound"], "8.2f")}x '
                     f'{_fmt(row["fwd_pct_of_bound"], "7.0f")}% '
                     f'{_fmt(row["train_pct_of_bound"], "7.0f")}% '
                     f'{_fmt(row["cpu_speedup_fwd"], "8.2f")}x '
                     f'{_fmt(row["cpu_speedup_train"], "8.2f")}x')
    return '\n'.join(lines)


def is_hybrid(operator):
    """Whether an ``--operators`` entry is a hybrid (``relu+softmax@0,11``)."""
    return operator not in OPERATOR_VARIANTS and not isinstance(parse_attn_spec(operator), str)


def bound_fractions(operators):
    """``{operator: bound_fraction_target}`` of the measured operators that have one
    (hybrids have their own target, ``HYBRID_EXCESS``)."""
    from linvit_mm.models.attention import attention_class
    fractions = {op: attention_class(OPERATOR_VARIANTS.get(op, (op,))[0]).bound_fraction_target
                 for op in operators if not is_hybrid(op)}
    return {op: fraction for op, fraction in fractions.items() if fraction is not None}


def blockwise_prediction(row, by_key, kind):
    """What the hybrid's blocks' operators predict for its ``kind`` time: each block charged
    its operator's measured time per block, ``sum_op n_op / L * t(op)``; None when one of
    them was not measured at that size."""
    blocks = row['block_operators']
    predicted = 0.
    for op in set(blocks):
        single = by_key.get((row['patch_tokens'], op))
        if single is None:
            return None
        predicted += blocks.count(op) / len(blocks) * single[f'{kind}_ms']
    return predicted


def hybrid_targets(rows, by_key):
    results = []
    hybrids = [op for op in dict.fromkeys(row['operator'] for row in rows) if is_hybrid(op)]
    for tokens in BOUND_TARGET_TOKENS:
        for op in hybrids:
            row = by_key.get((tokens, op))
            for kind in ('fwd', 'train'):
                name = (f'{op} {kind} time <= {HYBRID_EXCESS:.1f}x what its MAC bound predicts '
                        f'@ {tokens} tokens')
                if row is None or row['mac_bound'] is None:
                    results.append((name, 'SKIP', 'size or softmax not measured'))
                    continue
                excess = row['mac_bound'] / row[f'speedup_{kind}']
                detail = (f'{excess:.2f}x softmax time / MAC bound ({row[f"speedup_{kind}"]:.2f}x '
                          f'of {row["mac_bound"]:.2f}x)')
                predicted = blockwise_prediction(row, by_key, kind)
                if predicted is not None:
                    detail += (f"; {row[f'{kind}_ms'] / predicted:.2f}x what its blocks' "
                               f'operators predict')
                results.append((name, 'PASS' if excess <= HYBRID_EXCESS else 'FAIL', detail))
    return results


def evaluate_targets(rows):
    """The targets as ``(name, 'PASS' | 'FAIL' | 'SKIP', detail)`` triples."""
    by_key = {(row['patch_tokens'], row['operator']): row for row in rows}
    targets = bound_fractions(dict.fromkeys(row['operator'] for row in rows))
    results = []
    for tokens in BOUND_TARGET_TOKENS:
        for op, fraction in targets.items():
            row = by_key.get((tokens, op))
            for kind in ('fwd', 'train'):
                name = f'{op} {kind} speed-up >= {fraction:.0%} of MAC bound @ {tokens} tokens'
                if row is None or row['mac_bound'] is None:
                    results.append((name, 'SKIP', 'size or softmax not measured'))
                    continue
                pct = row[f'{kind}_pct_of_bound']
                results.append((name, 'PASS' if pct >= 100 * fraction else 'FAIL',
                                f'{row[f"speedup_{kind}"]:.2f}x of {row["mac_bound"]:.2f}x '
                                f'= {pct:.0f}%'))
    for op in targets:
        row, ref = by_key.get((SMALL_TOKENS, op)), by_key.get((SMALL_TOKENS, REFERENCE))
        for kind in ('fwd', 'train'):
            name = f'{op} {kind} @ {SMALL_TOKENS} tokens <= {SMALL_SLOWDOWN}x softmax'
            if row is None or ref is None:
                results.append((name, 'SKIP', 'size or softmax not measured'))
                continue
            ratio = row[f'{kind}_ms'] / ref[f'{kind}_ms']
            results.append((name, 'PASS' if ratio <= SMALL_SLOWDOWN else 'FAIL',
                            f'{ratio:.2f}x softmax'))
    results += hybrid_targets(rows, by_key)
    small, large = MEMORY_PAIR
    for op in targets:
        name = f'{op} train peak memory @ {large} <= {MEMORY_GROWTH}x @ {small} tokens'
        lo, hi = by_key.get((small, op)), by_key.get((large, op))
        if lo is None or hi is None or lo['peak_mib'] is None or hi['peak_mib'] is None:
            results.append((name, 'SKIP', 'size or memory not measured'))
            continue
        growth = hi['peak_mib'] / lo['peak_mib']
        results.append((name, 'PASS' if growth <= MEMORY_GROWTH else 'FAIL',
                        f'{hi["peak_mib"]:.0f} / {lo["peak_mib"]:.0f} MiB = {growth:.2f}x'))
    return results


def format_targets(results):
    """The checked targets, one per line; those the run could not check, in one line."""
    checked = [result for result in results if result[1] != 'SKIP']
    lines = ['Targets (CPU, fp32, batch 1, ViT-S):']
    lines += [f'  {verdict:4s}  {name}: {detail}' for name, verdict, detail in checked]
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
          f'{args.neighbour_warmup}; usable CPUs {usable_cpus()} ({usable_cores()} cores), '
          f'neighbour pinned to CPU {max(usable_cpus())}; 1-minute load average at start '
          f'{load}; torch={torch.__version__}', flush=True)
    rows = run_neighbour_benchmark(policies, args.neighbour_steps, args.neighbour_warmup,
                                   log=lambda msg: print(msg, flush=True))
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
    if args.neighbour_steps < 1 or args.neighbour_warmup < 0:
        parser.error('--neighbour-steps must be >= 1 and --neighbour-warmup >= 0')
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
          f'torch={torch.__version__}', flush=True)
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
                                   max_retakes=args.max_retakes)
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
    plot(rows, out_dir / 'benchmark_backbone.png',
         f'LinearViT {args.arch}, batch 1, fp32, {device}, {args.threads} threads')
    print(format_targets(evaluate_targets(rows)))
    elapsed = (datetime.now(timezone.utc) - started).total_seconds()
    print(f'\nwrote {out_dir / "benchmark_backbone.csv"} and {out_dir / "benchmark_backbone.png"}'
          f' ({elapsed / 60:.1f} min)')
    return rows


if __name__ == '__main__':
    main()
