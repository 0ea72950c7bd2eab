#!/usr/bin/env python
"""Convert the LinearViT model of a config (and checkpoint) to a timm ``VisionTransformer``.

    python tools/model_converters/linvit_to_timm.py CONFIG [CHECKPOINT] OUT [--backbone]
        [--dynamic-img-size] [--cfg-options k=v ...]

The model (an mmpretrain classifier, or with ``--backbone`` / for mmdet and mmseg configs its
LinearViT backbone) becomes a timm ``VisionTransformer`` whose attention layers are the same
linvit_mm operators (``linvit_mm.deployment.to_timm``); every tensor is copied, and the tool
runs both models on the same random images and prints the largest difference. OUT holds
``{'state_dict': timm names, 'timm_spec': what builds the model}``; load it with::

    from linvit_mm.deployment import load_timm_vit
    model = load_timm_vit('relu-small_timm.pth')     # a timm VisionTransformer, eval mode

``--dynamic-img-size``: a timm model for any image size (``dynamic_img_size=True``), where
timm resamples the position embedding as the LinearViT does (refused otherwise, saying why).

The file loads with ``load_timm_vit`` only: its weights carry a key
(``linvit_mm_operator``) that a plain ``timm.create_model('vit_*')`` lacks, so a strict
load into timm's own Softmax ViT, which would compute another function, fails. A model timm
cannot express (a hybrid of operators, a neck, ...) is refused with one line on stderr and
exit status 2, nothing written.
"""
import argparse
import os.path as osp
import sys


def parse_args(argv=None):
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser(
        description='Convert a LinearViT model to a timm VisionTransformer')
    parser.add_argument('config', help='config file path')
    parser.add_argument('paths', nargs='+', metavar='[CHECKPOINT] OUT',
                        help='the checkpoint (default: random init) and the file to write')
    parser.add_argument('--backbone', action='store_true',
                        help='mmpretrain configs: convert the backbone, not the classifier')
    parser.add_argument('--dynamic-img-size', action='store_true',
                        help='a timm model that takes any image size')
    parser.add_argument('--tolerance', type=float, default=1e-4,
                        help='largest allowed |timm - LinearViT| relative to the largest output')
    parser.add_argument('--allow-non-finite', action='store_true',
                        help='go on with NaN / Inf weights in the checkpoint (refused by '
                        'default; the check against eager still fails on a NaN error)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value (xxx=[a,b] for lists)')
    args = parser.parse_args(argv)
    if len(args.paths) > 2:
        parser.error(f'takes [CHECKPOINT] OUT, got {args.paths}')
    args.checkpoint, args.out = (None, *args.paths) if len(args.paths) == 1 else args.paths
    if args.checkpoint is not None and not osp.isfile(args.checkpoint):
        parser.error(f'checkpoint {args.checkpoint!r} does not exist')
    if args.checkpoint is not None and osp.abspath(args.checkpoint) == osp.abspath(args.out):
        parser.error('OUT would overwrite the checkpoint')
    if not osp.isdir(osp.dirname(osp.abspath(args.out))):
        parser.error(f'the directory of OUT {args.out!r} does not exist')
    return args


def main(argv=None):
    args = parse_args(argv)
    import torch
    from mmengine.config import Config

    from linvit_mm.deployment import (ConversionError, ImageModel, check_inputs,
                                      compare_with_eager, linvit_to_timm, save_timm_vit)
    from linvit_mm.deployment.export import build_model, within_tolerance
    cfg = Config.fromfile(args.config)
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    model = build_model(cfg, args.checkpoint, backbone=args.backbone,
                        allow_non_finite=args.allow_non_finite)
    attn_cfg = cfg.model.get('backbone', cfg.model).get('attn_cfg')
    try:
        timm_model, spec = linvit_to_timm(model, attn_cfg=attn_cfg,
                                          dynamic_img_size=args.dynamic_img_size)
    except ConversionError as err:
        print(f'linvit_to_timm: error: not convertible to a timm VisionTransformer: {err}',
              file=sys.stderr)
        return 2
    source = ImageModel(model)
    print(f'Converted the {"classifier" if source.is_classifier else "backbone"} '
          f'({spec["attn_type"]}) to timm VisionTransformer(global_pool='
          f'{spec["vit"]["global_pool"]!r}, num_classes={spec["vit"]["num_classes"]}, '
          f'dynamic_img_size={args.dynamic_img_size})')

    def run_timm(images):
        with torch.no_grad():
            return timm_model(images)

    shape = tuple(source.backbone.img_size)
    comparisons = compare_with_eager(source, run_timm, check_inputs(source, shape))
    if args.dynamic_img_size:
        patch = source.patch_size
        other = (shape[0] + patch, shape[1] + 2 * patch)
        comparisons += compare_with_eager(source, run_timm, check_inputs(source, other))
    if not within_tolerance(comparisons, args.tolerance, 'the LinearViT',
                            'The timm model differs'):
        return 1
    save_timm_vit(timm_model, spec, args.out)
    print(f'Max error {max(c.max_abs_error for c in comparisons):.3g}; wrote {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
