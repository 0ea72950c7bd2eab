"""Checkpoints of linear-attention ViTs: which family a checkpoint is, from its keys.

A released linear ViT keeps a Softmax ViT's names for most of its tensors (``qkv``, ``proj``,
the MLPs, the norms, the patch embedding), so a reader of Softmax checkpoints would copy
those and leave the tensors that make it linear (its inner weights, its residual branch, its
mixing matrix) at their init, computing neither the release's function nor a Softmax one.
:func:`detect_linear_source` tells such a checkpoint by the keys only a linear family has;
``load_softmax_checkpoint`` (and with it ``SoftmaxTransfer`` and the distillation teacher
built with it) refuses what it finds, naming the family and what to use instead.

The layouts, as the official code names the tensors (``N`` a block; every release also has
the Softmax ViT names around them). ``key`` is what :data:`LINEAR_SOURCES` matches:

==========  ======================  =================================================  =========
family      repository              tensors only this family has                       operator
==========  ======================  =================================================  =========
vit3        LeapLabTHU/ViTTT        ``blocks.N.attn.w1``, ``.w2`` ``(1, heads, d, d)``,  ttt
                                    ``blocks.N.attn.w3`` ``(d, 1, 3, 3)``,
                                    ``blocks.N.cpe.{weight,bias}`` (the conditional
                                    position encoding, a 3x3 depthwise conv before the
                                    block); and ``attn.qkv`` of ``3C + 3d`` rows,
                                    ``attn.proj`` of ``C + d`` inputs. ``{'model': ...}``
                                    (H-ViT³: ``layers.I.blocks.N...``)
inline      LeapLabTHU/InLine       ``blocks.N.attn.residual.0.{weight,bias}``,          inline
                                    ``blocks.N.attn.residual.2.{weight,bias}`` (the
                                    local residual branch, two grouped 1x1 Conv1d)
mhla        DAGroup-PKU/MHLA        ``blocks.N.attn.piece_attn.conv.weight`` (the block  mhla
                                    mixing matrix as a 1x1 conv), ``attn.norm.*`` (its
                                    own LayerNorm first), ``attn.to_qkv.weight``,
                                    ``attn.lepe.*`` (5x5 depthwise conv of the values),
                                    ``attn.to_out.0.*``, ``attn.q_norm`` / ``k_norm``
hedgehog    HazyResearch/lolcats    ``....self_attn.feature_map_q.mlp.layer``,           hedgehog
                                    ``feature_map_k.mlp.layer`` ``(heads, d, f)``
                                    (adapter maps: ``layer0``, ``layer1``, ``bias0``,
                                    ``bias1``)
linvit_mm   this project            ``meta['linvit_mm']`` recording a non-Softmax        recorded
                                    operator, or ``layers.N.attn.w1 | w2 | w3 | cpe``
                                    (ttt), ``attn.block_mixing`` / ``value_conv`` (mhla),
                                    ``attn.feature_proj[_k]`` (hedgehog)
==========  ======================  =================================================  =========

``attn.norm`` alone is not taken for MHLA: timm's EVA-02 attention names its sub-LN so.
A LinearViT checkpoint of ``elu`` / ``relu`` / ``inline`` has no tensor of its own; it is
told by its record (every checkpoint of the staged recipe and of ``tools/train.py`` carries
one).
"""
import re
from collections.abc import Mapping
from typing import List, NamedTuple, Optional, Tuple

import torch

__all__ = ['LinearSource', 'LinearSourceMatch', 'LINEAR_SOURCES', 'detect_linear_source',
           'refuse_linear_source']

_BLOCK = r'(?:^|\.)blocks\.\d+\.'
_OURS = r'(?:^|\.)layers\.\d+\.attn\.'
_CONVERT = ('convert it into a LinearViT checkpoint with '
            'tools/model_converters/linear_release_to_linvit.py and load that with '
            "init_cfg=dict(type='LinearViTCheckpoint', checkpoint=...)")


class LinearSource(NamedTuple):
    """One family of linear-attention checkpoints.

    Attributes:
        name: its name (``vit3``, ``inline``, ``mhla``, ``hedgehog``, ``linvit_mm``).
        description: what it is, for messages.
        repository: where its official code is.
        attn_type: the linvit_mm operator of the family (None: the one recorded).
        keys: ``(regular expression, what the tensor is)``: a key that matches
            (``re.search``) shows the family.
        instead: what to do with such a checkpoint instead of a Softmax transfer.
    """
    name: str
    description: str
    repository: str
    attn_type: Optional[str]
    keys: Tuple[Tuple[str, str], ...]
    instead: str


class LinearSourceMatch(NamedTuple):
    """What :func:`detect_linear_source` found: the family, the keys that show it (all of
    them, in checkpoint order) and, for a recorded checkpoint, its operators."""
    source: LinearSource
    keys: List[str]
    attn_types: Optional[List[str]] = None

    def describe(self, limit=4):
        if self.attn_types is not None:
            linear = sorted(set(self.attn_types) - {'softmax'})
            return f'its record names the operator(s) {linear}'
        what = {}
        for key in self.keys:
            label = next(text for pattern, text in self.source.keys if re.search(pattern, key))
            what.setdefault(label, []).append(key)
        parts = [f'{", ".join(names[:limit])}{", ..." if len(names) > limit else ""} ({label})'
                 for label, names in what.items()]
        return f'it holds {len(self.keys)} such tensor(s): ' + '; '.join(parts)


