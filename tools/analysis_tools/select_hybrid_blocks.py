#!/usr/bin/env python
"""Which blocks of a linear-attention student should keep Softmax attention: the greedy pass
of DtR, Distill-then-Replace (Xia et al., 2026, arXiv 2601.11667), on a validation set.

After block-wise distillation (or any run that taught the student's attention to follow the
Softmax teacher's), DtR starts from the all-Softmax model and replaces its blocks by linear
ones one at a time, each time the block whose replacement hurts validation least, until
only the budget of Softmax blocks is left. This tool runs that pass to the end (all blocks
linear), so one run answers every budget, and keeps the set of ``--budget`` blocks.

**What a configuration is.** The student classifier (config + checkpoint: its patch
embedding, MLPs, norms and head) with, in each block, either its own (linear) attention
module or the teacher's Softmax one. Swapping the attention module, not the whole block, is
what block-wise distillation makes a block differ by (it trains only the attention; the rest
is the teacher's), and for a student fine-tuned end to end it keeps the parts that were
trained beside attention distilled to the teacher's outputs. The all-Softmax configuration
is the start of the pass; the all-linear one is the student itself.

**Scores**, over the images of the config's validation set (``--num-images``: that many,
evenly spaced through it): ``loss``, the mean cross-entropy of the head's logits (no label
smoothing); ``accuracy``, top-1 in %; and the fidelity of the final features, ``cos`` /
``relMSE`` of the last block's output tokens against the all-Softmax configuration's
(``attention_fidelity.py``'s definitions). ``--criterion`` picks what the greedy pass
minimises: ``loss`` (default; continuous, so a small set still ranks), ``accuracy`` (ties
broken by loss) or ``fidelity`` (relMSE). Ties go to the lower block index.

**Outputs** in ``--out-dir``: ``blocks.csv`` (each block: its scores with that block alone
linear, the change of the criterion against all-Softmax, the greedy step that replaced
it), ``greedy.csv`` (each step: the blocks still Softmax and the scores), ``selection.png``
(the two), the hybrid checkpoint ``hybrid.pth`` (the student's weights with the teacher's
attention in the kept Softmax blocks) and the hybrid config, a leaf over the student config
that sets ``attn_type=dict(default=..., softmax=[...])`` and ``load_from`` that checkpoint,
so ``tools/test.py`` evaluates the selected hybrid and ``tools/train.py`` fine-tunes it.

**Teacher**: as ``attention_fidelity.py`` takes it (the config's AttentionDistillHook
teacher, or ``--teacher-config`` / ``--teacher-checkpoint``); it must be all Softmax and
have the student's depth, width, heads and patch size. The student must be all linear.

Example::

    python tools/analysis_tools/select_hybrid_blocks.py \\
        configs/classification/imagenet/linvit-relu-small_fullcopy-distill_32xb128_in1k.py \\
        work_dirs/linvit-relu-small_fullcopy-distill_32xb128_in1k/epoch_300.pth \\
        --budget 2 --num-images 2000 --device cuda
"""
import argparse
import csv
import os
import os.path as osp

import torch

from linvit_mm.analysis import (CRITERIA, AttentionSwap, Evaluator, backbone_of, build_hybrid,
                                build_teacher, check_budget, check_pair, cost_key,
                                criterion_delta, find_distill_hook, greedy_replace,
                                hybrid_attn_type, hybrid_config_text, hybrid_state,
                                load_config, load_student, validation_batches)

BLOCK_COLUMNS = ('block', 'operator', 'loss', 'accuracy', 'cos', 'relmse', 'delta',
                 'greedy_step')
GREEDY_COLUMNS = ('step', 'replaced', 'num_softmax', 'softmax_blocks', 'loss', 'accuracy',
                  'cos', 'relmse')


# ------------------------------------------------------------------ output
def block_rows(steps, student, criterion):
    cost = cost_key(criterion)
    start = steps[0]['score']
    first = steps[1]['trials'] if len(steps) > 1 else {}
    step_of = {step['replaced']: index for index, step in enumerate(steps) if index}
    rows = []
    for block, score in sorted(first.items()):
        rows.append(dict(block=block, operator=student.layers[block].attn.attn_type, **score,
                         delta=criterion_delta(criterion, score, start),
                         greedy_step=step_of.get(block)))
    return sorted(rows, key=lambda row: (cost(first[row['block']]), row['block']))


