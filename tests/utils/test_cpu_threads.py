"""linvit_mm.cpu_threads: what a tool's process gets, and that nothing else is touched."""
import types
import warnings

import pytest

from linvit_mm import cpu_threads
from linvit_mm.cpu_threads import (configure_if_tool, configure_tool_process,
                                   shared_machine_note, tool_environment, usable_cores)

# Spelled out, not imported: dropping a name from the module must fail a test.
WAIT_VARIABLES = ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'KMP_BLOCKTIME')
THREAD_VARIABLES = ('OMP_NUM_THREADS', 'MKL_NUM_THREADS')


def test_unset_variables_get_the_chosen_values():
    assert tool_environment({}, cores=3) == {'OMP_NUM_THREADS': '3',
                                             'LINVIT_MM_AUTO_THREADS': '3'}


def test_thread_count_defaults_to_the_usable_cores(monkeypatch):
    assert tool_environment({})['OMP_NUM_THREADS'] == str(usable_cores())
    monkeypatch.setattr(cpu_threads, 'usable_cores', lambda: 5)  # as on an SMT machine
    assert tool_environment({})['OMP_NUM_THREADS'] == '5'


@pytest.mark.parametrize('name', WAIT_VARIABLES)
def test_a_users_wait_variable_changes_nothing_and_none_is_ever_set(name):
    chosen = tool_environment({name: '7'}, cores=2)
    assert chosen == {'OMP_NUM_THREADS': '2', 'LINVIT_MM_AUTO_THREADS': '2'}


@pytest.mark.parametrize('name', THREAD_VARIABLES)
def test_a_users_thread_variable_keeps_the_thread_count_unset(name):
    chosen = tool_environment({name: '7'}, cores=2)
    assert chosen == {}


def test_configure_leaves_the_users_values_and_sets_only_the_rest():
    environ = {'OMP_WAIT_POLICY': 'ACTIVE', 'PATH': '/bin'}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # torch is loaded in this process
        chosen = configure_tool_process(environ)
    assert environ['OMP_WAIT_POLICY'] == 'ACTIVE'
    assert set(chosen) == {'OMP_NUM_THREADS', 'LINVIT_MM_AUTO_THREADS'}
    assert environ == {'OMP_WAIT_POLICY': 'ACTIVE', 'PATH': '/bin',
                       'OMP_NUM_THREADS': chosen['OMP_NUM_THREADS'],
                       'LINVIT_MM_AUTO_THREADS': chosen['OMP_NUM_THREADS']}


def test_configure_warns_when_torch_is_loaded_already():
    # this test process has imported torch: the wait policy would come too late
    with pytest.warns(UserWarning, match='import linvit_mm before torch'):
        configure_tool_process({})
    assert cpu_threads.torch_loaded_at_configuration is True


def test_only_a_main_that_declares_the_marker_is_configured(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_threads, 'configure_tool_process', lambda: calls.append(1) or {'x': 1})
    assert configure_if_tool(types.SimpleNamespace()) == {}
    assert configure_if_tool(types.SimpleNamespace(LINVIT_MM_TOOL='yes')) == {}
    assert calls == []
    assert configure_if_tool(types.SimpleNamespace(LINVIT_MM_TOOL=True)) == {'x': 1}
    assert calls == [1]


def _topology(root, cpu, package, core):
    folder = root / f'cpu{cpu}' / 'topology'
    folder.mkdir(parents=True)
    (folder / 'physical_package_id').write_text(f'{package}\n')
    (folder / 'core_id').write_text(f'{core}\n')


def test_smt_siblings_count_as_one_core(tmp_path):
    # cpus 0 and 2 are the two threads of core 0; cpu 1 is core 1; package 1 has its own core 0
    for cpu, package, core in ((0, 0, 0), (1, 0, 1), (2, 0, 0), (3, 1, 0)):
        _topology(tmp_path, cpu, package, core)
    assert usable_cores([0, 2], sysfs=str(tmp_path)) == 1
    assert usable_cores([0, 1, 2], sysfs=str(tmp_path)) == 2
    assert usable_cores([0, 1, 2, 3], sysfs=str(tmp_path)) == 3


def test_without_a_readable_topology_every_cpu_is_a_core(tmp_path):
    assert usable_cores([0, 1, 5], sysfs=str(tmp_path)) == 3


