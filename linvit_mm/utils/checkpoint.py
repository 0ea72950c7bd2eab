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

Both are read by torch's own weights-only unpickler (``weights_only=True`` passed
explicitly, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` does not override), with these
data types added to its allow-list for the duration of the load
(``torch.serialization.safe_globals``). That unpickler calls only allow-listed
functions and restores state (the pickle ``BUILD`` step) only on instances of
allow-listed types, never on a class, function or module.

It restores an allowed instance through the class's own ``__setstate__``, and
``HistoryBuffer.__setstate__`` writes the pickled statistics table into the
*class-level* ``_statistics_methods``: a file could make ``statistics('mean')`` of
every buffer in the process compute something else. So the names
``mmengine.logging.history_buffer.HistoryBuffer`` and ``argparse.Namespace`` resolve
to stand-ins (:class:`_Restorer`) that accept exactly the instance data a genuine
object pickles, check it, and only then become the real class; the statistics table
a genuine buffer pickles (mmengine's four default methods) is checked and dropped,
never written anywhere.

The one function of our own is ``getattr``: allow-listing ``builtins.getattr`` would
reach anything, so the name maps to one that returns only the four default statistics
methods of ``HistoryBuffer``. Anything else (a pickle naming any other global,
building on a class, or state a genuine object does not have) is refused with
``UnsafeCheckpointError`` that names it; nothing it carries runs.

``install_checkpoint_policy`` routes every scheme of mmengine's ``CheckpointLoader``
here: local paths, ``http(s)://`` (downloaded to torch hub's cache as mmengine does,
then read as a local file), ``open-mmlab://`` / ``openmmlab://``, ``torchvision://`` /
``modelzoo://``, ``mmcls://``, ``pavi://`` and ``s3://`` / ``petrel://``; a scheme
registered by another package before linvit_mm is imported is refused by name, since
its loader would call plain ``torch.load``.
"""
import argparse
import contextlib
import functools
import io
import os
import os.path as osp
import pickle
import sys
import threading
import zipfile
from tempfile import TemporaryDirectory
from urllib.parse import urlparse

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


# ---------------------------------------------------------------- restoring allowed objects

# What HistoryBuffer.__getstate__ returns: its instance data and, under
# 'statistics_methods', the class's statistics table.
_HISTORY_BUFFER_DATA = ('max_length', '_log_history', '_count_history')
_HISTORY_BUFFER_STATISTICS = ('min', 'max', 'current', 'mean')


class _Restoration:
    """The stand-ins one load created; each must have become its real class at the end."""

    def __init__(self):
        self.pending = []
        self.refusal = None

    def refuse(self, message):
        # torch re-raises an unpickling error with its own advice around it; the loader
        # reports this message instead
        self.refusal = message
        raise UnsafeCheckpointError(message)

    def unfinished(self):
        return sorted({type(obj).real_name for obj in self.pending if isinstance(obj, _Restorer)})


_loads = threading.local()


def _current_restoration():
    stack = getattr(_loads, 'stack', None)
    if not stack:
        raise UnsafeCheckpointError(
            'an allowed mmengine/argparse object is restored only inside '
            'linvit_mm.utils.checkpoint.load_checkpoint_file')
    return stack[-1]


@contextlib.contextmanager
def _restoring():
    if not hasattr(_loads, 'stack'):
        _loads.stack = []
    restoration = _Restoration()
    _loads.stack.append(restoration)
    try:
        yield restoration
    finally:
        _loads.stack.pop()


class _Restorer:
    """Stands in for an allowed class while a checkpoint is unpickled.

    The pickle creates it (``NEWOBJ``, without arguments) and gives it its state
    (``BUILD``); ``instance_data`` checks the state and returns what goes into the
    instance's ``__dict__``, and the object then becomes an instance of ``real()``. A
    stand-in left without state, called like a constructor, or given state twice is
    refused.
    """
    real_name = ''

    def __new__(cls, *args):
        restoration = _current_restoration()
        if args:
            restoration.refuse(f'refusing {cls.real_name} created with arguments {args!r} '
                               '(a genuine one is created empty and given its state)')
        obj = super().__new__(cls)
        restoration.pending.append(obj)
        return obj

    def __init__(self, *args, **kwargs):
        _current_restoration().refuse(
            f'refusing to call {self.real_name}(...) while unpickling (a genuine one is '
            'restored from its pickled state)')

    def __setstate__(self, state):
        restorer = type(self)
        data = restorer.instance_data(state, _current_restoration().refuse)
        self.__class__ = restorer.real()
        self.__dict__.update(data)
        restorer.finish(self)

    @staticmethod
    def real():
        raise NotImplementedError

    @classmethod
    def instance_data(cls, state, refuse):
        raise NotImplementedError

    @staticmethod
    def finish(obj):
        """Called with the restored object, an instance of ``real()``."""


def _describe(obj):
    return getattr(obj, '__qualname__', None) or type(obj).__name__


class _HistoryBufferRestorer(_Restorer):
    real_name = 'mmengine.logging.history_buffer.HistoryBuffer'

    @staticmethod
    def real():
        from mmengine.logging import HistoryBuffer
        return HistoryBuffer

    @classmethod
    def instance_data(cls, state, refuse):
        import numpy as np
        what = 'a pickled HistoryBuffer'
        if not isinstance(state, dict):
            refuse(f'refusing {what} whose state is a {type(state).__name__}, not the dict '
                   'of its attributes')
        extra = sorted(map(repr, set(state) - {*_HISTORY_BUFFER_DATA, 'statistics_methods'}))
        missing = [key for key in _HISTORY_BUFFER_DATA if key not in state]
        if extra or missing:
            refuse(f'refusing {what} with state keys {sorted(map(repr, state))}: '
                   + (f'{", ".join(extra)} not instance data of a HistoryBuffer' if extra else
                      f'{", ".join(map(repr, missing))} missing'))
        max_length = state['max_length']
        if type(max_length) is not int or max_length < 1:
            refuse(f'refusing {what} with max_length={max_length!r} (a positive int)')
        for key in ('_log_history', '_count_history'):
            history = state[key]
            if (type(history) is not np.ndarray or history.ndim != 1
                    or history.dtype.kind not in 'biuf'):
                refuse(f'refusing {what} whose {key} is not a 1-d numeric numpy array '
                       f'({_describe(history)})')
        if len(state['_log_history']) != len(state['_count_history']):
            refuse(f'refusing {what} with {len(state["_log_history"])} logged values and '
                   f'{len(state["_count_history"])} counts')
        # The table is the class's, shared by every buffer of the process: it is
        # checked and dropped, never written.
        table = state.get('statistics_methods', {})
        if not isinstance(table, dict):
            refuse(f'refusing {what} whose statistics_methods is a {type(table).__name__}')
        real = cls.real()
        for name, method in table.items():
            if name not in _HISTORY_BUFFER_STATISTICS or method is not getattr(real, name):
                refuse(f'refusing {what} whose statistics_methods maps {name!r} to '
                       f'{_describe(method)} (only mmengine\'s own '
                       f'{"/".join(_HISTORY_BUFFER_STATISTICS)} methods, each under its name, '
                       'are restored; the table is shared by every HistoryBuffer)')
        return {key: state[key] for key in _HISTORY_BUFFER_DATA}

    @staticmethod
    def finish(obj):
        # what HistoryBuffer() itself does: the defaults, where absent
        obj._set_default_statistics()


class _NamespaceRestorer(_Restorer):
    real_name = 'argparse.Namespace'

    @staticmethod
    def real():
        return argparse.Namespace

    @classmethod
    def instance_data(cls, state, refuse):
        if not isinstance(state, dict):
            refuse(f'refusing a pickled argparse.Namespace whose state is a '
                   f'{type(state).__name__}, not the dict of its attributes')
        for key in state:
            if not isinstance(key, str) or (key.startswith('__') and key.endswith('__')):
                refuse(f'refusing a pickled argparse.Namespace with attribute {key!r}')
        return state


def _history_buffer_statistic(owner, name):
    """``getattr`` as run checkpoints use it: a default statistics method of HistoryBuffer."""
    if owner is not _HistoryBufferRestorer or name not in _HISTORY_BUFFER_STATISTICS:
        shown = 'HistoryBuffer' if owner is _HistoryBufferRestorer else _describe(owner)
        _current_restoration().refuse(f'refusing getattr({shown}, {name!r}) while unpickling')
    return getattr(_HistoryBufferRestorer.real(), name)


@functools.lru_cache(maxsize=1)
def _run_checkpoint_globals():
    """What mmengine run checkpoints pickle besides torch's weights-only defaults, in the form
    ``torch.serialization.safe_globals`` takes (an object, or ``(object, 'module.name')``)."""
    import numpy as np

    multiarray = (np._core if hasattr(np, '_core') else np.core).multiarray
    allowed = [np.dtype, np.ndarray,
               (_HistoryBufferRestorer, _HistoryBufferRestorer.real_name),
               (_NamespaceRestorer, _NamespaceRestorer.real_name),
               (_history_buffer_statistic, 'builtins.getattr')]
    # numpy 1.x writes numpy.core.multiarray, numpy 2.x numpy._core.multiarray
    for module in ('numpy.core.multiarray', 'numpy._core.multiarray'):
        allowed += [(multiarray._reconstruct, f'{module}._reconstruct'),
                    (multiarray.scalar, f'{module}.scalar')]
    # a dtype instance is of its DType class (numpy.dtypes.Float64DType, ...); restoring its
    # state needs the class allowed
    allowed += [cls for cls in vars(np.dtypes).values()
                if isinstance(cls, type) and issubclass(cls, np.dtype)]
    return tuple(allowed)


# ---------------------------------------------------------------- loading

def _rewound(source):
    if not isinstance(source, (str, os.PathLike)):
        source.seek(0)
    return source


def _is_torch_file(source):
    """A zip archive (torch.save) or a pickle of protocol 2 or later (legacy torch.save)."""
    with contextlib.ExitStack() as stack:
        f = (stack.enter_context(open(source, 'rb')) if isinstance(source, (str, os.PathLike))
             else _rewound(source))
        if zipfile.is_zipfile(f):
            return True
        f.seek(0)
        return f.read(1) == pickle.PROTO


def _refusal_reason(source, err):
    """The globals a checkpoint names beyond the allow-list in force, or else the weights-only
    unpickler's own reason (without its advice to allow-list more)."""
    refused = []
    if zipfile.is_zipfile(_rewound(source)):  # torch reads the globals of zip checkpoints only
        refused = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(_rewound(source)))
    if refused:
        return (f'it pickles {", ".join(map(repr, refused))}, which the loader does not allow '
                f'(tensors, plain containers, numpy data, mmengine run metadata)')
    message = str(err).split('WeightsUnpickler error: ', 1)[-1].strip()
    message = message.splitlines()[0].split(' Please use `torch.serialization', 1)[0]
    return f'torch\'s weights-only unpickler refused it ({message})'


