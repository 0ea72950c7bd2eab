"""What ``tools/train.py`` and ``tools/test.py`` do around mmengine's Runner.

The tools keep the upstream CLI; this module holds the pieces they share:
distributed runs on machines without CUDA (gloo) and ``--amp`` on CPU (bf16
autocast). Checkpoint loading needs nothing here: importing ``linvit_mm``
installs the safe loader of ``linvit_mm.utils.checkpoint``.
"""
import os
import os.path as osp

import torch
import torch.distributed as dist

def _replace_sync_bn(node):
    """SyncBN needs CUDA (under gloo it raises); on CPU the same config runs with BN."""
    if isinstance(node, dict):
        if node.get('type') in ('SyncBN', 'MMSyncBN', 'TorchSyncBN'):
            node['type'] = 'BN'
        for value in node.values():
            _replace_sync_bn(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            _replace_sync_bn(value)


def configure_device(cfg, launcher):
    """Adjust a config for the machine it runs on; returns notes for the log.

    Without CUDA: SyncBN -> BN and, for ``--launcher pytorch``, a gloo process
    group created before the Runner (mmengine's own init calls
    ``torch.cuda.set_device``) and a DDP wrapper without ``device_ids`` (mmengine
    passes the local rank, which CPU modules reject).
    """
    notes = []
    if torch.cuda.is_available():
        return notes
    if 'model' in cfg:
        before = str(cfg.model)
        _replace_sync_bn(cfg.model)
        if str(cfg.model) != before:
            notes.append('no CUDA: SyncBN replaced by BN')
    cfg.sync_bn = None
    if launcher == 'pytorch':
        if not dist.is_initialized():
            dist.init_process_group(backend='gloo')
        wrapper = dict(cfg.get('model_wrapper_cfg') or dict(type='MMDistributedDataParallel'))
        wrapper['device_ids'] = None
        cfg.model_wrapper_cfg = wrapper
        notes.append(f'no CUDA: gloo process group, rank {dist.get_rank()} of '
                     f'{dist.get_world_size()}')
    elif launcher != 'none':
        raise RuntimeError(f'--launcher {launcher} needs CUDA; on a CPU machine use '
                           f'--launcher pytorch (torchrun, gloo)')
    return notes


def configure_amp(cfg):
    """``--amp``: fp16 with dynamic loss scaling on CUDA, bf16 autocast on CPU."""
    optim_wrapper = cfg.optim_wrapper.get('type', 'OptimWrapper')
    if optim_wrapper in ('AmpOptimWrapper', 'CPUAmpOptimWrapper'):
        return
    if optim_wrapper != 'OptimWrapper':
        raise ValueError(f'--amp replaces OptimWrapper, but this config uses {optim_wrapper}')
    if torch.cuda.is_available():
        cfg.optim_wrapper.type = 'AmpOptimWrapper'
        cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
    else:
        cfg.optim_wrapper.type = 'CPUAmpOptimWrapper'


def finalize_distributed():
    """A barrier and an explicit teardown: without them gloo sometimes aborts at exit."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def default_work_dir(config_path):
    return osp.join('./work_dirs', osp.splitext(osp.basename(config_path))[0])


def set_local_rank(local_rank):
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(local_rank)
