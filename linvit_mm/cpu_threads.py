"""CPU threading of linvit_mm's tools: a busy neighbour costs them about its core, no more.

torch's OpenMP runtime (libgomp) lets an idle worker thread spin for a while before it
sleeps (``GOMP_SPINCOUNT`` 300000 by default). When another process holds one of the cores,
the peer a spinning thread waits for is often not running: the spinner burns the time slice
the peer needed, and every parallel region stalls. A training step that takes 70 ms on two
idle cores took 350 ms beside one single-threaded job. Letting idle workers sleep at once
(``OMP_WAIT_POLICY=PASSIVE``) removes the stall; docs/environment.md has the measurements.

Why the package's first statement runs this
    libgomp reads ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` once, when it loads at
    ``import torch``, and ``import linvit_mm`` imports torch (checkpoint loading,
    mmengine). So the variables must be in the environment before linvit_mm's own imports
    run, and a helper the tools imported after the package would come too late. This module
    uses nothing but the standard library, and ``linvit_mm/__init__.py`` calls
    :func:`configure_if_tool` before anything else. It acts only when the program being run
    declares itself a tool, a module-level ``LINVIT_MM_TOOL = True`` in ``__main__`` set
    before its first import of linvit_mm (each of ``tools/train.py``, ``tools/test.py``,
    ``tools/demo.py`` and ``tools/analysis_tools/benchmark_*.py`` has it). Code that merely
    imports linvit_mm has no such marker: its process is left exactly as it was. One
    implementation; each tool only declares the marker and imports linvit_mm first.

What a tool's process gets
    * ``OMP_WAIT_POLICY=PASSIVE`` unless the user set any of ``OMP_WAIT_POLICY``,
      ``GOMP_SPINCOUNT`` or ``KMP_BLOCKTIME``;
    * ``OMP_NUM_THREADS`` = the physical cores among the CPUs this process may run on
      (``os.sched_getaffinity``; one thread per core, as torch's own default), unless the
      user set ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS``.

    The user's variables always win, and whatever is set reaches the tool's child
    processes too (the demo's runs, the benchmarks' probes).
"""
import os
import sys
import warnings

TOOL_MARKER = 'LINVIT_MM_TOOL'
WAIT_POLICY = 'PASSIVE'
# Any of these means the user chose how idle OpenMP threads wait (libgomp's, LLVM/Intel's).
WAIT_VARIABLES = ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'KMP_BLOCKTIME')
# torch's default intra-op thread count reads these, in this order.
THREAD_VARIABLES = ('OMP_NUM_THREADS', 'MKL_NUM_THREADS')

# What configure_tool_process set in this process ({} when the user's variables won or
# nothing ran) and whether torch was already loaded then (the wait policy would be too late).
configured = {}
torch_loaded_at_configuration = None


def usable_cpus():
    """The logical CPUs this process may run on."""
    if hasattr(os, 'sched_getaffinity'):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def usable_cores(cpus=None, sysfs='/sys/devices/system/cpu'):
    """Physical cores among ``cpus`` (default :func:`usable_cpus`): SMT siblings count once.

    Read from the kernel's CPU topology; where it cannot be read, every CPU is a core.
    """
    cpus = usable_cpus() if cpus is None else list(cpus)
    cores = set()
    for cpu in cpus:
        topology = os.path.join(sysfs, f'cpu{cpu}', 'topology')
        try:
            with open(os.path.join(topology, 'physical_package_id')) as f:
                package = f.read().strip()
            with open(os.path.join(topology, 'core_id')) as f:
                core = f.read().strip()
        except OSError:
            return max(1, len(cpus))
        cores.add((package, core))
    return max(1, len(cores))


def tool_environment(environ=None, cores=None):
    """The variables a tool sets in ``environ`` (default ``os.environ``): the chosen wait
    policy and thread count, each left out where the user set one of its variables."""
    environ = os.environ if environ is None else environ
    chosen = {}
    if not any(name in environ for name in WAIT_VARIABLES):
        chosen['OMP_WAIT_POLICY'] = WAIT_POLICY
    if not any(name in environ for name in THREAD_VARIABLES):
        chosen['OMP_NUM_THREADS'] = str(usable_cores() if cores is None else cores)
    return chosen


def configure_tool_process(environ=None):
    """Set :func:`tool_environment` in ``environ`` (default ``os.environ``); return it.

    Warns when torch is loaded already: the thread count would still apply to child
    processes, the wait policy to none of this process's threads.
    """
    global torch_loaded_at_configuration
    environ = os.environ if environ is None else environ
    torch_loaded_at_configuration = 'torch' in sys.modules
    chosen = tool_environment(environ)
    environ.update(chosen)
    configured.update(chosen)
    if chosen and torch_loaded_at_configuration:
        warnings.warn(f'{", ".join(chosen)} set after torch was imported: libgomp read its '
                      'variables when torch loaded; import linvit_mm before torch')
    return chosen


def configure_if_tool(main=None):
    """Configure this process when its ``__main__`` (or ``main``) declares
    ``LINVIT_MM_TOOL = True``; otherwise change nothing. Returns what was set."""
    main = sys.modules.get('__main__') if main is None else main
    if getattr(main, TOOL_MARKER, False) is not True:
        return {}
    return configure_tool_process()


def shared_machine_note(load=None, cores=None):
    """One line saying that other jobs share the machine, when the 1-minute load average
    (default ``os.getloadavg()``) exceeds the CPUs this process may use; else ``None``."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    cores = len(usable_cpus()) if cores is None else cores
    if load <= cores:
        return None
    return (f'other jobs share this machine (1-minute load average {load:.1f} on {cores} '
            f'usable CPUs): stage times will be longer than on an idle machine')