def greedy_rows(steps):
    return [dict(step=index, replaced='' if step['replaced'] is None else step['replaced'],
                 num_softmax=len(step['softmax']),
                 softmax_blocks=' '.join(map(str, step['softmax'])), **step['score'])
            for index, step in enumerate(steps)]


def write_csv(rows, columns, path):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: (f'{value:.8g}' if isinstance(value, float) else value)
                             for key, value in row.items() if key in columns})


def format_tables(blocks, greedy, criterion, budget):
    lines = [f'Each block alone linear (the rest Softmax), best first by {criterion}:',
             f'{"block":>5}  {"operator":>9}  {"loss":>8}  {"top-1 %":>7}  {"cos":>8}  '
             f'{"relMSE":>9}  {"delta":>9}  {"greedy step":>11}']
    for row in blocks:
        lines.append(f'{row["block"]:>5}  {row["operator"]:>9}  {row["loss"]:>8.4f}  '
                     f'{row["accuracy"]:>7.2f}  {row["cos"]:>8.5f}  {row["relmse"]:>9.3e}  '
                     f'{row["delta"]:>+9.4f}  {row["greedy_step"]:>11}')
    lines += ['', 'Greedy pass (DtR), from all Softmax to all linear:',
              f'{"step":>4}  {"replaced":>8}  {"softmax blocks":<24}  {"loss":>8}  '
              f'{"top-1 %":>7}  {"relMSE":>9}']
    for row in greedy:
        mark = '  <- budget' if row['num_softmax'] == budget else ''
        lines.append(f'{row["step"]:>4}  {str(row["replaced"]):>8}  '
                     f'{row["softmax_blocks"] or "-":<24}  {row["loss"]:>8.4f}  '
                     f'{row["accuracy"]:>7.2f}  {row["relmse"]:>9.3e}{mark}')
    return '\n'.join(lines)


def plot(blocks, greedy, criterion, budget, path, title):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, (ax_blocks, ax_path) = plt.subplots(1, 2, figsize=(11, 3.9))
    ordered = sorted(blocks, key=lambda row: row['block'])
    ax_blocks.bar([row['block'] for row in ordered], [row['delta'] for row in ordered])
    ax_blocks.set_xticks([row['block'] for row in ordered])
    ax_blocks.set_xlabel('block made linear (all others Softmax)')
    ax_blocks.set_ylabel(f'change of {criterion}' + (' (relMSE)' if criterion == 'fidelity'
                                                     else ''))
    ax_blocks.axhline(0, color='black', linewidth=.8)
    counts = [row['num_softmax'] for row in greedy]
    ax_path.plot(counts, [row['loss'] for row in greedy], marker='o', label='loss')
    ax_path.set_xlabel('Softmax blocks left (greedy pass, right to left)')
    ax_path.set_ylabel('validation loss')
    ax_path.invert_xaxis()
    ax_path.axvline(budget, color='grey', linestyle='--', linewidth=.8)
    ax_acc = ax_path.twinx()
    ax_acc.plot(counts, [row['accuracy'] for row in greedy], marker='s', color='tab:orange',
                label='top-1 %')
    ax_acc.set_ylabel('top-1 (%)')
    handles = ax_path.get_legend_handles_labels()[0] + ax_acc.get_legend_handles_labels()[0]
    ax_path.legend(handles, ['loss', 'top-1 %'], loc='best')
    for ax in (ax_blocks, ax_path):
        ax.grid(alpha=.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ CLI
def parse_args(argv=None):
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser(
        description='DtR greedy selection of the blocks of a linear student that keep '
        'Softmax attention, scored on the validation set of its config')
    parser.add_argument('config', help='config of the student classifier')
    parser.add_argument('checkpoint', help='student checkpoint (mmengine run checkpoint)')
    parser.add_argument('--teacher-config', default=None,
                        help="config whose model is the Softmax teacher (default: the "
                        "config's AttentionDistillHook teacher)")
    parser.add_argument('--teacher-checkpoint', default=None,
                        help="teacher weights, instead of the teacher's init_cfg")
    parser.add_argument('--budget', type=int, default=2,
                        help='Softmax blocks the hybrid keeps (default 2)')
    parser.add_argument('--criterion', choices=CRITERIA, default='loss',
                        help='what the greedy pass minimises (default: validation loss)')
    parser.add_argument('--num-images', type=int, default=None,
                        help='images of the validation set, evenly spaced (default: all)')
    parser.add_argument('--batch-size', type=int, default=32)
    parser.add_argument('--out-dir', default=None,
                        help='default: work_dirs/select_hybrid_blocks/<config name>')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default=None,
                        help='override settings of the student config (key=value)')
    args = parser.parse_args(argv)
    if args.num_images is not None and args.num_images < 1 or args.batch_size < 1:
        parser.error('--num-images and --batch-size must be >= 1')
    if args.out_dir is None:
        args.out_dir = osp.join('work_dirs', 'select_hybrid_blocks',
                                osp.splitext(osp.basename(args.config))[0])
    return args


