"""Read the Softmax ViT checkpoints people actually have and rename them for mmpretrain.

The initialisation settings (Copy, MLPCopy, FullCopy, ...) need one thing from a
checkpoint: the Softmax ViT's tensors under the names of mmpretrain's
``ImageClassifier`` + ``VisionTransformer`` + ``VisionTransformerClsHead``, which
LinearViT follows::

    backbone.patch_embed.projection.{weight,bias}
    backbone.cls_token                      (1, 1, C)
    backbone.pos_embed                      (1, num_extra_tokens + H*W, C)
    backbone.pre_norm.*                     (CLIP-style norm before the blocks)
    backbone.layers.N.ln1.*                 norm before attention
    backbone.layers.N.attn.qkv.*            (3C, C) rows ordered q, k, v
    backbone.layers.N.attn.proj.*
    backbone.layers.N.attn.gamma1.weight    layer scale (DeiT III)
    backbone.layers.N.ln2.*                 norm before the MLP
    backbone.layers.N.ffn.layers.0.0.*      fc1
    backbone.layers.N.ffn.layers.1.*        fc2
    backbone.layers.N.ffn.gamma2.weight     layer scale (DeiT III)
    backbone.ln1.*                          final norm over all tokens (final_norm=True)
    backbone.ln2.*                          norm after average pooling (out_type='avg_featmap')
    head.layers.pre_logits.*                optional representation layer
    head.layers.head.{weight,bias}          the linear classifier

Layouts recognised (``source_format``; the label names the *layout*, and a file
written by another tool in the same layout gets the same label):

- ``'deit-official'``: ``{'model': timm keys, ...}`` (DeiT releases and training
  checkpoints; MoCo v3's ``convert_to_deit.py`` output).
- ``'timm'``: a bare timm state dict (also DINO's backbone-only releases), or a timm
  ``train.py`` checkpoint ``{'state_dict': ..., 'arch': ..., 'version': ...}``.
- ``'mmpretrain'``: ``{'state_dict': {'backbone.*', 'head.*', ...}, 'meta': ...}``,
  or a bare dict with those keys.
- ``'dino'``: a full DINO checkpoint ``{'teacher', 'student', 'dino_loss', ...}``
  (the teacher is used, as DINO evaluates it) or a bare ``backbone.``/``head.``
  wrapper state dict.
- ``'mocov3'``: ``{'state_dict': {'module.base_encoder.*', 'module.momentum_encoder.*',
  'module.predictor.*'}, 'arch': ...}`` (the base encoder is used, without its
  projection MLP).
- ``'ibot'``: full iBOT checkpoints (``'ibot_loss'`` next to teacher/student) and the
  released ``{'state_dict': ...}`` backbone files, with or without ``backbone.``.
- ``'mae'``: ``{'model': ...}`` with the decoder (``decoder_*``, ``mask_token``) or the
  global-pool ``fc_norm`` of MAE fine-tuned models.

Files are read with ``torch.load(weights_only=True)`` first; one that also pickles
training metadata (the ``args`` namespace of DeiT / DINO / MAE releases, numpy scalars,
mmengine run metadata) is read by ``linvit_mm.utils.checkpoint``'s restricted unpickler,
which allows exactly those. These are external files: a pickle that carries code is
refused, never executed.
"""
import argparse
import math
import os
import pickle
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from linvit_mm.utils.checkpoint import UnsafeCheckpointError, load_checkpoint_file

__all__ = ['SoftmaxCheckpoint', 'load_softmax_checkpoint', 'KNOWN_FORMATS']

KNOWN_FORMATS = {
    'deit-official': "{'model': timm keys} (DeiT releases / training checkpoints)",
    'timm': "bare timm state dict (blocks.N.attn.qkv, patch_embed.proj, norm, head)",
    'mmpretrain': "{'state_dict': {'backbone.layers.N...', 'head.layers.head...'}, "
                  "'meta': ...}",
    'dino': "DINO full checkpoint {'teacher', 'student', ...} or backbone./head. dict",
    'mocov3': "{'state_dict': {'module.base_encoder...', 'module.momentum_encoder...'}}",
    'ibot': "iBOT full checkpoint {'teacher', 'student', 'ibot_loss'} or "
            "{'state_dict': ...} backbone file",
    'mae': "{'model': encoder keys + decoder_*/mask_token, or fc_norm (fine-tuned)}",
}

