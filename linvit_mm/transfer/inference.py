"""What a Softmax ViT checkpoint's tensors and metadata say about its architecture.

Shapes give the width, depth, patch size and position-embedding layout. The number of
attention heads is not in any shape: it comes from the checkpoint's own metadata (an
explicit ``num_heads`` or an architecture name its code base fixes) or from the caller.
"""
import argparse
import math
import re
from typing import List, Mapping, NamedTuple, Optional, Tuple

import torch

__all__ = ['Layout', 'infer_layout', 'infer_num_heads', 'check_num_heads']

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
# The code base whose names a layout's architecture names are.
_FORMAT_CODE_BASES = {'deit-official': 'deit', 'dino': 'dino', 'ibot': 'dino',
                      'mocov3': 'mocov3', 'mae': 'mae'}


class Layout(NamedTuple):
    embed_dims: Optional[int]
    depth: Optional[int]
    patch_size: Optional[Tuple[int, int]]
    pos_grid: Optional[Tuple[int, int]]
    num_extra_tokens: Optional[int]
    notes: List[str]


def infer_layout(state, has_dist):
    """Read the architecture from the tensors of ``state`` (mmpretrain names).

    A distilled DeiT's position embedding carries a slot for the distillation token that
    no model here has; it is dropped from ``state`` in place.

    Args:
        state (dict): the mapped tensors.
        has_dist (bool): whether the checkpoint had a distillation token.

    Returns:
        Layout
    """
    notes = []
    embed_dims = depth = patch_size = None
    proj = state.get('backbone.patch_embed.projection.weight')
    if proj is not None:
        embed_dims = int(proj.shape[0])
        patch_size = (int(proj.shape[2]), int(proj.shape[3]))
    else:
        notes.append('no patch embedding (backbone.patch_embed.projection) mapped; '
                     'patch_size unknown')
    if 'head.layers.head.weight' not in state:
        notes.append('no linear classifier head in the checkpoint '
                     '(backbone-only or self-supervised weights)')
    layer_ids = sorted({int(m.group(1)) for m in
                        (re.match(r'^backbone\.layers\.(\d+)\.', key) for key in state) if m})
    if layer_ids:
        depth = layer_ids[-1] + 1
        if layer_ids != list(range(depth)):
            notes.append(f'layer indices are not contiguous: {layer_ids}')
        if embed_dims is None:
            qkv = state.get(f'backbone.layers.{layer_ids[0]}.attn.qkv.weight')
            if qkv is not None:
                embed_dims = int(qkv.shape[1])
    pos_grid, num_extra_tokens = _pos_layout(state, has_dist, notes)
    return Layout(embed_dims, depth, patch_size, pos_grid, num_extra_tokens, notes)


def _pos_layout(state, has_dist, notes):
    """``(pos_grid, num_extra_tokens)`` of ``backbone.pos_embed``; (None, None) without one."""
    pos_embed = state.get('backbone.pos_embed')
    if pos_embed is None:
        return None, None
    if pos_embed.dim() != 3 or pos_embed.shape[0] != 1:
        raise ValueError('pos_embed must have shape (1, tokens, C), got '
                         f'{tuple(pos_embed.shape)}')
    num_slots = int(pos_embed.shape[1])
    registers = state.get('backbone.register_tokens')
    num_prefix = (int('backbone.cls_token' in state) + int(has_dist)
                  + (int(registers.shape[1]) if registers is not None else 0))
    candidates = [num_prefix] + [k for k in (0, 1, 2) if k != num_prefix]
    extra = next((k for k in candidates if num_slots > k
                  and math.isqrt(num_slots - k) ** 2 == num_slots - k), None)
    if extra is None:
        notes.append(f'pos_embed has {num_slots} slots, not {num_prefix} extra '
                     'tokens plus a square grid; pos_grid left unknown')
        return None, num_prefix
    if extra == 2 and has_dist:
        # DeiT orders the prefix as [class, distillation]; the class slot stays.
        state['backbone.pos_embed'] = torch.cat([pos_embed[:, :1], pos_embed[:, 2:]], 1)
        extra = 1
        notes.append('distilled DeiT: dropped the distillation-token slot of '
                     'pos_embed (kept class-token slot + patch grid); dist_token '
                     'and head_dist are unused')
    elif extra == 0 and num_prefix > 0:
        notes.append('pos_embed has no class-token slot (num_extra_tokens=0, e.g. '
                     'DeiT III, DINOv2 with registers / timm no_embed_class): the class token '
                     '(and registers) get no position embedding; prepend a zero slot to load '
                     'it into a ViT whose pos_embed covers the class token')
    elif extra != num_prefix:
        notes.append(f'pos_embed has {extra} leading non-patch slot(s) but the '
                     f'checkpoint has {num_prefix} prefix token(s)')
    side = math.isqrt(num_slots - extra)
    return (side, side), extra