def main(argv=None):
    args = parse_args(argv)
    import linvit_mm.engine  # noqa: F401  (registers the hook, installs the safe loader)
    import linvit_mm.models  # noqa: F401
    cfg = load_config(args.config, args.cfg_options)
    hook = find_distill_hook(cfg) or {}
    student_path = hook.get('student', 'backbone')
    model = load_student(cfg, args.checkpoint, args.device)
    if not getattr(model, 'with_head', False):
        raise ValueError(f'the model of {args.config} ({type(model).__name__}) has no head to '
                         f'score the validation set with; the tool selects blocks of a '
                         f'classifier')
    student = backbone_of(model, student_path)
    teacher, teacher_source = build_teacher(cfg, args.teacher_config, args.teacher_checkpoint,
                                            args.device)
    check_pair(student, teacher)
    depth = len(student.layers)
    check_budget(args.budget, depth)

    batches, num_images = validation_batches(cfg, model, args.num_images, args.batch_size,
                                             args.device)
    print(f'student: {student.attn_type} {student_path} of {args.config}, weights '
          f'{args.checkpoint}')
    print(f'teacher: {teacher_source}')
    print(f'{num_images} validation images; greedy pass over {depth} blocks '
          f'({depth * (depth + 1) // 2 + 1} configurations), criterion {args.criterion}',
          flush=True)
    evaluator = Evaluator(model, AttentionSwap(student, teacher), batches)
    cost = cost_key(args.criterion)

    def evaluate(softmax_blocks):
        score = evaluator(softmax_blocks)
        print(f'  softmax {sorted(softmax_blocks)}: loss {score["loss"]:.4f}, top-1 '
              f'{score["accuracy"]:.2f} %, relMSE {score["relmse"]:.3e}', flush=True)
        return score

    steps = greedy_replace(range(depth), evaluate, cost, budget=0)
    chosen = next(step for step in steps if len(step['softmax']) == args.budget)
    blocks, greedy = block_rows(steps, student, args.criterion), greedy_rows(steps)

    layout, with_cls_token = hybrid_attn_type(student, chosen['softmax'])
    state = hybrid_state(model, student_path, teacher, chosen['softmax'])
    build_hybrid(cfg, student_path, layout, with_cls_token, state)

    os.makedirs(args.out_dir, exist_ok=True)
    write_csv(blocks, BLOCK_COLUMNS, osp.join(args.out_dir, 'blocks.csv'))
    write_csv(greedy, GREEDY_COLUMNS, osp.join(args.out_dir, 'greedy.csv'))
    plot(blocks, greedy, args.criterion, args.budget, osp.join(args.out_dir, 'selection.png'),
         f'{osp.basename(args.config)}: DtR greedy pass, {num_images} validation images')
    torch.save(dict(state_dict=state, meta=dict(
        select_hybrid_blocks=dict(config=args.config, checkpoint=args.checkpoint,
                                  teacher=teacher_source, softmax_blocks=chosen['softmax'],
                                  criterion=args.criterion, num_images=num_images))),
        osp.join(args.out_dir, 'hybrid.pth'))
    stem = osp.splitext(osp.basename(args.config))[0]
    config_path = osp.join(args.out_dir, f'{stem}_softmax-{"-".join(map(str, chosen["softmax"]))}'
                           f'.py')
    with open(config_path, 'w') as f:
        f.write(hybrid_config_text(args.config, args.checkpoint, student_path, layout,
                                   with_cls_token, args.out_dir, args.budget, args.criterion,
                                   num_images, chosen['score']))

    print()
    print(format_tables(blocks, greedy, args.criterion, args.budget))
    print(f'\nbudget {args.budget}: Softmax in blocks {chosen["softmax"]} '
          f'({evaluator.calls} configurations evaluated)')
    print(f'wrote {config_path}, {osp.join(args.out_dir, "hybrid.pth")}, blocks.csv, '
          f'greedy.csv and selection.png in {args.out_dir}')
    return dict(steps=steps, chosen=chosen, blocks=blocks, greedy=greedy, config=config_path,
                evaluator=evaluator)


if __name__ == '__main__':
    main()
