"""Evaluate a checkpoint with an mmpretrain, mmdet or mmseg config.

The command line of the upstream OpenMMLab tools; the config's ``default_scope`` decides
what a scope-specific option means, as each upstream ``tools/test.py`` defines it::

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--out PATH]
        [--out-item {pred,metrics}] [--show-dir DIR] [--show] [--amp] [--no-pin-memory]
        [--tta] [--no-strict-load] [--cfg-options k=v ...] [--launcher pytorch]

A CHECKPOINT that does not fit a LinearViT model of the config (other operators, stage, head
or tensors) is refused before anything loads (``linvit_mm.engine.strict_load``;
``--no-strict-load`` loads what fits, with a warning; docs/user_guides/loading.md). On a
machine without CUDA, where the user set no thread count, ``default_hooks.cpu_threads``
(``CPUThreadHook``) runs fewer intra-op threads while other processes hold cores.

``--out``

* mmpretrain: a file. ``--out-item pred`` (the default): the predictions, pickled
  (``.pkl``); ``--out-item metrics``: the metrics, in the format its extension names
  (``.json``, ``.yaml``/``.yml`` or ``.pkl``);
* mmdet: the predictions, pickled (``.pkl``), masks RLE-encoded (mmdet's ``DumpDetResults``);
* mmseg: a directory: the evaluator (its ``output_dir``) writes each image's predicted
  segmentation map there as a PNG, and the metrics are computed as usual.

``--amp`` runs the test loop under bf16 autocast (fp16 on GPUs without bf16, or with
``--amp-dtype fp16``);
``--no-pin-memory`` turns ``pin_memory`` off in the test dataloader.
"""
# Declared before the first import: linvit_mm, imported first, then chooses this process's
# CPU threading before torch loads (see linvit_mm/cpu_threads.py; the user's variables win).
LINVIT_MM_TOOL = True
import linvit_mm  # noqa: E402,F401  isort: skip
import argparse
import os.path as osp

import mmengine
import torch
from mmengine.config import Config, ConfigDict, DictAction
from mmengine.dist import is_main_process
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

import linvit_mm.engine  # noqa: F401
from linvit_mm.engine.launch import (amp_dtype, configure_device, default_work_dir,
                                     finalize_distributed, set_local_rank)
from linvit_mm.engine.optim_wrapper import cpu_has_native_bf16

