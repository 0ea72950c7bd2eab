"""The busy-neighbour mode's pieces: its policies, its run order, its ratios, its neighbour."""
import os
import time
from contextlib import contextmanager

import pytest

from linvit_mm.utils import benchmark as bench
from linvit_mm.utils.benchmark import (busy_neighbour, format_neighbour_table,
                                       neighbour_policies, neighbour_ratios,
                                       run_neighbour_benchmark)

USER = {'OMP_WAIT_POLICY': 'ACTIVE', 'GOMP_SPINCOUNT': '5', 'OMP_NUM_THREADS': '7',
        'MKL_NUM_THREADS': '7', 'LINVIT_MM_AUTO_THREADS': '7', 'PATH': '/bin'}


def test_policies_start_from_the_plain_environment_whatever_the_user_set():
    policies = neighbour_policies(USER)
    assert policies['torch default'] == {'PATH': '/bin'}
    assert policies['linvit_mm tools'] == {'PATH': '/bin', 'OMP_NUM_THREADS': str(bench_cores()),
                                           'LINVIT_MM_AUTO_THREADS': str(bench_cores())}
    assert policies['1 thread'] == {'PATH': '/bin', 'OMP_NUM_THREADS': '1'}


def bench_cores():
    from linvit_mm.cpu_threads import usable_cores
    return usable_cores()


def fake_neighbour():
    """``(state, neighbour)``: ``state['busy']`` is True inside the ``neighbour()`` block."""
    state = {'busy': False}

    @contextmanager
    def neighbour():
        state['busy'] = True
        yield
        state['busy'] = False

    return state, neighbour


def test_each_policy_runs_idle_then_beside_the_neighbour():
    calls, state, neighbour = [], *fake_neighbour()

    times = {('a', False): 10., ('a', True): 40., ('b', False): 12., ('b', True): 15.}

    def measure(env, steps, warmup, **step):
        calls.append((env['name'], state['busy'], steps, warmup))
        return dict(ms=times[env['name'], state['busy']], threads=2)

    policies = {'a': {'name': 'a'}, 'b': {'name': 'b', 'OMP_WAIT_POLICY': 'PASSIVE'}}
    rows = run_neighbour_benchmark(policies, steps=3, warmup=1, measure=measure,
                                   neighbour=neighbour, log=lambda msg: None)
    assert calls == [('a', False, 3, 1), ('a', True, 3, 1), ('b', False, 3, 1),
                     ('b', True, 3, 1)]
    assert [(r['policy'], r['neighbour'], r['ms'], r['wait_policy']) for r in rows] == [
        ('a', 'idle', 10., '-'), ('a', 'busy', 40., '-'), ('b', 'idle', 12., 'PASSIVE'),
        ('b', 'busy', 15., 'PASSIVE')]
    # one round: no range column
    assert 'rounds: min-max ms' not in format_neighbour_table(rows)


def test_rounds_interleave_the_sweep_and_report_each_rows_median():
    calls, state, neighbour = [], *fake_neighbour()

    # the machine drifts: every round is slower than the one before
    def measure(env, steps, warmup, **step):
        calls.append((env['name'], state['busy']))
        drift = 1 + len(calls) // 4
        base = {('a', False): 10., ('a', True): 40., ('b', False): 12., ('b', True): 15.}
        return dict(ms=base[env['name'], state['busy']] * drift, threads=2)

    policies = {'a': {'name': 'a'}, 'b': {'name': 'b'}}
    lines = []
    rows = run_neighbour_benchmark(policies, steps=3, warmup=1, measure=measure,
                                   neighbour=neighbour, log=lines.append, rounds=3)
    assert len(lines) == 12 and lines[4].startswith('  round 2/3 a ')
    assert calls == [('a', False), ('a', True), ('b', False), ('b', True)] * 3
    by_row = {(r['policy'], r['neighbour']): r for r in rows}
    assert len(rows) == 4
    # call i (counted from 1) runs at drift 1 + i // 4
    assert by_row['a', 'idle']['rounds_ms'] == [10., 20., 30.]
    assert by_row['a', 'idle']['ms'] == 20.
    assert by_row['b', 'busy']['rounds_ms'] == [30., 45., 60.]
    assert by_row['b', 'busy']['ms'] == 45.
    assert by_row['b', 'idle']['x_idle'] == 1. and by_row['b', 'busy']['x_idle'] == 45. / 24.
    table = format_neighbour_table(rows)
    assert 'rounds: min-max ms' in table and '30.0-60.0' in table
    with pytest.raises(ValueError, match='rounds must be >= 1, got 0'):
        run_neighbour_benchmark(policies, measure=measure, neighbour=neighbour, rounds=0)


