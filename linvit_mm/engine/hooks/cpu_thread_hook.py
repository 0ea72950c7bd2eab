"""Keep a CPU run's intra-op threads to the cores other processes leave it."""
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from linvit_mm.cpu_threads import tool_thread_governor


@HOOKS.register_module()
class CPUThreadHook(Hook):
    """Polls the tools' :class:`~linvit_mm.cpu_threads.ThreadGovernor` before every
    training, validation and test iteration.

    ``tools/train.py`` and ``tools/test.py`` add it as ``default_hooks.cpu_threads`` when they
    chose the thread count themselves (the user set neither ``OMP_NUM_THREADS`` nor
    ``MKL_NUM_THREADS``); ``default_hooks.cpu_threads = None`` in a config switches it off.
    Where the count is the user's, or the CPU counters cannot be read (not Linux), the hook
    says so once at INFO and changes nothing. Each change of the count is logged at INFO.

    Args:
        interval (float): seconds between two decisions (a poll in between reads one clock).
    """

    priority = 'VERY_HIGH'

    def __init__(self, interval=1.0):
        if not interval > 0:
            raise ValueError(f'CPUThreadHook: interval must be > 0 seconds, got {interval}')
        self.interval = float(interval)
        self.governor = None

    def before_run(self, runner):
        self.governor = tool_thread_governor(self.interval, log=runner.logger.info)
        if self.governor is None:
            runner.logger.info('CPUThreadHook: the intra-op thread count stays as set '
                               '(chosen by the user, or no CPU counters to read)')
        else:
            runner.logger.info(f'CPUThreadHook: {self.governor.threads} intra-op threads, '
                               f'fewer while other processes hold some of the '
                               f'{len(self.governor.cpus)} CPUs (checked every '
                               f'{self.interval:g} s)')

    def _poll(self):
        if self.governor is not None:
            self.governor.poll()

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self._poll()

    def before_val_iter(self, runner, batch_idx, data_batch=None):
        self._poll()

    def before_test_iter(self, runner, batch_idx, data_batch=None):
        self._poll()
