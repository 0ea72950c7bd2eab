"""Evaluate a checkpoint with an mmpretrain, mmdet or mmseg config.

Same command line as the upstream OpenMMLab tools::

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--out results.pkl]
        [--show-dir DIR] [--show] [--cfg-options k=v ...] [--launcher pytorch]
"""
import argparse
import os.path as osp

from mmengine.config import Config, ConfigDict, DictAction
from mmengine.evaluator import DumpResults
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

import linvit_mm.engine  # noqa: F401
from linvit_mm.engine.launch import (configure_device, default_work_dir, finalize_distributed,
                                     set_local_rank)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Test (and evaluate) a model')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--work-dir', help='the dir to save evaluation logs')
    parser.add_argument('--out', help='dump predictions to this pickle file (.pkl)')
    parser.add_argument('--show-dir',
                        help='write visualised predictions (boxes, masks, segmentation maps, '
                        'labels) as images into this directory, relative to the work dir '
                        'of the run unless absolute')
    parser.add_argument('--show', action='store_true', help='show predictions in a window')
    parser.add_argument('--interval', type=int, default=1, help='visualise every N-th sample')
    parser.add_argument('--wait-time', type=float, default=2, help='seconds per shown image')
    parser.add_argument('--tta', action='store_true', help='test-time augmentation')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value (xxx=[a,b] for lists)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    set_local_rank(args.local_rank)
    return args


def enable_visualization(cfg, args):
    """Switch on the task's visualisation hook the way each upstream test.py does."""
    hook = cfg.get('default_hooks', {}).get('visualization')
    if hook is None:
        raise ValueError('--show/--show-dir need a `visualization` entry in default_hooks')
    hook_type = hook['type'].split('.')[-1]
    if hook_type == 'VisualizationHook':  # mmpretrain
        hook.update(enable=True, show=args.show, interval=args.interval,
                    wait_time=args.wait_time, out_dir=args.show_dir)
    elif hook_type == 'DetVisualizationHook':  # mmdet
        hook.update(draw=True, show=args.show, interval=args.interval,
                    wait_time=args.wait_time, test_out_dir=args.show_dir)
    elif hook_type == 'SegVisualizationHook':  # mmseg
        hook.update(draw=True, show=args.show, interval=args.interval,
                    wait_time=args.wait_time)
        if args.show_dir:
            cfg.visualizer['save_dir'] = args.show_dir
    else:
        raise ValueError(f'do not know how to switch on visualisation hook {hook_type}')


def merge_args(cfg, args):
    # --cfg-options first, so that explicit flags (--no-validate, --amp, ...) win.
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    cfg.launcher = args.launcher
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = default_work_dir(args.config)
    cfg.load_from = args.checkpoint

    if args.show or args.show_dir:
        enable_visualization(cfg, args)

    if args.tta:
        if 'tta_model' not in cfg or 'tta_pipeline' not in cfg:
            raise ValueError('--tta needs `tta_model` and `tta_pipeline` in the config')
        cfg.tta_model.module = cfg.model
        cfg.model = cfg.tta_model
        cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline
    return cfg


def main(argv=None):
    args = parse_args(argv)
    if args.out is not None and not args.out.endswith(('.pkl', '.pickle')):
        raise ValueError('--out must be a .pkl file')
    cfg = merge_args(Config.fromfile(args.config), args)
    notes = configure_device(cfg, args.launcher)
    try:
        runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
        for note in notes:
            runner.logger.info(note)
        if args.out is not None:
            runner.test_evaluator.metrics.append(DumpResults(out_file_path=args.out))
        metrics = runner.test()
    finally:
        finalize_distributed()
    return metrics


if __name__ == '__main__':
    main()
