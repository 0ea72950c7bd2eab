"""CPU threading of linvit_mm's tools: a busy neighbour costs them about its core, no more.

torch's OpenMP runtime (libgomp) lets an idle worker thread spin for a while before it
sleeps (``GOMP_SPINCOUNT`` 300000 by default). When another process holds one of the cores,
the peer a spinning thread waits for is often not running: the spinner burns the time slice
the peer needed, and every parallel region stalls. The demo teacher's training step took
57 ms on two idle cores and 460 ms beside one single-threaded job. Letting idle workers sleep
at once (``OMP_WAIT_POLICY=PASSIVE``) removes the stall but makes the idle step a third slower
(every parallel region then pays a wake-up); one thread removes it too but gives up a core
of an idle machine. So the tools keep the spinning default and run as many threads as there
are cores that other processes leave free, re-read every second by :class:`ThreadGovernor`
(:class:`~linvit_mm.engine.hooks.CPUThreadHook` polls it between iterations): beside the
same job the step costs what one thread costs on an idle machine, and idle it is torch's
default. docs/environment.md and docs/benchmarks.md have the measurements.

Why the package's first statement runs this
    libgomp reads ``OMP_NUM_THREADS`` once, when it loads at ``import torch``, and
    ``import linvit_mm`` imports torch (checkpoint loading, mmengine). So the variables must
    be in the environment before linvit_mm's own imports run. This module uses nothing but
    the standard library (torch is imported only by :meth:`ThreadGovernor.poll`, once it is
    loaded), and ``linvit_mm/__init__.py`` calls :func:`configure_if_tool` before anything
    else. It acts only when the program being run declares itself a tool, a module-level
    ``LINVIT_MM_TOOL = True`` in ``__main__`` set before its first import of linvit_mm (each
    of ``tools/train.py``, ``tools/test.py``, ``tools/demo.py`` and
    ``tools/analysis_tools/benchmark_*.py`` has it). Code that merely imports linvit_mm has
    no such marker: its process is left exactly as it was.

What a tool's process gets
    * ``OMP_NUM_THREADS`` = the physical cores among the CPUs this process may run on
      (``os.sched_getaffinity``; one thread per core, as torch's own default) and
      ``LINVIT_MM_AUTO_THREADS`` = the same number, unless the user set ``OMP_NUM_THREADS``
      or ``MKL_NUM_THREADS``; the second says the count is automatic, and only then does
      the governor change it;
    * nothing else: how idle threads wait (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``,
      ``KMP_BLOCKTIME``) stays the user's or the runtime's default.

    The user's variables always win, and whatever is set reaches the tool's child
    processes too (the demo's runs, the benchmarks' probes).
"""
import os
import sys
import time
import warnings

TOOL_MARKER = 'LINVIT_MM_TOOL'
# How idle OpenMP threads wait (libgomp's, LLVM/Intel's): the tools set none of them; the
# busy-neighbour benchmark leaves them out of its plain environment.
WAIT_VARIABLES = ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'KMP_BLOCKTIME')
# torch's default intra-op thread count reads these, in this order.
THREAD_VARIABLES = ('OMP_NUM_THREADS', 'MKL_NUM_THREADS')
# Set beside OMP_NUM_THREADS, to the same value, when a tool chose the count: the thread
# governor may then change it while the tool runs. A count the user chose, or a parent that
# split the cores between children (the demo's parallel runs), differs from it or comes
# without it, and is left as it is.
AUTO_THREADS_VARIABLE = 'LINVIT_MM_AUTO_THREADS'

# What configure_tool_process set in this process ({} when the user's variables won or
# nothing ran) and whether torch was already loaded then (libgomp had read its variables).
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
    """The variables a tool sets in ``environ`` (default ``os.environ``): the automatic
    thread count and its marker, none where the user set a thread count."""
    environ = os.environ if environ is None else environ
    chosen = {}
    if not any(name in environ for name in THREAD_VARIABLES):
        chosen['OMP_NUM_THREADS'] = chosen[AUTO_THREADS_VARIABLE] = str(
            usable_cores() if cores is None else cores)
    return chosen


def threads_are_automatic(environ=None):
    """Whether the intra-op thread count of this process (``environ``: default
    ``os.environ``) is one a tool chose, and so one the :class:`ThreadGovernor` may change."""
    environ = os.environ if environ is None else environ
    auto = environ.get(AUTO_THREADS_VARIABLE)
    return (auto is not None and environ.get('OMP_NUM_THREADS') == auto
            and environ.get('MKL_NUM_THREADS') in (None, auto))


