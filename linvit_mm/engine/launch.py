"""What ``tools/train.py`` and ``tools/test.py`` do around mmengine's Runner.

The tools keep the upstream CLI; this module holds the pieces they share:
distributed runs on machines without CUDA (gloo), ``--amp`` on CPU (bf16
autocast) and, for training, the safeguards every run gets (a non-finite loss
stops it before a checkpoint is written; checkpoints are written atomically).
Reading checkpoints safely needs nothing here (importing ``linvit_mm`` installs the safe
loader of ``linvit_mm.utils.checkpoint``); whether a checkpoint fits the model is
checked by ``linvit_mm.engine.strict_load``, which the tools call once the Runner is built.
"""
import os
import re
import os.path as osp

import torch
import torch.distributed as dist

# The training safeguards (``add_training_safeguards``): the ``default_hooks`` entry of the
# finite-loss check and the file backend of atomic checkpoint writes.
FINITE_LOSS_HOOK_KEY = 'check_loss'
FINITE_LOSS_HOOK = dict(type='FiniteLossHook')
ATOMIC_CHECKPOINTS = dict(backend='atomic_local')
# The record of the model's LinearViTs in every checkpoint, which strict loading compares.
RECORD_HOOK_KEY = 'record_model'
RECORD_HOOK = dict(type='ModelRecordHook')
RECORD_HOOK_TYPES = ('ModelRecordHook', 'StagedRecordHook')
# Fewer intra-op threads while other processes hold cores (linvit_mm.cpu_threads).
CPU_THREAD_HOOK_KEY = 'cpu_threads'
CPU_THREAD_HOOK = dict(type='CPUThreadHook')

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
    passes the local rank, which CPU modules reject); for a ``FlexibleRunner``, its
    FSDP strategy's wrapper on ``device_id='cpu'`` (DDP's without ``device_ids``); and
    :func:`add_cpu_thread_hook`.
    """
    notes = []
    if torch.cuda.is_available():
        return notes
    notes.extend(add_cpu_thread_hook(cfg))
    if 'model' in cfg:
        before = str(cfg.model)
        _replace_sync_bn(cfg.model)
        if str(cfg.model) != before:
            notes.append('no CUDA: SyncBN replaced by BN')
    cfg.sync_bn = None
    if launcher == 'pytorch':
        if not dist.is_initialized():
            dist.init_process_group(backend='gloo')
        if cfg.get('runner_type') == 'FlexibleRunner' and cfg.get('strategy'):
            notes.append(_cpu_strategy(cfg.strategy))
        else:
            wrapper = dict(cfg.get('model_wrapper_cfg')
                           or dict(type='MMDistributedDataParallel'))
            wrapper['device_ids'] = None
            cfg.model_wrapper_cfg = wrapper
        notes.append(f'no CUDA: gloo process group, rank {dist.get_rank()} of '
                     f'{dist.get_world_size()}')
    elif launcher != 'none':
        raise RuntimeError(f'--launcher {launcher} needs CUDA; on a CPU machine use '
                           f'--launcher pytorch (torchrun, gloo)')
    return notes


def add_cpu_thread_hook(cfg, environ=None):
    """``default_hooks.cpu_threads = dict(type='CPUThreadHook')`` when the tool chose the
    intra-op thread count itself (:func:`linvit_mm.cpu_threads.threads_are_automatic`), the
    config lists no ``CPUThreadHook`` and does not switch it off
    (``default_hooks.cpu_threads = None``); returns a note for the log, or nothing."""
    from linvit_mm.cpu_threads import threads_are_automatic
    from .hooks import cpu_thread_hook  # noqa: F401  registers the hook the entry names
    if not threads_are_automatic(environ):
        return []
    if CPU_THREAD_HOOK_KEY in (cfg.get('default_hooks') or {}):  # its own entry, or None: off
        return []
    if CPU_THREAD_HOOK['type'] in _listed_hook_types(cfg):
        return []
    if cfg.get('default_hooks') is None:
        cfg.default_hooks = dict()
    cfg.default_hooks[CPU_THREAD_HOOK_KEY] = dict(CPU_THREAD_HOOK)
    return [f'added default_hooks.{CPU_THREAD_HOOK_KEY}={CPU_THREAD_HOOK}: fewer intra-op '
            f'threads while other processes hold some of the cores']


def _cpu_strategy(strategy):
    """A FlexibleRunner strategy on CPU processes: mmengine gives FSDP the local rank as
    ``device_id`` and DDP as ``device_ids``, both CUDA device indices."""
    from mmengine._strategy import DDPStrategy, FSDPStrategy
    from mmengine.registry import STRATEGIES
    strategy_type = strategy.get('type')
    strategy_cls = STRATEGIES.get(strategy_type) if isinstance(strategy_type, str) \
        else strategy_type
    kind = getattr(strategy_cls, '__name__', str(strategy_type))
    wrapper = dict(strategy.get('model_wrapper') or {})
    if isinstance(strategy_cls, type) and issubclass(strategy_cls, FSDPStrategy):
        wrapper['device_id'] = 'cpu'
    elif isinstance(strategy_cls, type) and issubclass(strategy_cls, DDPStrategy):
        wrapper['device_ids'] = None
    else:
        raise RuntimeError(f'no CUDA: the {kind} strategy has no CPU path here; FSDPStrategy, '
                           f'DDPStrategy and their subclasses run on CPU processes (gloo)')
    strategy.model_wrapper = wrapper
    return f'no CUDA: {kind} on CPU processes ({wrapper})'


AMP_DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16}


def amp_dtype(requested=None):
    """The autocast dtype of ``--amp``: ``requested`` (``'bf16'`` / ``'fp16'``), else bf16
    where the device computes in it (a CPU; a CUDA GPU that supports it, Ampere and later),
    fp16 on older GPUs. bf16 keeps fp32's range: no loss scaling, no overflow of the linear
    attention's sums. A CPU autocasts to bf16 only."""
    if requested is not None and requested not in AMP_DTYPES:
        raise ValueError(f'amp dtype {requested!r}: choose from {", ".join(AMP_DTYPES)}')
    if not torch.cuda.is_available():
        if requested == 'fp16':
            raise ValueError('--amp-dtype fp16 needs CUDA: autocast on a CPU is bf16')
        return torch.bfloat16
    if requested is not None:
        return AMP_DTYPES[requested]
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def configure_amp(cfg, requested=None):
    """``--amp``: bf16 autocast (fp16 with dynamic loss scaling on GPUs without bf16, or when
    ``requested='fp16'``); on a CPU, bf16 through ``CPUAmpOptimWrapper``. Returns a log note."""
    optim_wrapper = cfg.optim_wrapper.get('type', 'OptimWrapper')
    if optim_wrapper in ('AmpOptimWrapper', 'CPUAmpOptimWrapper'):
        return f'--amp: the config already uses {optim_wrapper}'
    if optim_wrapper != 'OptimWrapper':
        raise ValueError(f'--amp replaces OptimWrapper, but this config uses {optim_wrapper}')
    dtype = amp_dtype(requested)
    if not torch.cuda.is_available():
        cfg.optim_wrapper.type = 'CPUAmpOptimWrapper'
        return '--amp: bf16 autocast on the CPU'
    cfg.optim_wrapper.type = 'AmpOptimWrapper'
    cfg.optim_wrapper.dtype = 'bfloat16' if dtype == torch.bfloat16 else 'float16'
    if dtype == torch.float16:
        cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
    return f'--amp: {cfg.optim_wrapper.dtype} autocast on CUDA'


