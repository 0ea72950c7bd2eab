"""Merge attention-alignment checkpoints that each trained some blocks into one checkpoint.

Stage 1 of the staged recipe trains every block on the teacher's own input to it, so its
blocks can be split over jobs (``--cfg-options "model.layers=[0,1,2,3]"`` and so on, same
config otherwise) and merged here::

    python tools/model_converters/merge_aligned_blocks.py OUT JOB_A.pth JOB_B.pth [...]

Each block's attention (``backbone.layers.N.attn.*``) comes from the job that trained it,
everything else from the first job. Refused, with every reason named and nothing written:
a checkpoint without an attention-alignment record (runs with ``StagedRecordHook`` have
one), checkpoints of different ViTs, a block trained by two jobs or by none, and jobs that
differ outside the trained attention (other teachers or initialisations), a job holding
NaN or Inf values (a diverged job), an input that cannot be read (truncated), and an OUT that
cannot be written (a directory, or a path under a regular file: checked first). The output is
written atomically (a complete file or none) and loads into stage 2 like the checkpoint of a
single job (``LinearViTCheckpoint``).
"""
import argparse
import os.path as osp
import sys

from mmengine.runner.checkpoint import save_checkpoint

import linvit_mm.engine  # noqa: F401  (the atomic_local file backend)
from linvit_mm.staged import check_output_path, merge_aligned_blocks, read_checkpoint


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Merge attention-alignment checkpoints of disjoint block sets.')
    parser.add_argument('out', help='where to write the merged checkpoint')
    parser.add_argument('checkpoints', nargs='+',
                        help='checkpoints of the jobs (the first gives the shared tensors)')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    sources = [osp.realpath(path) for path in args.checkpoints]
    repeated = sorted({path for path in args.checkpoints
                       if sources.count(osp.realpath(path)) > 1})
    if repeated:
        print(f'error: {", ".join(repeated)} given more than once; give each job once',
              file=sys.stderr)
        return 1
    if osp.realpath(args.out) in sources:
        print(f'error: OUT {args.out!r} is one of the inputs; give another path',
              file=sys.stderr)
        return 1
    try:
        check_output_path(args.out)
        loaded = {path: read_checkpoint(path, what='alignment checkpoint')
                  for path in args.checkpoints}
        merged = merge_aligned_blocks(loaded)
    except (FileNotFoundError, ValueError) as err:
        print(f'error: {err}', file=sys.stderr)
        return 1
    save_checkpoint(merged, args.out, backend_args=dict(backend='atomic_local'))
    record = merged['meta']['linvit_mm']
    print(f'merged {len(args.checkpoints)} checkpoints ({len(record["trained_layers"])} '
          f'blocks) into {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
