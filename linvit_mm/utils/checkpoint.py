"""Checkpoint loading under torch >= 2.6 without ever unpickling code.

torch 2.6 made ``torch.load`` weights-only by default. Two kinds of files reach
mmengine's checkpoint loader in this project:

* weight files from outside (DeiT releases, timm or self-supervised state dicts,
  ``init_cfg=dict(type='Pretrained', ...)``): plain tensors and containers, read
  with ``weights_only=True``;
* mmengine run checkpoints (``--resume``, ``load_from``, ``tools/test.py CKPT``,
  the classification-stage checkpoint that initialises a detector). Besides
  tensors they pickle mmengine's ``HistoryBuffer`` and numpy scalars, and the
  buffer's statistics table as ``getattr(HistoryBuffer, 'mean')``, which
  weights-only loading refuses. Allow-listing ``builtins.getattr`` wholesale
  would allow arbitrary code, so these files are read by a restricted unpickler:
  torch's weights-only allow-list, plus numpy's array/scalar reconstruction,
  ``HistoryBuffer``, ``argparse.Namespace`` (the ``args`` that DeiT, DINO and MAE
  training checkpoints carry), and ``getattr`` limited to public attributes of
  ``HistoryBuffer``.

Anything else (a pickle naming any other global) is refused with
``UnsafeCheckpointError`` naming the global; nothing it carries runs.
``install_checkpoint_policy`` routes mmengine's loader for local files here.
"""
import argparse
import os.path as osp
import pickle
import types

import torch

__all__ = ['UnsafeCheckpointError', 'install_checkpoint_policy', 'load_checkpoint_file',
           'load_weights_only']


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The file pickles an object that is neither a tensor container nor run metadata."""


def load_weights_only(path, map_location='cpu'):
    """``torch.load(weights_only=True)`` with an error that says why a file is refused."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f'{path} pickles objects beyond tensors and plain containers, so it was not loaded '
            '(weight files are read with weights_only=True: unpickling them in full could run '
            f'code they carry). Original error: {str(err).splitlines()[0]}') from err


def _run_checkpoint_globals():
    import numpy as np
    from mmengine.logging import HistoryBuffer
    from torch._weights_only_unpickler import _get_allowed_globals

    allowed = dict(_get_allowed_globals())
    core = np._core if hasattr(np, '_core') else np.core
    allowed.update({
        'numpy.dtype': np.dtype,
        'numpy.ndarray': np.ndarray,
        f'{core.multiarray.__name__}._reconstruct': core.multiarray._reconstruct,
        f'{core.multiarray.__name__}.scalar': core.multiarray.scalar,
        'mmengine.logging.history_buffer.HistoryBuffer': HistoryBuffer,
        'builtins.getattr': _public_attribute_of(HistoryBuffer),
        'collections.OrderedDict': __import__('collections').OrderedDict,
        # the ``args`` of DeiT / DINO / iBOT / MAE training checkpoints; rebuilding one
        # only sets attributes
        'argparse.Namespace': argparse.Namespace,
    })
    for name in dir(np.dtypes):
        dtype_class = getattr(np.dtypes, name)
        if isinstance(dtype_class, type) and issubclass(dtype_class, np.dtype):
            allowed[f'numpy.dtypes.{name}'] = dtype_class
    return allowed


def _public_attribute_of(*owners):
    def restricted_getattr(obj, name):
        if obj not in owners or not isinstance(name, str) or name.startswith('_'):
            raise UnsafeCheckpointError(f'refusing getattr({obj!r}, {name!r}) while unpickling')
        return getattr(obj, name)

    return restricted_getattr


class _RunCheckpointUnpickler(pickle.Unpickler):
    allowed = None

    def find_class(self, module, name):
        if type(self).allowed is None:
            type(self).allowed = _run_checkpoint_globals()
        qualified = f'{module}.{name}'
        if module == '__builtin__':  # protocol-2 pickles name builtins this way
            qualified = f'builtins.{name}'
        if qualified in self.allowed:
            return self.allowed[qualified]
        raise UnsafeCheckpointError(
            f'the checkpoint pickles {qualified!r}, which is neither a tensor container nor '
            'mmengine run metadata; refusing to unpickle it')


_run_checkpoint_pickle = types.SimpleNamespace(
    Unpickler=_RunCheckpointUnpickler,
    load=lambda file, **kwargs: _RunCheckpointUnpickler(file, **kwargs).load(),
    __name__='linvit_mm_run_checkpoint_pickle')


def load_checkpoint_file(path, map_location=None):
    """Load weights or an mmengine run checkpoint; refuse anything that would run code."""
    path = osp.expanduser(str(path))
    if not osp.isfile(path):
        raise FileNotFoundError(f'{path} can not be found.')
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        pass
    try:
        return torch.load(path, map_location=map_location, weights_only=False,
                          pickle_module=_run_checkpoint_pickle)
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(f'{path}: {err}') from None


def install_checkpoint_policy():
    """Route mmengine's local-file checkpoint loading through ``load_checkpoint_file``."""
    from mmengine.runner.checkpoint import CheckpointLoader
    CheckpointLoader.register_scheme(prefixes='', loader=load_checkpoint_file, force=True)