def _load_safely(source, name, map_location):
    """Unpickle ``source`` (a path or a binary file object) with the run-checkpoint allow-list;
    ``name`` says which file in messages."""
    # The context adds to torch's process-wide allow-list (threads loading meanwhile see it
    # too; the stand-ins refuse to work outside this function) and removes on exit what it
    # added, so what a caller had allowed stays allowed.
    present = set(torch.serialization.get_safe_globals())
    missing = [entry for entry in _run_checkpoint_globals() if entry not in present]
    advice = ('Nothing it carries was run; if the file comes from a source you trust, save its '
              'tensors as a plain state dict (torch.load(weights_only=False) outside linvit_mm) '
              'and load that')
    with torch.serialization.safe_globals(missing), _restoring() as restoration:
        try:
            # weights_only given explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD only changes
            # torch's default
            checkpoint = torch.load(_rewound(source), map_location=map_location,
                                    weights_only=True)
        except pickle.UnpicklingError as err:
            if restoration.refusal:
                raise UnsafeCheckpointError(
                    f'{name}: refusing to unpickle it: {restoration.refusal}. {advice}') from err
            if not _is_torch_file(source):
                raise pickle.UnpicklingError(
                    f'{name} is not a torch.save file (neither a zip archive nor a pickle)'
                ) from err
            raise UnsafeCheckpointError(
                f'{name}: refusing to unpickle it: {_refusal_reason(source, err)}. {advice}'
            ) from err
        unfinished = restoration.unfinished()
        if unfinished:
            raise UnsafeCheckpointError(
                f'{name}: refusing to unpickle it: it pickles {", ".join(unfinished)} without '
                f'the state a genuine one has. {advice}')
    return checkpoint


