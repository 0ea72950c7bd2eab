#!/usr/bin/env python
"""How closely a linear-attention student reproduces its Softmax teacher, block by block.

For a student checkpoint and its teacher, on a few images, the tool prints per block its
operator (a hybrid student's differ from block to block) and

* ``cos attn`` / ``relMSE attn``: cosine similarity and relative MSE between the
  student's and the teacher's attention outputs (what ``AttentionDistillHook``
  matches: the output of each ``BaseAttention`` module, after its projection);
* ``cos block`` / ``relMSE block``: the same between the outputs of the blocks
  (``backbone.layers[i]``, residual stream after the MLP);

and writes them to ``fidelity.csv`` and ``fidelity.png`` in ``--out-dir``. A block
whose attention output is far from the teacher's is one that distillation has not yet
converged on; block outputs show how the differences accumulate along the depth.

Definitions, over all compared tokens ``n`` of all images: ``cos`` is the mean over
tokens of the cosine similarity of the student's and the teacher's ``C``-vectors, and
``relMSE = sum ||s_n - t_n||^2 / sum ||t_n||^2``. A student identical to its teacher
gives 1 and 0. Tokens are aligned as the hook aligns them: patch tokens only when student
and teacher do not lead their sequences with the same extra tokens (a student without class
token, mhla or ttt; a teacher with registers) or the hook is set to ``patch_tokens_only``.

**Student**: the config's ``model``, weights from ``CHECKPOINT`` (an mmengine run
checkpoint or a state dict of the whole model; loaded strictly). The compared module is
the hook's ``student`` (default ``backbone``).

**Teacher**, by default the ``teacher`` of the ``AttentionDistillHook`` in the config's
``custom_hooks``, built and initialised from its own ``init_cfg`` as the hook does.
``--teacher-config`` takes the teacher from another config's ``model`` instead (a
classifier's ``backbone`` or a bare backbone). ``--teacher-checkpoint`` loads the
teacher's weights from a file instead of its ``init_cfg``: an mmengine run checkpoint
of a classifier (keys ``backbone.*``), a bare backbone state dict, or any Softmax ViT
layout ``linvit_mm.transfer`` reads (DeiT, timm, ...).

**Images**: ``--images`` (files and/or folders) through the config's test pipeline, or
the first ``--num-images`` of the config's validation set; either way the config's data
preprocessor makes the batch, and the very same tensor feeds student and teacher.

Example::

    python tools/analysis_tools/attention_fidelity.py \\
        configs/classification/imagenet/linvit-relu-small_fullcopy-distill_32xb128_in1k.py \\
        work_dirs/linvit-relu-small_fullcopy-distill_32xb128_in1k/epoch_300.pth --num-images 16
"""
import argparse
import csv
import os
import os.path as osp
import sys

from linvit_mm.analysis import (backbone_of, build_teacher, compare_blocks, find_distill_hook,
                                load_config, load_student, packed_samples,
                                preprocessed_batches, uses_patch_tokens_only)

CSV_COLUMNS = ('block', 'operator', 'cos_attn', 'relmse_attn', 'cos_block', 'relmse_block',
               'tokens')


# ------------------------------------------------------------------ output
def format_table(rows):
    lines = [f'{"block":>5}  {"operator":>9}  {"cos attn":>9}  {"relMSE attn":>11}  '
             f'{"cos block":>9}  {"relMSE block":>12}']
    for row in rows:
        lines.append(f'{row["block"]:>5}  {row["operator"]:>9}  {row["cos_attn"]:>9.5f}  '
                     f'{row["relmse_attn"]:>11.3e}  {row["cos_block"]:>9.5f}  '
                     f'{row["relmse_block"]:>12.3e}')
    return '\n'.join(lines)


def write_csv(rows, path):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f'{v:.8g}' if isinstance(v, float) else v)
                             for k, v in row.items()})


