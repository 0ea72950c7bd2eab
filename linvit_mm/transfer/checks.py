"""What must hold before a Softmax checkpoint is copied, beyond tensor shapes.

- The head count: no shape tells how many heads a checkpoint's attention has, and copied
  ``q``/``k``/``v`` rows split into other heads compute another function.
- The architecture: what a copied component computes depends on switches no tensor shape
  of it shows (RoPE, registers, LayerScale, the MLP type, a pre-norm, a qkv bias, the patch
  size); checkpoint and model must agree on each one a selected component depends on.
- What the checkpoint's tensors cannot show: the MLP activation of a CLIP checkpoint
  (QuickGELU for OpenAI's, GELU for OpenCLIP's, in identical tensors) is warned about.
- Unknown tensors: a checkpoint tensor that has no counterpart in a Softmax ViT is copied
  by no setting; :func:`unknown_tensors` lists them for the report's warning.
- Completeness: every selected component the module has must come from the checkpoint, and
  wholly. A component is judged per block for the block components (``attention``,
  ``mlp``, ``norms``) and as a whole for the norms outside the blocks and the other
  components; a part copied next to tensors that keep their own init computes neither the
  checkpoint's function nor a fresh one.
"""
from collections import OrderedDict

from linvit_mm.models.attention import OWN_INIT, WHOLE, BaseAttention

from .families import FAMILIES, read_architecture
from .key_maps import UNMAPPED_GROUP
from .settings import COMPONENTS, block_index, component_of

__all__ = ['attention_operators', 'check_head_counts', 'check_architecture', 'check_complete',
           'check_activation', 'unknown_tensors']

_MAX_LISTED_NAMES = 4
_MAX_LISTED_PARTS = 5
# Components judged block by block for completeness.
_BLOCK_COMPONENTS = ('attention', 'mlp', 'norms')


