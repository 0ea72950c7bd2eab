"""Convert a Softmax ViT checkpoint (DeiT, timm, DINO, MoCo v3, iBOT, MAE, DeiT III, DINOv2,
DINOv3, CLIP, EVA-02, mmpretrain) to mmpretrain names, for inspection or for
``init_cfg=dict(type='Pretrained', ...)``.

    python tools/model_converters/softmax_vit_to_mmpretrain.py SRC DST [--show] [--num-heads N]
        [--family NAME]

The source is read without running anything it pickles (see ``load_softmax_checkpoint``);
the output is ``{'state_dict': {'backbone.*', 'head.*'}, 'meta': {...}}`` and loads the same
way. ``--num-heads`` states the head count of a checkpoint that does not record it; it is
checked and written to ``meta['num_heads']``, where the transfer reads it. ``--family``
states the source family of a checkpoint whose tensors do not tell it (checked against them;
an unknown name is refused with the list of known ones).
"""
import argparse
import os
import os.path as osp
import sys

import torch

from linvit_mm.transfer.checkpoint import load_softmax_checkpoint


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Convert a Softmax ViT checkpoint to an mmpretrain-format checkpoint.')
    parser.add_argument('src', help='source checkpoint (.pth / .pth.tar)')
    parser.add_argument('dst', help='where to write the mmpretrain-format checkpoint (not SRC)')
    parser.add_argument('--show', action='store_true',
                        help='also list every converted tensor and every unused key')
    parser.add_argument('--num-heads', type=int, default=None,
                        help="the checkpoint's number of attention heads, when it does not "
                             'record it (checked against its width and metadata)')
    parser.add_argument('--family', default=None,
                        help='the source family (vit, deit3, dinov2, dinov3, clip, eva02), when '
                             'the tensors do not tell it (checked against them)')
    return parser.parse_args(argv)


def same_file(src, dst):
    """Whether writing ``dst`` would overwrite ``src`` (same path, a link to it, a hard link)."""
    if osp.realpath(src) == osp.realpath(dst):
        return True
    return osp.exists(src) and osp.exists(dst) and osp.samefile(src, dst)


def main(argv=None):
    args = parse_args(argv)
    if same_file(args.src, args.dst):
        print(f'error: DST {args.dst!r} is the source file {args.src!r}; writing it would '
              f'replace the checkpoint being converted. Give another DST.', file=sys.stderr)
        return 1
    try:
        ckpt = load_softmax_checkpoint(args.src, num_heads=args.num_heads, family=args.family)
    except (FileNotFoundError, ValueError) as err:
        print(f'error: {err}', file=sys.stderr)
        return 1

    meta = dict(
        source_format=ckpt.source_format,
        converted_by='linvit_mm',
        source=osp.basename(args.src),
        embed_dims=ckpt.embed_dims,
        depth=ckpt.depth,
        patch_size=ckpt.patch_size,
        pos_grid=ckpt.pos_grid,
        num_extra_tokens=ckpt.num_extra_tokens,
        family=ckpt.family,
        num_register_tokens=ckpt.num_register_tokens,
        rope=ckpt.rope,
        unused_keys=list(ckpt.unused_keys),
        notes=list(ckpt.notes))
    if ckpt.num_heads is not None:
        meta['num_heads'] = ckpt.num_heads
    dst_dir = osp.dirname(osp.abspath(args.dst))
    os.makedirs(dst_dir, exist_ok=True)
    torch.save({'state_dict': ckpt.state_dict, 'meta': meta}, args.dst)

    print(ckpt.summary())
    if args.show:
        print('converted tensors:')
        for name, tensor in ckpt.state_dict.items():
            print(f'  {name}: {tuple(tensor.shape)}')
        for group, keys in ckpt.unused_groups.items():
            print(f'unused ({group}):')
            for key in keys:
                print(f'  {key}')
    print(f'saved {len(ckpt.state_dict)} tensors to {args.dst}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
