"""How busy other processes keep the machine while a benchmark times something."""
import time

from linvit_mm.cpu_threads import read_cpu_busy_seconds, read_own_cpu_seconds, usable_cpus


class BackgroundLoad:
    """CPU cores other processes kept busy, on average, between ``start`` and ``stop``.

    Busy time of the CPUs this process may run on (``/proc/stat``, read by
    :func:`linvit_mm.cpu_threads.read_cpu_busy_seconds`, as the tools' thread governor reads
    it) minus this process's own CPU time (all its threads, and its finished children), over
    the wall time. On a shared machine this says how much of the timing ran beside someone
    else's work; ``None`` where ``/proc/stat`` cannot be read.
    """

    def __init__(self):
        self.cpus = usable_cpus()
        self._start = None

    def start(self):
        busy = read_cpu_busy_seconds(self.cpus)
        self._start = None if busy is None else (
            time.perf_counter(), busy, read_own_cpu_seconds(children=True))

    def stop(self):
        if self._start is None:
            return None
        busy = read_cpu_busy_seconds(self.cpus)
        if busy is None:
            return None
        wall0, busy0, own0 = self._start
        own_s = read_own_cpu_seconds(children=True) - own0
        return max(0., busy - busy0 - own_s) / max(time.perf_counter() - wall0, 1e-9)


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
