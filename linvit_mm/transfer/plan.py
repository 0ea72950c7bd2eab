"""The plan of a transfer: the fate of every tensor of the model (copied, in which rows, or kept
and why), decided and checked against the checkpoint before anything is written."""
from collections import OrderedDict

import torch

from linvit_mm.models.attention import LEADING_ROWS, OWN_INIT, WHOLE

from .settings import block_index, component_of, is_softmax_tensor

__all__ = ['plan_transfer']

_MAX_LISTED_MISMATCHES = 5

NOT_SELECTED = 'not selected'
OPERATOR_SPECIFIC = 'operator-specific'
NO_COUNTERPART = 'no Softmax ViT counterpart'


def _operator_of(module, rel_name):
    """The attention operator that holds the tensor ``rel_name`` of ``module``, or None."""
    parts = rel_name.split('.')
    if 'attn' not in parts:
        return None
    try:
        return module.get_submodule('.'.join(parts[:parts.index('attn') + 1]))
    except AttributeError:
        return None


def plan_transfer(module, ckpt, selected, prefix, notes):
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
        # tokens come as class token, registers, patches: the checkpoint's slots are the first
        # tokens', the zeros those after them
        zeros = source.new_zeros(1, extra - src_extra, source.shape[2])
        source = torch.cat([source[:, :src_extra], zeros, source[:, src_extra:]], 1)
        what.append(f'added {extra - src_extra} zero slot(s) for the model\'s leading tokens '
                    f'the checkpoint gives no position embedding')
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
