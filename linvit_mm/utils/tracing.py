"""Eager-only shortcuts: what a traced graph must compute itself instead of reading.

``torch.export``, ``torch.compile`` (and ``torch.onnx.export``, which exports first) run the
model on fake tensors whose sizes may be symbols. Two kinds of eager shortcuts break there:

* a cache of tensors keyed by sizes: a symbolic size cannot be a key, and a table built
  while tracing is a fake tensor, which, once stored, every later eager call would get
  back (``eager_cache`` neither reads nor stores while tracing);
* a branch on sizes that skips work when it is not needed (resampling to the same grid,
  padding by zero): on symbolic sizes the branch becomes a guard that pins the exported
  graph to the example's size. Under :func:`is_tracing` the general path runs, which gives
  the same result for every size.
"""
import collections
import contextlib
import functools

import torch


def is_tracing():
    """Whether the model is being traced (``torch.export``, ``torch.compile``,
    ``torch.onnx.export``, ``torch.jit.trace``) rather than run."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _plain_tensors(value):
    values = value if isinstance(value, (tuple, list)) else (value, )
    return all(type(v) is torch.Tensor for v in values if isinstance(v, torch.Tensor))


def eager_cache(maxsize):
    """Decorator: an LRU cache of ``maxsize`` entries for a function of hashable arguments
    that builds tensors (or a tuple of them), used by eager calls only.

    While tracing the function is called without the cache, so the graph computes the
    tensors from its (possibly symbolic) arguments; a result that is not a plain tensor
    (a fake or functional one, e.g. under a fake-tensor mode that ``is_tracing`` does not
    see) is never stored. Callers must only read the returned tensors: they are shared.
    """

    def wrap(function):
        entries = collections.OrderedDict()

        @functools.wraps(function)
        def cached(*args):
            if is_tracing():
                return function(*args)
            result = entries.get(args)
            if result is not None:
                # another thread may have evicted it meanwhile: then it is just not recent
                with contextlib.suppress(KeyError):
                    entries.move_to_end(args)
                return result
            result = function(*args)
            if _plain_tensors(result):
                entries[args] = result
                while len(entries) > maxsize:
                    with contextlib.suppress(KeyError):
                        entries.popitem(last=False)
            return result

        cached.cache_clear = entries.clear
        cached.cache_len = entries.__len__
        return cached

    return wrap