# timm block parameter -> mmpretrain TransformerEncoderLayer parameter. Exact names
# only: anything else in a block (relative position tables, q/k norms, BEiT q/v
# biases) has no counterpart in mmpretrain's VisionTransformer and is reported.
_TIMM_BLOCK_PARAMS = {
    'norm1.weight': 'ln1.weight',
    'norm1.bias': 'ln1.bias',
    'attn.qkv.weight': 'attn.qkv.weight',
    'attn.qkv.bias': 'attn.qkv.bias',
    'attn.proj.weight': 'attn.proj.weight',
    'attn.proj.bias': 'attn.proj.bias',
    'norm2.weight': 'ln2.weight',
    'norm2.bias': 'ln2.bias',
    'mlp.fc1.weight': 'ffn.layers.0.0.weight',
    'mlp.fc1.bias': 'ffn.layers.0.0.bias',
    'mlp.fc2.weight': 'ffn.layers.1.weight',
    'mlp.fc2.bias': 'ffn.layers.1.bias',
    # layer scale: timm calls it ls1/ls2.gamma, the DeiT III release gamma_1/gamma_2.
    'ls1.gamma': 'attn.gamma1.weight',
    'gamma_1': 'attn.gamma1.weight',
    'ls2.gamma': 'ffn.gamma2.weight',
    'gamma_2': 'ffn.gamma2.weight',
}

_TIMM_TOP_PARAMS = {
    'cls_token': 'backbone.cls_token',
    'pos_embed': 'backbone.pos_embed',
    'patch_embed.proj.weight': 'backbone.patch_embed.projection.weight',
    'patch_embed.proj.bias': 'backbone.patch_embed.projection.bias',
    'norm_pre.weight': 'backbone.pre_norm.weight',
    'norm_pre.bias': 'backbone.pre_norm.bias',
    'norm.weight': 'backbone.ln1.weight',
    'norm.bias': 'backbone.ln1.bias',
    # fc_norm normalises the *pooled* patch tokens (MAE global pool, timm avg pool),
    # which is mmpretrain's ln2 under out_type='avg_featmap', final_norm=False.
    'fc_norm.weight': 'backbone.ln2.weight',
    'fc_norm.bias': 'backbone.ln2.bias',
    'pre_logits.fc.weight': 'head.layers.pre_logits.weight',
    'pre_logits.fc.bias': 'head.layers.pre_logits.bias',
    'head.weight': 'head.layers.head.weight',
    'head.bias': 'head.layers.head.bias',
}

_TARGET_LAYER_PARAMS = frozenset(_TIMM_BLOCK_PARAMS.values())
_TARGET_TOP_PARAMS = frozenset(_TIMM_TOP_PARAMS.values())
_TARGET_LAYER_RE = re.compile(r'^backbone\.layers\.(\d+)\.(.+)$')
_TIMM_BLOCK_RE = re.compile(r'^blocks\.(\d+)\.(.+)$')

_METHOD_NAMES = {'dino': 'DINO', 'ibot': 'iBOT'}
_DIST_GROUP = 'distillation token / head (DeiT distilled)'
_MAE_DECODER_GROUP = 'MAE decoder'
_NOT_A_CLASSIFIER_GROUP = 'head that is not a linear classifier (projection MLP)'
_UNMAPPED_GROUP = 'no counterpart in mmpretrain VisionTransformer'
_NON_TENSOR_GROUP = 'non-tensor entries'

