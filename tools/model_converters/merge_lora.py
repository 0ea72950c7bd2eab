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
``LinearViTCheckpoint`` (it records the operators) load it unchanged.

Refused with every reason named, before anything is written: a checkpoint whose recorded
alpha, rank or targets differ from the config's, or whose factors were trained on other base
weights than the config loads (runs with ``LoRATargetsHook`` record both); a checkpoint
without that record, unless ``--allow-unrecorded`` (then the config is trusted, with a
warning); missing, extra or misshaped factors; NaN or Inf in the checkpoint, the base
weights or the merged weights; an unreadable input or an OUT that cannot be written. The
output is written atomically (a complete file or none).
"""
import argparse
import sys

from mmengine.config import Config, DictAction
from mmengine.registry import MODELS, init_default_scope
from mmengine.runner.checkpoint import save_checkpoint

import linvit_mm.engine  # noqa: F401  (the atomic_local file backend)
from linvit_mm.staged import check_output_path, merge_lora_checkpoint, read_checkpoint


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Merge the LoRA factors of a checkpoint into a plain checkpoint.')
    parser.add_argument('config', help='the config of the LoRA run')
    parser.add_argument('checkpoint', help='a checkpoint of that run')
    parser.add_argument('out', help='where to write the merged checkpoint')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value, as for the run')
    parser.add_argument('--allow-unrecorded', action='store_true',
                        help='merge a checkpoint that does not record the LoRA settings and '
                             'base weights it was trained with (written before runs recorded '
                             'them), trusting the config')
    return parser.parse_args(argv)


def merge(cfg, filename, allow_unrecorded=False):
    """The merged checkpoint (``state_dict`` and ``meta``) of ``filename``, a checkpoint of a
    run of ``cfg`` (see :func:`linvit_mm.staged.merge_lora_checkpoint`)."""
    checkpoint = read_checkpoint(filename, what='LoRA checkpoint')
    init_default_scope(cfg.get('default_scope', 'mmpretrain'))
    # LoRAModel initialises its module (the frozen weights) when it is built; the rest of the
    # model comes from the checkpoint, so init_weights (the head's initialiser) is not run.
    model = MODELS.build(cfg.model)
    return merge_lora_checkpoint(model, checkpoint, filename,
                                 allow_unrecorded=allow_unrecorded)


def main(argv=None):
    args = parse_args(argv)
    try:
        check_output_path(args.out, inputs=[args.checkpoint])
    except ValueError as err:
        print(f'error: {err}', file=sys.stderr)
        return 1
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    try:
        merged = merge(cfg, args.checkpoint, allow_unrecorded=args.allow_unrecorded)
    except (FileNotFoundError, ValueError) as err:
        print(f'error: {err}', file=sys.stderr)
        return 1
    save_checkpoint(merged, args.out, backend_args=dict(backend='atomic_local'))
    print(f'merged the LoRA factors of {args.checkpoint} into {len(merged["state_dict"])} '
          f'tensors: {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