def load_checkpoint_file(path, map_location=None):
    """Load weights or an mmengine run checkpoint; refuse anything that would run code."""
    path = osp.expanduser(str(path))
    if not osp.isfile(path):
        raise FileNotFoundError(f'{path} can not be found.')
    return _load_safely(path, path, map_location)


# ---------------------------------------------------------------- mmengine's schemes
# Each replaces the loader of the same name in mmengine.runner.checkpoint: the same way to
# find or fetch the file, then _load_safely instead of plain torch.load. mmengine prints
# the part of the name after 'load_from' as the backend.

def load_from_local(filename, map_location=None):
    """A local path (``~`` expanded)."""
    return load_checkpoint_file(filename, map_location)


def _download(url, model_dir=None, progress=True):
    """The file of ``url`` in torch hub's checkpoint cache, downloaded if absent: the cache
    and file name mmengine's ``load_url`` (``torch.hub.load_state_dict_from_url``) uses."""
    model_dir = model_dir or osp.join(torch.hub.get_dir(), 'checkpoints')
    os.makedirs(model_dir, exist_ok=True)
    cached = osp.join(model_dir, osp.basename(urlparse(url).path))
    if not osp.exists(cached):
        sys.stdout.write(f'Downloading: "{url}" to {cached}\n')
        torch.hub.download_url_to_file(url, cached, None, progress=progress)
    return cached


