"""Train a model from an mmpretrain, mmdet or mmseg config (the config's default_scope decides).

Same command line as the upstream OpenMMLab tools::

    python tools/train.py CONFIG [--work-dir DIR] [--resume [auto|CKPT]]
        [--resume-lr-scale S] [--amp [--amp-dtype {bf16,fp16}]]
        [--auto-scale-lr] [--no-validate] [--no-strict-load] [--cfg-options k=v ...]
        [--launcher pytorch]

A config that lacks them gets the training safeguards of
``linvit_mm.engine.launch.add_training_safeguards`` (a non-finite loss stops the run
before its checkpoint is written; checkpoints are written atomically; checkpoints record
the model's LinearViTs); the log says so. A ``--resume`` or ``load_from`` checkpoint that does
not fit a LinearViT model is refused before anything loads (``linvit_mm.engine.strict_load``;
``--no-strict-load`` loads what fits, with a warning; docs/user_guides/loading.md). On a
machine without CUDA, where the user set no thread count, ``default_hooks.cpu_threads``
(``CPUThreadHook``) runs fewer intra-op threads while other processes hold cores
(docs/environment.md).
"""
# Declared before the first import: linvit_mm, imported first, then chooses this process's
# CPU threading before torch loads (see linvit_mm/cpu_threads.py; the user's variables win).
LINVIT_MM_TOOL = True
import linvit_mm  # noqa: E402,F401  isort: skip
import argparse
import math
import os.path as osp

from mmengine.config import Config, DictAction
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

import linvit_mm.engine  # noqa: F401  (CPUAmpOptimWrapper, FiniteLossHook, atomic_local)
from linvit_mm.engine.launch import (add_training_safeguards, configure_amp, configure_device,
                                     default_work_dir, finalize_distributed,
                                     repair_last_checkpoint, set_local_rank)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train a model')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument(
        '--resume', nargs='?', type=str, const='auto',
        help='resume from this checkpoint; without a path, from the latest checkpoint in '
        'the work dir')
    parser.add_argument('--resume-lr-scale', type=float, metavar='S',
                        help='with --resume: multiply the learning rate the run resumes with '
                        '(restored from the checkpoint, whatever the config says) by S, e.g. '
                        '0.5 after a divergence')
    parser.add_argument('--amp', action='store_true',
                        help='mixed precision: bf16 autocast (fp16 with loss scaling on GPUs '
                        'without bf16); bf16 on a CPU')
    parser.add_argument('--amp-dtype', choices=['bf16', 'fp16'],
                        help='with --amp on CUDA: this autocast dtype instead')
    parser.add_argument('--no-validate', action='store_true',
                        help='do not evaluate checkpoints during training')
    parser.add_argument('--auto-scale-lr', action='store_true',
                        help='scale the learning rate by the actual batch size')
    parser.add_argument('--no-pin-memory', action='store_true',
                        help='disable pin_memory in every dataloader')
    parser.add_argument('--no-persistent-workers', action='store_true',
                        help='disable persistent_workers in every dataloader')
    parser.add_argument('--no-strict-load', action='store_true',
                        help='load a checkpoint that does not fit the model (other operators, '
                        'missing, extra or resized tensors) as far as it fits, with a warning, '
                        'instead of refusing it (the config key strict_load = False)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value (xxx=[a,b] for lists)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    # torch.distributed.launch passes --local-rank, older launchers --local_rank.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if args.amp_dtype is not None and not args.amp:
        parser.error('--amp-dtype chooses the dtype of --amp: give --amp too')
    if args.resume_lr_scale is not None:
        if args.resume is None:
            parser.error('--resume-lr-scale scales the learning rate of a resumed run: give '
                         '--resume too')
        if not (math.isfinite(args.resume_lr_scale) and args.resume_lr_scale > 0):
            parser.error(f'--resume-lr-scale must be a finite number > 0, got '
                         f'{args.resume_lr_scale}')
    set_local_rank(args.local_rank)
    return args


def merge_args(cfg, args):
    # --cfg-options first, so that explicit flags (--no-validate, --amp, ...) win.
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    cfg.launcher = args.launcher
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = default_work_dir(args.config)

    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    if args.resume_lr_scale is not None:
        cfg.custom_hooks = list(cfg.get('custom_hooks') or []) + [
            dict(type='ResumeLRScaleHook', scale=args.resume_lr_scale)]

    if args.no_strict_load:
        cfg.strict_load = False

    if args.no_validate:
        cfg.val_cfg = None
        cfg.val_dataloader = None
        cfg.val_evaluator = None

    if args.auto_scale_lr:
        if 'auto_scale_lr' not in cfg or 'base_batch_size' not in cfg.auto_scale_lr:
            raise ValueError('--auto-scale-lr needs `auto_scale_lr = dict(base_batch_size=N)` '
                             'in the config')
        cfg.auto_scale_lr.enable = True

    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        if cfg.get(loader) is None:
            continue
        if args.no_pin_memory:
            cfg[loader]['pin_memory'] = False
        if args.no_persistent_workers:
            cfg[loader]['persistent_workers'] = False
    return cfg


def main(argv=None):
    args = parse_args(argv)
    cfg = merge_args(Config.fromfile(args.config), args)
    # Every run stops at a non-finite loss and writes its checkpoints atomically.
    notes = add_training_safeguards(cfg) + configure_device(cfg, args.launcher)
    if args.amp:  # after --cfg-options (merge_args), so the flag wins over them
        notes.append(configure_amp(cfg, args.amp_dtype))
    if cfg.get('resume') is True and cfg.get('load_from') is None:
        repaired = repair_last_checkpoint(cfg.work_dir)
        notes += [repaired] if repaired else []
    try:
        runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
        for note in notes:
            runner.logger.info(note)
        # Before the weights are initialised: a checkpoint that does not fit is refused first.
        linvit_mm.engine.strict_load.check_runner_checkpoint(runner)
        runner.train()
    finally:
        finalize_distributed()


if __name__ == '__main__':
    main()