# Architecture names whose head count the checkpoint's own code base fixes, keyed by
# the code base because the same name differs between them (MoCo v3's ViT-S has 12
# heads, DINO's 6). Values are (embed_dims, num_heads); a name is trusted only when
# its embed_dims matches the tensors.
_ARCH_HEADS = {
    # DeiT paper, Table 1 (also DeiT III's deit_*_patch16_LS).
    'deit': {'tiny': (192, 3), 'small': (384, 6), 'base': (768, 12),
             'medium': (512, 8), 'large': (1024, 16), 'huge': (1280, 16)},
    # timm's own model names (vit_*/deit_*), for timm train.py checkpoints.
    'timm': {'tiny': (192, 3), 'small': (384, 6), 'medium': (512, 8),
             'base': (768, 12), 'large': (1024, 16), 'huge': (1280, 16)},
    # DINO / iBOT vision_transformer.py vit_tiny / vit_small / vit_base (/ vit_large).
    'dino': {'tiny': (192, 3), 'small': (384, 6), 'base': (768, 12),
             'large': (1024, 16)},
    # MoCo v3 vits.py.
    'mocov3': {'small': (384, 12), 'base': (768, 12), 'large': (1024, 16),
               'huge': (1280, 16)},
    # MAE models_mae.py / models_vit.py.
    'mae': {'base': (768, 12), 'large': (1024, 16), 'huge': (1280, 16)},
    # mmpretrain VisionTransformer.arch_zoo.
    'mmpretrain': {'deit-t': (192, 3), 'deit-tiny': (192, 3), 'deit-s': (384, 6),
                   'deit-small': (384, 6), 'deit-b': (768, 12),
                   'deit-base': (768, 12), 'b': (768, 12), 'base': (768, 12),
                   'l': (1024, 16), 'large': (1024, 16), 'h': (1280, 16),
                   'huge': (1280, 16), 's': (768, 8), 'small': (768, 8)},
}

# How each code base spells its model names: DeiT deit_tiny_patch16_224 /
# deit_small_distilled_patch16_224 / deit_base_patch16_LS; timm vit_small_patch16_224;
# DINO, iBOT and MoCo v3 vit_small; MAE mae_vit_base_patch16 / vit_base_patch16.
_ARCH_NAME_PATTERNS = {
    'deit': r'^deit_([a-z]+)_',
    'timm': r'^(?:vit|deit)_([a-z]+)_',
    'dino': r'^vit_([a-z]+)$',
    'mocov3': r'^vit_([a-z]+)$',
    'mae': r'^(?:mae_)?vit_([a-z]+)_patch',
}


@dataclass
class SoftmaxCheckpoint:
    """A Softmax ViT checkpoint in mmpretrain names, with what was learnt reading it.

    Attributes:
        state_dict: tensors under ``backbone.*`` / ``head.*`` target names. Tensors
            are those read from the file (or given), not copies, except
            ``backbone.pos_embed`` when a distillation slot was dropped.
        source_format: the layout detected, one of :data:`KNOWN_FORMATS`.
        unused_keys: source keys (as in the chosen model dict, ``module.`` stripped)
            that were not mapped.
        unused_groups: the same keys grouped by why they are unused.
        notes: decisions taken while reading (which encoder was picked, slots
            dropped, ignored top-level entries), for the user to see.
        embed_dims, depth, patch_size: read from tensor shapes.
        num_heads: not inferable from shapes; set only when the checkpoint's own
            metadata names it (an explicit ``num_heads`` or a known architecture name).
        pos_grid: (h, w) of the patch part of ``backbone.pos_embed`` when square.
        num_extra_tokens: leading non-patch slots in ``backbone.pos_embed``
            (1 = class token slot; 0 = position embedding without a class slot, as in
            DeiT III or timm ``no_embed_class`` models).
    """
    state_dict: Dict[str, torch.Tensor]
    source_format: str
    unused_keys: List[str] = field(default_factory=list)
    unused_groups: Dict[str, List[str]] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    embed_dims: Optional[int] = None
    depth: Optional[int] = None
    num_heads: Optional[int] = None
    patch_size: Optional[Tuple[int, int]] = None
    pos_grid: Optional[Tuple[int, int]] = None
    num_extra_tokens: Optional[int] = None

    def summary(self) -> str:
        """Human-readable multi-line description (used by the converter CLI)."""
        lines = [
            f'source format   : {self.source_format}',
            f'mapped tensors  : {len(self.state_dict)}',
            f'embed_dims      : {self.embed_dims}',
            f'depth           : {self.depth}',
            f'num_heads       : {self.num_heads}'
            + ('' if self.num_heads is not None else ' (not recorded in the checkpoint)'),
            f'patch_size      : {self.patch_size}',
            f'pos_grid        : {self.pos_grid}',
            f'num_extra_tokens: {self.num_extra_tokens}',
            f'unused tensors  : {len(self.unused_keys)}',
        ]
        for group, keys in self.unused_groups.items():
            examples = ', '.join(keys[:3]) + (', ...' if len(keys) > 3 else '')
            lines.append(f'  - {group}: {len(keys)} ({examples})')
        lines += [f'note: {note}' for note in self.notes]
        return '\n'.join(lines)