def _load_downloaded(cached, map_location):
    # torch < 1.6 files were published zipped, one file per archive (torch.hub reads them so)
    if zipfile.is_zipfile(cached):
        with zipfile.ZipFile(cached) as archive:
            members = archive.infolist()
            if len(members) == 1 and not members[0].is_dir():
                extracted = archive.extract(members[0], osp.dirname(cached))
                return load_checkpoint_file(extracted, map_location)
    return load_checkpoint_file(cached, map_location)


def load_from_http(filename, map_location=None, model_dir=None, progress=os.isatty(0)):
    """An ``http(s)://`` URL, downloaded by local rank 0 first in distributed runs."""
    from mmengine.dist import get_dist_info
    rank, world_size = get_dist_info()
    if rank == 0:
        cached = _download(filename, model_dir, progress)
    if world_size > 1:
        torch.distributed.barrier()
        if rank > 0:
            cached = _download(filename, model_dir, progress)
    return _load_downloaded(cached, map_location)


def load_from_pavi(filename, map_location=None):
    """A ``pavi://`` model of pavi's model cloud."""
    if not filename.startswith('pavi://'):
        raise ValueError(f'Expected a path starting with pavi://, got {filename}')
    try:
        from pavi import modelcloud
    except ImportError:
        raise ImportError('Please install pavi to load checkpoint from modelcloud.') from None
    model = modelcloud.get(filename[len('pavi://'):])
    with TemporaryDirectory() as tmp_dir:
        downloaded = osp.join(tmp_dir, osp.basename(model.name))
        model.download(downloaded)
        return load_checkpoint_file(downloaded, map_location)


def load_from_ceph(filename, map_location=None, backend='petrel'):
    """An ``s3://`` or ``petrel://`` path, read through mmengine's file backend."""
    from mmengine import fileio
    file_backend = fileio.get_file_backend(filename, backend_args={'backend': backend})
    with io.BytesIO(file_backend.get(filename)) as buffer:
        return _load_safely(buffer, filename, map_location)


