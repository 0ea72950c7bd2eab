"""Every scheme of mmengine's CheckpointLoader reads through the safe unpickler, also with
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1; nothing touches the network."""
import json
import os
import shutil
import sys
import types

import pytest
import torch
from mmengine.logging import HistoryBuffer
from mmengine.runner.checkpoint import CheckpointLoader

import linvit_mm  # noqa: F401  (installs the checkpoint policy)
from linvit_mm.utils import checkpoint as policy
from linvit_mm.utils.checkpoint import schemes


class RunsCode:
    """Unpickling this runs a shell command that writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f'touch {self.marker}', ))


@pytest.fixture
def files(tmp_path):
    """``{'crafted': path, 'genuine': path}``: a code-running pickle and a run checkpoint."""
    source = tmp_path / 'source'
    source.mkdir()
    marker = tmp_path / 'marker'
    torch.save({'state_dict': {'w': torch.ones(1)}, 'evil': RunsCode(marker)},
               source / 'crafted.pth')
    # mmengine's mmcls conversion keeps backbone.* keys, without the prefix
    torch.save({'state_dict': {'w': torch.full((1, ), 7.), 'backbone.w': torch.full((1, ), 7.)},
                'message_hub': {'log_scalars': {'loss': HistoryBuffer([1., 3.], [1, 1])}}},
               source / 'genuine.pth')
    return {'crafted': source / 'crafted.pth', 'genuine': source / 'genuine.pth',
            'marker': marker}


def from_url(url):
    """The stored file an ``https://example.invalid/<kind>.pth`` URL stands for."""
    return os.path.basename(url).split('.')[0]


@pytest.fixture
def offline(monkeypatch, tmp_path, files):
    """Downloads copy local files; torch hub's cache, MMENGINE_HOME and the storage back-ends
    live under tmp_path."""
    downloads = []

    def download_url_to_file(url, dst, hash_prefix=None, progress=True):
        downloads.append(url)
        shutil.copyfile(files[from_url(url)], dst)

    monkeypatch.setattr(torch.hub, 'download_url_to_file', download_url_to_file)
    monkeypatch.setattr(torch.hub, '_hub_dir', None)
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch_home'))

    home = tmp_path / 'mmengine_home'
    home.mkdir()
    shutil.copyfile(files['crafted'], home / 'crafted.pth')
    shutil.copyfile(files['genuine'], home / 'genuine.pth')
    # local files under MMENGINE_HOME, and names that map to URLs
    (home / 'open_mmlab.json').write_text(json.dumps(
        {'crafted': 'crafted.pth', 'genuine': 'genuine.pth',
         'crafted_url': 'https://example.invalid/crafted.pth',
         'genuine_url': 'https://example.invalid/genuine.pth'}))
    monkeypatch.setenv('MMENGINE_HOME', str(home))

    urls = {kind: f'https://example.invalid/{kind}.pth' for kind in ('crafted', 'genuine')}
    import mmengine.runner.checkpoint as mmengine_checkpoint
    monkeypatch.setattr(mmengine_checkpoint, 'get_torchvision_models', lambda: urls)
    monkeypatch.setattr(mmengine_checkpoint, 'get_mmcls_models', lambda: urls)

    class Storage:
        def __init__(self, *args, **kwargs):
            pass

        def get(self, filename):
            return files[from_url(filename)].read_bytes()

    import mmengine.fileio
    monkeypatch.setattr(mmengine.fileio, 'get_file_backend', lambda *a, **k: Storage())

    class Model:
        def __init__(self, path):
            self.name = f'{path}.pth'

        def download(self, dst):
            shutil.copyfile(files[from_url(self.name)], dst)

    monkeypatch.setitem(sys.modules, 'pavi', types.SimpleNamespace(
        modelcloud=types.SimpleNamespace(get=Model)))
    return downloads


# scheme: how to name the crafted / genuine file with it
SCHEMES = {
    'local': lambda files, kind: str(files[kind]),
    'http': lambda files, kind: f'http://example.invalid/{kind}.pth',
    'https': lambda files, kind: f'https://example.invalid/{kind}.pth',
    'open-mmlab_local': lambda files, kind: f'open-mmlab://{kind}',
    'openmmlab_local': lambda files, kind: f'openmmlab://{kind}',
    'open-mmlab_url': lambda files, kind: f'open-mmlab://{kind}_url',
    'torchvision': lambda files, kind: f'torchvision://{kind}',
    'modelzoo': lambda files, kind: f'modelzoo://{kind}',
    'mmcls': lambda files, kind: f'mmcls://{kind}',
    'pavi': lambda files, kind: f'pavi://models/{kind}',
    's3': lambda files, kind: f's3://bucket/{kind}.pth',
    'petrel': lambda files, kind: f'petrel://bucket/{kind}.pth',
    'cluster_s3': lambda files, kind: f'cluster:s3://bucket/{kind}.pth',
}


@pytest.mark.parametrize('scheme', list(SCHEMES))
def test_code_running_pickle_is_refused_on_every_scheme(monkeypatch, files, offline, scheme):
    monkeypatch.setenv('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', '1')
    with pytest.raises(policy.UnsafeCheckpointError, match="refusing.*'posix.system'"):
        CheckpointLoader.load_checkpoint(SCHEMES[scheme](files, 'crafted'))
    assert not files['marker'].exists()


@pytest.mark.parametrize('scheme', list(SCHEMES))
def test_run_checkpoint_loads_on_every_scheme(monkeypatch, files, offline, scheme):
    monkeypatch.setenv('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', '1')
    checkpoint = CheckpointLoader.load_checkpoint(SCHEMES[scheme](files, 'genuine'))
    assert torch.equal(checkpoint['state_dict']['w'], torch.full((1, ), 7.))
    if scheme != 'mmcls':  # mmengine's mmcls conversion keeps the state dict only
        assert checkpoint['message_hub']['log_scalars']['loss'].mean() == 2.


def test_download_goes_to_torch_hubs_cache_once(files, offline, tmp_path):
    for _ in range(2):
        CheckpointLoader.load_checkpoint('https://example.invalid/genuine.pth')
    assert offline == ['https://example.invalid/genuine.pth']
    assert (tmp_path / 'torch_home' / 'hub' / 'checkpoints' / 'genuine.pth').is_file()


def test_every_registered_scheme_is_ours():
    loaders = CheckpointLoader._schemes
    assert {'', 'http://', 'https://', 'open-mmlab://', 'openmmlab://', 'torchvision://',
            'modelzoo://', 'mmcls://', 'pavi://', r'(\S+\:)?s3://'} <= set(loaders)
    assert {prefix: loader.__module__ for prefix, loader in loaders.items()} == {
        prefix: schemes.__name__ for prefix in loaders}


def test_scheme_of_another_package_is_refused_by_name(monkeypatch, files):
    monkeypatch.setattr(CheckpointLoader, '_schemes', dict(CheckpointLoader._schemes))
    CheckpointLoader.register_scheme('mystore://', loader=lambda f, m=None: torch.load(
        files['crafted'], weights_only=False))
    policy.install_checkpoint_policy()
    with pytest.raises(policy.UnsafeCheckpointError, match="scheme 'mystore://'"):
        CheckpointLoader.load_checkpoint('mystore://crafted')
    assert not files['marker'].exists()