@pytest.mark.parametrize('load, shown', [(4.5, True), (4.0, False), (0.3, False)],
                         ids=['above', 'equal', 'below'])
def test_shared_machine_note_only_above_the_usable_cpus(load, shown):
    note = shared_machine_note(load=load, cores=4)
    assert (note is not None) == shown
    if shown:
        assert 'other jobs share this machine' in note and '4.5' in note



# ------------------------------------------------------------------ the thread governor
@pytest.mark.parametrize('environ, automatic', [
    ({'OMP_NUM_THREADS': '2', 'LINVIT_MM_AUTO_THREADS': '2'}, True),
    ({'OMP_NUM_THREADS': '2', 'MKL_NUM_THREADS': '2', 'LINVIT_MM_AUTO_THREADS': '2'}, True),
    ({'OMP_NUM_THREADS': '2'}, False),
    # a parent tool chose 2, then gave this child 1 of them (the demo's parallel runs)
    ({'OMP_NUM_THREADS': '1', 'LINVIT_MM_AUTO_THREADS': '2'}, False),
    ({'OMP_NUM_THREADS': '2', 'MKL_NUM_THREADS': '1', 'LINVIT_MM_AUTO_THREADS': '2'}, False),
    ({'LINVIT_MM_AUTO_THREADS': '2'}, False),
    ({}, False),
], ids=['chosen', 'chosen-mkl-same', 'users', 'split-by-parent', 'users-mkl', 'marker-only',
        'nothing'])
def test_threads_are_automatic_only_when_the_count_is_the_one_a_tool_chose(environ, automatic):
    assert cpu_threads.threads_are_automatic(environ) is automatic


def test_a_tool_environment_is_automatic_and_a_users_is_not():
    assert cpu_threads.threads_are_automatic(tool_environment({}, cores=2))
    users = {'OMP_NUM_THREADS': '2'}
    assert not cpu_threads.threads_are_automatic(dict(users, **tool_environment(users)))


class FakeMachine:
    """Counters a test moves by hand: seconds of the clock, busy CPU seconds on the
    process's CPUs (others' and ours), and ours."""

    def __init__(self):
        self.now, self.busy, self.own = 100., 1000., 10.
        self.set_to = []

    def advance(self, seconds, others, own):
        """``seconds`` pass; other processes use ``others`` CPUs, this one ``own``."""
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds

    def governor(self, cores=2, cpus=(0, 1), interval=1., log=None):
        return cpu_threads.ThreadGovernor(
            cores=cores, cpus=cpus, interval=interval, read_busy=lambda: self.busy,
            read_own=lambda: self.own, clock=lambda: self.now, set_threads=self.set_to.append,
            log=log)


def test_the_governor_gives_up_the_cores_others_hold_and_takes_them_back():
    machine, lines = FakeMachine(), []
    governor = machine.governor(log=lines.append)
    assert governor.threads == 2 and governor.active
    machine.advance(1., others=0.05, own=2.)
    assert governor.poll() == 2 and machine.set_to == []
    # one single-threaded neighbour: it gets about 2/3 of a CPU beside our two threads
    machine.advance(1., others=0.7, own=1.3)
    assert governor.poll() == 1 and machine.set_to == [1]
    assert lines == ['intra-op threads 2 -> 1: other processes use 0.7 of the 2 CPUs this '
                     'one may run on']
    # with one thread, the neighbour has its whole core: stay
    machine.advance(1., others=1., own=1.)
    assert governor.poll() == 1 and machine.set_to == [1]
    # the neighbour is gone
    machine.advance(1., others=0., own=1.)
    assert governor.poll() == 2 and machine.set_to == [1, 2]
    assert governor.changes == 2 and len(lines) == 2


@pytest.mark.parametrize('others, threads', [(0., 4), (0.49, 4), (0.5, 3), (1.4, 3), (1.6, 2),
                                             (3.2, 1), (7., 1)])
def test_the_governor_rounds_the_others_share_and_keeps_one_thread(others, threads):
    machine = FakeMachine()
    governor = machine.governor(cores=4, cpus=range(4))
    machine.advance(2., others=others, own=4. - min(others, 3.))
    assert governor.poll() == threads