def _model_url(table, name, filename, table_name):
    if name not in table:
        raise KeyError(f'{filename}: {name!r} is not in {table_name}')
    return table[name]


def load_from_torchvision(filename, map_location=None):
    """``torchvision://NAME`` (or the deprecated ``modelzoo://NAME``)."""
    import logging

    from mmengine.logging import print_log
    from mmengine.runner.checkpoint import get_torchvision_models
    if filename.startswith('modelzoo://'):
        print_log('The URL scheme of "modelzoo://" is deprecated, please use "torchvision://" '
                  'instead', logger='current', level=logging.WARNING)
        name = filename[len('modelzoo://'):]
    else:
        name = filename[len('torchvision://'):]
    url = _model_url(get_torchvision_models(), name, filename, "torchvision's model URLs")
    return load_from_http(url, map_location=map_location)


def load_from_openmmlab(filename, map_location=None):
    """``open-mmlab://NAME`` / ``openmmlab://NAME``: mmengine's table of OpenMMLab models,
    updated by ``$MMENGINE_HOME/open_mmlab.json`` (a URL, or a path under MMENGINE_HOME)."""
    import logging

    from mmengine.logging import print_log
    from mmengine.runner.checkpoint import (_get_mmengine_home, get_deprecated_model_names,
                                            get_external_models)
    prefix = 'open-mmlab://' if filename.startswith('open-mmlab://') else 'openmmlab://'
    name = filename[len(prefix):]
    deprecated = get_deprecated_model_names()
    if name in deprecated:
        print_log(f'{prefix}{name} is deprecated in favor of {prefix}{deprecated[name]}',
                  logger='current', level=logging.WARNING)
        name = deprecated[name]
    url = _model_url(get_external_models(), name, filename,
                     "mmengine's OpenMMLab model table or $MMENGINE_HOME/open_mmlab.json")
    if url.startswith(('http://', 'https://')):
        return load_from_http(url, map_location=map_location)
    path = osp.join(_get_mmengine_home(), url)
    if not osp.isfile(path):
        raise FileNotFoundError(f'{path} can not be found ({filename}).')
    return load_checkpoint_file(path, map_location)


def load_from_mmcls(filename, map_location=None):
    """``mmcls://NAME``: an mmcls model, its keys renamed as mmengine does."""
    from mmengine.runner.checkpoint import _process_mmcls_checkpoint, get_mmcls_models
    name = filename[len('mmcls://'):]
    url = _model_url(get_mmcls_models(), name, filename, "mmengine's mmcls model table")
    return _process_mmcls_checkpoint(load_from_http(url, map_location=map_location))


SCHEME_LOADERS = {
    '': load_from_local,
    'http://': load_from_http,
    'https://': load_from_http,
    'pavi://': load_from_pavi,
    r'(\S+\:)?s3://': load_from_ceph,
    r'(\S+\:)?petrel://': load_from_ceph,
    'modelzoo://': load_from_torchvision,
    'torchvision://': load_from_torchvision,
    'open-mmlab://': load_from_openmmlab,
    'openmmlab://': load_from_openmmlab,
    'mmcls://': load_from_mmcls,
}


def _refusing_loader(prefix):

    def load_from_unsupported_scheme(filename, map_location=None):
        raise UnsafeCheckpointError(
            f'{filename}: linvit_mm has no safe loader for the checkpoint scheme {prefix!r} '
            '(its registered loader would unpickle the file in full, which can run code it '
            'carries); fetch the file and give its local path')

    return load_from_unsupported_scheme


def install_checkpoint_policy():
    """Route every scheme of mmengine's ``CheckpointLoader`` through the safe unpickler."""
    from mmengine.runner.checkpoint import CheckpointLoader
    for prefix in list(CheckpointLoader._schemes):
        if prefix not in SCHEME_LOADERS:
            CheckpointLoader.register_scheme(prefixes=prefix, loader=_refusing_loader(prefix),
                                             force=True)
    for prefix, loader in SCHEME_LOADERS.items():
        CheckpointLoader.register_scheme(prefixes=prefix, loader=loader, force=True)
