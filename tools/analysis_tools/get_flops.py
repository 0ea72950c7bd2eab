#!/usr/bin/env python
"""FLOPs and parameters of the model of a config, with linvit_mm's attention operators counted.

    python tools/analysis_tools/get_flops.py CONFIG [--shape H [W]] [--cfg-options k=v ...]

The command line and the output of mmpretrain's ``tools/analysis_tools/get_flops.py``: the
model with each module's parameters, FLOPs and activations, the same as a table, then
``Flops``, ``Params`` and ``Activation`` of one image of ``--shape`` (default 224 x 224).
The figures come from :func:`linvit_mm.utils.complexity.get_model_complexity_info`,
mmengine's analysis with every attention operator counted like the backbone benchmark
counts it (mmengine alone misses ``scaled_dot_product_attention`` and the operators' custom
autograd Functions, so softmax would show fewer FLOPs than relu). As in mmengine, one fused
multiply-add is one flop: the FLOPs are multiply-accumulates.

What is counted:

* mmpretrain configs: the classifier's ``extract_feat`` (backbone and neck), as upstream;
* mmdet and mmseg configs: the backbone alone (e.g. the ViT-Adapter with its ViT, not the
  FPN, heads or the sliding-window test), on the image padded to the data preprocessor's
  size divisor as the model would get it.

The model keeps its random initialisation: no checkpoint is read (FLOPs do not depend on
the weights), and building it downloads nothing.

Example::

    python tools/analysis_tools/get_flops.py \\
        configs/classification/imagenet/linvit-relu-small_fullcopy-distill_32xb128_in1k.py
    python tools/analysis_tools/get_flops.py \\
        configs/detection/mask-rcnn_linvit-adapter-relu-small_fpn_1x_coco.py --shape 800 1333
"""
import argparse

DENSE_SCOPES = ('mmdet', 'mmseg')
SUPPORTED_SCOPES = ('mmpretrain', ) + DENSE_SCOPES


def parse_args(argv=None):
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser(description='Get model flops and params')
    parser.add_argument('config', help='config file path')
    parser.add_argument('--shape', type=int, nargs='+', default=[224, 224],
                        help='input image size: H W, or one size for a square image')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value (xxx=[a,b] for lists)')
    args = parser.parse_args(argv)
    if len(args.shape) not in (1, 2) or min(args.shape) < 1:
        parser.error(f'--shape takes one or two positive sizes (H W), got {args.shape}')
    return args


def input_shape(shape):
    return (3, shape[0], shape[0]) if len(shape) == 1 else (3, *shape)


def size_divisor(cfg):
    """The divisor the config's data preprocessor pads images to (1 if it does not pad)."""
    preprocessor = cfg.model.get('data_preprocessor') or cfg.get('data_preprocessor') or {}
    return preprocessor.get('pad_size_divisor') or preprocessor.get('size_divisor') or 1


def padded(shape, divisor):
    channels, height, width = shape
    return channels, -(-height // divisor) * divisor, -(-width // divisor) * divisor


def build_analysed_model(cfg):
    """The part of the config's model that is analysed, and a line saying which part."""
    from mmengine.registry import MODELS, init_default_scope

    import linvit_mm.models  # noqa: F401  (registers LinearViT, the adapter, the operators)
    scope = cfg.get('default_scope', 'mmpretrain')
    if scope not in SUPPORTED_SCOPES:
        raise ValueError(f'default_scope {scope!r}: the tool analyses mmpretrain, mmdet and '
                         f'mmseg configs')
    init_default_scope(scope)
    model = MODELS.build(cfg.model)
    model.eval()
    if scope in DENSE_SCOPES:
        if getattr(model, 'backbone', None) is None:
            raise ValueError(f'{type(model).__name__} has no backbone to analyse')
        return model.backbone, f'!!!Only the backbone network ({type(model.backbone).__name__}) ' \
            'is counted in FLOPs analysis.'
    if not hasattr(model, 'extract_feat'):
        raise ValueError(f'FLOPs counter is currently not supported with '
                         f'{type(model).__name__} (it has no extract_feat)')
    model.forward = model.extract_feat
    parts = 'backbone and neck' if getattr(model, 'neck', None) is not None else 'backbone'
    return model, f'!!!Only the {parts} network is counted in FLOPs analysis.'


def main(argv=None):
    args = parse_args(argv)
    from mmengine.config import Config

    from linvit_mm.utils.complexity import get_model_complexity_info
    cfg = Config.fromfile(args.config)
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    model, counted = build_analysed_model(cfg)
    shape = input_shape(args.shape)
    if cfg.get('default_scope') in DENSE_SCOPES:
        shape = padded(shape, size_divisor(cfg))
    results = get_model_complexity_info(model, shape)
    print(results['out_arch'])
    print(results['out_table'])
    split_line = '=' * 30
    print(f'{split_line}\nInput shape: {shape}\n'
          f'Flops: {results["flops_str"]}\nParams: {results["params_str"]}\n'
          f'Activation: {results["activations_str"]}\n{split_line}')
    print(counted)
    print('!!!Please be cautious if you use the results in papers. '
          'You may need to check if all ops are supported and verify that the '
          'flops computation is correct.')
    return results


if __name__ == '__main__':
    main()