def attention_operators(module):
    """``(name, operator)`` of every attention operator in ``module``."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, BaseAttention)]


# --------------------------------------------------------------------- head count


def check_head_counts(module, ckpt, selected, notes, warnings):
    """Compare the checkpoint's head count with the model's operators.

    Refuses copying attention into operators with another count; notes a difference
    that does not matter (attention not copied); warns when the checkpoint's count is
    unknown and attention is copied.

    Returns:
        dict: ``{'checkpoint': count or None, 'model': sorted operator counts}``, or None
        when no checkpoint was read.
    """
    if ckpt is None:
        return None
    # Only operators that take the checkpoint's qkv rows split them into heads.
    heads = OrderedDict((name, operator.num_heads) for name, operator in attention_operators(module)
                        if operator.softmax_fill.get('qkv', WHOLE) != OWN_INIT)
    model_counts = sorted(set(heads.values()))
    summary = {'checkpoint': ckpt.num_heads, 'model': model_counts}
    if not heads:
        return summary
    copies_attention = 'attention' in selected
    if ckpt.num_heads is None:
        if copies_attention:
            warnings.append(
                f'the checkpoint does not state its number of attention heads, so the copied '
                f'attention is taken to have the model\'s ({_counts_text(model_counts)}); with '
                f'another count its q/k/v rows are split into other heads and compute another '
                f'function. State the checkpoint\'s count with num_heads=N (SoftmaxTransfer, '
                f'transfer_softmax_weights, load_softmax_checkpoint; --num-heads of the '
                f'converter) to have it checked')
        return summary
    differ = [name for name, count in heads.items() if count != ckpt.num_heads]
    if not differ:
        return summary
    text = (f'the checkpoint has {ckpt.num_heads} attention heads ({ckpt.num_heads_from}), '
            f'the {type(module).__name__}\'s attention operators have '
            f'{_counts_text(sorted({heads[name] for name in differ}))} '
            f'({_names_text(differ)})')
    if not copies_attention:
        notes.append(f'{text}; only the attention depends on the head count, and it is not '
                     f'copied')
        return summary
    raise ValueError(
        f'{text}. The copied q/k/v rows would be split into other heads than they were '
        f'trained in, and the attention would compute another function. Nothing was copied. '
        f'Build the model with the checkpoint\'s head count (an arch with '
        f'num_heads={ckpt.num_heads}, e.g. arch=dict(embed_dims=..., num_layers=..., '
        f'num_heads={ckpt.num_heads}, feedforward_channels=...)), or copy without the '
        f'attention component (e.g. setting=\'mlpcopy\'). If the checkpoint\'s count is '
        f'wrong, give the right one with num_heads=.')


def _counts_text(counts):
    return ' or '.join(str(count) for count in counts) + ' heads'


def _names_text(names):
    names = list(names)
    more = f', ... ({len(names)} in all)' if len(names) > _MAX_LISTED_NAMES else ''
    return ', '.join(names[:_MAX_LISTED_NAMES]) + more


# --------------------------------------------------------------------- architecture

# field -> the components whose copy computes another function when it differs
_ARCH_FIELDS = OrderedDict([
    ('patch_size', ('patch_embed', 'pos_embed')),
    ('num_register_tokens', ('registers', )),
    ('rope', ('attention', )),
    ('layer_scale', ('attention', 'mlp')),
    ('qkv_bias', ('attention', )),
    ('ffn_type', ('mlp', )),
    ('ffn_norm', ('mlp', )),
    ('pre_norm', ('norms', )),
])


def check_architecture(module, ckpt, selected, prefix, warnings):
    """Refuse a checkpoint whose architecture differs from the model's where it matters.

    Compared for a backbone (a module with blocks under ``prefix``), each field only when a
    component that depends on it is copied (``_ARCH_FIELDS``): e.g. a DINOv3 checkpoint's
    attention was trained with RoPE, so it is not copied into a model without; its MLP
    does not care. A checkpoint whose family is unknown has an unknown RoPE: its attention is
    refused by a model with RoPE, and copied into one without with a warning.

    Raises:
        ValueError: naming each field that differs with both values, before anything is
            copied.
    """
    if ckpt is None:
        return
    model_tensors = {prefix + name: tensor for name, tensor in module.state_dict().items()}
    if not any(name.startswith('backbone.layers.') for name in model_tensors):
        return
    backbone = _backbone_of(module, prefix)
    model_arch = read_architecture(model_tensors, getattr(backbone, 'pos_embed_extra_tokens',
                                                          None))
    rope = getattr(backbone, 'rope', None)
    model = dict(model_arch._asdict(), rope=getattr(rope, 'rope_type', None),
                 patch_size=_square(getattr(backbone, 'patch_size', None)))
    checkpoint = {field: getattr(ckpt, field) for field in _ARCH_FIELDS}
    checkpoint['patch_size'] = _square(ckpt.patch_size)
    differ = []
    for field, components in _ARCH_FIELDS.items():
        if not set(components) & set(selected):
            continue
        if field == 'rope' and ckpt.family is None:
            if model['rope'] is not None:
                differ.append(f'rope: checkpoint unknown (its source family is unknown), model '
                              f'{model["rope"]!r}')
            else:
                warnings.append('the checkpoint\'s source family is unknown, so whether its '
                                'attention was trained with RoPE is too; it is copied into a '
                                'model without. State the family with family= to have it '
                                'checked')
            continue
        if field == 'patch_size' and None in (checkpoint[field], model[field]):
            continue  # a checkpoint without patch embedding, or a module without patches
        if checkpoint[field] != model[field]:
            differ.append(f'{field}: checkpoint {checkpoint[field]!r}, model {model[field]!r}')
    if not differ:
        return
    family = (f'{ckpt.family} family ({ckpt.family_from})' if ckpt.family
              else 'unknown family')
    word = _arch_word(ckpt)
    advice = (f"Build the model with arch='{word}' (the checkpoint's arch word) or an arch dict "
              f'with these values' if word else 'Build the model with these values (an arch '
              'dict with the switches of LinearViT)')
    raise ValueError(
        f'the checkpoint ({family}, {ckpt.source_format} layout) does not fit the '
        f'{type(module).__name__} in what the selected components {list(selected)} compute:\n  '
        + '\n  '.join(differ) + f'\nNothing was copied. {advice}, or copy without the '
        f'components that depend on them.')


def _backbone_of(module, prefix):
    """The module whose tensors are ``backbone.*``: ``module`` itself under ``'backbone.'``,
    its ``backbone`` under ``''`` (a whole ImageClassifier)."""
    path = 'backbone.'[len(prefix):] if 'backbone.'.startswith(prefix) else ''
    try:
        return module.get_submodule(path.rstrip('.')) if path else module
    except AttributeError:
        return module


def _square(size):
    """An int patch size from an ``(h, w)`` pair of equal sides (or an int)."""
    if isinstance(size, (tuple, list)) and len(size) == 2 and size[0] == size[1]:
        return int(size[0])
    return size


def _arch_word(ckpt):
    """The LinearViT arch word of the checkpoint's family and width, if there is one."""
    from linvit_mm.models import LinearViT
    if ckpt.family not in FAMILIES:
        return None
    for word, arch in LinearViT.arch_zoo.items():
        if (word.startswith(ckpt.family + '-') and arch['embed_dims'] == ckpt.embed_dims
                and arch.get('num_register_tokens', 0) == ckpt.num_register_tokens
                and arch['num_layers'] == ckpt.depth):
            return word
    return None


