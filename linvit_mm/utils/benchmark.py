"""Pieces the analysis tools (``tools/analysis_tools/benchmark_*.py``) share."""
import json
import logging
import time
from contextlib import contextmanager

import torch


def parse_arch(value):
    """``--arch``: a LinearViT arch name (``'small'``) or a JSON dict of the four arch keys.

    A dict passes through, so a value parsed once can be parsed again.
    """
    if isinstance(value, dict):
        return value
    text = value.strip()
    if text.startswith('{'):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f'--arch {text!r} is not valid JSON: {err}') from None
    return text


def synchronise(device):
    """Wait for queued CUDA work, so a wall clock read after it covers that work."""
    if torch.device(device).type == 'cuda':
        torch.cuda.synchronize(device)


@contextmanager
def quiet_mmengine_logs(level=logging.WARNING):
    """Raise the current mmengine logger's level for a block.

    ``init_weights`` logs every parameter's initialisation at INFO, which buries a
    benchmark's own output; the tools only need the values.
    """
    from mmengine.logging import MMLogger
    logger = MMLogger.get_current_instance()
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)


class ForwardClock:
    """Summed wall time of the forwards of some modules, through their own forward hooks.

    Times a part of a model (its ViT blocks, a distillation teacher) inside a larger
    forward without changing that forward.
    """

    def __init__(self, modules, device):
        self.device = device
        self.total = 0.
        self._start = None
        self.handles = []
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._begin))
            self.handles.append(module.register_forward_hook(self._end))

    def _begin(self, *args):
        synchronise(self.device)
        self._start = time.perf_counter()

    def _end(self, *args):
        synchronise(self.device)
        self.total += time.perf_counter() - self._start

    def take(self):
        """Seconds summed since the last ``take``; restarts the sum."""
        total, self.total = self.total, 0.
        return total

    def remove(self):
        for handle in self.handles:
            handle.remove()
