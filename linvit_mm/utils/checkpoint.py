"""Checkpoint loading under torch >= 2.6, where ``torch.load`` defaults to weights only.

Two kinds of files reach mmengine's checkpoint loader:

* the project's own run checkpoints (``--resume``, ``load_from``, ``tools/test.py CKPT``,
  anything under the run's ``work_dir``). mmengine pickles its ``HistoryBuffer``
  and numpy objects into them, which weights-only loading refuses, and making
  them loadable by allow-listing would need ``builtins.getattr`` (i.e. arbitrary
  code). These paths are *trusted* by the tools and unpickled in full.
* weight files from outside (DeiT releases, timm or self-supervised state dicts,
  ``init_cfg=dict(type='Pretrained', ...)``). They are plain tensors, so they are
  always read with ``weights_only=True``: a pickle carrying code is refused, never
  executed.

``install_checkpoint_policy`` replaces mmengine's loader for local files with
``load_local_checkpoint``, which applies that rule.
"""
import os
import os.path as osp
import pickle

import torch

_trusted_files = set()
_trusted_dirs = set()


def _norm(path):
    return osp.realpath(osp.expanduser(str(path)))


def trust_checkpoint(path):
    """Mark a checkpoint file, or every file under a directory, as the user's own run output."""
    path = _norm(path)
    (_trusted_dirs if osp.isdir(path) else _trusted_files).add(path)


def trust_run_dir(work_dir):
    """The runner writes its checkpoints into work_dir, so they are trusted even before they exist."""
    _trusted_dirs.add(_norm(work_dir))


def is_trusted(path):
    path = _norm(path)
    if path in _trusted_files:
        return True
    return any(path == d or path.startswith(d + os.sep) for d in _trusted_dirs)


class UntrustedCheckpointError(pickle.UnpicklingError):
    pass


def load_weights_only(path, map_location='cpu'):
    """``torch.load(weights_only=True)`` with an error that explains the refusal."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UntrustedCheckpointError(
            f'{path} holds pickled objects beyond tensors and plain containers, so it was not '
            'loaded (external weight files are read with weights_only=True; unpickling them in '
            'full could run code they carry). If this file is your own training checkpoint, '
            'pass it as --resume / load_from / the tools/test.py checkpoint, or call '
            f'linvit_mm.utils.checkpoint.trust_checkpoint(path). Original error: '
            f'{str(err).splitlines()[0]}') from err


def load_local_checkpoint(filename, map_location=None):
    filename = osp.expanduser(filename)
    if not osp.isfile(filename):
        raise FileNotFoundError(f'{filename} can not be found.')
    if is_trusted(filename):
        return torch.load(filename, map_location=map_location, weights_only=False)
    return load_weights_only(filename, map_location=map_location)


def install_checkpoint_policy():
    """Route mmengine's local-file checkpoint loading through ``load_local_checkpoint``."""
    from mmengine.runner.checkpoint import CheckpointLoader
    CheckpointLoader.register_scheme(prefixes='', loader=load_local_checkpoint, force=True)
