"""How busy other processes keep the machine while a benchmark times something."""
import os
import time


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
