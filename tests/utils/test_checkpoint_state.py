"""A file the safe loader accepts cannot change the process: allowed objects get instance
data only, and a genuine run checkpoint still loads and resumes."""
import argparse
import io

import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer, MessageHub
from mmengine.runner import load_checkpoint as mmengine_load_checkpoint
from mmengine.runner.checkpoint import CheckpointLoader

import linvit_mm  # noqa: F401  (installs the checkpoint policy)
from linvit_mm.transfer import load_softmax_checkpoint
from linvit_mm.utils import checkpoint as policy
from linvit_mm.utils.checkpoint.restoring import _run_checkpoint_globals


def genuine_state(**changes):
    state = {'max_length': 10, '_log_history': np.array([1., 3.]),
             '_count_history': np.array([1, 1]),
             'statistics_methods': {name: getattr(HistoryBuffer, name)
                                    for name in ('min', 'max', 'current', 'mean')}}
    state.update(changes)
    return state


def pickled_buffer(state):
    """A real HistoryBuffer that pickles ``state`` (or, with None, no state at all): the file
    names HistoryBuffer and, in its state, only allow-listed types."""
    buffer = HistoryBuffer()
    buffer.__getstate__ = lambda: state
    return buffer


CRAFTED = {
    # mmengine's __setstate__ writes the pickled table into the class: every buffer's
    # statistics('mean') would then compute the max
    'mean_computes_max': (genuine_state(statistics_methods={'mean': HistoryBuffer.max}),
                          "maps 'mean' to HistoryBuffer.max"),
    'table_adds_a_name': (genuine_state(statistics_methods={'average': HistoryBuffer.max}),
                          "maps 'average'"),
    'instance_table': (genuine_state(_statistics_methods={'mean': HistoryBuffer.max}),
                       "'_statistics_methods' not instance data"),
    'method_shadowed': (genuine_state(update=HistoryBuffer.max), "'update' not instance data"),
    'slotstate': ((genuine_state(), {'max_length': 3}), 'state is a tuple'),
    'no_state': (None, 'without the state a genuine one has'),
    'lengths_differ': (genuine_state(_count_history=np.array([1])),
                       '2 logged values and 1 counts'),
    'history_not_an_array': (genuine_state(_log_history=[1., 3.]),
                             '_log_history is not a 1-d numeric numpy array'),
    'max_length_not_int': (genuine_state(max_length=2.5), 'max_length=2.5'),
}


def read_through(path_kind, path):
    if path_kind == 'load_checkpoint_file':
        return policy.load_checkpoint_file(path)
    if path_kind == 'CheckpointLoader':
        return CheckpointLoader.load_checkpoint(str(path))
    if path_kind == 'mmengine.runner.load_checkpoint':
        return mmengine_load_checkpoint(torch.nn.Linear(1, 1), str(path))
    return load_softmax_checkpoint(str(path))


PATHS = ['load_checkpoint_file', 'CheckpointLoader', 'mmengine.runner.load_checkpoint',
         'load_softmax_checkpoint']


@pytest.fixture
def statistics_table():
    """The class-level table as it was; restored after the test whatever happened."""
    HistoryBuffer()  # the defaults are in
    saved = dict(HistoryBuffer._statistics_methods)
    yield saved
    HistoryBuffer._statistics_methods.clear()
    HistoryBuffer._statistics_methods.update(saved)


def save_run_checkpoint(path, buffer):
    torch.save({'state_dict': {'weight': torch.ones(1, 1), 'bias': torch.zeros(1)},
                'message_hub': {'log_scalars': {'train/loss': buffer}, 'runtime_info': {},
                                'resumed_keys': {'train/loss': True}}}, path)


def test_crafted_buffer_changes_the_process_through_mmengines_setstate(tmp_path,
                                                                       statistics_table):
    """The crafted file is a real attack: allowing HistoryBuffer as such lets it rewrite the
    statistics of every buffer."""
    path = tmp_path / 'crafted.pth'
    save_run_checkpoint(path, pickled_buffer(CRAFTED['mean_computes_max'][0]))
    numpy_data = [entry for entry in _run_checkpoint_globals()
                  if not isinstance(entry, tuple) or 'numpy' in entry[1]]
    with torch.serialization.safe_globals([HistoryBuffer, (getattr, 'builtins.getattr'),
                                           *numpy_data]):
        torch.load(path, weights_only=True)
    assert HistoryBuffer([1., 3.], [1, 1]).statistics('mean') == 3.


@pytest.mark.parametrize('path_kind', PATHS)
@pytest.mark.parametrize('attack', list(CRAFTED))
def test_crafted_buffer_is_refused_and_the_process_unchanged(tmp_path, statistics_table,
                                                             attack, path_kind):
    state, reason = CRAFTED[attack]
    path = tmp_path / f'{attack}.pth'
    save_run_checkpoint(path, pickled_buffer(state))
    error = ValueError if path_kind == 'load_softmax_checkpoint' else policy.UnsafeCheckpointError
    with pytest.raises(error, match=rf'{path.name}.*refusing.*{reason}'):
        read_through(path_kind, path)
    assert HistoryBuffer._statistics_methods == statistics_table
    assert all(HistoryBuffer._statistics_methods[name] is method
               for name, method in statistics_table.items())
    assert HistoryBuffer([1., 3.], [1, 1]).statistics('mean') == 2.