def _hook_type_name(hook):
    hook_type = hook.get('type') if isinstance(hook, dict) else type(hook)
    if isinstance(hook_type, str):
        return hook_type.split('.')[-1]
    return getattr(hook_type, '__name__', None)


def _listed_hook_types(cfg):
    """The type names of the hooks a config lists in ``default_hooks`` and ``custom_hooks``."""
    hooks = [*(cfg.get('default_hooks') or {}).values(), *(cfg.get('custom_hooks') or [])]
    return {_hook_type_name(h) for h in hooks if h}


def add_training_safeguards(cfg):
    """Give a training config what it lacks of the project's safeguards; returns log notes.

    - ``default_hooks.check_loss = dict(type='FiniteLossHook')`` unless a
      ``FiniteLossHook`` is already in ``default_hooks`` or ``custom_hooks``: a NaN or
      infinite loss stops the run with an error before that iteration's checkpoint.
      ``default_hooks.check_loss = None`` in a config switches it off deliberately.
    - ``backend_args=dict(backend='atomic_local')`` for the checkpoint hook when it
      sets no file backend of its own and saves to a local directory: a checkpoint is
      written to a temporary file and renamed, so a killed save never leaves a partial
      ``*.pth``.
    - ``default_hooks.record_model = dict(type='ModelRecordHook')`` unless a
      ``ModelRecordHook`` or ``StagedRecordHook`` is there: every checkpoint of a model with a
      LinearViT records its operators, sizes and stage (``meta['linvit_mm']``), which a later
      ``--resume``, ``load_from`` or ``tools/test.py`` compares with its config before loading
      (``linvit_mm.engine.strict_load``). ``default_hooks.record_model = None`` switches it off.

    A config keeps anything it sets itself. ``tools/train.py`` calls this for every
    config, the project's and users' alike; base configs cannot always carry them,
    since mmengine refuses ``default_hooks`` in a base that sits beside the upstream
    ``default_runtime.py`` in a config's ``_base_`` list (a key two sibling bases define).
    """
    notes = []
    if cfg.get('default_hooks') is None:
        cfg.default_hooks = dict()
    default_hooks = cfg.default_hooks
    listed = _listed_hook_types(cfg)
    if FINITE_LOSS_HOOK_KEY in default_hooks and default_hooks[FINITE_LOSS_HOOK_KEY] is None:
        notes.append(f'finite-loss check switched off by the config '
                     f'(default_hooks.{FINITE_LOSS_HOOK_KEY}=None)')
    elif FINITE_LOSS_HOOK['type'] not in listed:
        default_hooks[FINITE_LOSS_HOOK_KEY] = dict(FINITE_LOSS_HOOK)
        notes.append(f'added default_hooks.{FINITE_LOSS_HOOK_KEY}={FINITE_LOSS_HOOK}: a NaN or '
                     f'infinite loss stops the run before its checkpoint is written')
    if not (RECORD_HOOK_KEY in default_hooks and default_hooks[RECORD_HOOK_KEY] is None) and \
            not listed.intersection(RECORD_HOOK_TYPES):
        # Imported for its registration: a config lists the hook by name.
        from . import strict_load  # noqa: F401
        default_hooks[RECORD_HOOK_KEY] = dict(RECORD_HOOK)
        notes.append(f'added default_hooks.{RECORD_HOOK_KEY}={RECORD_HOOK}: checkpoints record '
                     f'the operators and sizes of the model\'s LinearViTs')

    if 'checkpoint' not in default_hooks:
        default_hooks['checkpoint'] = dict(type='CheckpointHook', interval=1)  # mmengine's
    checkpoint = default_hooks['checkpoint']
    if not isinstance(checkpoint, dict):  # None (no checkpoints) or a built hook
        return notes
    target = str(checkpoint.get('out_dir') or cfg.get('work_dir') or '')
    if (checkpoint.get('backend_args') is None and checkpoint.get('file_client_args') is None
            and '://' not in target):
        checkpoint['backend_args'] = dict(ATOMIC_CHECKPOINTS)
        notes.append(f'checkpoints written atomically (default_hooks.checkpoint.backend_args='
                     f'{ATOMIC_CHECKPOINTS}: a temporary file, then a rename)')
    return notes


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