# --------------------------------------------------------------------- activation

# Both CLIP arch words and the activation each one builds its MLP with.
_CLIP_ACTIVATIONS = (('clip-base', 'QuickGELU', "OpenAI CLIP's"),
                     ('clip-base-gelu', 'GELU', "OpenCLIP's (LAION, DataComp)"))


def _mlp_activation(backbone):
    layers = getattr(backbone, 'layers', None)
    if not layers:
        return None
    return next((type(m).__name__ for m in layers[0].ffn.modules()
                 if type(m).__name__ in ('GELU', 'QuickGELU', 'SiLU', 'ReLU')), None)


def check_activation(module, ckpt, selected, prefix, warnings):
    """Warn that a CLIP checkpoint's MLP activation is unknown when its MLP is copied.

    OpenAI's CLIP and most of OpenCLIP's release the same tensors under the same names, and
    no release layout records the activation (QuickGELU or GELU), so a copied MLP computes
    the checkpoint's function only if the model's arch word is the right one of the two.
    """
    if ckpt is None or ckpt.family != 'clip' or 'mlp' not in selected:
        return
    activation = _mlp_activation(_backbone_of(module, prefix))
    if activation is None:
        return
    words = ', '.join(f"{owner} with {act} (arch '{word}')"
                      for word, act, owner in _CLIP_ACTIVATIONS)
    other = next((word for word, act, _ in _CLIP_ACTIVATIONS if act != activation),
                 'clip-base-gelu')
    warnings.append(
        f'a CLIP checkpoint does not show the activation its MLPs were trained with: '
        f'{words} have identical tensors. The model uses {activation}; if the checkpoint '
        f"was trained with the other, its copied MLPs compute another function: build the "
        f"model with arch='{other}' then")


# --------------------------------------------------------------------- unknown tensors


def unknown_tensors(ckpt):
    """The checkpoint's tensors (source names) that no key map knows: neither a Softmax
    ViT's nor one left out for a known reason (a decoder, a text tower, a distillation
    token, ...)."""
    if ckpt is None:
        return []
    return [key for group, keys in ckpt.unused_groups.items()
            if group == UNMAPPED_GROUP or group.startswith("mmpretrain '") for key in keys]


# --------------------------------------------------------------------- completeness


