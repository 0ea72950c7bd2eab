"""Copy (parts of) a Softmax ViT checkpoint into a LinearViT or a classifier head.

:func:`transfer_softmax_weights` implements the initialisation settings of the paper
(Table A; see :mod:`linvit_mm.transfer.settings` for the presets and the components) on a
module that already carries its default initialisation: tensors it does not set keep
exactly what they had.

Rules:

- Every tensor is checked before any is written; an error copies nothing. Errors: a
  tensor of a selected component whose shape does not fit (a ViT-B checkpoint into a Tiny
  model, a different patch size) or a depth mismatch (the first offending tensors are
  named); and, checked in :mod:`linvit_mm.transfer.checks`, a head count of the checkpoint
  that differs from the model's attention operators when attention is copied, a ``prefix``
  that selects no tensor of the checkpoint (the error lists the prefixes it has), a
  selected component the model has but the checkpoint lacks entirely, and a component the
  checkpoint holds only in part (per block for ``attention``, ``mlp``, ``norms``), unless
  ``allow_partial``; and an architecture switch (RoPE, registers, LayerScale, the MLP type,
  a pre-norm, a qkv bias, the patch size) in which checkpoint and model differ where a
  copied component depends on it.
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

from linvit_mm.models.attention import LEADING_ROWS, OWN_INIT, WHOLE

from .analytic import IMPULSE_DEFAULTS, MIMETIC_DEFAULTS, impulse_init, mimetic_init
from .checkpoint import SoftmaxCheckpoint, load_softmax_checkpoint
from .checks import (attention_operators, check_activation, check_architecture,
                     check_complete, check_head_counts, unknown_tensors)
from .report import REPORT_STATUSES, format_transfer_report
from .settings import COMPONENTS, block_index, component_of, is_softmax_tensor, resolve_setting

__all__ = ['transfer_softmax_weights']

_ANALYTIC = {
    'mimetic': (mimetic_init, MIMETIC_DEFAULTS),
    'impulse': (impulse_init, IMPULSE_DEFAULTS),
}
_MAX_LISTED_MISMATCHES = 5

NOT_SELECTED = 'not selected'
OPERATOR_SPECIFIC = 'operator-specific'
NO_COUNTERPART = 'no Softmax ViT counterpart'


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
    plan = _plan(module, ckpt, selected, prefix, notes)
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


# --------------------------------------------------------------------------- planning


def _operator_of(module, rel_name):
    """The attention operator that holds the tensor ``rel_name`` of ``module``, or None."""
    parts = rel_name.split('.')
    if 'attn' not in parts:
        return None
    try:
        return module.get_submodule('.'.join(parts[:parts.index('attn') + 1]))
    except AttributeError:
        return None


def _plan(module, ckpt, selected, prefix, notes):
    """Decide the fate of every tensor; raise (before any write) if the checkpoint misfits.

    Returns dict(copies=[(target, source, rows or None)], status={rel: (status, reason)},
    not_in_model=[rel], partial={rel: text}, found={rel: bool}, ckpt_tensors={rel: tensor},
    module_components=set), ``found`` saying for each tensor a selected component could fill
    whether the checkpoint has it, ``module_components`` the components of which the module
    has Softmax ViT tensors under ``prefix``, selected or not.
    """
    model_tensors = module.state_dict(keep_vars=True)
    ckpt_tensors = OrderedDict()
    if ckpt is not None:
        ckpt_tensors = OrderedDict((name[len(prefix):], value)
                                   for name, value in ckpt.state_dict.items()
                                   if name.startswith(prefix))
    copies, status, partial, mismatches, not_float = [], OrderedDict(), OrderedDict(), [], []
    found = OrderedDict()
    module_components = {component_of(prefix + rel) for rel in model_tensors
                         if is_softmax_tensor(prefix + rel)}

    for rel, target in model_tensors.items():
        full = prefix + rel
        component = component_of(full)
        if component is None or component not in selected:
            status[rel] = ('kept own init', NOT_SELECTED if component else NO_COUNTERPART)
            continue
        if not is_softmax_tensor(full):
            status[rel] = ('kept own init',
                           OPERATOR_SPECIFIC if component == 'attention' else NO_COUNTERPART)
            continue
        fill = WHOLE
        if component == 'attention':
            operator = _operator_of(module, rel)
            layer_kind = rel.split('.')[-2]  # 'qkv' or 'proj'
            fill = getattr(operator, 'softmax_fill', {}).get(layer_kind, WHOLE)
            if fill == OWN_INIT:
                status[rel] = ('kept own init',
                               f'{OPERATOR_SPECIFIC}: the {operator.attn_type} '
                               f'{layer_kind} layer is not a Softmax block\'s')
                continue
        found[rel] = rel in ckpt_tensors
        if not found[rel]:
            status[rel] = ('absent in checkpoint', None)
            continue
        source = ckpt_tensors[rel]
        if not source.is_floating_point():
            not_float.append(f'{full}: {source.dtype}')
            continue
        if fill == LEADING_ROWS and target.shape != source.shape:
            if _differs_in_rows_only(source, target) and source.shape[0] < target.shape[0]:
                rows = source.shape[0]
                copies.append((target, source, rows))
                status[rel] = ('copied', None)
                partial[rel] = (f'rows 0:{rows} of {target.shape[0]} copied, rows '
                                f'{rows}:{target.shape[0]} are operator-specific and keep '
                                f'their own init')
            else:
                mismatches.append(_mismatch(full, source, target))
            continue
        if target.shape == source.shape:
            copies.append((target, source, None))
            status[rel] = ('copied', None)
        elif component == 'pos_embed':
            resized, why = _fit_pos_embed(source, target, ckpt, module)
            if resized is None:
                mismatches.append(_mismatch(full, source, target) + f' ({why})')
            else:
                copies.append((target, resized, None))
                status[rel] = ('copied', None)
                notes.append(f'pos_embed: {why}')
        elif component == 'head' and _differs_in_rows_only(source, target):
            # a head for another label set: one row per class
            status[rel] = ('kept own init',
                           f'shape differs: the checkpoint has {source.shape[0]} classes, the '
                           f'model {target.shape[0]}')
        else:
            mismatches.append(_mismatch(full, source, target))

    not_in_model = [rel for rel in ckpt_tensors
                    if rel not in model_tensors and component_of(prefix + rel) in selected]

    if not_float:
        raise ValueError(
            f'the checkpoint ({ckpt.source_format} layout) holds {len(not_float)} selected '
            f'tensor(s) that are not floating point, which a copy would cast into the '
            f'{type(module).__name__}\'s weights:\n  '
            + '\n  '.join(not_float[:_MAX_LISTED_MISMATCHES])
            + ('\n  ...' if len(not_float) > _MAX_LISTED_MISMATCHES else '')
            + '\nNothing was copied. Use the checkpoint in the precision it was trained in.')
    depth_problem = _depth_problem(model_tensors, ckpt_tensors, selected, prefix)
    if mismatches or depth_problem:
        raise ValueError(_misfit_message(ckpt, module, mismatches, depth_problem))
    return dict(copies=copies, status=status, not_in_model=not_in_model, partial=partial,
                found=found, ckpt_tensors=ckpt_tensors, module_components=module_components)


def _mismatch(name, source, target):
    return f'{name}: checkpoint {tuple(source.shape)} vs model {tuple(target.shape)}'


def _differs_in_rows_only(source, target):
    """Same shape but for the first (output) axis."""
    return (source.dim() == target.dim() and source.shape[1:] == target.shape[1:]
            and source.shape[0] != target.shape[0])


def _fit_pos_embed(source, target, ckpt, module):
    """The checkpoint's pos_embed laid out for the model's grid and extra-token slots."""
    from mmpretrain.models.utils import resize_pos_embed
    if source.dim() != 3 or source.shape[0] != 1 or source.shape[2] != target.shape[2]:
        return None, 'embedding widths differ'
    grid = getattr(module, 'patch_resolution', None)
    extra = getattr(module, 'pos_embed_extra_tokens', getattr(module, 'num_extra_tokens', None))
    if grid is None or extra is None:
        return None, 'the model does not say its patch grid (patch_resolution)'
    if ckpt.pos_grid is None or ckpt.num_extra_tokens is None:
        return None, 'the checkpoint position embedding is not extra tokens plus a square grid'
    grid, src_grid, src_extra = tuple(grid), tuple(ckpt.pos_grid), ckpt.num_extra_tokens
    if target.shape[1] != extra + grid[0] * grid[1]:
        return None, 'the model pos_embed does not match its own patch grid'
    what = []
    if src_extra > extra:
        source = torch.cat([source[:, :extra], source[:, src_extra:]], dim=1)
        what.append(f'dropped {src_extra - extra} leading slot(s) the model has no token for')
    elif src_extra < extra:
        source = torch.cat([source.new_zeros(1, extra - src_extra, source.shape[2]), source], 1)
        what.append(f'added {extra - src_extra} zero slot(s) for the model\'s class token (the '
                    f'checkpoint gives it no position embedding)')
    if src_grid != grid:
        mode = getattr(module, 'interpolate_mode', 'bicubic')
        if hasattr(module, '_resample_pos_embed'):
            # the model's own resampling, as at its forward (timm's for the source arches)
            source = module._resample_pos_embed(source, src_grid, grid)
        else:
            source = resize_pos_embed(source, src_grid, grid, mode=mode, num_extra_tokens=extra)
        what.append(f'resized from {src_grid[0]}x{src_grid[1]} to {grid[0]}x{grid[1]} ({mode})')
    return source, '; '.join(what)


def _depth_problem(model_tensors, ckpt_tensors, selected, prefix):
    if not {'attention', 'mlp', 'norms'} & set(selected) or not ckpt_tensors:
        return None
    model_blocks = {block_index(prefix + rel) for rel in model_tensors} - {None}
    ckpt_blocks = {block_index(prefix + rel) for rel in ckpt_tensors} - {None}
    if not model_blocks or model_blocks == ckpt_blocks:
        return None
    missing = sorted(model_blocks - ckpt_blocks)
    extra = sorted(ckpt_blocks - model_blocks)
    text = (f'depth differs: the model has {len(model_blocks)} blocks, the checkpoint '
            f'{len(ckpt_blocks)}')
    if missing:
        text += f'; blocks {_ranges(missing)} of the model are not in the checkpoint'
    if extra:
        text += f'; checkpoint blocks {_ranges(extra)} have no place in the model'
    return text


def _ranges(indices):
    spans, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            spans.append(f'{start}' if start == prev else f'{start}-{prev}')
            start = cur
    return ', '.join(spans)


def _misfit_message(ckpt, module, mismatches, depth_problem):
    lines = [f'the Softmax checkpoint ({ckpt.source_format} layout, embed_dims='
             f'{ckpt.embed_dims}, depth={ckpt.depth}, patch_size={ckpt.patch_size}) does not fit '
             f'the {type(module).__name__}']
    if depth_problem:
        lines.append(f'  {depth_problem}')
    if mismatches:
        lines.append(f'  {len(mismatches)} tensor(s) differ in shape, the first:')
        lines += [f'    {text}' for text in mismatches[:_MAX_LISTED_MISMATCHES]]
    lines.append('Nothing was copied. Pick the model size (arch, patch_size, depth) of the '
                 'checkpoint.')
    return '\n'.join(lines)


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