def test_genuine_message_hub_checkpoint_loads_and_resumes(tmp_path, statistics_table):
    hub = MessageHub('run_checkpoint_state')
    for loss in (1., 2., 6.):
        hub.update_scalar('train/loss', loss)
    hub.update_info('iter', 3)
    path = tmp_path / 'iter_3.pth'
    torch.save({'state_dict': {'w': torch.ones(1)}, 'message_hub': hub.state_dict(),
                'meta': {'seed': np.int64(3)}}, path)

    resumed = MessageHub('run_checkpoint_state_resumed')
    resumed.load_state_dict(CheckpointLoader.load_checkpoint(str(path))['message_hub'])
    loss = resumed.get_scalar('train/loss')
    assert type(loss) is HistoryBuffer
    assert sorted(vars(loss)) == ['_count_history', '_log_history', 'max_length']
    assert loss.statistics('mean') == pytest.approx(3.) and loss.current() == 6.
    assert resumed.get_info('iter') == 3
    resumed.update_scalar('train/loss', 11.)
    assert loss.mean(window_size=2) == pytest.approx(8.5)
    # ... and what the resumed run saves loads again
    torch.save({'message_hub': resumed.state_dict()}, tmp_path / 'iter_4.pth')
    again = policy.load_checkpoint_file(tmp_path / 'iter_4.pth')
    assert again['message_hub']['log_scalars']['train/loss'].max() == 11.
    assert HistoryBuffer._statistics_methods == statistics_table


def test_buffer_statistics_work_in_a_process_that_made_no_buffer(tmp_path, statistics_table):
    """A loaded buffer has the default statistics, as one made by HistoryBuffer() has."""
    buffer = HistoryBuffer([2., 4.], [1, 1])
    save_run_checkpoint(tmp_path / 'run.pth', buffer)
    HistoryBuffer._statistics_methods.clear()
    loaded = policy.load_checkpoint_file(tmp_path / 'run.pth')
    assert loaded['message_hub']['log_scalars']['train/loss'].statistics('mean') == 3.


def pickled_namespace(state):
    namespace = argparse.Namespace(lr=0.1)
    namespace.__getstate__ = lambda: state
    return namespace


@pytest.mark.parametrize('state, reason', [
    ({'lr': 0.1, '__class__': 'x'}, "attribute '__class__'"),
    (({'lr': 0.1}, {'seed': 0}), 'state is a tuple'),
    (None, 'argparse.Namespace without the state'),
], ids=['dunder_attribute', 'slotstate', 'no_state'])
def test_namespace_takes_plain_attributes_only(tmp_path, state, reason):
    torch.save({'args': pickled_namespace(state)}, tmp_path / 'args.pth')
    with pytest.raises(policy.UnsafeCheckpointError, match=reason):
        policy.load_checkpoint_file(tmp_path / 'args.pth')


def test_stand_ins_work_only_inside_the_loader(tmp_path):
    """The allow-list is process-wide while a load runs; another thread's torch.load that sees
    it still cannot restore a HistoryBuffer or call the restricted getattr."""
    buffer = io.BytesIO()
    torch.save({'b': HistoryBuffer([1.], [1])}, buffer)
    with torch.serialization.safe_globals(list(_run_checkpoint_globals())):
        with pytest.raises(Exception, match='restored only inside'):
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def write_pickle(path, pkl):
    """A ``torch.save`` archive whose pickle is ``pkl``."""
    import zipfile
    template = io.BytesIO()
    torch.save({}, template)
    with zipfile.ZipFile(template) as src, zipfile.ZipFile(path, 'w') as dst:
        for name in src.namelist():
            dst.writestr(name, pkl if name.endswith('/data.pkl') else src.read(name))


HISTORY_BUFFER = b'cmmengine.logging.history_buffer\nHistoryBuffer\n'


@pytest.mark.parametrize('pkl, reason', [
    # HistoryBuffer(...) called as a constructor instead of restored from its state
    (b'\x80\x02' + HISTORY_BUFFER + b')R.', r'refusing to call .*HistoryBuffer\(\.\.\.\)'),
    (b'\x80\x02' + HISTORY_BUFFER + b'K\x01\x85\x81.', 'created with arguments'),
    # getattr reaches the four statistics only, not other public attributes
    (b'\x80\x02c__builtin__\ngetattr\n' + HISTORY_BUFFER + b'X\x06\x00\x00\x00update\x86R.',
     r"refusing getattr\(HistoryBuffer, 'update'\)"),
], ids=['called', 'newobj_with_arguments', 'getattr_update'])
def test_history_buffer_is_only_restored_from_state(tmp_path, statistics_table, pkl, reason):
    write_pickle(tmp_path / 'crafted.pth', pkl)
    with pytest.raises(policy.UnsafeCheckpointError, match=reason):
        policy.load_checkpoint_file(tmp_path / 'crafted.pth')
    assert HistoryBuffer._statistics_methods == statistics_table
