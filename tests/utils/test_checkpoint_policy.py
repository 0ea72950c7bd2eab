"""Weight files load weights-only; mmengine run checkpoints load too; code never runs."""
import pickle

import pytest
import torch
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
    from collections import OrderedDict

    from mmengine.logging import HistoryBuffer
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
    import numpy as np
    from mmengine.logging import HistoryBuffer
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
