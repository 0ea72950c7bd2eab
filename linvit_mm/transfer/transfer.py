"""Copy (parts of) a Softmax ViT checkpoint into a LinearViT or a classifier head.

:func:`transfer_softmax_weights` implements the initialisation settings of the paper
(Table A; see :mod:`linvit_mm.transfer.settings` for the presets and the components) on a
module that already carries its default initialisation: tensors it does not set keep
exactly what they had.

Rules:

- Every tensor is checked before any is written; an error copies nothing. Errors: a tensor
  of a selected component whose shape does not fit (a ViT-B checkpoint into a Tiny model, a
  different patch size) or a depth mismatch (the first offending tensors are named; both
  found by the plan, :mod:`linvit_mm.transfer.plan`); and, checked in
  :mod:`linvit_mm.transfer.checks`, a head count of the checkpoint that differs from the
  model's attention operators when attention is copied, a ``prefix`` that selects no tensor
  of the checkpoint (the error lists the prefixes it has), a selected component the model
  has but the checkpoint lacks entirely, and a component the checkpoint holds only in part
  (per block for ``attention``, ``mlp``, ``norms``), unless ``allow_partial``; and an
  architecture switch (RoPE, registers, LayerScale, the MLP type, a pre-norm, a qkv bias,
  the patch size) in which checkpoint and model differ where a copied component depends on
  it.
- A classifier head with a different number of classes keeps its own init and is reported
  as such (a transfer to another label set); a head of another width is an error.
- Copies are exact ``copy_`` under ``no_grad``. The only tensors that are not bit-equal to
  the checkpoint are a ``pos_embed`` resized to another patch grid (the model's own
  resampling: its interpolation mode and antialias; mmpretrain's ``resize_pos_embed`` for a
  module without one) and a dtype conversion.
- Operator-specific tensors (MHLA's ``block_mixing`` and ``value_conv``; TTT's ``w1``,
  ``w2``, ``w3``, ``cpe``, the extra ``3d`` qkv rows and its ``(C, C + d)`` proj) keep the
  operator's own init. Which rows of ``qkv`` / ``proj`` a checkpoint fills is the
  operator class's ``softmax_fill``; such tensors never make a component "in part". A
  model without class token or learned position embedding (MHLA, TTT) reports the
  checkpoint's ``cls_token`` / ``pos_embed`` as "not in model".
"""
import logging
import re
from collections import OrderedDict

import torch
from mmengine.logging import print_log

from .analytic import IMPULSE_DEFAULTS, MIMETIC_DEFAULTS, impulse_init, mimetic_init
from .checkpoint import SoftmaxCheckpoint, load_softmax_checkpoint
from .checks import (attention_operators, check_activation, check_architecture,
                     check_complete, check_head_counts, unknown_tensors)
from .plan import plan_transfer
from .report import REPORT_STATUSES, format_transfer_report
from .settings import COMPONENTS, component_of, resolve_setting

__all__ = ['transfer_softmax_weights']

_ANALYTIC = {
    'mimetic': (mimetic_init, MIMETIC_DEFAULTS),
    'impulse': (impulse_init, IMPULSE_DEFAULTS),
}


