"""Peak memory of one training step: CUDA's allocator statistics, or on a CPU the resident
set of a fresh process.

On a CPU a step runs in a fresh subprocess (:func:`run_probe`) that first takes one untimed
step on a small input (thread pools, oneDNN primitives, library code pages and an optimiser's
state are then resident), frees the gradients, reads ``VmRSS``, resets the peak (``5`` into
``/proc/self/clear_refs``), takes the step at full size and reads ``VmHWM``: the figure is
``VmHWM - VmRSS``. The subprocess fixes glibc's mmap threshold (``MALLOC_MMAP_THRESHOLD_``),
which otherwise grows as large blocks are freed and keeps freed tensors in the heap; with it
fixed, every tensor above 128 KiB is mapped on allocation and unmapped on free, so resident
memory follows live tensors and the figure is the step's activations, gradients and kernel
workspaces, not the interpreter or the weights. ``torch.utils.benchmark`` measures time only.
"""
import gc
import importlib
import json
import os
import subprocess
import sys

import torch

# Above glibc's default threshold, below every activation of interest.
MMAP_THRESHOLD = 128 * 1024
PROBE_GRID = 2  # patches per side of the warm-up input of a probe


def status_kib(field):
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    raise RuntimeError(f'/proc/self/status has no {field} line')


def reset_peak_rss():
    # Linux >= 4.0: writing 5 resets VmHWM to the current VmRSS.
    with open('/proc/self/clear_refs', 'w') as clear_refs:
        clear_refs.write('5')


def rss_step_peak(step):
    """Run ``step()`` and return ``(dict(peak_mib, rss_before_mib), what step returned)``:
    the resident set's peak during it over the resident set just before it."""
    gc.collect()
    before_kib = status_kib('VmRSS')
    reset_peak_rss()
    if status_kib('VmHWM') > before_kib + 1024:
        raise RuntimeError('resetting VmHWM through /proc/self/clear_refs had no effect; this '
                           'kernel cannot measure a step peak this way (use --device cuda)')
    result = step()
    peak_kib = status_kib('VmHWM')
    return dict(peak_mib=(peak_kib - before_kib) / 1024, rss_before_mib=before_kib / 1024), result


def cuda_step_peak_mib(step, device):
    """MiB allocated at the peak of ``step()`` over what was allocated just before it."""
    device = torch.device(device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def probe_environment(environ=None):
    """``environ`` (default ``os.environ``) with glibc's mmap and trim thresholds fixed."""
    threshold = str(MMAP_THRESHOLD)
    return dict(os.environ if environ is None else environ, MALLOC_MMAP_THRESHOLD_=threshold,
                MALLOC_TRIM_THRESHOLD_=threshold)


def _probe_child(target, options):
    # Runs in the fresh process of run_probe: the probe's result as the last line.
    module, name = target.split(':')
    probe = getattr(importlib.import_module(module), name)
    print(json.dumps(probe(**json.loads(options))), flush=True)


def run_probe(target, what, **options):
    """``target`` (``'module:function'``, a probe returning a JSON-able dict) called with
    ``options`` in a fresh interpreter with :func:`probe_environment`; its dict. ``what``
    names the measurement in the error of a failed probe."""
    code = ('import sys\nfrom linvit_mm.utils.benchmark.memory import _probe_child\n'
            '_probe_child(sys.argv[1], sys.argv[2])\n')
    result = subprocess.run([sys.executable, '-c', code, target, json.dumps(options)],
                            env=probe_environment(), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f'memory probe {what} failed (exit {result.returncode}):\n'
                           f'{result.stderr[-3000:]}')
    return json.loads(result.stdout.strip().splitlines()[-1])