def load_softmax_checkpoint(path_or_state, map_location='cpu',
                            fc_norm_target='ln2') -> SoftmaxCheckpoint:
    """Read a Softmax ViT checkpoint of any known layout into mmpretrain names.

    Args:
        path_or_state: path of a checkpoint file, or an already loaded checkpoint
            (the object ``torch.load`` returned, or a bare state dict).
        map_location: passed to ``torch.load`` when reading a file (a loaded
            checkpoint keeps its tensors where they are).
        fc_norm_target (str): where a global-pool ``fc_norm`` (MAE fine-tuned, timm
            ``global_pool='avg'``) goes. ``'ln2'`` (default) is mmpretrain's norm of
            the pooled features (``out_type='avg_featmap', final_norm=False``): the
            same function. ``'ln1'`` makes it the final norm, for models that have
            no pooled norm (LinearViT); that norm then acts on the tokens before
            pooling, which is not the same function.

    Returns:
        SoftmaxCheckpoint

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the file is not a weights-only PyTorch checkpoint, or its layout
            is not one of :data:`KNOWN_FORMATS`.
        TypeError: ``path_or_state`` is neither a path nor a mapping.
    """
    if fc_norm_target not in ('ln1', 'ln2'):
        raise ValueError(f"fc_norm_target must be 'ln1' or 'ln2', got {fc_norm_target!r}")
    if isinstance(path_or_state, (str, os.PathLike)):
        where = os.fspath(path_or_state)
        raw = _read_checkpoint(where, map_location)
    elif isinstance(path_or_state, Mapping):
        where = 'the given checkpoint'
        raw = path_or_state
    else:
        raise TypeError('load_softmax_checkpoint expects a checkpoint path or a loaded '
                        f'checkpoint mapping, got {type(path_or_state).__name__}')
    if not isinstance(raw, Mapping):
        raise ValueError(f'{where}: expected a dict-like checkpoint, the file holds a '
                         f'{type(raw).__name__}. Known formats:\n{_formats_text()}')

    source_format, model_dict, prefix_groups, notes = _pick_model_dict(raw, where)
    if source_format == 'mmpretrain':
        state_dict, unused_groups = _select_mmpretrain(model_dict, notes)
    else:
        state_dict, unused_groups = _map_timm(model_dict)
    _place_pooled_norm(state_dict, fc_norm_target, notes)
    for group, keys in prefix_groups.items():
        unused_groups.setdefault(group, []).extend(keys)
    unused_groups = {group: keys for group, keys in unused_groups.items() if keys}

    has_dist = any(key in model_dict for key in ('dist_token', 'backbone.dist_token'))
    ckpt = SoftmaxCheckpoint(
        state_dict=state_dict,
        source_format=source_format,
        unused_keys=[key for keys in unused_groups.values() for key in keys],
        unused_groups=unused_groups,
        notes=notes)
    _fill_shapes(ckpt, has_dist)
    _fill_num_heads(ckpt, raw)
    return ckpt


# --------------------------------------------------------------------------- reading