LINEAR_SOURCES = (
    LinearSource(
        'vit3', 'ViT³ (test-time-training attention)', 'LeapLabTHU/ViTTT', 'ttt',
        ((_BLOCK + r'attn\.w[12]$', 'inner SwiGLU weights w1 / w2'),
         (_BLOCK + r'attn\.w3$', 'inner 3x3 depthwise kernel w3'),
         (_BLOCK + r'cpe\.(weight|bias)$', 'conditional position encoding cpe')),
        f"its attention is the ttt operator: {_CONVERT}, with attn_type='ttt'"),
    LinearSource(
        'inline', 'InLine attention (injective linear attention with a local residual)',
        'LeapLabTHU/InLine', 'inline',
        ((r'\.attn\.residual\.[02]\.(weight|bias)$', 'local residual branch attn.residual'), ),
        f"its attention is the inline operator: {_CONVERT}, with attn_type='inline'"),
    LinearSource(
        'mhla', 'MHLA (multi-head linear attention with block mixing)', 'DAGroup-PKU/MHLA',
        'mhla',
        ((r'\.attn\.piece_attn\.conv\.weight$', 'block mixing conv piece_attn'),
         (r'\.attn\.lepe\.(weight|bias)$', 'value conv lepe'),
         (r'\.attn\.to_qkv\.weight$', 'qkv projection to_qkv')),
        f"its attention is the mhla operator: {_CONVERT}, with attn_type='mhla'"),
    LinearSource(
        'hedgehog', 'Hedgehog / LoLCATs learned feature maps', 'HazyResearch/lolcats',
        'hedgehog',
        ((r'\.feature_map_[qk]\.mlp\.(layer[01]?|bias[01]?)$',
          'learned feature map feature_map_q / feature_map_k'), ),
        "its attention is the hedgehog operator: its maps are a LinearViT's "
        "attn_type='hedgehog' feature_proj (queries) and feature_proj_k (keys, "
        'tie_qk=False); load them into such a model yourself'),
    LinearSource(
        'linvit_mm', 'linvit_mm LinearViT with linear attention', 'this project', None,
        ((_OURS + r'(w[123]|cpe\.(weight|bias))$', 'ttt operator tensors'),
         (_OURS + r'(block_mixing|value_conv\.(weight|bias))$', 'mhla operator tensors'),
         (_OURS + r'feature_proj(_k)?$', 'hedgehog operator tensors')),
        "load it into a LinearViT of its operator with init_cfg=dict(type="
        "'LinearViTCheckpoint', checkpoint=...) (or resume / load_from its run); as a "
        'distillation teacher, build the teacher with that operator and '
        'allow_non_softmax_teacher=True'),
)
_BY_NAME = {source.name: source for source in LINEAR_SOURCES}


def _tensor_keys(checkpoint, depth=2):
    """Every key of a tensor in ``checkpoint`` and in the mappings it holds (``state_dict``,
    ``model``, ``teacher``, ...), down to ``depth`` levels."""
    keys = []
    for key, value in checkpoint.items():
        if torch.is_tensor(value) and isinstance(key, str):
            keys.append(key)
        elif isinstance(value, Mapping) and depth > 0:
            keys.extend(_tensor_keys(value, depth - 1))
    return keys


def _recorded_operators(checkpoint):
    # imported here: linvit_mm.staged imports this package's readers
    from linvit_mm.staged.record import RECORD_KEY
    meta = checkpoint.get('meta')
    record = meta.get(RECORD_KEY) if isinstance(meta, Mapping) else None
    backbones = record.get('backbones') if isinstance(record, Mapping) else None
    if not isinstance(backbones, Mapping):
        return None
    types = [name for description in backbones.values() if isinstance(description, Mapping)
             for name in description.get('attn_types') or []]
    return types if any(name != 'softmax' for name in types) else None


def detect_linear_source(checkpoint) -> Optional[LinearSourceMatch]:
    """The linear-attention family whose checkpoint ``checkpoint`` is, or None.

    Args:
        checkpoint (Mapping): a loaded checkpoint (any container: its tensors are looked for
            at the top and in the mappings it holds) or a bare state dict.

    Returns:
        LinearSourceMatch | None: the first family of :data:`LINEAR_SOURCES` whose keys the
        checkpoint holds (a record of linvit_mm naming a non-Softmax operator comes first).
    """
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f'detect_linear_source expects a checkpoint mapping, got '
                        f'{type(checkpoint).__name__}')
    recorded = _recorded_operators(checkpoint)
    if recorded is not None:
        return LinearSourceMatch(_BY_NAME['linvit_mm'], [], recorded)
    keys = _tensor_keys(checkpoint)
    for source in LINEAR_SOURCES:
        found = [key for key in keys if any(re.search(pattern, key) for pattern, _ in source.keys)]
        if found:
            return LinearSourceMatch(source, found)
    return None


def refuse_linear_source(checkpoint, where):
    """Raise ``ValueError`` if ``checkpoint`` is one of a linear-attention family."""
    match = detect_linear_source(checkpoint)
    if match is None:
        return
    source = match.source
    raise ValueError(
        f'{where}: this is a {source.description} checkpoint ({source.repository}), not a '
        f'Softmax ViT: {match.describe()}. A Softmax transfer would copy the tensors named '
        f'like a Softmax ViT\'s and leave these at their init, computing neither this '
        f'model\'s function nor a Softmax one. Refused before anything is copied; '
        f'{source.instead}.')