def transfer_softmax_weights(module, checkpoint=None, setting=None, components=None,
                             prefix='backbone.', logger='current', analytic_cfg=None,
                             map_location='cpu', fc_norm_target='ln2', num_heads=None,
                             allow_partial=False, family=None):
    """Initialise ``module`` from a Softmax ViT checkpoint with one setting of the paper.

    Args:
        module (nn.Module): a ``LinearViT`` (``prefix='backbone.'``) or a classifier head
            such as ``VisionTransformerClsHead`` (``prefix='head.'``), already carrying its
            default initialisation.
        checkpoint (str | PathLike | Mapping | SoftmaxCheckpoint, optional): a checkpoint
            file, a loaded checkpoint or state dict of any layout
            :func:`load_softmax_checkpoint` reads, or its result. Needed unless the setting
            copies nothing (``random``, ``mimetic``, ``impulse``); then it is not read.
        setting (str, optional): ``random``, ``mimetic``, ``impulse``, ``copy``,
            ``mlpcopy`` or ``fullcopy``.
        components (list[str], optional): instead of ``setting``, the components to copy
            (a subset of :data:`COMPONENTS`), e.g. for the Table G ablation.
        prefix (str): the module's place in mmpretrain names: its tensor ``x`` is the
            checkpoint's ``prefix + x``. ``''`` fits a whole ``ImageClassifier``.
        logger (str | logging.Logger): where the report table goes (``print_log``).
        analytic_cfg (dict, optional): overrides of the Mimetic / Impulse constants
            (:data:`MIMETIC_DEFAULTS`, :data:`IMPULSE_DEFAULTS`).
        map_location, fc_norm_target: passed to :func:`load_softmax_checkpoint` when the
            checkpoint is read here.
        num_heads (int, optional): the checkpoint's number of attention heads, for
            checkpoints that do not state it (see :func:`load_softmax_checkpoint`). With a
            known count, copying attention into operators with another count is refused;
            without one the copy assumes the model's count and warns.
        allow_partial (bool): copy a component the checkpoint holds only in part (e.g. a
            block whose ``fc1`` is missing) instead of refusing; what was left out is
            reported (``'copied in part'``) and logged as a warning.
        family (str, optional): the checkpoint's source family, for one whose tensors do
            not tell it (see :func:`load_softmax_checkpoint`).

    Returns:
        dict: the report. ``'setting'``, ``'components'``, ``'analytic_method'``,
        ``'source_format'``, ``'prefix'``; ``'counts'``: per component, the number of the
        module's tensors ``'copied'``, ``'analytic'`` (set by Mimetic / Impulse),
        ``'kept own init'`` and ``'absent in checkpoint'`` (each module tensor is in exactly
        one of these), and of checkpoint tensors ``'not in model'``; the names (relative
        to the module) under the same keys, ``'kept own init'`` mapping each name to its
        reason (``'not selected'``, ``'operator-specific'``, a shape that differs, ...);
        ``'partial'``: tensors of which only some rows were copied; ``'copied in part'``:
        per component, ``{block index (None outside the blocks): [names absent in the
        checkpoint]}`` (only with ``allow_partial``); ``'num_heads'``: the checkpoint's
        head count (None if unknown) and the model operators' counts; ``'notes'``;
        ``'unknown in checkpoint'``: the checkpoint's tensors (source names) that have no
        counterpart in a Softmax ViT and no known reason to be left out, copied by no
        setting (also a warning); ``'warnings'`` (also logged at WARNING level): unknown
        tensors, a CLIP checkpoint's unknown MLP activation, partial copies, ...

    Raises:
        ValueError: unknown setting or component, both or neither given, a checkpoint
            missing for a copying setting, a checkpoint that does not fit the model (shapes,
            depth, head count of copied attention), a selected tensor that is not floating
            point (an integer weight is not cast), a selected component the checkpoint
            lacks, one it holds in part (without ``allow_partial``), Mimetic / Impulse on an
            operator without a QK^T form. Nothing is copied then.
        FileNotFoundError: the checkpoint path does not exist.
    """
    setting, selected, analytic = resolve_setting(setting, components)
    analytic_kwargs = _analytic_kwargs(analytic, analytic_cfg)
    if analytic is not None:
        _check_qk_operators(module, analytic)

    notes, warnings = [], []
    ckpt = None
    if selected:
        if checkpoint is None:
            raise ValueError(f'{_describe(setting, selected)} copies from a Softmax checkpoint, '
                             f'but checkpoint is None; only random, mimetic and impulse need none')
        ckpt = _as_checkpoint(checkpoint, map_location, fc_norm_target, num_heads, family)
        notes += [f'checkpoint: {note}' for note in ckpt.notes]
    elif checkpoint is not None:
        notes.append(f'{_describe(setting, selected)} copies nothing; the checkpoint was not '
                     f'read')

    check_architecture(module, ckpt, selected, prefix, warnings)
    check_activation(module, ckpt, selected, prefix, warnings)
    unknown = unknown_tensors(ckpt)
    if unknown:
        warnings.append(_unknown_text(unknown))
    plan = plan_transfer(module, ckpt, selected, prefix, notes)
    heads = check_head_counts(module, ckpt, selected, notes, warnings)
    in_part = check_complete(module, ckpt, plan, _describe(setting, selected), selected, prefix,
                             allow_partial, notes, warnings)
    with torch.no_grad():
        for target, source, rows in plan['copies']:
            (target if rows is None else target[:rows]).copy_(source)

    status = plan['status']
    if analytic is not None:
        init_fn, _ = _ANALYTIC[analytic]
        for name in init_fn(module, **analytic_kwargs):
            status[name] = ('analytic', None)
        if analytic == 'impulse' and getattr(module, 'pos_embed', None) is None \
                and hasattr(module, 'patch_resolution'):
            notes.append('impulse: the model has no learned pos_embed; query/key were solved '
                         'against its fixed sin-cos embedding of the '
                         f'{tuple(module.patch_resolution)} grid, which is not rescaled')

    report = _build_report(status, plan['not_in_model'], plan['partial'], prefix, setting,
                           selected, analytic, ckpt, notes)
    report.update({'copied in part': in_part, 'num_heads': heads, 'warnings': warnings,
                   'unknown in checkpoint': unknown})
    print_log(format_transfer_report(report, type(module).__name__), logger=logger)
    for warning in warnings:
        print_log(f'Softmax weight transfer into {type(module).__name__}: {warning}',
                  logger=logger, level=logging.WARNING)
    return report


