"""What a staged-recipe checkpoint says about its LinearViT, and the comparison with a model.

A checkpoint's tensors do not say everything about the ViT that wrote them: a ``relu`` and an
``elu`` block have the same tensors, and so do blocks of 3 and of 6 heads of the same width.
Checkpoints of the staged recipe therefore carry a record under ``meta['linvit_mm']``::

    {'backbones': {'backbone.': {'attn_types': ['relu', ...], 'num_heads': [6, ...],
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
    """The record of one LinearViT: operator and heads per block, sizes and extra tokens."""
    return dict(
        attn_types=[layer.attn.attn_type for layer in vit.layers],
        num_heads=[int(layer.attn.num_heads) for layer in vit.layers],
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
    return problems