def infer_num_heads(raw, source_format, embed_dims):
    """The head count the checkpoint's own metadata states, if any.

    Looked for in the top level, ``args`` and ``meta`` of ``raw``: an explicit
    ``num_heads``, an architecture name of the layout's code base (``arch``, ``model``),
    or an mmpretrain config text. A value that does not fit ``embed_dims`` is passed over
    (with a note).

    Returns:
        tuple: ``(num_heads or None, where it was read or None, notes)``.
    """
    candidates = []  # (source description, kind of value, value)

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

    notes = []
    for where, kind, value in candidates:
        if kind is None:
            heads, dims = value, None
        else:
            resolved = _heads_from_arch_name(source_format, kind, value, raw)
            if resolved is None:
                continue
            dims, heads = resolved
        if embed_dims is not None and (
                (dims is not None and dims != embed_dims) or heads <= 0
                or embed_dims % heads != 0):
            notes.append(f'{where}={value!r} does not fit embed_dims={embed_dims}; '
                         f'num_heads left unknown')
            continue
        source = f'{where}={value!r}'
        notes.append(f'num_heads={heads} from {source}')
        return heads, source, notes
    return None, None, notes


def _heads_from_arch_name(source_format, kind, name, raw):
    if kind == 'mmpretrain':
        return _ARCH_HEADS['mmpretrain'].get(name.lower())
    code_base = _FORMAT_CODE_BASES.get(source_format)
    # Only timm's own train.py (which writes 'version') names timm models; MoCo v3's
    # linear-probe checkpoints share the layout but mean MoCo v3's vit_small.
    if source_format == 'timm' and 'version' in raw:
        code_base = 'timm'
    if code_base is None:
        return None
    match = re.match(_ARCH_NAME_PATTERNS[code_base], name.lower())
    return _ARCH_HEADS[code_base].get(match.group(1)) if match else None


def check_num_heads(num_heads, embed_dims, stated=None, stated_from=None):
    """Check a head count the caller gives for a checkpoint; return it.

    Args:
        num_heads (int): the caller's count.
        embed_dims (int, optional): the checkpoint's width; the heads must divide it.
        stated (int, optional): what the checkpoint's own metadata says, which must agree.
        stated_from (str, optional): where the metadata says it, for the message.

    Raises:
        ValueError: not a positive integer, not a divisor of ``embed_dims``, or not what
            the checkpoint states.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f'num_heads must be a positive integer (the checkpoint\'s number of '
                         f'attention heads), got {num_heads!r}')
    if embed_dims is not None and embed_dims % num_heads != 0:
        raise ValueError(f'num_heads={num_heads} does not divide the checkpoint\'s width '
                         f'embed_dims={embed_dims}; give the number of heads its attention '
                         f'was trained with')
    if stated is not None and stated != num_heads:
        raise ValueError(f'num_heads={num_heads} was given, but the checkpoint states '
                         f'num_heads={stated} ({stated_from}); drop the num_heads option or '
                         f'give {stated}')
    return num_heads

