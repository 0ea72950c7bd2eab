"""Checkpoint loading under torch >= 2.6 without ever unpickling code.

torch 2.6 made ``torch.load`` weights-only by default. Two kinds of files reach
mmengine's checkpoint loader in this project:

* weight files from outside (DeiT releases, timm or self-supervised state dicts,
  ``init_cfg=dict(type='Pretrained', ...)``): plain tensors and containers;
* mmengine run checkpoints (``--resume``, ``load_from``, ``tools/test.py CKPT``,
  the classification-stage checkpoint that initialises a detector). Besides
  tensors they pickle mmengine's ``HistoryBuffer``, numpy arrays and scalars, and
  the buffer's statistics table as ``getattr(HistoryBuffer, 'mean')``; DeiT, DINO
  and MAE training checkpoints carry their ``args`` as an ``argparse.Namespace``.

Both are read by torch's own weights-only unpickler, with these data types added
to its allow-list for the duration of the load (``torch.serialization.safe_globals``).
That unpickler calls only allow-listed functions and restores state (the pickle
``BUILD`` step) only on instances of allow-listed types, never on a class, function
or module, so a pickle cannot overwrite attributes process-wide (e.g. set
``argparse.Namespace.__init__``) through a class it is allowed to name. State given
to such an instance stays on that instance.

The one piece of our own is ``getattr``: allow-listing ``builtins.getattr`` would
reach anything, so the name maps to a function that returns public attributes of
``HistoryBuffer`` only. Anything else (a pickle naming any other global, or building
on a class) is refused with ``UnsafeCheckpointError`` that names it; nothing it
carries runs. ``install_checkpoint_policy`` routes mmengine's loader for local files
here.
"""
import argparse
import functools
import os.path as osp
import pickle
import zipfile

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
            f'code they carry): {_refusal_reason(path, err)}') from err


def _public_attribute_of(*owners):

    def restricted_getattr(obj, name):
        if obj not in owners or not isinstance(name, str) or name.startswith('_'):
            raise UnsafeCheckpointError(f'refusing getattr({obj!r}, {name!r}) while unpickling')
        return getattr(obj, name)

    return restricted_getattr


@functools.lru_cache(maxsize=1)
def _run_checkpoint_globals():
    """What mmengine run checkpoints pickle besides torch's weights-only defaults, in the form
    ``torch.serialization.safe_globals`` takes (an object, or ``(object, 'module.name')``)."""
    import numpy as np
    from mmengine.logging import HistoryBuffer

    multiarray = (np._core if hasattr(np, '_core') else np.core).multiarray
    allowed = [np.dtype, np.ndarray, HistoryBuffer, argparse.Namespace,
               (_public_attribute_of(HistoryBuffer), 'builtins.getattr')]
    # numpy 1.x writes numpy.core.multiarray, numpy 2.x numpy._core.multiarray
    for module in ('numpy.core.multiarray', 'numpy._core.multiarray'):
        allowed += [(multiarray._reconstruct, f'{module}._reconstruct'),
                    (multiarray.scalar, f'{module}.scalar')]
    # a dtype instance is of its DType class (numpy.dtypes.Float64DType, ...); restoring its
    # state needs the class allowed
    allowed += [cls for cls in vars(np.dtypes).values()
                if isinstance(cls, type) and issubclass(cls, np.dtype)]
    return tuple(allowed)


def _is_torch_file(path):
    """A zip archive (torch.save) or a pickle of protocol 2 or later (legacy torch.save)."""
    with open(path, 'rb') as f:
        if zipfile.is_zipfile(f):
            return True
        f.seek(0)
        return f.read(1) == pickle.PROTO


def _refusal_reason(path, err):
    """The globals a checkpoint names beyond the allow-list in force, or else the weights-only
    unpickler's own reason (without its advice to allow-list more)."""
    refused = []
    if zipfile.is_zipfile(path):  # torch reads the globals of zip checkpoints only
        refused = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    if refused:
        return (f'it pickles {", ".join(map(repr, refused))}, which the loader does not allow '
                f'(tensors, plain containers, numpy data, mmengine run metadata)')
    message = str(err).split('WeightsUnpickler error: ', 1)[-1].strip()
    message = message.splitlines()[0].split(' Please use `torch.serialization', 1)[0]
    return f'torch\'s weights-only unpickler refused it ({message})'


def load_checkpoint_file(path, map_location=None):
    """Load weights or an mmengine run checkpoint; refuse anything that would run code."""
    path = osp.expanduser(str(path))
    if not osp.isfile(path):
        raise FileNotFoundError(f'{path} can not be found.')
    # The context adds to torch's process-wide allow-list (threads loading meanwhile see it
    # too) and removes on exit what it added, so what a caller had allowed stays allowed.
    present = set(torch.serialization.get_safe_globals())
    missing = [entry for entry in _run_checkpoint_globals() if entry not in present]
    with torch.serialization.safe_globals(missing):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            if not _is_torch_file(path):
                raise pickle.UnpicklingError(
                    f'{path} is not a torch.save file (neither a zip archive nor a pickle)'
                ) from err
            raise UnsafeCheckpointError(
                f'{path}: refusing to unpickle it: {_refusal_reason(path, err)}. Nothing it '
                f'carries was run; if the file comes from a source you trust, save its tensors '
                f'as a plain state dict (torch.load(weights_only=False) outside linvit_mm) and '
                f'load that') from err


def install_checkpoint_policy():
    """Route mmengine's local-file checkpoint loading through ``load_checkpoint_file``."""
    from mmengine.runner.checkpoint import CheckpointLoader
    CheckpointLoader.register_scheme(prefixes='', loader=load_checkpoint_file, force=True)