def check_complete(module, ckpt, plan, what, selected, prefix, allow_partial, notes, warnings):
    """Refuse a copy that would fill a selected component only partly (or not at all).

    A setting that selects no component the module has (``copy`` given to a classifier
    head) copies nothing into it, and says so in ``notes``: the same setting name then serves
    the backbone and the head of a config. A ``prefix`` under which no tensor of the module is
    a Softmax ViT tensor is an error (a mistyped prefix).

    Returns:
        dict: the components copied in part, ``{component: {block or None: [absent
        names]}}`` (empty unless ``allow_partial``).
    """
    if ckpt is None:
        return {}
    module_name = type(module).__name__
    if not plan['module_components']:
        first = next(iter(module.state_dict()), None)
        example = f' (e.g. {prefix}{first})' if first is not None else ''
        raise ValueError(
            f"{what}: under prefix '{prefix}' no tensor of the {module_name} is a Softmax ViT "
            f"tensor{example}, and the checkpoint holds its {len(ckpt.state_dict)} tensors "
            f"under {_held_text(ckpt)}. Nothing was copied. Give the module's place in "
            f"mmpretrain names: 'backbone.' for a backbone, 'head.' for a classifier head, "
            f"'' for a whole ImageClassifier.")
    # component -> block index (None: outside the blocks, or not a block component)
    #   -> ([names found], [names absent])
    units = OrderedDict()
    for rel, present in plan['found'].items():
        component = component_of(prefix + rel)
        block = block_index(prefix + rel) if component in _BLOCK_COMPONENTS else None
        names = units.setdefault(component, OrderedDict()).setdefault(block, ([], []))
        names[0 if present else 1].append(rel)
    if not units:
        has = [component for component in COMPONENTS if component in plan['module_components']]
        notes.append(f'{what} copies nothing into the {module_name}: it has none of the '
                     f'selected components that a checkpoint fills (it has {has}), and keeps '
                     f'its own init')
        return {}
    missing = [component for component, blocks in units.items()
               if not any(present for present, _ in blocks.values())]
    lacks = _lacks_text(ckpt, module_name, selected, missing, units, prefix)
    if not plan['ckpt_tensors']:
        raise ValueError(
            f"{what}: the checkpoint has no tensor under prefix '{prefix}' (it holds its "
            f'{len(ckpt.state_dict)} tensors under {_held_text(ckpt)}): {lacks} Nothing was '
            f'copied. If the prefix is wrong, give the module\'s place in mmpretrain names.'
            + _checkpoint_notes(ckpt))
    if missing:
        raise ValueError(f'{what}: {lacks} Nothing was copied.' + _checkpoint_notes(ckpt))

    in_part = OrderedDict()
    for component, blocks in units.items():
        lacking = OrderedDict((block, absent) for block, (_, absent) in blocks.items() if absent)
        if lacking:
            in_part[component] = lacking
    if not in_part:
        return {}
    lines = [f'{_unit_text(component, block)}: {_names_text(absent)}'
             for component, lacking in in_part.items() for block, absent in lacking.items()]
    shown = lines[:_MAX_LISTED_PARTS]
    if len(lines) > len(shown):
        shown.append(f'... ({len(lines)} parts in all)')
    if allow_partial:
        warnings.append('copied in part (allow_partial=True); absent in the checkpoint, these '
                        'keep their own init next to copied tensors:\n  ' + '\n  '.join(shown))
        return in_part
    raise ValueError(
        f'{what}: the checkpoint ({ckpt.source_format} layout) holds '
        f'{", ".join(in_part)} only in part; absent in it:\n  ' + '\n  '.join(shown)
        + f'\nCopied next to tensors that keep their own init, the rest would compute neither '
        f'the checkpoint\'s function nor a fresh one. Nothing was copied. Use a complete '
        f'checkpoint, copy without the component, or pass allow_partial=True to copy what '
        f'there is (the report then lists what was left out).' + _checkpoint_notes(ckpt))


def _lacks_text(ckpt, module_name, selected, missing, units, prefix):
    """Why copying the components ``missing`` is refused, and what to do instead."""
    absent = [name for component in missing for _, names in units[component].items()
              for name in names[1]]
    rest = [component for component in selected if component not in missing]
    instead = (f'copy without them (components={rest})' if rest
               else 'leave this module out of the transfer')
    return (f'the checkpoint ({ckpt.source_format} layout) has no tensor of the component(s) '
            f'{missing} that the {module_name} has ({_names_text(absent)} under prefix '
            f"'{prefix}'), so they would keep their own init: {instead}, or use a checkpoint "
            f'that has them.')


def _held_text(ckpt):
    """``'backbone.' (150), 'head.' (2)``: the first name parts of the checkpoint's tensors."""
    starts = OrderedDict()
    for name in ckpt.state_dict:
        start = name.split('.', 1)[0] + '.'
        starts[start] = starts.get(start, 0) + 1
    return ', '.join(f"'{start}' ({count})" for start, count in starts.items())


def _unit_text(component, block):
    if block is not None:
        return f'{component} of block {block}'
    if component in _BLOCK_COMPONENTS:
        return f'{component} outside the blocks'
    return component


def _checkpoint_notes(ckpt):
    return ''.join(f'\n  checkpoint note: {note}' for note in ckpt.notes)
