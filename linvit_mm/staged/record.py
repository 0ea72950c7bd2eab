"""What a staged-recipe checkpoint says about its LinearViT, and the comparison with a model.

A checkpoint's tensors do not say everything about the ViT that wrote them: a ``relu`` and an
``elu`` block have the same tensors, and so do blocks of 3 and of 6 heads of the same width.
Checkpoints of the staged recipe therefore carry a record under ``meta['linvit_mm']``::

    {'backbones': {'backbone.': {'attn_types': ['relu', ...], 'num_heads': [6, ...],
                                 'attn_options': [{'eps': 1e-06, 'rope': None}, ...],
                                 'window_sizes': [None, ...],
                                 'embed_dims': 384, 'num_layers': 12, 'patch_size': [16, 16],
                                 'with_cls_token': True, 'num_register_tokens': 0}},
     'stage': 'align-attn', 'trained_layers': [0, 1, ...]}

``backbones`` maps the key prefix of each LinearViT to its description (one entry per block
for what can differ per block). ``StagedRecordHook`` writes it into every checkpoint of a run;
the merge tools write it into what they produce; ``LinearViTCheckpoint`` checks it against the
model it loads into.
"""
from mmengine.utils import to_2tuple

RECORD_KEY = 'linvit_mm'
ARCH_FIELDS = ('embed_dims', 'num_layers', 'patch_size', 'with_cls_token',
               'num_register_tokens')


def describe_linear_vit(vit):
    """The record of one LinearViT: operator, heads, the operator's options that change what
    it computes and the attention window per block; sizes and extra tokens."""
    return dict(
        attn_types=[layer.attn.attn_type for layer in vit.layers],
        num_heads=[int(layer.attn.num_heads) for layer in vit.layers],
        attn_options=[layer.attn.computed_options() for layer in vit.layers],
        window_sizes=[list(layer.window_size) if layer.window_size else None
                      for layer in vit.layers],
        embed_dims=int(vit.embed_dims),
        num_layers=len(vit.layers),
        patch_size=list(to_2tuple(vit.patch_size)),
        with_cls_token=bool(vit.with_cls_token),
        num_register_tokens=int(vit.num_register_tokens))


def find_linear_vits(model):
    """``{key prefix: LinearViT}`` for every outermost LinearViT inside ``model`` (itself
    included, prefix ``''``), in module order."""
    from linvit_mm.models.backbones import LinearViT
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearViT) and not any(
                name.startswith(prefix) for prefix in found if prefix):
            found[f'{name}.' if name else ''] = module
    return found


def model_record(model):
    """The record of ``model``: its LinearViTs and, when the model states one
    (``staged_record()``: the aligners), its stage."""
    record = dict(backbones={prefix: describe_linear_vit(vit)
                             for prefix, vit in find_linear_vits(model).items()})
    stage = getattr(model, 'staged_record', None)
    if callable(stage):
        record.update(stage())
    return record


def checkpoint_record(checkpoint):
    """The record a loaded checkpoint carries, or None."""
    meta = checkpoint.get('meta') if isinstance(checkpoint, dict) else None
    record = meta.get(RECORD_KEY) if isinstance(meta, dict) else None
    return record if isinstance(record, dict) else None


def block_ranges(indices):
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    indices = sorted(indices)
    parts, start = [], None
    for position, index in enumerate(indices):
        if start is None:
            start = index
        if position + 1 == len(indices) or indices[position + 1] != index + 1:
            parts.append(str(start) if start == index else f'{start}-{index}')
            start = None
    return ', '.join(parts)


def _per_block(name, recorded, expected):
    """Differences of a per-block field, grouped by (checkpoint value, model value)."""
    if len(recorded) != len(expected):
        return []  # the depth difference is reported once, by num_layers
    groups = {}
    for index, (have, want) in enumerate(zip(recorded, expected)):
        if have != want:
            groups.setdefault((have, want), []).append(index)
    return [f'{name} of blocks {block_ranges(blocks)}: checkpoint {have!r}, model {want!r}'
            for (have, want), blocks in groups.items()]


def option_differences(recorded, expected):
    """How the per-block options and windows of two LinearViT records differ:
    ``[(what, blocks, checkpoint value, model value), ...]``, ``what`` being
    ``'attn_cfg.<option>'`` or ``'window_size'``. Records of other depths, or without these
    fields (written before they were recorded), give nothing: depth is compared elsewhere."""
    groups = {}

    def note(what, index, have, want):
        key = (what, repr(have), repr(want))
        groups.setdefault(key, (what, [], have, want))[1].append(index)

    have_options, want_options = recorded.get('attn_options'), expected.get('attn_options')
    if isinstance(have_options, list) and len(have_options) == len(want_options or []):
        for index, (have, want) in enumerate(zip(have_options, want_options)):
            if not (isinstance(have, dict) and isinstance(want, dict)):
                continue  # a block built without build_attention records no options
            for name in sorted(set(have) | set(want)):
                if have.get(name, '(absent)') != want.get(name, '(absent)'):
                    note(f'attn_cfg.{name}', index, have.get(name, '(absent)'),
                         want.get(name, '(absent)'))
    have_windows, want_windows = recorded.get('window_sizes'), expected.get('window_sizes')
    if isinstance(have_windows, list) and len(have_windows) == len(want_windows or []):
        for index, (have, want) in enumerate(zip(have_windows, want_windows)):
            if have != want:
                note('window_size', index, have, want)
    return list(groups.values())


def record_differences(recorded, expected):
    """Human-readable differences between a recorded and a model's description."""
    problems = [f'the record lacks {field}' for field in ('attn_types', 'num_heads')
                if not isinstance(recorded.get(field), list)]
    for field in ARCH_FIELDS:
        have, want = recorded.get(field), expected.get(field)
        if field == 'patch_size' and have is not None:
            have = list(have)
        if have != want:
            problems.append(f'{field}: checkpoint {have!r}, model {want!r}')
    problems += _per_block('operator', recorded.get('attn_types') or [], expected['attn_types'])
    problems += _per_block('num_heads', recorded.get('num_heads') or [], expected['num_heads'])
    problems += [f'{what} of blocks {block_ranges(blocks)}: checkpoint {have!r}, model {want!r}'
                 for what, blocks, have, want in option_differences(recorded, expected)]
    return problems