PICKLE_SUFFIXES = ('.pkl', '.pickle')
# what mmengine.dump writes, by extension
METRIC_SUFFIXES = ('.json', '.yaml', '.yml') + PICKLE_SUFFIXES


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Test (and evaluate) a model')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--work-dir', help='the dir to save evaluation logs')
    parser.add_argument('--out',
                        help='mmpretrain / mmdet: the file the predictions (or, with '
                        '--out-item metrics, the metrics) are written to; mmseg: the directory '
                        'the predicted segmentation maps are written to')
    parser.add_argument('--out-item', choices=['pred', 'metrics'],
                        help='mmpretrain: what --out holds, the predictions (default) or the '
                        'metrics')
    parser.add_argument('--amp', action='store_true',
                        help='test under autocast: bf16 (fp16 on GPUs without bf16)')
    parser.add_argument('--amp-dtype', choices=['bf16', 'fp16'],
                        help='with --amp on CUDA: this autocast dtype instead')
    parser.add_argument('--no-pin-memory', action='store_true',
                        help='disable pin_memory in the test dataloader')
    parser.add_argument('--show-dir',
                        help='write visualised predictions (boxes, masks, segmentation maps, '
                        'labels) as images into this directory, relative to the work dir '
                        'of the run unless absolute')
    parser.add_argument('--show', action='store_true', help='show predictions in a window')
    parser.add_argument('--interval', type=int, default=1, help='visualise every N-th sample')
    parser.add_argument('--wait-time', type=float, default=2, help='seconds per shown image')
    parser.add_argument('--tta', action='store_true', help='test-time augmentation')
    parser.add_argument('--no-strict-load', action='store_true',
                        help='load a checkpoint that does not fit the model (other operators, '
                        'missing, extra or resized tensors) as far as it fits, with a warning, '
                        'instead of refusing it (the config key strict_load = False)')
    parser.add_argument('--allow-non-finite', action='store_true',
                        help='test a checkpoint whose weights hold NaN or Inf (refused by '
                        'default: such a model scores 0 without an error)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value (xxx=[a,b] for lists)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if args.amp_dtype is not None and not args.amp:
        parser.error('--amp-dtype chooses the dtype of --amp: give --amp too')
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
    if args.no_strict_load:
        cfg.strict_load = False

    if args.show or args.show_dir:
        enable_visualization(cfg, args)

    if args.tta:
        if 'tta_model' not in cfg or 'tta_pipeline' not in cfg:
            raise ValueError('--tta needs `tta_model` and `tta_pipeline` in the config')
        cfg.tta_model.module = cfg.model
        cfg.model = cfg.tta_model
        cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline

    if args.amp:
        # mmengine's test loop autocasts when fp16 is set, to torch's autocast dtype of the
        # device: set to bf16 where it is the choice (a CPU autocasts to bf16 only)
        dtype = amp_dtype(args.amp_dtype)
        if torch.cuda.is_available():
            torch.set_autocast_dtype('cuda', dtype)
        cfg.test_cfg = ConfigDict(cfg.get('test_cfg') or {})
        cfg.test_cfg.fp16 = True
    if args.no_pin_memory and cfg.get('test_dataloader') is not None:
        cfg.test_dataloader.pin_memory = False
    return cfg


def output_kind(cfg, args):
    """What ``--out`` / ``--out-item`` ask of this config's scope, checked before anything
    runs: ``None``, ``'predictions'``, ``'det_predictions'``, ``'metrics'`` or
    ``'seg_maps'``."""
    scope = cfg.get('default_scope')
    if args.out is None:
        if args.out_item is not None:
            raise ValueError('--out-item needs --out, the file to write the '
                             f'{"metrics" if args.out_item == "metrics" else "predictions"} to')
        return None
    if args.out_item is not None and scope != 'mmpretrain':
        meaning = ('is the directory for the predicted maps' if scope == 'mmseg' else
                   'dumps the predictions')
        raise ValueError(f'--out-item is an option of mmpretrain configs; this config is '
                         f'{scope!r}, where --out {meaning}: leave --out-item out')
    if scope == 'mmseg':
        if args.out.endswith(PICKLE_SUFFIXES) or osp.isfile(args.out):
            raise ValueError(f'--out {args.out}: for mmseg configs --out is a directory, where '
                             f'the predicted segmentation maps are written as PNG files (mmseg '
                             f'1.x); give a directory path')
        return 'seg_maps'
    if args.out_item == 'metrics':
        if not args.out.endswith(METRIC_SUFFIXES):
            raise ValueError(f'--out {args.out} --out-item metrics: the metrics are written in '
                             f'the format of the extension; use one of '
                             f'{", ".join(METRIC_SUFFIXES)}')
        return 'metrics'
    if not args.out.endswith(PICKLE_SUFFIXES):
        raise ValueError(f'--out {args.out}: the predictions are pickled; use a .pkl file'
                         + (' (or --out-item metrics for the metrics)'
                            if scope == 'mmpretrain' else ''))
    return 'det_predictions' if scope == 'mmdet' else 'predictions'


def write_segmentation_maps(cfg, out_dir):
    """mmseg's ``--out``: the evaluator writes the predicted maps into ``out_dir``."""
    evaluators = cfg.test_evaluator
    for evaluator in evaluators if isinstance(evaluators, (list, tuple)) else [evaluators]:
        evaluator['output_dir'] = out_dir
        evaluator['keep_results'] = True


def prediction_dumper(kind, out_file):
    from mmengine.evaluator import DumpResults
    if kind == 'det_predictions':
        from mmdet.evaluation import DumpDetResults
        return DumpDetResults(out_file_path=out_file)
    return DumpResults(out_file_path=out_file)


def main(argv=None):
    args = parse_args(argv)
    cfg = merge_args(Config.fromfile(args.config), args)
    out_kind = output_kind(cfg, args)
    if out_kind == 'seg_maps':
        write_segmentation_maps(cfg, args.out)
    notes = configure_device(cfg, args.launcher)
    if args.amp and not torch.cuda.is_available():
        notes.append('--amp on a CPU: bf16 autocast' + (
            '; this CPU has no native bf16 arithmetic, so it is emulated and slower than fp32'
            if cpu_has_native_bf16() is False else ''))
    try:
        runner = Runner.from_cfg(cfg) if 'runner_type' not in cfg else RUNNERS.build(cfg)
        for note in notes:
            runner.logger.info(note)
        # Before the weights are initialised: a checkpoint that does not fit is refused first.
        linvit_mm.engine.strict_load.check_runner_checkpoint(
            runner, allow_non_finite=args.allow_non_finite)
        if out_kind in ('predictions', 'det_predictions'):
            runner.test_evaluator.metrics.append(prediction_dumper(out_kind, args.out))
        metrics = runner.test()
        if out_kind == 'metrics' and is_main_process():
            mmengine.dump(metrics, args.out)
            runner.logger.info(f'metrics written to {args.out}')
    finally:
        finalize_distributed()
    return metrics


if __name__ == '__main__':
    main()
