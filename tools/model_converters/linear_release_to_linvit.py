"""Convert a released linear-attention ViT (ViT³, InLine-DeiT, MHLA) into a LinearViT checkpoint.

    python tools/model_converters/linear_release_to_linvit.py SRC OUT \
        [--family vit3|inline|mhla] [--num-heads N [--force-num-heads]]

The family is told from the keys unless ``--family`` names it; ``--num-heads`` is needed
only for an MHLA ViT of a width other than the released 192 / 384 / 768 (its tensors do not
hold the head count; elsewhere it is checked against them; at a released width another count
than the release's is refused unless ``--force-num-heads``). Integer or boolean tensors are
refused. Every tensor of the release
must have a place in the LinearViT that computes the official forward (an unknown or missing
one is an error naming it, and nothing is written). The output holds ``backbone.*`` and the
classifier ``head.layers.head.*`` with the record of the ViT, so it loads strictly with
``init_cfg=dict(type='LinearViTCheckpoint', checkpoint=OUT)`` into the model the tool prints
(docs/user_guides/transfer.md, "Released linear ViTs").
"""
import argparse
import sys

from mmengine.runner.checkpoint import save_checkpoint

import linvit_mm.engine  # noqa: F401  (the atomic_local file backend)
from linvit_mm.staged import check_output_path, read_checkpoint
from linvit_mm.transfer.linear_releases import (LINEAR_RELEASES, convert_linear_release,
                                                converted_checkpoint)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Convert a released linear ViT (ViT^3, InLine-DeiT, MHLA) into a '
        'LinearViT checkpoint that LinearViTCheckpoint loads strictly.')
    parser.add_argument('src', help='the release checkpoint')
    parser.add_argument('out', help='where to write the LinearViT checkpoint')
    parser.add_argument('--family', choices=list(LINEAR_RELEASES), default=None,
                        help='the release family (default: told from the keys)')
    parser.add_argument('--num-heads', type=int, default=None,
                        help='attention heads (MHLA ViTs of unreleased widths only need it)')
    parser.add_argument('--force-num-heads', action='store_true',
                        help='use --num-heads at a released MHLA width whose release has '
                        'another count (a model of your own trained with that count)')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        check_output_path(args.out, inputs=[args.src])
        converted = convert_linear_release(read_checkpoint(args.src, what='release checkpoint'),
                                           args.family, num_heads=args.num_heads,
                                           force_num_heads=args.force_num_heads)
        checkpoint = converted_checkpoint(converted)
    except (FileNotFoundError, ValueError) as err:
        print(f'error: {err}', file=sys.stderr)
        return 1
    save_checkpoint(checkpoint, args.out, backend_args=dict(backend='atomic_local'))
    release = converted.release
    cfg = dict(converted.model_cfg,
               init_cfg=dict(type='LinearViTCheckpoint', checkpoint=args.out))
    print(f'{release.description} ({release.repository}) -> {args.out}: '
          f'{len(converted.backbone)} backbone tensors, '
          f'{len(converted.head)} classifier tensors')
    for note in converted.notes:
        print(f'note: {note}')
    print(f'backbone: {cfg}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