def _read_checkpoint(path, map_location):
    """Read a weight file or an mmengine run checkpoint without running code.

    ``load_checkpoint_file`` allows tensors, plain containers, numpy data, mmengine's
    run metadata and argparse namespaces (the ``args`` of DeiT, DINO, iBOT and MAE
    training checkpoints); any other pickled object is refused.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f'Softmax ViT checkpoint not found: {path!r}')
    try:
        return load_checkpoint_file(path, map_location=map_location)
    except UnsafeCheckpointError as err:
        raise ValueError(
            f'refused to load {err}. Weight files are read without executing '
            'anything they carry; if you trust this file, load it yourself and pass the '
            'loaded dict, or its state_dict, to load_softmax_checkpoint.') from None
    except pickle.UnpicklingError as err:
        raise ValueError(f'{path!r} is not a PyTorch checkpoint: torch.load cannot '
                         f'unpickle it ({_last_line(err)}).') from None
    except (RuntimeError, EOFError, KeyError, IndexError, OSError) as err:
        raise ValueError(f'{path!r} is not a PyTorch checkpoint: torch.load cannot '
                         f'read it ({type(err).__name__}: {err}).') from None


def _last_line(err):
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    specific = [line for line in lines if line.startswith('Unsupported')]
    return (specific or lines or [repr(err)])[0]


def _formats_text():
    return '\n'.join(f'  {name}: {desc}' for name, desc in KNOWN_FORMATS.items())


def _is_tensor_dict(obj):
    return (isinstance(obj, Mapping) and len(obj) > 0
            and all(isinstance(key, str) for key in obj)
            and any(torch.is_tensor(value) for value in obj.values()))


def _strip_module(state):
    """Drop the ``module.`` prefixes that DataParallel / DDP wrapping adds."""
    stripped = OrderedDict()
    for key, value in state.items():
        while key.startswith('module.'):
            key = key[len('module.'):]
        stripped[key] = value
    return stripped


def _split_prefix(state, prefix):
    selected = OrderedDict((key[len(prefix):], value) for key, value in state.items()
                           if key.startswith(prefix))
    rest = [key for key in state if not key.startswith(prefix)]
    return selected, rest


def _has_prefix(state, prefix):
    return any(key.startswith(prefix) for key in state)


def _describe_entries(raw, names):
    parts = []
    for name in names:
        value = raw[name]
        if _is_tensor_dict(value):
            parts.append(f"{name} ({len(value)} tensor{'s' if len(value) > 1 else ''})")
        else:
            parts.append(name)
    return ', '.join(parts)


def _unrecognised(where, raw, model_dict):
    top = list(raw)[:8]
    examples = list(model_dict)[:6] if model_dict is not None else []
    return ValueError(
        f'{where}: unrecognised checkpoint layout. Top-level keys: {top}; example '
        f'tensor keys: {examples}. A plain ViT with blocks.N.attn.qkv (timm) or '
        f'backbone.layers.N.attn.qkv (mmpretrain) is expected. Known formats:\n'
        f'{_formats_text()}')


def _pick_model_dict(raw, where):
    """Find the Softmax encoder's state dict inside the checkpoint.

    Returns (source_format, model_dict, prefix_groups, notes) where model_dict has
    ``module.`` and encoder prefixes stripped and prefix_groups holds the keys left
    out with the prefix choice.
    """
    notes = []
    prefix_groups = {}

    container = next((name for name in ('teacher', 'state_dict', 'model')
                      if _is_tensor_dict(raw.get(name))), None)
    if container is None:
        if not _is_tensor_dict(raw):
            raise _unrecognised(where, raw, None)
        model_dict = raw
    else:
        model_dict = raw[container]
        others = [name for name in raw if name != container]
        if others:
            notes.append(f"read the '{container}' entry; ignored top-level entries: "
                         f'{_describe_entries(raw, others)}')

    # Values that are not tensors (mmengine's _metadata is an attribute, but some
    # tools leave version numbers in the dict) cannot be weights.
    non_tensor = [key for key, value in model_dict.items() if not torch.is_tensor(value)]
    if non_tensor:
        prefix_groups[_NON_TENSOR_GROUP] = non_tensor
    model_dict = _strip_module(OrderedDict(
        (key, value) for key, value in model_dict.items() if torch.is_tensor(value)))

    if (_has_prefix(model_dict, 'backbone.layers.')
            or _has_prefix(model_dict, 'backbone.patch_embed.projection.')):
        if not any(key.endswith('.attn.qkv.weight') and _TARGET_LAYER_RE.match(key)
                   for key in model_dict):
            raise _unrecognised(where, raw, model_dict)
        return 'mmpretrain', model_dict, prefix_groups, notes

    if _has_prefix(model_dict, 'base_encoder.'):
        encoder, rest = _split_prefix(model_dict, 'base_encoder.')
        _group_rest(prefix_groups, rest, {
            'momentum_encoder.': 'MoCo v3 momentum encoder',
            'predictor.': 'MoCo v3 predictor MLP'})
        notes.append('MoCo v3: using base_encoder (momentum_encoder and predictor '
                     'ignored; base_encoder.head is the projection MLP)')
        _require_vit(encoder, where, raw)
        return 'mocov3', encoder, prefix_groups, notes

    if _has_prefix(model_dict, 'backbone.blocks.'):
        encoder, rest = _split_prefix(model_dict, 'backbone.')
        _group_rest(prefix_groups, rest, {'head.': 'self-supervised projection head'})
        # DINO saves teacher/student; iBOT's released backbone files use 'state_dict'.
        source_format = ('ibot' if container == 'state_dict'
                         or _looks_like_ibot(raw, model_dict) else 'dino')
        if container == 'teacher':
            method = _METHOD_NAMES[source_format]
            notes.append(f'{method}: using the teacher (the network {method} evaluates); '
                         'the student is ignored')
        _require_vit(encoder, where, raw)
        return source_format, encoder, prefix_groups, notes

    _require_vit(model_dict, where, raw)
    has_decoder = (_has_prefix(model_dict, 'decoder_') or 'mask_token' in model_dict)
    if container == 'teacher':
        source_format = 'ibot' if _looks_like_ibot(raw, model_dict) else 'dino'
        notes.append(f'{_METHOD_NAMES[source_format]}: using the teacher; the student '
                     'is ignored')
    elif has_decoder or (container == 'model' and 'fc_norm.weight' in model_dict):
        source_format = 'mae'
    elif container == 'model':
        source_format = 'deit-official'
    elif container == 'state_dict':
        # timm's train.py writes 'arch' and 'version' beside its state_dict; iBOT's
        # released backbone files hold nothing else.
        source_format = ('ibot' if _looks_like_ibot(raw, model_dict)
                         or set(raw) == {'state_dict'} else 'timm')
    else:
        source_format = 'timm'
    return source_format, model_dict, prefix_groups, notes


def _looks_like_ibot(raw, model_dict):
    if 'ibot_loss' in raw:
        return True
    # iBOT's student has a learnt mask embedding and its head a second (patch) branch.
    return any(key.endswith('masked_embed') or '.last_layer2.' in key
               or key.startswith('head.mlp2.') for key in model_dict)


def _group_rest(groups, keys, prefixes):
    for key in keys:
        group = next((name for prefix, name in prefixes.items()
                      if key.startswith(prefix)), _UNMAPPED_GROUP)
        groups.setdefault(group, []).append(key)


def _require_vit(state, where, raw):
    if not any(_TIMM_BLOCK_RE.match(key) and key.endswith('attn.qkv.weight')
               for key in state):
        raise _unrecognised(where, raw, state)


# ------------------------------------------------------------------------- mapping


def _map_timm(state):
    mapped = OrderedDict()
    unused = {}
    for key, value in state.items():
        target = _TIMM_TOP_PARAMS.get(key)
        if target is None:
            match = _TIMM_BLOCK_RE.match(key)
            if match and match.group(2) in _TIMM_BLOCK_PARAMS:
                target = (f'backbone.layers.{match.group(1)}.'
                          f'{_TIMM_BLOCK_PARAMS[match.group(2)]}')
        if target is not None:
            mapped[target] = value
            continue
        if key == 'dist_token' or key.startswith('head_dist.'):
            group = _DIST_GROUP
        elif key.startswith('decoder_') or key == 'mask_token':
            group = _MAE_DECODER_GROUP
        elif key.startswith('head.'):
            group = _NOT_A_CLASSIFIER_GROUP
        else:
            group = _UNMAPPED_GROUP
        unused.setdefault(group, []).append(key)
    return mapped, unused


def _select_mmpretrain(state, notes):
    selected = OrderedDict()
    unused = {}
    for key, value in state.items():
        layer = _TARGET_LAYER_RE.match(key)
        if key in _TARGET_TOP_PARAMS or (layer and layer.group(2) in _TARGET_LAYER_PARAMS):
            selected[key] = value
            continue
        # LinearClsHead names its classifier head.fc; it is the same linear layer.
        if key in ('head.fc.weight', 'head.fc.bias'):
            selected['head.layers.head.' + key.rsplit('.', 1)[1]] = value
            if key == 'head.fc.weight':
                notes.append('LinearClsHead head.fc -> head.layers.head')
            continue
        if key == 'backbone.dist_token' or key.startswith('head.layers.head_dist.'):
            group = _DIST_GROUP
        elif key.startswith('backbone.'):
            group = _UNMAPPED_GROUP
        elif key.startswith('head.'):
            group = _NOT_A_CLASSIFIER_GROUP
        else:
            group = f"mmpretrain '{key.split('.', 1)[0]}'"
        unused.setdefault(group, []).append(key)
    return selected, unused


def _place_pooled_norm(state, target, notes):
    pooled = [key for key in state if key.startswith('backbone.ln2.')]
    if not pooled:
        return
    if target == 'ln2':
        notes.append('the norm of the average-pooled patch tokens (timm/MAE fc_norm) is '
                     "backbone.ln2, mmpretrain's avg_featmap norm (final_norm=False); "
                     "fc_norm_target='ln1' makes it the final norm instead")
        return
    if any(key.startswith('backbone.ln1.') for key in state):
        raise ValueError("fc_norm_target='ln1' but the checkpoint has both a final norm "
                         '(norm / backbone.ln1) and a pooled norm (fc_norm / backbone.ln2)')
    for key in pooled:
        state['backbone.ln1.' + key.rsplit('.', 1)[1]] = state.pop(key)
    notes.append('the pooled-token norm (fc_norm) is used as the final norm backbone.ln1: '
                 'trained on pooled features, it now normalises the tokens before pooling')


# ------------------------------------------------------------------ derived info


def _fill_shapes(ckpt, has_dist):
    state = ckpt.state_dict
    proj = state.get('backbone.patch_embed.projection.weight')
    if proj is not None:
        ckpt.embed_dims = int(proj.shape[0])
        ckpt.patch_size = (int(proj.shape[2]), int(proj.shape[3]))
    else:
        ckpt.notes.append('no patch embedding (backbone.patch_embed.projection) mapped; '
                          'patch_size unknown')
    if 'head.layers.head.weight' not in state:
        ckpt.notes.append('no linear classifier head in the checkpoint '
                          '(backbone-only or self-supervised weights)')
    layer_ids = sorted({int(m.group(1)) for m in map(_TARGET_LAYER_RE.match, state) if m})
    if layer_ids:
        ckpt.depth = layer_ids[-1] + 1
        if layer_ids != list(range(ckpt.depth)):
            ckpt.notes.append(f'layer indices are not contiguous: {layer_ids}')
        if ckpt.embed_dims is None:
            qkv = state.get(f'backbone.layers.{layer_ids[0]}.attn.qkv.weight')
            if qkv is not None:
                ckpt.embed_dims = int(qkv.shape[1])

    pos_embed = state.get('backbone.pos_embed')
    if pos_embed is None:
        return
    if pos_embed.dim() != 3 or pos_embed.shape[0] != 1:
        raise ValueError('pos_embed must have shape (1, tokens, C), got '
                         f'{tuple(pos_embed.shape)}')
    num_slots = int(pos_embed.shape[1])
    num_prefix = int('backbone.cls_token' in state) + int(has_dist)
    candidates = [num_prefix] + [k for k in (0, 1, 2) if k != num_prefix]
    extra = next((k for k in candidates if num_slots > k
                  and math.isqrt(num_slots - k) ** 2 == num_slots - k), None)
    if extra is None:
        ckpt.num_extra_tokens = num_prefix
        ckpt.notes.append(f'pos_embed has {num_slots} slots, not {num_prefix} extra '
                          'tokens plus a square grid; pos_grid left unknown')
        return
    if extra == 2 and has_dist:
        # DeiT orders the prefix as [class, distillation]; the class slot stays.
        state['backbone.pos_embed'] = torch.cat([pos_embed[:, :1], pos_embed[:, 2:]], 1)
        extra = 1
        ckpt.notes.append('distilled DeiT: dropped the distillation-token slot of '
                          'pos_embed (kept class-token slot + patch grid); dist_token '
                          'and head_dist are unused')
    elif extra == 0 and num_prefix > 0:
        ckpt.notes.append('pos_embed has no class-token slot (num_extra_tokens=0, e.g. '
                          'DeiT III / timm no_embed_class): the class token gets no '
                          'position embedding; prepend a zero slot to load it into a '
                          'ViT whose pos_embed covers the class token')
    elif extra != num_prefix:
        ckpt.notes.append(f'pos_embed has {extra} leading non-patch slot(s) but the '
                          f'checkpoint has {num_prefix} prefix token(s)')
    side = math.isqrt(num_slots - extra)
    ckpt.num_extra_tokens = extra
    ckpt.pos_grid = (side, side)


def _fill_num_heads(ckpt, raw):
    candidates = []  # (source description, code base or None, value)

    def collect(obj, where):
        if isinstance(obj, argparse.Namespace):
            obj = vars(obj)
        if not isinstance(obj, Mapping):
            return
        if isinstance(obj.get('num_heads'), int):
            candidates.append((f"{where}['num_heads']", None, obj['num_heads']))
        for name_key in ('model', 'arch'):
            if isinstance(obj.get(name_key), str):
                candidates.append((f"{where}['{name_key}']", 'name', obj[name_key]))
        cfg_text = obj.get('cfg') or obj.get('config')
        if isinstance(cfg_text, str):
            heads = set(re.findall(r'num_heads\s*=\s*(\d+)', cfg_text))
            if len(heads) == 1:
                candidates.append((f"{where}['cfg']", None, int(heads.pop())))
            archs = set(re.findall(r"arch\s*=\s*'([\w-]+)'", cfg_text))
            if len(archs) == 1:
                candidates.append((f"{where}['cfg'] arch", 'mmpretrain', archs.pop()))

    collect(raw, 'checkpoint')
    collect(raw.get('args'), 'args')
    collect(raw.get('meta'), 'meta')

    for where, kind, value in candidates:
        if kind is None:
            heads, dims = value, None
        else:
            resolved = _heads_from_arch_name(ckpt.source_format, kind, value, raw)
            if resolved is None:
                continue
            dims, heads = resolved
        if ckpt.embed_dims is not None and (
                (dims is not None and dims != ckpt.embed_dims)
                or ckpt.embed_dims % heads != 0):
            ckpt.notes.append(f'{where}={value!r} does not fit embed_dims='
                              f'{ckpt.embed_dims}; num_heads left unknown')
            continue
        ckpt.num_heads = heads
        ckpt.notes.append(f'num_heads={heads} from {where}={value!r}')
        return


def _heads_from_arch_name(source_format, kind, name, raw):
    if kind == 'mmpretrain':
        return _ARCH_HEADS['mmpretrain'].get(name.lower())
    code_base = {'deit-official': 'deit', 'dino': 'dino', 'ibot': 'dino',
                 'mocov3': 'mocov3', 'mae': 'mae'}.get(source_format)
    # Only timm's own train.py (which writes 'version') names timm models; MoCo v3's
    # linear-probe checkpoints share the layout but mean MoCo v3's vit_small.
    if source_format == 'timm' and 'version' in raw:
        code_base = 'timm'
    if code_base is None:
        return None
    match = re.match(_ARCH_NAME_PATTERNS[code_base], name.lower())
    return _ARCH_HEADS[code_base].get(match.group(1)) if match else None
