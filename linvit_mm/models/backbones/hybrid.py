"""Which attention operator each block of a LinearViT runs: one for all, or a hybrid.

``LinearViT(attn_type=...)`` takes any of

* an operator name, ``'relu'``: every block;
* a list with one name per block, ``['softmax', 'relu', ..., 'relu', 'softmax']``;
* a dict, ``dict(default='relu', softmax=[0, -1])``: ``default`` for every block not listed
  under another operator's name (indices count from the end when negative, as Python's);
* the compact description, ``'relu+softmax@0,11'``: the default operator, then ``+name@i,j``
  for each other operator and its blocks. It is what ``LinearViT.attn_type`` reports for a
  hybrid, so a model's ``attn_type`` always builds the same layout again (an operator's
  registry name never holds ``+`` or ``@``).

:func:`resolve_attn_types` turns any of them into the list of names, one per block, checked
(length, registered names, indices in range and given once) before any block is built;
:func:`describe_attn_types` writes the compact description of a list.
"""
from collections import Counter
from collections.abc import Mapping, Sequence

from ...utils.blocks import is_block_index
from ..attention import attention_class

DEFAULT_KEY = 'default'
SOFTMAX = 'softmax'
_JOIN, _AT, _SEP = '+', '@', ','


def _check_name(name, where):
    if not isinstance(name, str):
        raise TypeError(f'{where} must be an operator name (str), got {name!r}')
    try:
        attention_class(name)
    except ValueError as err:
        raise ValueError(f'{where}: {err}') from None
    return name


def parse_attn_spec(spec):
    """The dict form of a compact description: ``'relu+softmax@0,11'`` ->
    ``{'default': 'relu', 'softmax': [0, 11]}``; a plain name is returned as it is."""
    if _JOIN not in spec and _AT not in spec:
        return spec
    default, *parts = spec.split(_JOIN)
    layout = {DEFAULT_KEY: default}
    for part in parts:
        name, at, indices = part.partition(_AT)
        if not (name and at and indices):
            raise ValueError(f'attn_type {spec!r}: {part!r} is not an operator@blocks part; '
                             f"write the default operator, then '+name@i,j' for each other "
                             f"operator, e.g. 'relu+softmax@0,11'")
        if name in layout:
            raise ValueError(f'attn_type {spec!r} names the operator {name!r} twice; list all its '
                             f'blocks after one @')
        try:
            layout[name] = [int(index) for index in indices.split(_SEP)]
        except ValueError:
            raise ValueError(f'attn_type {spec!r}: the blocks of {name!r} must be integers '
                             f'separated by commas, got {indices!r}') from None
    if _AT in default:
        raise ValueError(f'attn_type {spec!r} starts with {default!r}; it must start with the '
                         f"default operator (no @), e.g. 'relu+softmax@0,11'")
    return layout


def resolve_attn_types(attn_type, num_layers):
    """The operator name of each of the ``num_layers`` blocks.

    Raises:
        TypeError / ValueError: a list of another length, an unregistered name, a dict without
            ``'default'``, block indices outside ``[-num_layers, num_layers - 1]``, not ints,
            or given twice (the error names them and what to write instead).
    """
    if isinstance(attn_type, str):
        attn_type = parse_attn_spec(attn_type)
    if isinstance(attn_type, str):
        return [_check_name(attn_type, 'attn_type')] * num_layers
    if isinstance(attn_type, Mapping):
        return _resolve_dict(attn_type, num_layers)
    if isinstance(attn_type, Sequence):
        types = list(attn_type)
        if len(types) != num_layers:
            raise ValueError(f'attn_type lists {len(types)} operators for a model of '
                             f'{num_layers} blocks; give one per block, or a dict such as '
                             f"dict(default='relu', softmax=[0, {num_layers - 1}])")
        return [_check_name(name, f'attn_type[{i}]') for i, name in enumerate(types)]
    raise TypeError(f'attn_type must be an operator name, a list of one per block or a dict '
                    f"with 'default', got {attn_type!r}")


def _resolve_dict(layout, num_layers):
    if DEFAULT_KEY not in layout:
        raise ValueError(f"attn_type {dict(layout)!r} has no 'default': the operator of the "
                         f"blocks not listed, e.g. dict(default='relu', softmax=[0, "
                         f"{num_layers - 1}])")
    types = [_check_name(layout[DEFAULT_KEY], "attn_type['default']")] * num_layers
    given = {}  # block -> the operator that claimed it
    for name, indices in layout.items():
        if name == DEFAULT_KEY:
            continue
        _check_name(name, f'attn_type key {name!r}')
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
            raise TypeError(f'attn_type[{name!r}] must be a list of block indices, got '
                            f'{indices!r}')
        for index in indices:
            if not is_block_index(index):
                raise TypeError(f'attn_type[{name!r}] holds {index!r}; block indices are ints')
            if not -num_layers <= index < num_layers:
                raise ValueError(f'attn_type[{name!r}] holds block {index}, outside the '
                                 f'{num_layers} blocks of the model (valid: {-num_layers} to '
                                 f'{num_layers - 1})')
            block = index % num_layers
            if block in given:
                raise ValueError(f'block {block} is given twice in attn_type (as {index} under '
                                 f'{name!r}, already under {given[block]!r}); list each block '
                                 f'once')
            given[block] = name
            types[block] = name
    return types


def describe_attn_types(types):
    """The operator name if every block has the same, else the compact description, e.g.
    ``'relu+softmax@0,11'``: the most common operator as the default (on a tie, not
    Softmax: a hybrid reads as a linear model with Softmax blocks; then the one of the
    earliest block), then each other operator with its blocks, in order of first use."""
    counts = Counter(types)
    default = max(counts, key=lambda name: (counts[name], name != SOFTMAX, -types.index(name)))
    if counts[default] == len(types):
        return default
    others = {}
    for index, name in enumerate(types):
        if name != default:
            others.setdefault(name, []).append(str(index))
    return _JOIN.join([default] + [f'{name}{_AT}{_SEP.join(blocks)}'
                                   for name, blocks in others.items()])


def class_token_of(types, with_cls_token=None):
    """Whether a model of these blocks carries a class token: ``with_cls_token`` if given,
    else the operators' shared convention (``uses_cls_token``); operators that disagree
    (e.g. softmax and mhla) need it given, and the error says what each choice means."""
    if with_cls_token is not None:
        return bool(with_cls_token)
    conventions = {}
    for index, name in enumerate(types):
        conventions.setdefault(attention_class(name).uses_cls_token, {}).setdefault(
            name, []).append(index)
    if len(conventions) == 1:
        return next(iter(conventions))

    def listed(uses):
        return ', '.join(f'{name} (blocks {blocks})' for name, blocks in conventions[uses].items())

    raise ValueError(
        f'attn_type {describe_attn_types(types)!r} mixes operators whose models carry a class '
        f'token ({listed(True)}) with operators whose models pool the patch tokens '
        f'({listed(False)}); say which the hybrid does: with_cls_token=True carries the class '
        f'token through every block (an operator without one treats it as a leading extra '
        f'token, as it does registers), with_cls_token=False drops it (average pooling, '
        f'out_type="avg_featmap")')
