"""Run checkpoints load in full only where trusted; external weight files are weights-only."""
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


@pytest.fixture(autouse=True)
def fresh_policy(monkeypatch):
    monkeypatch.setattr(policy, '_trusted_files', set())
    monkeypatch.setattr(policy, '_trusted_dirs', set())
    policy.install_checkpoint_policy()


def test_plain_weights_load_weights_only(tmp_path):
    torch.save({'model': {'w': torch.ones(2)}}, tmp_path / 'deit.pth')
    ckpt = CheckpointLoader.load_checkpoint(str(tmp_path / 'deit.pth'))
    assert torch.equal(ckpt['model']['w'], torch.ones(2))


def test_code_carrying_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / 'pwned'
    torch.save({'state_dict': {}, 'evil': Payload(marker)}, tmp_path / 'evil.pth')
    with pytest.raises(policy.UntrustedCheckpointError, match='weights_only=True'):
        CheckpointLoader.load_checkpoint(str(tmp_path / 'evil.pth'))
    assert not marker.exists()
    assert isinstance(policy.UntrustedCheckpointError('x'), pickle.UnpicklingError)


def test_run_checkpoints_load_in_full_where_trusted(tmp_path):
    from mmengine.logging import HistoryBuffer
    run_dir = tmp_path / 'work_dir'
    run_dir.mkdir()
    ckpt_path = run_dir / 'iter_2.pth'
    torch.save({'state_dict': {}, 'message_hub': HistoryBuffer()}, ckpt_path)
    with pytest.raises(policy.UntrustedCheckpointError):
        CheckpointLoader.load_checkpoint(str(ckpt_path))
    policy.trust_run_dir(run_dir)
    assert isinstance(CheckpointLoader.load_checkpoint(str(ckpt_path))['message_hub'],
                      HistoryBuffer)


def test_single_trusted_file(tmp_path):
    from mmengine.logging import HistoryBuffer
    path = tmp_path / 'resume_me.pth'
    torch.save({'message_hub': HistoryBuffer()}, path)
    policy.trust_checkpoint(path)
    assert policy.is_trusted(path)
    assert not policy.is_trusted(tmp_path / 'other.pth')
    CheckpointLoader.load_checkpoint(str(path))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match='nope.pth'):
        CheckpointLoader.load_checkpoint(str(tmp_path / 'nope.pth'))