def read_cpu_busy_seconds(cpus, stat_path='/proc/stat'):
    """CPU seconds spent busy (everything but idle and iowait) on ``cpus`` since boot, from
    the kernel's per-CPU counters; None where they cannot be read (not Linux)."""
    wanted = {f'cpu{cpu}' for cpu in cpus}
    try:
        with open(stat_path) as f:
            lines = [line.split() for line in f if line.startswith('cpu')]
    except OSError:
        return None
    ticks = 0
    found = 0
    for fields in lines:
        if fields[0] in wanted:
            # user nice system idle iowait irq softirq steal (guest time is inside user)
            values = [int(v) for v in fields[1:9]]
            ticks += sum(values) - values[3] - values[4]
            found += 1
    if found != len(wanted):
        return None
    return ticks / os.sysconf('SC_CLK_TCK')


def read_own_cpu_seconds(children=False):
    """CPU seconds this process's threads have run (user + system); ``children``: its
    finished, waited-for child processes' too."""
    times = os.times()
    own = times.user + times.system
    return own + times.children_user + times.children_system if children else own


class ThreadGovernor:
    """torch's intra-op thread count, re-sized between steps to the cores other processes
    leave this one.

    Beside a busy neighbour, OpenMP threads that spin-wait for a peer that is not scheduled
    stall every parallel region (a 57 ms training step took 460 ms beside one single-threaded
    job on 2 cores); letting them sleep at once instead (``OMP_WAIT_POLICY=PASSIVE``) removes
    the stall but makes the idle step about a third slower (a wake-up per region). The
    governor keeps the fast spinning default and, instead, runs fewer threads while other
    processes hold cores: every ``interval`` seconds (a :meth:`poll` in between reads one
    clock) it takes the CPU time spent on this process's CPUs (``/proc/stat``) minus this
    process's own (``os.times``), the other processes' share, and sets
    ``threads = cores - round(others)``, at least 1 and at most ``cores``. Data-loading
    workers are other processes too, and rightly count: they take a core as well.

    :meth:`poll` must run on the thread that runs the model (the main thread): OpenMP keeps
    the thread count per calling thread. ``set_threads`` defaults to ``torch.set_num_threads``;
    ``log`` receives one line per change.
    """

    def __init__(self, cores=None, cpus=None, interval=1.0, read_busy=None, read_own=None,
                 clock=time.monotonic, set_threads=None, log=None):
        if not interval > 0:
            raise ValueError(f'interval must be > 0 seconds, got {interval}')
        self.cpus = usable_cpus() if cpus is None else sorted(cpus)
        self.cores = usable_cores(self.cpus) if cores is None else int(cores)
        self.interval = float(interval)
        self._read_busy = read_busy or (lambda: read_cpu_busy_seconds(self.cpus))
        self._read_own = read_own or read_own_cpu_seconds
        self._clock = clock
        self._set_threads = set_threads
        self._log = log
        self.threads = self.cores
        self.changes = 0
        self._mark = (clock(), self._read_busy(), self._read_own())

    @property
    def active(self):
        """False where the CPU counters cannot be read: :meth:`poll` then changes nothing."""
        return self._mark[1] is not None

    def poll(self):
        """Re-size the thread count if ``interval`` has passed since the last decision;
        returns the thread count."""
        now = self._clock()
        last_time, last_busy, last_own = self._mark
        if last_busy is None or now - last_time < self.interval:
            return self.threads
        busy, own = self._read_busy(), self._read_own()
        self._mark = (now, busy, own)
        if busy is None:
            return self.threads
        others = max(0., (busy - last_busy) - (own - last_own)) / (now - last_time)
        # in cores: a busy CPU of an SMT pair is half a core
        others_cores = others * self.cores / len(self.cpus)
        target = max(1, min(self.cores, self.cores - int(others_cores + .5)))
        if target != self.threads:
            if self._log is not None:
                self._log(f'intra-op threads {self.threads} -> {target}: other processes '
                          f'use {others:.1f} of the {len(self.cpus)} CPUs this one may run on')
            self.threads = target
            self.changes += 1
            if self._set_threads is None:
                import torch
                torch.set_num_threads(target)
            else:
                self._set_threads(target)
        return self.threads


def tool_thread_governor(interval=1.0, log=None, environ=None):
    """A :class:`ThreadGovernor` for this process when its thread count is automatic
    (:func:`threads_are_automatic`) and the CPU counters can be read; None otherwise."""
    environ = os.environ if environ is None else environ
    if not threads_are_automatic(environ):
        return None
    governor = ThreadGovernor(cores=int(environ[AUTO_THREADS_VARIABLE]), interval=interval,
                              log=log)
    return governor if governor.active else None


def configure_tool_process(environ=None):
    """Set :func:`tool_environment` in ``environ`` (default ``os.environ``); return it.

    Warns when torch is loaded already: libgomp read its variables then, so the count
    reaches this process only through the governor, and its child processes.
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
