"""The busy-neighbour comparison of ``benchmark_backbone.py --busy-neighbour``: a training
step under each OpenMP threading policy, idle and beside a spinning process.

Timed with ``time.perf_counter`` over a fixed 5 warm-up + 30 timed steps (the protocol
docs/benchmarks.md's table states), each policy in its own fresh interpreter, since libgomp
reads its variables when torch loads; ``torch.utils.benchmark`` chooses its own number of
runs in the one process it times.
"""
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import torch

from .common import quiet_mmengine_logs

# The step of the demo's teacher stage: LinearViT 4 blocks, width 96 (3 heads), 64 px
# images in 8 px patches, batch 32, Softmax attention, mean of the outputs, AdamW.
NEIGHBOUR_ARCH = dict(embed_dims=96, num_layers=4, num_heads=3, feedforward_channels=384)
NEIGHBOUR_STEP = dict(arch=NEIGHBOUR_ARCH, attn_type='softmax', img_size=64, patch_size=8,
                      batch_size=32)
NEIGHBOUR_STEPS, NEIGHBOUR_WARMUP = 30, 5
# A single-threaded process that keeps its core busy until it is killed.
SPINNER_CODE = 'while True:\n    pass\n'


def neighbour_policies(environ=None):
    """``{label: environment}`` of the runs the busy-neighbour mode compares.

    ``torch default``: none of the OpenMP thread or wait variables (what a plain script gets);
    ``linvit_mm tools``: what a tool sets on a machine where the user set none
    (:func:`linvit_mm.cpu_threads.tool_environment`: the automatic thread count, which the
    step's governor re-sizes); ``1 thread``: the torch default wait, one intra-op thread,
    the reference a busy neighbour should not fall far below.
    """
    from linvit_mm.cpu_threads import (AUTO_THREADS_VARIABLE, THREAD_VARIABLES, WAIT_VARIABLES,
                                       tool_environment)
    environ = os.environ if environ is None else environ
    left_out = WAIT_VARIABLES + THREAD_VARIABLES + (AUTO_THREADS_VARIABLE,)
    plain = {k: v for k, v in environ.items() if k not in left_out}
    return {'torch default': plain,
            'linvit_mm tools': dict(plain, **tool_environment(plain)),
            '1 thread': dict(plain, OMP_NUM_THREADS='1')}


def time_neighbour_step(steps=NEIGHBOUR_STEPS, warmup=NEIGHBOUR_WARMUP, **step):
    """Mean wall time (ms) of ``steps`` training steps after ``warmup`` untimed ones, with
    this process's threading as a tool's would be: where its thread count is automatic the
    tools' :class:`~linvit_mm.cpu_threads.ThreadGovernor` polls before every step, as
    :class:`~linvit_mm.engine.hooks.CPUThreadHook` does in a run. Returns
    ``dict(ms, threads, samples_ms, thread_changes)``, ``threads`` as of the last step."""
    from linvit_mm.cpu_threads import tool_thread_governor
    from linvit_mm.models.backbones.linear_vit import LinearViT
    governor = tool_thread_governor()
    step = dict(NEIGHBOUR_STEP, **step)
    torch.manual_seed(0)
    model = LinearViT(arch=step['arch'], attn_type=step['attn_type'], img_size=step['img_size'],
                      patch_size=step['patch_size'])
    with quiet_mmengine_logs():
        model.init_weights()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    images = torch.randn(step['batch_size'], 3, step['img_size'], step['img_size'])
    samples = []
    for index in range(warmup + steps):
        started = time.perf_counter()
        if governor is not None:
            governor.poll()
        optimizer.zero_grad(set_to_none=True)
        sum(out.float().mean() for out in model(images)).backward()
        optimizer.step()
        if index >= warmup:
            samples.append((time.perf_counter() - started) * 1e3)
    return dict(ms=sum(samples) / len(samples), threads=torch.get_num_threads(),
                samples_ms=samples, thread_changes=0 if governor is None else governor.changes)


def _neighbour_child(options):
    # Runs in the fresh process of one measurement: its environment is the policy's.
    print(json.dumps(time_neighbour_step(**json.loads(options))), flush=True)


def measure_in_subprocess(env, steps, warmup, **step):
    """:func:`time_neighbour_step` in a fresh interpreter with environment ``env`` (libgomp
    reads its variables once, when torch loads, so each policy needs its own process)."""
    code = ('import sys\nfrom linvit_mm.utils.benchmark.neighbour import _neighbour_child\n'
            '_neighbour_child(sys.argv[1])\n')
    options = json.dumps(dict(step, steps=steps, warmup=warmup))
    result = subprocess.run([sys.executable, '-c', code, options], env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f'the busy-neighbour measurement failed (exit '
                           f'{result.returncode}):\n{result.stderr[-3000:]}')
    return json.loads(result.stdout.strip().splitlines()[-1])


