"""The allow-list of a run-checkpoint load: the stand-ins that rebuild ``HistoryBuffer`` and
``argparse.Namespace`` from checked instance data, and the ``getattr`` limited to
``HistoryBuffer``'s default statistics methods."""
import argparse
import contextlib
import functools
import pickle
import threading


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The file pickles an object that is neither a tensor container nor run metadata."""


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


def _dtype_problem(dtype):
    """Why ``dtype`` is not a plain numeric or bool type, or None.

    Only the type's structure is read: the flags that say whether a dtype holds object
    pointers come from the pickle, which can clear them on a dtype with an object field, and
    numpy would then take raw bytes of the file for pointers. A dtype is accepted only when it
    equals, field for field and flag for flag, the one numpy builds from its type string.
    """
    import numpy as np
    if dtype.kind not in 'biufc':
        return f'dtype {dtype.str!r} (kind {dtype.kind!r})'
    canonical = np.dtype(dtype.str)
    if (type(dtype) is not type(canonical) or dtype.fields is not None
            or dtype.names is not None or dtype.subdtype is not None
            or dtype.shape != () or dtype.itemsize != canonical.itemsize
            or dtype.flags != canonical.flags or dtype.alignment != canonical.alignment
            or dtype.hasobject):
        return f'dtype {dtype.str!r} whose pickled state does not match its type'
    return None


def unsafe_numpy_data(obj):
    """Where a loaded checkpoint holds numpy data that is not plain numeric / bool data (an
    array or scalar whose dtype is structured, of objects, or forged), as a message; or None."""
    import numpy as np

    seen = set()
    stack = [(obj, 'the checkpoint')]
    while stack:
        value, where = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        dtype = None
        if isinstance(value, np.dtype):
            dtype = value
        elif isinstance(value, (np.ndarray, np.generic)):
            dtype = value.dtype
        if dtype is not None:
            problem = _dtype_problem(dtype)
            if problem:
                return f'{where} is numpy data of {problem}'
            continue
        if isinstance(value, dict):
            stack += [(v, f'{where}[{k!r}]') for k, v in value.items()]
            stack += [(k, f'a key of {where}') for k in value]
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack += [(v, f'{where}[{i}]') for i, v in enumerate(value)]
        elif isinstance(value, (argparse.Namespace, _HistoryBufferRestorer.real())):
            stack += [(v, f'{where}.{k}') for k, v in vars(value).items()]
    return None
