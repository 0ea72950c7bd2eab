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
import copy
import csv
import importlib.util
import os
import os.path as osp
from itertools import combinations

import torch
import torch.nn.functional as F

CRITERIA = ('loss', 'accuracy', 'fidelity')
SOFTMAX = 'softmax'
BLOCK_COLUMNS = ('block', 'operator', 'loss', 'accuracy', 'cos', 'relmse', 'delta',
                 'greedy_step')
GREEDY_COLUMNS = ('step', 'replaced', 'num_softmax', 'softmax_blocks', 'loss', 'accuracy',
                  'cos', 'relmse')


def _load_fidelity_tool():
    # The analysis tools are scripts, not a package: this one reuses the fidelity tool's
    # loading of the student, the teacher and the config, and its agreement measure.
    path = osp.join(osp.dirname(osp.abspath(__file__)), 'attention_fidelity.py')
    spec = importlib.util.spec_from_file_location('linvit_attention_fidelity', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fidelity = _load_fidelity_tool()


# ------------------------------------------------------------------ the greedy pass
def cost_key(criterion):
    """What the greedy pass minimises, as a function of a configuration's scores."""
    if criterion == 'loss':
        return lambda score: (score['loss'], )
    if criterion == 'accuracy':
        return lambda score: (-score['accuracy'], score['loss'])
    if criterion == 'fidelity':
        return lambda score: (score['relmse'], )
    raise ValueError(f'unknown criterion {criterion!r}; choose from {CRITERIA}')


def greedy_replace(blocks, evaluate, cost, budget=0):
    """DtR's pass: from every block of ``blocks`` Softmax, replace one block at a time by its
    linear version, each time the one whose replacement gives the configuration of least
    ``cost(evaluate(softmax_blocks))``, until ``budget`` blocks are left Softmax.

    ``evaluate`` maps a frozenset of Softmax blocks to its scores. Returns the steps: the
    start (``replaced=None``) and one per replacement, each with ``softmax`` (the sorted
    blocks left), ``replaced``, ``score`` and ``trials`` (every candidate's scores, by block).
    The sets along the path are nested, so the pass run to 0 gives the choice for every
    budget.
    """
    softmax = frozenset(blocks)
    if not 0 <= budget <= len(softmax):
        raise ValueError(f'budget {budget} is outside 0..{len(softmax)}')
    steps = [dict(softmax=sorted(softmax), replaced=None, score=evaluate(softmax), trials={})]
    while len(softmax) > budget:
        trials = {block: evaluate(softmax - {block}) for block in sorted(softmax)}
        replaced = min(trials, key=lambda block: (cost(trials[block]), block))
        softmax = softmax - {replaced}
        steps.append(dict(softmax=sorted(softmax), replaced=replaced, score=trials[replaced],
                          trials=trials))
    return steps


def best_subsets(blocks, evaluate, cost, size):
    """Brute force: the Softmax sets of ``size`` blocks ordered by cost (for checking the
    greedy pass on small models)."""
    return sorted((cost(evaluate(frozenset(subset))), subset)
                  for subset in combinations(sorted(blocks), size))


# ------------------------------------------------------------------ the models
def check_pair(student, teacher):
    """Refuse, before any evaluation, a teacher and student that cannot be swapped block by
    block; every problem is named in one error."""
    depth, teacher_depth = len(student.layers), len(teacher.layers)
    if depth != teacher_depth:
        raise ValueError(f'the teacher has {teacher_depth} blocks, the student {depth}: blocks '
                         f'are swapped one for one, so the teacher must have the student\'s '
                         f"depth (give --teacher-config with the student's arch)")
    problems = []
    non_softmax = sorted({layer.attn.attn_type for layer in teacher.layers} - {SOFTMAX})
    if non_softmax:
        problems.append(f"the teacher's attention is {non_softmax}, not Softmax: the pass "
                        f'starts from the all-Softmax model')
    already = [i for i, layer in enumerate(student.layers) if layer.attn.attn_type == SOFTMAX]
    if already:
        problems.append(f'the student already has Softmax attention in blocks {already}: the '
                        f'tool picks which blocks of an all-linear student keep Softmax')
    for trait in ('embed_dims', 'num_heads'):
        differ = [f'block {i}: {getattr(s.attn, trait)} vs {getattr(t.attn, trait)}'
                  for i, (s, t) in enumerate(zip(student.layers, teacher.layers))
                  if getattr(s.attn, trait) != getattr(t.attn, trait)]
        if differ:
            problems.append(f'{trait} differs (student vs teacher: {"; ".join(differ[:4])})')
    if getattr(student, 'patch_size', None) != getattr(teacher, 'patch_size', None):
        problems.append(f'the student cuts {student.patch_size}-pixel patches, the teacher '
                        f'{teacher.patch_size}')
    if problems:
        raise ValueError('the teacher does not fit the student:\n  - ' + '\n  - '.join(problems))


class AttentionSwap:
    """Puts the teacher's Softmax attention module into chosen blocks of the student."""

    def __init__(self, student, teacher):
        self.layers = student.layers
        self.linear = [layer.attn for layer in student.layers]
        self.softmax = [layer.attn for layer in teacher.layers]

    def set(self, softmax_blocks):
        for index, layer in enumerate(self.layers):
            layer.attn = self.softmax[index] if index in softmax_blocks else self.linear[index]

    def restore(self):
        self.set(())


class Evaluator:
    """Scores of a configuration (a set of Softmax blocks) on fixed preprocessed batches."""

    def __init__(self, model, swap, batches):
        self.model = model
        self.swap = swap
        self.batches = batches
        self.reference = None  # the all-Softmax configuration's final tokens, per batch
        self.calls = 0
        self._cache = {}

    @torch.no_grad()
    def _run(self, softmax_blocks):
        tokens = []
        handle = self.swap.layers[-1].register_forward_hook(
            lambda module, args, output: tokens.append(output))
        self.swap.set(softmax_blocks)
        try:
            self.model.eval()
            loss = correct = count = 0.
            for inputs, labels in self.batches:
                logits = self.model(inputs, mode='tensor')
                if isinstance(logits, (tuple, list)):
                    logits = logits[-1]
                loss += float(F.cross_entropy(logits.float(), labels, reduction='sum'))
                correct += int((logits.argmax(dim=-1) == labels).sum())
                count += labels.numel()
        finally:
            self.swap.restore()
            handle.remove()
        return dict(loss=loss / count, accuracy=100. * correct / count), tokens

    def __call__(self, softmax_blocks):
        key = frozenset(softmax_blocks)
        if key not in self._cache:
            all_softmax = frozenset(range(len(self.swap.layers)))
            if self.reference is None and key != all_softmax:
                self(all_softmax)
            score, tokens = self._run(key)
            if key == all_softmax:
                self.reference = tokens
            agreement = fidelity.Agreement()
            for student, teacher in zip(tokens, self.reference):
                agreement.add(student, teacher)
            score.update(cos=agreement.cosine, relmse=agreement.rel_mse)
            self.calls += 1
            self._cache[key] = score
        return self._cache[key]


def validation_batches(cfg, model, num_images, batch_size, device):
    """``(inputs, labels)`` of ``num_images`` images spread evenly over the config's
    validation set (all of it when ``None``), through its test pipeline and the model's
    data preprocessor."""
    from mmengine.dataset import pseudo_collate
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import DATASETS
    loader = cfg.get('val_dataloader') or cfg.get('test_dataloader')
    if not loader or not loader.get('dataset'):
        raise ValueError('the config has no val_dataloader (or test_dataloader) with a dataset')
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        dataset = DATASETS.build(loader['dataset'])
    total = len(dataset)
    if total == 0:
        raise ValueError('the validation set of the config is empty')
    count = total if num_images is None else min(num_images, total)
    indices = sorted({round(i * total / count) for i in range(count)})
    batches = []
    for start in range(0, len(indices), batch_size):
        samples = [dataset[i] for i in indices[start:start + batch_size]]
        data = model.data_preprocessor(pseudo_collate(samples), training=False)
        labels = torch.cat([sample.gt_label for sample in data['data_samples']])
        batches.append((data['inputs'].to(device), labels.to(device)))
    return batches, len(indices)


# ------------------------------------------------------------------ the hybrid
def hybrid_attn_type(student, softmax_blocks):
    """The dict form of the student's operators with ``softmax_blocks`` Softmax, and the
    ``with_cls_token`` the hybrid needs written (None: its operators' convention gives it)."""
    from linvit_mm.models.backbones.hybrid import (class_token_of, describe_attn_types,
                                                    parse_attn_spec)
    types = [SOFTMAX if i in softmax_blocks else layer.attn.attn_type
             for i, layer in enumerate(student.layers)]
    layout = parse_attn_spec(describe_attn_types(types))
    if isinstance(layout, str):
        layout = {'default': layout}
    try:
        inferred = class_token_of(types)
    except ValueError:
        inferred = None
    with_cls_token = None if inferred == student.with_cls_token else student.with_cls_token
    return layout, with_cls_token


def hybrid_state(model, student_path, teacher, softmax_blocks):
    """The model's state dict with block ``i``'s attention tensors the teacher's for each
    ``i`` in ``softmax_blocks`` (operator-specific tensors of the student's go)."""
    prefixes = {i: f'{student_path}.layers.{i}.attn.' for i in softmax_blocks}
    state = {key: value for key, value in model.state_dict().items()
             if not key.startswith(tuple(prefixes.values()))}
    teacher_state = teacher.state_dict()
    for i, prefix in prefixes.items():
        own = f'layers.{i}.attn.'
        state.update({prefix + key[len(own):]: value for key, value in teacher_state.items()
                      if key.startswith(own)})
    return {key: value.detach().cpu() for key, value in state.items()}


def nested(path, value):
    """``nested('backbone', v)`` -> ``{'backbone': v}``; dotted paths nest further."""
    for part in reversed(path.split('.')):
        value = {part: value}
    return value


def build_hybrid(cfg, student_path, layout, with_cls_token, state):
    """The hybrid classifier of the config with the spliced weights, loaded strictly (the
    check that the written config and checkpoint fit each other)."""
    model_cfg = copy.deepcopy(cfg.model)
    if cfg.get('data_preprocessor') is not None:
        model_cfg.setdefault('data_preprocessor', copy.deepcopy(cfg.data_preprocessor))
    backbone = model_cfg
    for part in student_path.split('.'):
        backbone = backbone[part]
    backbone['attn_type'] = layout
    if with_cls_token is not None:
        backbone['with_cls_token'] = with_cls_token
    model = fidelity.build_model(model_cfg)
    model.load_state_dict(state, strict=True)
    return model


def config_text(config, checkpoint, student_path, layout, with_cls_token, out_dir, budget,
                criterion, num_images, score):
    base = osp.relpath(osp.abspath(config), osp.abspath(out_dir))
    backbone = dict(attn_type=dict(_delete_=True, **layout))
    if with_cls_token is not None:
        backbone['with_cls_token'] = with_cls_token
    softmax = layout.get(SOFTMAX, [])
    lines = [
        f'# Written by tools/analysis_tools/select_hybrid_blocks.py: the DtR greedy pass over',
        f'#   {checkpoint}',
        f'# keeps Softmax attention in blocks {softmax} (budget {budget}, criterion {criterion},',
        f'# {num_images} validation images: loss {score["loss"]:.4f}, top-1 '
        f'{score["accuracy"]:.2f} %).',
        f'# load_from is the student with the teacher\'s attention in those blocks.',
        f"_base_ = '{base}'",
        '',
        f'model = {nested(student_path, backbone)!r}',
        f"load_from = '{osp.abspath(osp.join(out_dir, 'hybrid.pth'))}'",
    ]
    return '\n'.join(lines) + '\n'


# ------------------------------------------------------------------ output
def block_rows(steps, student, criterion):
    cost = cost_key(criterion)
    start = steps[0]['score']
    first = steps[1]['trials'] if len(steps) > 1 else {}
    step_of = {step['replaced']: index for index, step in enumerate(steps) if index}
    rows = []
    for block, score in sorted(first.items()):
        rows.append(dict(block=block, operator=student.layers[block].attn.attn_type, **score,
                         delta=_delta(criterion, score, start), greedy_step=step_of.get(block)))
    return sorted(rows, key=lambda row: (cost(first[row['block']]), row['block']))


def _delta(criterion, score, start):
    key = {'loss': 'loss', 'accuracy': 'accuracy', 'fidelity': 'relmse'}[criterion]
    return score[key] - start[key]


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
    cfg = fidelity.load_config(args.config, args.cfg_options)
    hook = fidelity.find_distill_hook(cfg) or {}
    student_path = hook.get('student', 'backbone')
    model = fidelity.load_student(cfg, args.checkpoint, args.device)
    if not getattr(model, 'with_head', False):
        raise ValueError(f'the model of {args.config} ({type(model).__name__}) has no head to '
                         f'score the validation set with; the tool selects blocks of a '
                         f'classifier')
    student = fidelity.backbone_of(model, student_path)
    teacher, teacher_source = fidelity.build_teacher(cfg, args.teacher_config,
                                                     args.teacher_checkpoint, args.device)
    check_pair(student, teacher)
    depth = len(student.layers)
    if not 1 <= args.budget < depth:
        raise ValueError(f'--budget {args.budget}: a hybrid of the {depth} blocks keeps 1 to '
                         f'{depth - 1} Softmax blocks')

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
        f.write(config_text(args.config, args.checkpoint, student_path, layout, with_cls_token,
                            args.out_dir, args.budget, args.criterion, num_images,
                            chosen['score']))

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
