"""Weight files load weights-only; mmengine run checkpoints load too; code never runs."""
import argparse
import io
import pickle
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer
from mmengine.runner.checkpoint import CheckpointLoader

from linvit_mm.utils import checkpoint as policy


class Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, 'w'))


class GetattrPayload:
    """Reaches through getattr from an allowed class to something else."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return (getattr, (self.owner, self.name))


@pytest.fixture(autouse=True)
def installed_policy():
    policy.install_checkpoint_policy()


def test_plain_weights_load(tmp_path):
    torch.save({'model': {'w': torch.ones(2)}}, tmp_path / 'deit.pth')
    ckpt = CheckpointLoader.load_checkpoint(str(tmp_path / 'deit.pth'))
    assert torch.equal(ckpt['model']['w'], torch.ones(2))


@pytest.mark.parametrize('payload', ['open', 'getattr-other-class', 'getattr-private'])
def test_code_carrying_pickles_are_refused_and_never_run(tmp_path, payload):
    marker = tmp_path / 'pwned'
    evil = {'open': Payload(marker),
            'getattr-other-class': GetattrPayload(OrderedDict, 'fromkeys'),
            'getattr-private': GetattrPayload(HistoryBuffer, '__init__')}[payload]
    torch.save({'state_dict': {}, 'evil': evil}, tmp_path / 'evil.pth')
    with pytest.raises(policy.UnsafeCheckpointError, match='refusing'):
        CheckpointLoader.load_checkpoint(str(tmp_path / 'evil.pth'))
    with pytest.raises(policy.UnsafeCheckpointError, match='weights_only=True'):
        policy.load_weights_only(tmp_path / 'evil.pth')
    assert not marker.exists()
    assert issubclass(policy.UnsafeCheckpointError, pickle.UnpicklingError)


def test_mmengine_run_checkpoint_loads_without_trusting_anything(tmp_path):
    buffer = HistoryBuffer()
    buffer.update(np.float64(0.5))
    buffer.update(1.5)
    path = tmp_path / 'iter_2.pth'
    torch.save({'state_dict': {'w': torch.ones(1)},
                'message_hub': {'log_scalars': {'train/loss': buffer}},
                'meta': {'seed': np.int64(3)}}, path)
    # weights-only loading alone refuses it ...
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    # ... the run-checkpoint unpickler reads it, HistoryBuffer statistics included.
    ckpt = CheckpointLoader.load_checkpoint(str(path))
    restored = ckpt['message_hub']['log_scalars']['train/loss']
    assert restored.mean() == pytest.approx(1.0)
    assert ckpt['meta']['seed'] == 3


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match='nope.pth'):
        CheckpointLoader.load_checkpoint(str(tmp_path / 'nope.pth'))


def test_training_args_and_numpy_arrays_load(tmp_path):
    path = tmp_path / 'deit_checkpoint.pth'
    torch.save({'model': {'w': torch.ones(1)}, 'args': argparse.Namespace(model='deit', lr=5e-4),
                'stats': np.arange(3.)}, path)
    ckpt = policy.load_checkpoint_file(path)
    assert isinstance(ckpt['args'], argparse.Namespace) and ckpt['args'].model == 'deit'
    assert np.array_equal(ckpt['stats'], np.arange(3.))


def test_numpy_1_module_names_load(tmp_path):
    """numpy 1.x pickles its reconstructors as numpy.core.multiarray, numpy 2.x as
    numpy._core.multiarray; run checkpoints of either load."""
    buffer = io.BytesIO()
    torch.save({'seed': np.int64(3), 'stats': np.arange(3.)}, buffer)
    pkl = read_pickle(buffer.getvalue())
    numpy2 = b'numpy._core.multiarray\n'
    assert numpy2 in pkl
    path = tmp_path / 'numpy1.pth'
    write_checkpoint(path, pkl.replace(numpy2, b'numpy.core.multiarray\n'))
    ckpt = policy.load_checkpoint_file(path)
    assert ckpt['seed'] == 3 and np.array_equal(ckpt['stats'], np.arange(3.))


def test_refusal_names_the_global(tmp_path):
    torch.save({'evil': Payload(tmp_path / 'pwned')}, tmp_path / 'evil.pth')
    with pytest.raises(policy.UnsafeCheckpointError,
                       match=r"it pickles 'io\.open', which the loader does not allow"):
        policy.load_checkpoint_file(tmp_path / 'evil.pth')


def test_allow_list_is_left_as_it_was(tmp_path):
    """The run-checkpoint types are allowed during a load only; what the caller had allowed
    before stays allowed."""
    saved = torch.serialization.get_safe_globals()
    path = tmp_path / 'run.pth'
    torch.save({'args': argparse.Namespace(seed=0)}, path)
    try:
        torch.serialization.add_safe_globals([np.ndarray])
        policy.load_checkpoint_file(path)
        allowed = torch.serialization.get_safe_globals()
        assert np.ndarray in allowed and argparse.Namespace not in allowed
        with pytest.raises(pickle.UnpicklingError):
            torch.load(path, weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


# ---------------------------------------------------------------- hand-made pickles
# Each attack names only classes and functions the loader allows, and then changes one of
# them for the whole process through the pickle BUILD step (state set on the object below it
# on the stack) or by calling a method the loader never meant to call.

def read_pickle(archive):
    """The ``data.pkl`` record of a ``torch.save`` archive."""
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith('/data.pkl')))


def write_checkpoint(path, pkl):
    """A ``torch.save`` archive whose pickle is ``pkl``."""
    template = io.BytesIO()
    torch.save({}, template)
    with zipfile.ZipFile(template) as src, zipfile.ZipFile(path, 'w') as dst:
        for name in src.namelist():
            dst.writestr(name, pkl if name.endswith('/data.pkl') else src.read(name))


def global_(module, name):
    return b'c' + f'{module}\n{name}\n'.encode()


def string(text):
    data = text.encode()
    return b'X' + len(data).to_bytes(4, 'little') + data


def attributes(**attrs):
    """A dict of ``attrs`` (values None or one-tuples of ints) as pickle opcodes."""
    body = b''
    for key, value in attrs.items():
        body += string(key) + (b'N' if value is None else b'K' + bytes([value[0]]) + b'\x85')
        body += b's'
    return b'}' + body


def build(target, state):
    """``target`` (opcodes that push an object), then BUILD with ``state``, then STOP."""
    return b'\x80\x02' + target + state + b'b.'


def slotstate(**attrs):
    """The ``(None, slotstate)`` form of a BUILD state: pickle calls setattr for each item."""
    return b'N' + attributes(**attrs) + b'\x86'


HISTORY_BUFFER = global_('mmengine.logging.history_buffer', 'HistoryBuffer')
# protocol 2 names builtins __builtin__, as torch.save writes them
GETATTR_MEAN = global_('__builtin__', 'getattr') + HISTORY_BUFFER + string('mean') + b'\x86R'
REGISTER_ORDERED_DICT = (global_('__builtin__', 'getattr') + HISTORY_BUFFER
                         + string('register_statistics') + b'\x86R'
                         + global_('collections', 'OrderedDict') + b'\x85R.')

# name: (pickle, the object it changes, the attribute it changes)
ATTACKS = {
    'namespace_dict': (build(global_('argparse', 'Namespace'), attributes(__init__=None)),
                       argparse.Namespace, '__init__'),
    'namespace_slotstate': (build(global_('argparse', 'Namespace'), slotstate(__init__=None)),
                            argparse.Namespace, '__init__'),
    'history_buffer_class': (build(HISTORY_BUFFER, slotstate(update=None)), HistoryBuffer,
                             'update'),
    'ordered_dict_class': (build(global_('collections', 'OrderedDict'),
                                 slotstate(fromkeys=None)), OrderedDict, 'fromkeys'),
    'numpy_dtype_class': (build(global_('numpy', 'dtype'), slotstate(newbyteorder=None)),
                          np.dtype, 'newbyteorder'),
    'numpy_dtype_subclass': (build(global_('numpy.dtypes', 'Float64DType'),
                                   slotstate(newbyteorder=None)),
                             np.dtypes.Float64DType, 'newbyteorder'),
    'history_buffer_method': (build(GETATTR_MEAN, slotstate(__defaults__=(1, ))),
                              HistoryBuffer.mean, '__defaults__'),
    'torch_function': (build(global_('torch._utils', '_rebuild_tensor_v2'),
                             slotstate(__defaults__=(1, ))),
                       torch._utils._rebuild_tensor_v2, '__defaults__'),
}


ABSENT = object()


def snapshot(owner, attribute):
    """A class's own attribute (ABSENT where it inherits it), or a function's."""
    if isinstance(owner, type):
        return vars(owner).get(attribute, ABSENT)
    return getattr(owner, attribute)


@pytest.mark.parametrize('attack', list(ATTACKS))
def test_build_on_a_class_or_function_is_refused(tmp_path, attack):
    pkl, owner, attribute = ATTACKS[attack]
    before = snapshot(owner, attribute)
    path = tmp_path / f'{attack}.pth'
    write_checkpoint(path, pkl)
    with pytest.raises(policy.UnsafeCheckpointError, match='refusing to unpickle'):
        CheckpointLoader.load_checkpoint(str(path))
    assert snapshot(owner, attribute) is before


def test_namespace_attack_works_on_an_unrestricted_unpickler():
    """The hand-made pickle is a real attack: plain ``pickle`` runs it."""
    original = argparse.Namespace.__init__
    try:
        pickle.loads(ATTACKS['namespace_slotstate'][0])
        assert argparse.Namespace.__init__ is None
    finally:
        argparse.Namespace.__init__ = original


def test_calling_a_class_method_reached_through_getattr_is_refused(tmp_path):
    path = tmp_path / 'register.pth'
    write_checkpoint(path, b'\x80\x02' + REGISTER_ORDERED_DICT)
    with pytest.raises(policy.UnsafeCheckpointError, match='refusing to unpickle'):
        policy.load_checkpoint_file(path)
    assert 'OrderedDict' not in HistoryBuffer._statistics_methods


# A dtype with an object field whose pickled state clears numpy's "holds references" flags:
# numpy then fills the array from the file's raw bytes and later reads them as an object
# pointer (a crash, or worse, when anything touches the value).
class ForgedDtype:
    def __init__(self, flags=0):
        self.flags = flags

    def __reduce__(self):
        return (np.dtype, ('V8', False, True),
                (3, '|', None, ('a', ), {'a': (np.dtype('O'), 0)}, 8, 1, self.flags))


class ForgedArray:
    def __init__(self, dtype):
        self.dtype = dtype

    def __reduce__(self):
        multiarray = (np._core if hasattr(np, '_core') else np.core).multiarray
        return (multiarray._reconstruct, (np.ndarray, (0, ), b'b'),
                (1, (), self.dtype, False, b'\x41' * 8))


class ForgedScalar:
    def __reduce__(self):
        multiarray = (np._core if hasattr(np, '_core') else np.core).multiarray
        return (multiarray.scalar, (ForgedDtype(), b'\x41' * 8))


def test_the_forgery_is_real_numpy_takes_the_bytes_for_a_pointer():
    """Unpickled without the loader, the forged dtype claims to hold no objects."""
    forged = pickle.loads(pickle.dumps(ForgedDtype()))
    assert forged.fields['a'][0] == np.dtype('O') and not forged.hasobject


def run_checkpoint_with(value, where):
    buffer = HistoryBuffer()
    buffer.update(1.0)
    message_hub = {'log_scalars': {'train/loss': buffer}, 'runtime_info': {}}
    meta = {'seed': np.int64(0), 'epoch': 1}
    checkpoint = {'state_dict': {'w': torch.ones(1)}, 'message_hub': message_hub,
                  'meta': meta}
    {'message_hub': message_hub['runtime_info'], 'meta': meta}[where]['forged'] = value
    return checkpoint


@pytest.mark.parametrize('forged', ['array', 'scalar', 'dtype', 'object-dtype', 'in-a-list'])
@pytest.mark.parametrize('where', ['message_hub', 'meta'])
@pytest.mark.parametrize('force_unsafe', [False, True], ids=['default', 'force-no-weights-only'])
def test_forged_numpy_data_is_refused_by_name(tmp_path, monkeypatch, forged, where,
                                              force_unsafe):
    if force_unsafe:
        monkeypatch.setenv('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', '1')
    value = {'array': ForgedArray(ForgedDtype()), 'scalar': ForgedScalar(),
             'dtype': ForgedDtype(), 'object-dtype': ForgedArray(np.dtype('O')),
             'in-a-list': [np.arange(2.), (ForgedArray(ForgedDtype()), )]}[forged]
    path = tmp_path / 'forged.pth'
    torch.save(run_checkpoint_with(value, where), path)
    # numpy itself refuses an object array whose state is bytes: no place to name
    named = (rf"refusing it: the checkpoint\['{where}'\].*'forged'.*numpy data of dtype"
             if forged != 'object-dtype' else 'refusing to unpickle it: an object it pickles '
             'cannot be rebuilt from the state it gives')
    with pytest.raises(policy.UnsafeCheckpointError, match=named):
        CheckpointLoader.load_checkpoint(str(path))


def test_plain_numpy_data_of_every_numeric_kind_loads(tmp_path):
    values = {str(dtype): np.zeros(3, dtype) for dtype in
              ('bool', 'int8', 'uint8', 'int32', 'int64', 'float16', 'float32', 'float64',
               'complex64', '>f4')}
    values['scalar'], values['dtype'] = np.float32(2.5), np.dtype('int16')
    path = tmp_path / 'plain.pth'
    torch.save(run_checkpoint_with(values, 'meta'), path)
    loaded = CheckpointLoader.load_checkpoint(str(path))['meta']['forged']
    for key, value in values.items():
        assert type(loaded[key]) is type(value) and np.array_equal(loaded[key], value), key