def plot(rows, path, title):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    blocks = [row['block'] for row in rows]
    fig, (ax_cos, ax_mse) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label, marker in (('attn', 'attention output', 'o'), ('block', 'block output', 's')):
        ax_cos.plot(blocks, [row[f'cos_{key}'] for row in rows], marker=marker, label=label)
        ax_mse.plot(blocks, [row[f'relmse_{key}'] for row in rows], marker=marker, label=label)
    ax_cos.set_ylabel('cosine similarity')
    ax_mse.set_ylabel('relative MSE')
    for ax in (ax_cos, ax_mse):
        ax.set_xlabel('block')
        ax.set_xticks(blocks)
        ax.grid(alpha=.3)
    # one legend below both panels, where it cannot cover a curve
    fig.legend(*ax_cos.get_legend_handles_labels(), loc='lower center', ncol=2, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, .07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ CLI
def parse_args(argv=None):
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser(
        description='Per-block cosine similarity and relative MSE between a student and its '
        'Softmax teacher (attention outputs and block outputs)')
    parser.add_argument('config', help='config of the student (a distillation config names '
                        'its teacher)')
    parser.add_argument('checkpoint', help='student checkpoint (mmengine run checkpoint)')
    parser.add_argument('--teacher-config', default=None,
                        help="config whose model is the teacher (default: the config's "
                        'AttentionDistillHook teacher)')
    parser.add_argument('--teacher-checkpoint', default=None,
                        help="teacher weights, instead of the teacher's init_cfg")
    source = parser.add_mutually_exclusive_group()
    source.add_argument('--images', nargs='+', default=None,
                        help='image files and/or folders, through the test pipeline')
    source.add_argument('--num-images', type=int, default=8,
                        help='first N images of the validation set (default: 8)')
    parser.add_argument('--batch-size', type=int, default=4)
    parser.add_argument('--out-dir', default=None,
                        help='where fidelity.csv and fidelity.png go (default: '
                        'work_dirs/attention_fidelity/<config name>)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default=None,
                        help='override settings of the student config (key=value)')
    args = parser.parse_args(argv)
    if args.num_images < 1 or args.batch_size < 1:
        parser.error('--num-images and --batch-size must be >= 1')
    if args.out_dir is None:
        args.out_dir = osp.join('work_dirs', 'attention_fidelity',
                                osp.splitext(osp.basename(args.config))[0])
    return args


def main(argv=None):
    args = parse_args(argv)
    from mmengine.utils import track_iter_progress

    import linvit_mm.engine  # noqa: F401  (registers the hook, installs the safe loader)
    import linvit_mm.models  # noqa: F401
    cfg = load_config(args.config, args.cfg_options)
    hook = find_distill_hook(cfg) or {}
    student_path = hook.get('student', 'backbone')
    model = load_student(cfg, args.checkpoint, args.device)
    student = backbone_of(model, student_path)
    teacher, teacher_source = build_teacher(cfg, args.teacher_config, args.teacher_checkpoint,
                                            device=args.device)
    patch_only = uses_patch_tokens_only(student, teacher, hook)
    samples = packed_samples(cfg, args.images, args.num_images)
    num_batches = -(-len(samples) // args.batch_size)
    print(f'comparing {len(samples)} images, {num_batches} batches of up to {args.batch_size}')
    batches = track_iter_progress(
        (preprocessed_batches(model, samples, args.batch_size, args.device), num_batches),
        file=sys.stdout)
    rows = compare_blocks(student, teacher, batches, patch_only)

    os.makedirs(args.out_dir, exist_ok=True)
    csv_path = osp.join(args.out_dir, 'fidelity.csv')
    png_path = osp.join(args.out_dir, 'fidelity.png')
    write_csv(rows, csv_path)
    student_type = getattr(student, 'attn_type', type(student).__name__)
    plot(rows, png_path, f'{osp.basename(args.config)} ({student_type}) vs teacher, '
         f'{len(samples)} images{", patch tokens" if patch_only else ""}')
    print(f'student: {student_type} {student_path} of {args.config}, weights {args.checkpoint}')
    print(f'teacher: {teacher_source}')
    print(f'{len(samples)} images, {"patch tokens only" if patch_only else "all tokens"}')
    print(format_table(rows))
    print(f'wrote {csv_path} and {png_path}')
    return rows


if __name__ == '__main__':
    main()