@contextmanager
def busy_neighbour(cpu=None):
    """A single-threaded spinning process, pinned to ``cpu`` (default: the last CPU this
    process may use, so that it takes one of the measured run's cores), for a block."""
    if cpu is None and hasattr(os, 'sched_getaffinity'):
        cpu = max(os.sched_getaffinity(0))
    code = SPINNER_CODE if cpu is None else (
        f'import os\nos.sched_setaffinity(0, {{{cpu}}})\n' + SPINNER_CODE)
    proc = subprocess.Popen([sys.executable, '-c', code])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def run_neighbour_benchmark(policies=None, steps=NEIGHBOUR_STEPS, warmup=NEIGHBOUR_WARMUP,
                            measure=measure_in_subprocess, neighbour=busy_neighbour,
                            log=print, rounds=1, **step):
    """Each policy of ``policies`` (default :func:`neighbour_policies`) idle, then beside a
    busy neighbour; one row per (policy, neighbour), ratios from :func:`neighbour_ratios`.

    ``rounds`` > 1 repeats the whole sweep that many times, so that every policy is measured
    in every stretch of the machine's drift, and a row's ``ms`` is the median of its rounds
    (``rounds_ms`` lists them): a small step's 30-step mean drifts by about 10 % from one
    minute to the next here, more than the differences between policies being compared.
    """
    if rounds < 1:
        raise ValueError(f'rounds must be >= 1, got {rounds}')
    policies = neighbour_policies() if policies is None else policies
    rows = {}
    for round_index in range(rounds):
        for label, env in policies.items():
            for busy in (False, True):
                if busy:
                    with neighbour():
                        result = measure(env, steps, warmup, **step)
                else:
                    result = measure(env, steps, warmup, **step)
                where = 'busy' if busy else 'idle'
                row = rows.setdefault((label, where), dict(
                    policy=label, neighbour=where, threads=result['threads'], rounds_ms=[],
                    wait_policy=env.get('OMP_WAIT_POLICY', '-')))
                row['rounds_ms'].append(result['ms'])
                log(f'  {f"round {round_index + 1}/{rounds} " if rounds > 1 else ""}'
                    f'{label:16s} {where:4s} {result["threads"]} threads '
                    f'{result["ms"]:8.1f} ms/step')
    for row in rows.values():
        row['ms'] = statistics.median(row['rounds_ms'])
    return neighbour_ratios(list(rows.values()))


def neighbour_ratios(rows, reference=('1 thread', 'idle'), baseline='torch default'):
    """Adds, in place: ``x_idle`` (over the same policy idle), ``x_ref`` (over the reference
    row: one thread, idle) and ``x_baseline`` (over the baseline policy, same neighbour)."""
    by_key = {(row['policy'], row['neighbour']): row for row in rows}
    ref = by_key.get(reference)
    for row in rows:
        idle = by_key.get((row['policy'], 'idle'))
        base = by_key.get((baseline, row['neighbour']))
        row['x_idle'] = row['ms'] / idle['ms'] if idle else None
        row['x_ref'] = row['ms'] / ref['ms'] if ref else None
        row['x_baseline'] = row['ms'] / base['ms'] if base else None
    return rows


def format_neighbour_table(rows):
    """The rows side by side: ms per step and the three ratios of :func:`neighbour_ratios`."""
    def ratio(value):
        return f'{value:9.2f}x' if value is not None else f'{"-":>10s}'

    # with several rounds: the median's row also shows the rounds' range
    spread = any(len(row.get('rounds_ms', ())) > 1 for row in rows)
    head = (f'{"policy":16s} {"neighbour":9s} {"threads":>7s} {"OMP_WAIT_POLICY":>15s} '
            f'{"ms/step":>9s} {"x idle":>10s} {"x 1 thr":>10s} {"x default":>10s}'
            + (f' {"rounds: min-max ms":>20s}' if spread else ''))
    lines = [head, '-' * len(head)]
    for row in rows:
        line = (f'{row["policy"]:16s} {row["neighbour"]:9s} {row["threads"]:7d} '
                f'{row["wait_policy"]:>15s} {row["ms"]:9.1f} {ratio(row["x_idle"])} '
                f'{ratio(row["x_ref"])} {ratio(row["x_baseline"])}')
        if spread:
            samples = row.get('rounds_ms') or [row['ms']]
            line += f' {f"{min(samples):.1f}-{max(samples):.1f}":>20s}'
        lines.append(line)
    return '\n'.join(lines)