_RUN_CHECKPOINT = re.compile(r'(?:epoch|iter)_(\d+)\.pth')


def repair_last_checkpoint(work_dir):
    """Make ``work_dir/last_checkpoint`` name a checkpoint that exists, before ``--resume``
    reads it; returns a note for the log, or None when there was nothing to repair.

    mmengine's ``CheckpointHook`` writes that file with a plain write after each save: a run
    killed in that moment leaves it empty (or naming a file since removed), and a later
    ``--resume`` fails with "can not be found". The checkpoints themselves are written
    atomically (``atomic_local``), so the newest ``epoch_N.pth`` / ``iter_N.pth`` of the
    work dir is whole: the file is rewritten, atomically, to name it. Without any, the stale
    file is removed and the run starts from the beginning, as a run with no checkpoint does.
    """
    from .fileio.atomic_local_backend import AtomicLocalBackend
    path = osp.join(work_dir, 'last_checkpoint')
    if not osp.isfile(path):
        return None
    with open(path) as f:
        named = f.read().strip()
    if named and osp.isfile(named):
        return None
    found = sorted((int(match.group(1)), name) for name in os.listdir(work_dir)
                   for match in [_RUN_CHECKPOINT.fullmatch(name)] if match)
    problem = (f'{path} names {named!r}, which does not exist' if named
               else f'{path} is empty (the run was stopped while writing it)')
    if not found:
        os.remove(path)
        return f'{problem}, and the work dir holds no checkpoint: removed it; the run starts ' \
               f'from the beginning'
    newest = osp.join(work_dir, found[-1][1])
    AtomicLocalBackend().put_text(newest, path)
    return f'{problem}: it now names the newest checkpoint of the work dir, {newest}'
