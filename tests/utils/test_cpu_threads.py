"""linvit_mm.cpu_threads: what a tool's process gets, and that nothing else is touched."""
import types
import warnings

import pytest

from linvit_mm import cpu_threads
from linvit_mm.cpu_threads import (WAIT_POLICY, configure_if_tool, configure_tool_process,
                                   shared_machine_note, tool_environment, usable_cores)

# Spelled out, not imported: dropping a name from the module must fail a test.
WAIT_VARIABLES = ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'KMP_BLOCKTIME')
THREAD_VARIABLES = ('OMP_NUM_THREADS', 'MKL_NUM_THREADS')


def test_unset_variables_get_the_chosen_values():
    assert tool_environment({}, cores=3) == {'OMP_WAIT_POLICY': 'PASSIVE',
                                             'OMP_NUM_THREADS': '3'}


def test_thread_count_defaults_to_the_usable_cores(monkeypatch):
    assert tool_environment({})['OMP_NUM_THREADS'] == str(usable_cores())
    monkeypatch.setattr(cpu_threads, 'usable_cores', lambda: 5)  # as on an SMT machine
    assert tool_environment({})['OMP_NUM_THREADS'] == '5'


@pytest.mark.parametrize('name', WAIT_VARIABLES)
def test_a_users_wait_variable_keeps_the_wait_policy_unset(name):
    chosen = tool_environment({name: '7'}, cores=2)
    assert chosen == {'OMP_NUM_THREADS': '2'}


@pytest.mark.parametrize('name', THREAD_VARIABLES)
def test_a_users_thread_variable_keeps_the_thread_count_unset(name):
    chosen = tool_environment({name: '7'}, cores=2)
    assert chosen == {'OMP_WAIT_POLICY': WAIT_POLICY}


def test_configure_leaves_the_users_values_and_sets_only_the_rest():
    environ = {'OMP_WAIT_POLICY': 'ACTIVE', 'PATH': '/bin'}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # torch is loaded in this process
        chosen = configure_tool_process(environ)
    assert environ['OMP_WAIT_POLICY'] == 'ACTIVE'
    assert set(chosen) == {'OMP_NUM_THREADS'}
    assert environ == {'OMP_WAIT_POLICY': 'ACTIVE', 'PATH': '/bin',
                       'OMP_NUM_THREADS': chosen['OMP_NUM_THREADS']}


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