def test_smt_cpus_count_as_half_cores():
    machine = FakeMachine()
    governor = machine.governor(cores=2, cpus=range(4))
    machine.advance(1., others=1., own=2.)   # one busy CPU of four = half of one of two cores
    assert governor.poll() == 1
    machine.advance(1., others=0.9, own=2.)  # 0.45 cores
    assert governor.poll() == 2


def test_the_governor_decides_once_per_interval_over_the_whole_interval():
    machine = FakeMachine()
    governor = machine.governor(interval=2.)
    machine.advance(1.5, others=2., own=0.)
    assert governor.poll() == 2 and machine.set_to == []   # not yet: only a clock read
    machine.advance(0.5, others=0., own=2.)
    # 3 CPU seconds of others over the 2 s since the last decision: 1.5 CPUs
    assert governor.poll() == 1


def test_the_governor_never_counts_our_time_as_others_nor_below_zero():
    machine = FakeMachine()
    governor = machine.governor()
    machine.advance(1., others=0., own=2.)
    machine.own += 0.3  # os.times and /proc/stat tick apart: ours may read above the total
    assert governor.poll() == 2


def test_without_cpu_counters_the_governor_does_nothing(tmp_path):
    assert cpu_threads.read_cpu_busy_seconds([0], stat_path=str(tmp_path / 'none')) is None
    calls = []
    governor = cpu_threads.ThreadGovernor(cores=2, cpus=[0, 1], read_busy=lambda: None,
                                          set_threads=calls.append, clock=lambda: 1e9)
    assert not governor.active and governor.poll() == 2 and calls == []


def test_busy_seconds_are_read_from_the_usable_cpus_only(tmp_path):
    stat = tmp_path / 'stat'
    # user nice system idle iowait irq softirq steal guest guest_nice
    # guest time (columns 9 and 10) is inside user already: not counted twice
    stat.write_text('cpu  900 0 900 900 900 0 0 0 0 0\n'
                    'cpu0 100 2 30 500 70 4 5 6 40 3\n'
                    'cpu1 200 0 10 900 10 0 0 0 0 0\n'
                    'intr 12345\n')
    tick = __import__('os').sysconf('SC_CLK_TCK')
    assert cpu_threads.read_cpu_busy_seconds([0], str(stat)) == 147 / tick
    assert cpu_threads.read_cpu_busy_seconds([0, 1], str(stat)) == 357 / tick
    assert cpu_threads.read_cpu_busy_seconds([0, 2], str(stat)) is None  # cpu2 not listed


def test_a_governor_only_for_an_automatic_count():
    assert cpu_threads.tool_thread_governor(environ={'OMP_NUM_THREADS': '2'}) is None
    governor = cpu_threads.tool_thread_governor(
        environ={'OMP_NUM_THREADS': '3', 'LINVIT_MM_AUTO_THREADS': '3'})
    assert governor is not None and governor.cores == governor.threads == 3
    assert governor.interval == 1.  # the documented default, as the governor's own
    assert cpu_threads.ThreadGovernor(cores=2, cpus=[0, 1], read_busy=lambda: 0.).interval == 1.


def test_without_set_threads_the_governor_sets_torchs_count(monkeypatch):
    import torch
    calls = []
    monkeypatch.setattr(torch, 'set_num_threads', calls.append)
    machine = FakeMachine()
    governor = cpu_threads.ThreadGovernor(cores=2, cpus=[0, 1], read_busy=lambda: machine.busy,
                                          read_own=lambda: machine.own,
                                          clock=lambda: machine.now)
    machine.advance(1., others=1., own=1.)
    assert governor.poll() == 1 and calls == [1]


def test_own_cpu_seconds_are_user_plus_system_and_the_childrens_when_asked(monkeypatch):
    times = types.SimpleNamespace(user=1., system=2., children_user=4., children_system=8.)
    monkeypatch.setattr(cpu_threads.os, 'times', lambda: times)
    assert cpu_threads.read_own_cpu_seconds() == 3.
    assert cpu_threads.read_own_cpu_seconds(children=True) == 15.


def test_the_governor_refuses_a_bad_interval():
    with pytest.raises(ValueError, match='interval must be > 0 seconds, got 0'):
        cpu_threads.ThreadGovernor(cores=2, cpus=[0, 1], interval=0, read_busy=lambda: 0.)
