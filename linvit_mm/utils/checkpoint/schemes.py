"""A safe loader for every scheme of mmengine's ``CheckpointLoader``, and the installer that
registers them (refusing by name a scheme another package registered)."""
import io
import os
import os.path as osp
import sys
import zipfile
from tempfile import TemporaryDirectory
from urllib.parse import urlparse

import torch

from .loading import _load_safely, load_checkpoint_file
from .restoring import UnsafeCheckpointError

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
