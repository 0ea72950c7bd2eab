"""Which blocks of a linear-attention student keep Softmax attention: the greedy pass of DtR,
Distill-then-Replace (Xia et al., 2026, arXiv 2601.11667), and the hybrid it selects.

From the all-Softmax configuration, the pass replaces one block at a time by its linear
version, each time the one whose replacement costs least, until the budget of Softmax blocks
is left (:func:`greedy_replace`). A configuration is the student classifier with, in each
block, its own (linear) attention module or the teacher's Softmax one
(:class:`AttentionSwap`); :class:`Evaluator` scores it on fixed validation batches. The
selected hybrid is the student's config with ``attn_type=dict(default=..., softmax=[...])``
and the student's weights with the teacher's attention in the kept blocks
(:func:`hybrid_attn_type`, :func:`hybrid_state`, :func:`build_hybrid`,
:func:`hybrid_config_text`).
"""
import copy
import os.path as osp
from itertools import combinations

import torch
import torch.nn.functional as F

from linvit_mm.models import pairing

from .fidelity import Agreement
from .student_teacher import build_model

__all__ = ['CRITERIA', 'AttentionSwap', 'Evaluator', 'best_subsets', 'build_hybrid',
           'check_budget', 'check_pair', 'cost_key', 'criterion_delta', 'greedy_replace',
           'hybrid_attn_type', 'hybrid_config_text', 'hybrid_state', 'validation_batches']

CRITERIA = ('loss', 'accuracy', 'fidelity')
SOFTMAX = 'softmax'
_CRITERION_SCORE = {'loss': 'loss', 'accuracy': 'accuracy', 'fidelity': 'relmse'}


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


def criterion_delta(criterion, score, start):
    """The change of the criterion's score (relMSE for ``fidelity``) from ``start``."""
    key = _CRITERION_SCORE[criterion]
    return score[key] - start[key]


def greedy_replace(blocks, evaluate, cost, budget=0):
    """DtR's pass: from every block of ``blocks`` Softmax, replace one block at a time by its
    linear version, each time the one whose replacement gives the configuration of least
    ``cost(evaluate(softmax_blocks))``, until ``budget`` blocks are left Softmax.

    ``evaluate`` maps a frozenset of Softmax blocks to its scores. Returns the steps: the
    start (``replaced=None``) and one per replacement, each with ``softmax`` (the sorted
    blocks left), ``replaced``, ``score`` and ``trials`` (every candidate's scores, by block).
    The sets along the path are nested, so the pass run to 0 gives the choice for every
    budget. Ties go to the lower block index.
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
    block (:func:`linvit_mm.models.pairing.fit_problems`: depth, width, heads, patch size, a
    Softmax teacher) or a student that already has Softmax blocks; every problem is named in
    one error."""
    # the teacher is built and its weights loaded already, from a file or its init_cfg
    problems = pairing.fit_problems(student, teacher, require_weights=False,
                                    non_softmax_advice='the pass starts from the all-Softmax '
                                    'model')
    already = pairing.softmax_blocks(pairing.attention_modules(student))
    if already:
        problems.append(f'the student already has Softmax attention in blocks {already}: the '
                        f'tool picks which blocks of an all-linear student keep Softmax')
    pairing.refuse(problems, 'the teacher does not fit the student')


def check_budget(budget, depth):
    """Refuse a budget that leaves no linear or no Softmax block in ``depth`` blocks."""
    if not 1 <= budget < depth:
        raise ValueError(f'--budget {budget}: a hybrid of the {depth} blocks keeps 1 to '
                         f'{depth - 1} Softmax blocks')


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
    """Scores of a configuration (a set of Softmax blocks) on fixed ``(inputs, labels)``
    batches: ``loss`` (mean cross-entropy of the logits, no label smoothing), ``accuracy``
    (top-1, %) and ``cos`` / ``relmse`` of the last block's output tokens against the
    all-Softmax configuration's. Each configuration is run once; ``calls`` counts them."""

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
            agreement = Agreement()
            for student, teacher in zip(tokens, self.reference):
                agreement.add(student, teacher)
            score.update(cos=agreement.cosine, relmse=agreement.rel_mse)
            self.calls += 1
            self._cache[key] = score
        return self._cache[key]


def validation_batches(cfg, model, num_images, batch_size, device):
    """``(inputs, labels)`` of ``num_images`` images spread evenly over the config's
    validation set (all of it when ``None``), through its test pipeline and the model's
    data preprocessor; and the number of images."""
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


def _nested(path, value):
    """``_nested('backbone', v)`` -> ``{'backbone': v}``; dotted paths nest further."""
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
    model = build_model(model_cfg)
    model.load_state_dict(state, strict=True)
    return model


def hybrid_config_text(config, checkpoint, student_path, layout, with_cls_token, out_dir,
                       budget, criterion, num_images, score):
    """The hybrid's config: a leaf over ``config`` (referred to relative to ``out_dir``, where
    it is written) that sets the layout and loads ``out_dir/hybrid.pth``."""
    base = osp.relpath(osp.abspath(config), osp.abspath(out_dir))
    backbone = dict(attn_type=dict(_delete_=True, **layout))
    if with_cls_token is not None:
        backbone['with_cls_token'] = with_cls_token
    softmax = layout.get(SOFTMAX, [])
    lines = [
        '# Written by tools/analysis_tools/select_hybrid_blocks.py: the DtR greedy pass over',
        f'#   {checkpoint}',
        f'# keeps Softmax attention in blocks {softmax} (budget {budget}, criterion {criterion},',
        f'# {num_images} validation images: loss {score["loss"]:.4f}, top-1 '
        f'{score["accuracy"]:.2f} %).',
        '# load_from is the student with the teacher\'s attention in those blocks.',
        f"_base_ = '{base}'",
        '',
        f'model = {_nested(student_path, backbone)!r}',
        f"load_from = '{osp.abspath(osp.join(out_dir, 'hybrid.pth'))}'",
    ]
    return '\n'.join(lines) + '\n'