def test_ratios_are_over_own_idle_one_thread_idle_and_the_default_beside_the_same():
    rows = [dict(policy=p, neighbour=n, ms=ms, threads=t, wait_policy='-')
            for p, n, ms, t in (('torch default', 'idle', 70., 2),
                                ('torch default', 'busy', 350., 2),
                                ('linvit_mm tools', 'idle', 72., 2),
                                ('linvit_mm tools', 'busy', 126., 2),
                                ('1 thread', 'idle', 105., 1))]
    by = {(r['policy'], r['neighbour']): r for r in neighbour_ratios(rows)}
    tools_busy = by['linvit_mm tools', 'busy']
    assert tools_busy['x_idle'] == pytest.approx(126 / 72)
    assert tools_busy['x_ref'] == pytest.approx(126 / 105)
    assert tools_busy['x_baseline'] == pytest.approx(126 / 350)
    assert by['linvit_mm tools', 'idle']['x_baseline'] == pytest.approx(72 / 70)
    table = format_neighbour_table(rows)
    assert len(table.splitlines()) == 2 + len(rows)
    assert '1.20x' in table and '0.36x' in table and '1.75x' in table


def test_a_ratio_without_its_reference_is_a_dash():
    rows = neighbour_ratios([dict(policy='x', neighbour='busy', ms=5., threads=1,
                                  wait_policy='-')])
    assert rows[0]['x_idle'] is rows[0]['x_ref'] is rows[0]['x_baseline'] is None
    assert format_neighbour_table(rows).splitlines()[-1].split()[-3:] == ['-', '-', '-']


@pytest.mark.skipif(not hasattr(os, 'sched_getaffinity'), reason='needs sched_getaffinity')
def test_the_neighbour_spins_on_the_last_usable_cpu_and_is_stopped():
    last = max(os.sched_getaffinity(0))
    with busy_neighbour() as proc:
        deadline = time.monotonic() + 60
        while os.sched_getaffinity(proc.pid) != {last} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.sched_getaffinity(proc.pid) == {last}
        assert proc.poll() is None
    assert proc.poll() is not None


def test_the_step_is_the_demo_teachers():
    assert bench.NEIGHBOUR_STEP == dict(
        arch=dict(embed_dims=96, num_layers=4, num_heads=3, feedforward_channels=384),
        attn_type='softmax', img_size=64, patch_size=8, batch_size=32)
    assert (bench.NEIGHBOUR_STEPS, bench.NEIGHBOUR_WARMUP) == (30, 5)


def test_the_timed_step_trains_and_reports_each_timed_step():
    import torch
    result = bench.time_neighbour_step(
        steps=2, warmup=1, batch_size=2,
        arch=dict(embed_dims=12, num_layers=1, num_heads=2, feedforward_channels=24))
    assert len(result['samples_ms']) == 2 and all(ms > 0 for ms in result['samples_ms'])
    assert result['ms'] == pytest.approx(sum(result['samples_ms']) / 2)
    assert result['threads'] == torch.get_num_threads()


def test_the_timed_step_polls_the_tools_governor_before_every_step(monkeypatch):
    from linvit_mm import cpu_threads

    class Governor:
        polls, changes = 0, 3

        def poll(self):
            Governor.polls += 1

    monkeypatch.setattr(cpu_threads, 'tool_thread_governor', lambda: Governor())
    result = bench.time_neighbour_step(
        steps=2, warmup=1, batch_size=2,
        arch=dict(embed_dims=12, num_layers=1, num_heads=2, feedforward_channels=24))
    assert Governor.polls == 3 and result['thread_changes'] == 3
    monkeypatch.setattr(cpu_threads, 'tool_thread_governor', lambda: None)
    assert bench.time_neighbour_step(
        steps=1, warmup=0, batch_size=2,
        arch=dict(embed_dims=12, num_layers=1, num_heads=2,
                  feedforward_channels=24))['thread_changes'] == 0


@pytest.mark.skipif(not os.path.exists('/proc/stat'), reason='reads /proc/stat')
def test_background_load_sees_the_busy_neighbour():
    with busy_neighbour():
        time.sleep(0.3)  # the spinner's interpreter is up
        load = bench.BackgroundLoad()
        load.start()
        time.sleep(1.)
        busy = load.stop()
    assert busy is not None and busy > 0.6  # one spinning CPU, less what the kernel rounds


def test_background_load_is_others_busy_time_over_the_wall_time(monkeypatch):
    from linvit_mm.utils.benchmark import load as load_module
    readings = {'busy': [100., 103.], 'own': [10., 11.5], 'wall': [50., 52.]}
    asked_children = []

    def own(children=False):
        asked_children.append(children)
        return readings['own'].pop(0)

    monkeypatch.setattr(load_module, 'read_cpu_busy_seconds',
                        lambda cpus: readings['busy'].pop(0))
    monkeypatch.setattr(load_module, 'read_own_cpu_seconds', own)
    monkeypatch.setattr(load_module.time, 'perf_counter', lambda: readings['wall'].pop(0))
    load = bench.BackgroundLoad()
    load.start()
    # 3 busy CPU seconds, 1.5 of them this process's (its children included), over 2 s
    assert load.stop() == 0.75 and asked_children == [True, True]
    readings.update(busy=[100., 100.5], own=[10., 11.5], wall=[0., 1.])
    load.start()
    assert load.stop() == 0.  # never below zero (the counters tick apart)
    monkeypatch.setattr(load_module, 'read_cpu_busy_seconds', lambda cpus: None)
    load.start()
    assert load.stop() is None
