"""linvit_mm.utils.benchmark.memory: a probe runs in a fresh interpreter with glibc's
thresholds fixed and measures a step's peak there, and a failing probe says which measurement
failed."""
import os
import subprocess

import pytest

from linvit_mm.utils.benchmark import memory


def environment_probe():
    """What the fresh interpreter sees, and the step peak of a 64 MiB allocation in it (the
    peak is measured where the tool measures it: in a process whose heap holds nothing freed
    that the step could reuse without growing the resident set)."""
    import torch
    peak, total = memory.rss_step_peak(lambda: torch.ones(64, 2**18).sum())
    return dict(pid=os.getpid(), mmap=os.environ.get('MALLOC_MMAP_THRESHOLD_'),
                trim=os.environ.get('MALLOC_TRIM_THRESHOLD_'), peak_mib=peak['peak_mib'],
                total=float(total))


@pytest.fixture
def importable_here(monkeypatch):
    """The probe's fresh interpreter can import this file's probes."""
    monkeypatch.setenv('PYTHONPATH', os.path.dirname(__file__) + os.pathsep
                       + os.environ.get('PYTHONPATH', ''))


def test_a_probe_runs_in_a_fresh_process_with_the_thresholds_fixed(importable_here):
    seen = memory.run_probe('test_benchmark_memory:environment_probe', 'of the test')
    assert seen['mmap'] == seen['trim'] == str(memory.MMAP_THRESHOLD)
    assert seen['pid'] != os.getpid()
    assert 48 < seen['peak_mib'] < 256 and seen['total'] == 64 * 2**18


def test_a_failing_probe_names_its_measurement(monkeypatch):
    # the child's failure faked: a second interpreter costs a minute on a loaded machine
    def failed(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, '', 'RuntimeError: no memory today\n')

    monkeypatch.setattr(memory.subprocess, 'run', failed)
    with pytest.raises(RuntimeError, match=r'memory probe of the test step failed \(exit 1\)'
                                           r':\nRuntimeError: no memory today'):
        memory.run_probe('test_benchmark_memory:failing_probe', 'of the test step')
