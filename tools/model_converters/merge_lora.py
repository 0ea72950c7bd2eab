"""Fold the LoRA factors of a LoRA fine-tuning checkpoint into a plain checkpoint.

A run of a config whose model holds mmpretrain's ``LoRAModel`` (the ``*_staged-lora_*``
configs: ``backbone=dict(type='LoRAModel', module=dict(type='LinearViT', ...))``) saves the
low-rank factors and the head only; the frozen weights come from the module's own
``init_cfg``. This tool builds the model from the config (which loads those weights),
loads the checkpoint into it and writes the state dict of the same model without LoRA,
``W = W0 + alpha / rank * up @ down`` for every adapted layer::

    python tools/model_converters/merge_lora.py CONFIG LORA_CKPT OUT [--cfg-options k=v ...]

The output has the keys of the plain model (``backbone.layers.N.attn.qkv.weight``,
``head.*``), so dense configs, ``tools/test.py`` with the config's plain twin, and
``LinearViTCheckpoint`` (it records the operators) load it unchanged. A checkpoint that the
config's model does not fit (a missing or extra factor, another shape) is refused with the
keys named; the output is written atomically (a complete file or none).
"""
import argparse
import os.path as osp
import sys

from mmengine.config import Config, DictAction
from mmengine.registry import MODELS, init_default_scope
from mmengine.runner.checkpoint import save_checkpoint

import linvit_mm.engine  # noqa: F401  (the atomic_local file backend)
from linvit_mm.staged import (RECORD_KEY, checkpoint_record, describe_linear_vit,
                              find_lora_models, merged_state_dict)
from linvit_mm.utils.checkpoint import load_checkpoint_file


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Merge the LoRA factors of a checkpoint into a plain checkpoint.')
    parser.add_argument('config', help='the config of the LoRA run')
    parser.add_argument('checkpoint', help='a checkpoint of that run')
    parser.add_argument('out', help='where to write the merged checkpoint')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value, as for the run')
    return parser.parse_args(argv)


def check_fits(model, state, filename):
    """Refuse a checkpoint whose factors and other tensors are not exactly the model's."""
    expected = model.state_dict()  # LoRAModel keeps its factors only, beside the rest
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [f'{key}: checkpoint {tuple(state[key].shape)}, model '
                  f'{tuple(expected[key].shape)}' for key in sorted(set(expected) & set(state))
                  if state[key].shape != expected[key].shape]
    problems = []
    if missing:
        problems.append(f'missing: {", ".join(missing)}')
    if unexpected:
        problems.append(f'not in the model: {", ".join(unexpected)}')
    if mismatched:
        problems.append(f'shapes that differ: {"; ".join(mismatched)}')
    if problems:
        raise ValueError(f'{filename} does not fit the LoRA model of the config (another '
                         f'config, rank or targets?):\n  - ' + '\n  - '.join(problems))


def merge(cfg, filename):
    """The merged checkpoint (``state_dict`` and ``meta``) of ``filename``, a checkpoint of a
    run of ``cfg``."""
    init_default_scope(cfg.get('default_scope', 'mmpretrain'))
    # LoRAModel initialises its module (the frozen weights) when it is built; the rest of the
    # model comes from the checkpoint, so init_weights (the head's initialiser) is not run.
    model = MODELS.build(cfg.model)
    lora_models = find_lora_models(model)
    if not lora_models:
        raise ValueError(f'the model of the config ({type(model).__name__}) holds no '
                         f'LoRAModel: nothing to merge')
    checkpoint = load_checkpoint_file(filename, map_location='cpu')
    state = checkpoint.get('state_dict', checkpoint)
    check_fits(model, state, filename)
    model.load_state_dict(state, strict=True)

    meta = dict(checkpoint.get('meta') or {})
    record = dict(checkpoint_record(checkpoint) or {})
    record.update(
        backbones={prefix: describe_linear_vit(lora_model.module)
                   for prefix, lora_model in lora_models.items()
                   if hasattr(lora_model.module, 'layers')},
        stage='lora-merged',
        # plain dicts: a checkpoint holding config objects would not load weights-only
        lora={prefix.rstrip('.'): dict(alpha=lora_model.alpha, rank=lora_model.rank,
                                       targets=[dict(t) for t in lora_model.targets])
              for prefix, lora_model in lora_models.items()},
        merged_from=osp.abspath(filename))
    meta[RECORD_KEY] = record
    return dict(state_dict=merged_state_dict(model), meta=meta)


def main(argv=None):
    args = parse_args(argv)
    if osp.exists(args.out) and osp.exists(args.checkpoint) and osp.samefile(
            args.out, args.checkpoint):
        print(f'error: OUT {args.out!r} is the checkpoint to merge; give another path',
              file=sys.stderr)
        return 1
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    try:
        merged = merge(cfg, args.checkpoint)
    except (FileNotFoundError, ValueError) as err:
        print(f'error: {err}', file=sys.stderr)
        return 1
    save_checkpoint(merged, args.out, backend_args=dict(backend='atomic_local'))
    print(f'merged the LoRA factors of {args.checkpoint} into {len(merged["state_dict"])} '
          f'tensors: {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