# --------------------------------------------------------------------------- inputs


def _unknown_text(unknown):
    where = [f'{key} ({_place(key)})' if _place(key) else key for key in unknown]
    return (f'{len(unknown)} tensor(s) of the checkpoint are unknown to the transfer (no '
            f'counterpart in a Softmax ViT) and are not copied, whatever the setting; a '
            f'copied component they belong to computes without them:\n  '
            + '\n  '.join(where))


def _place(key):
    match = re.search(r'(?:^|\.)(?:blocks|layers)\.(\d+)\.(attn\.)?', key)
    if match is None:
        return None
    return f"inside block {match.group(1)}'s attention" if match.group(2) else \
        f'inside block {match.group(1)}'


def _describe(setting, selected):
    return f'setting {setting!r}' if setting is not None else f'components {list(selected)}'


def _analytic_kwargs(analytic, analytic_cfg):
    if analytic is None:
        if analytic_cfg:
            raise ValueError(f'analytic_cfg {analytic_cfg} is only used by the mimetic and '
                             f'impulse settings')
        return {}
    _, defaults = _ANALYTIC[analytic]
    overrides = dict(analytic_cfg or {})
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f'unknown {analytic} option(s) {unknown}; valid options are: '
                         f'{", ".join(defaults)}')
    return {**defaults, **overrides}


def _check_qk_operators(module, analytic):
    for name, attn in attention_operators(module):
        if not attn.has_qk_form:
            raise ValueError(f'the {analytic} setting is not defined for the {attn.attn_type!r} '
                             f'operator ({name}): {analytic.capitalize()} shapes the per-head '
                             f'QK^T product W_q^T W_k and the value-output product, and '
                             f'{attn.attn_type} has no QK^T parameterisation: '
                             f'{attn.qk_form_absent_because}. Use random, copy, mlpcopy or '
                             f'fullcopy')


def _as_checkpoint(checkpoint, map_location, fc_norm_target, num_heads, family):
    if isinstance(checkpoint, SoftmaxCheckpoint):
        return checkpoint.with_family(family).with_num_heads(num_heads)
    return load_softmax_checkpoint(checkpoint, map_location=map_location,
                                   fc_norm_target=fc_norm_target, num_heads=num_heads,
                                   family=family)


# --------------------------------------------------------------------------- report


def _build_report(status, not_in_model, partial, prefix, setting, selected, analytic, ckpt,
                  notes):
    names = {key: [] for key in REPORT_STATUSES}
    names['kept own init'] = OrderedDict()
    groups = list(COMPONENTS)
    counts = OrderedDict((group, dict.fromkeys(REPORT_STATUSES, 0)) for group in groups)

    def count(group, key):
        if group not in counts:
            counts[group] = dict.fromkeys(REPORT_STATUSES, 0)
        counts[group][key] += 1

    for rel, (state, reason) in status.items():
        group = component_of(prefix + rel) or 'other'
        count(group, state)
        if state == 'kept own init':
            names[state][rel] = reason
        else:
            names[state].append(rel)
    for rel in not_in_model:
        count(component_of(prefix + rel), 'not in model')
        names['not in model'].append(rel)
    return dict(setting=setting, components=list(selected), analytic_method=analytic,
                source_format=ckpt.source_format if ckpt is not None else None,
                prefix=prefix, counts=counts, partial=dict(partial), notes=notes, **names)
