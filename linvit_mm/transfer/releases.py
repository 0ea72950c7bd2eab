"""The original release layouts of DINOv2, DINOv3, EVA-02 and CLIP, in timm's names.

timm reads these releases through its ``checkpoint_filter_fn`` (``vision_transformer.py``,
``eva.py``); this module is the same conversion, so a release and the timm state dict of
the same weights read alike. Each :class:`Release` says how to recognise its layout and
returns the tensors under timm's names (the key maps of :mod:`linvit_mm.transfer.key_maps`
take it from there), the source tensors it leaves out (grouped by why) and notes.

:func:`merge_timm_variants` then folds the tensors of timm's non-plain ViTs into a plain
ViT's names, in every timm-named state dict (a release converted here or a timm model's):
EVA's query and value biases with the key bias fixed at zero become one ``qkv`` bias, EVA's
separate ``q/k/v_proj`` one ``qkv``, and SwiGLU's separate gate and value layers
(``fc1_g``, ``fc1_x``) one packed ``fc1`` (gate rows first, as timm's ``GluMlp`` and
mmpretrain's ``SwiGLUFFN`` ``w12`` hold them).
"""
import re
from collections import OrderedDict
from typing import Callable, Dict, List, Mapping, NamedTuple, Tuple

import torch

__all__ = ['Release', 'RELEASES', 'find_release', 'merge_timm_variants', 'PRETRAINING_GROUP',
           'FIXED_ROPE_GROUP']

PRETRAINING_GROUP = 'used in pre-training only (mask token, masked-image-modelling head)'
FIXED_ROPE_GROUP = 'RoPE tables (fixed; recomputed from the arch)'
CLIP_TEXT_GROUP = 'CLIP text tower'
CLIP_PROJECTION_GROUP = 'CLIP image projection (image-text embedding, not a classifier)'

Converted = Tuple[Dict[str, torch.Tensor], Dict[str, List[str]], List[str]]


class Release(NamedTuple):
    """One release layout: its name (``source_format``), family, a description, whether a
    state dict has it (``detect``) and its conversion to timm's names (``convert``)."""
    name: str
    family: str
    description: str
    detect: Callable[[Mapping[str, torch.Tensor]], bool]
    convert: Callable[[Mapping[str, torch.Tensor]], Converted]


def _renamed(state, rules):
    """``state`` with every key rewritten by the ``(pattern, replacement)`` rules in turn."""
    out = OrderedDict()
    for key, value in state.items():
        for pattern, replacement in rules:
            key = re.sub(pattern, replacement, key)
        out[key] = value
    return out


def _set_aside(state, groups, group, predicate):
    """Move the keys ``predicate`` accepts out of ``state`` into ``groups[group]``."""
    for key in [key for key in state if predicate(key)]:
        groups.setdefault(group, []).append(key)
        del state[key]


# ----------------------------------------------------------------------------- CLIP

_CLIP_RULES = [  # timm's _convert_openai_clip, in its order
    (r'^conv1\.', 'patch_embed.proj.'), (r'^positional_embedding$', 'pos_embed'),
    (r'^transformer\.resblocks\.', 'blocks.'), (r'^ln_pre\.', 'norm_pre.'),
    (r'^ln_post\.', 'norm.'), (r'\.ln_(\d)\.', r'.norm\1.'), (r'\.in_proj_', '.qkv.'),
    (r'\.out_proj\.', '.proj.'), (r'\.mlp\.c_fc\.', '.mlp.fc1.'), (r'\.mlp\.c_proj\.', '.mlp.fc2.')]


def _clip_prefix(state):
    return next((prefix for prefix in ('visual.', 'module.visual.')
                 if prefix + 'class_embedding' in state), None)


def _convert_clip(state):
    """OpenAI CLIP / OpenCLIP ``visual.*`` (the image tower) -> timm ``vit_*_clip_*``."""
    prefix = _clip_prefix(state)
    groups, notes = {}, []
    visual = OrderedDict()
    for key, value in state.items():
        if key.startswith(prefix):
            visual[key[len(prefix):]] = value
        else:
            groups.setdefault(CLIP_TEXT_GROUP, []).append(key)
    _set_aside(visual, groups, CLIP_PROJECTION_GROUP, lambda key: key == 'proj')
    out = _renamed(visual, _CLIP_RULES)
    out['cls_token'] = out.pop('class_embedding').reshape(1, 1, -1)
    out['pos_embed'] = out['pos_embed'].unsqueeze(0)
    notes.append(f"CLIP: read the image tower ('{prefix}*')")
    return out, groups, notes


# ----------------------------------------------------------------------------- DINOv2

def _convert_dinov2(state):
    """DINOv2 (github facebookresearch/dinov2, ``dinov2_vit*14[_reg]``) -> timm
    ``vit_*_patch14[_reg4]_dinov2``."""
    out, groups, notes = OrderedDict(state), {}, []
    _set_aside(out, groups, PRETRAINING_GROUP, lambda key: key == 'mask_token')
    if 'register_tokens' in out:
        # The release's position embedding has a class-token slot and none for the
        # registers; timm's (no_embed_class) has neither, the slot folded into the class
        # token: the same tokens enter the blocks.
        out['reg_token'] = out.pop('register_tokens')
        pos_embed = out['pos_embed']
        out['cls_token'] = out['cls_token'] + pos_embed[:, :1]
        out['pos_embed'] = pos_embed[:, 1:]
        notes.append('DINOv2 with registers: the class-token slot of pos_embed is added to '
                     'cls_token and dropped (timm\'s no_embed_class layout, the same function)')
    return _renamed(out, [(r'\.mlp\.w12\.', '.mlp.fc1.'), (r'\.mlp\.w3\.', '.mlp.fc2.')]), \
        groups, notes


# ----------------------------------------------------------------------------- DINOv3

def _convert_dinov3(state):
    """DINOv3 (github facebookresearch/dinov3, ``dinov3_vit*16``) -> timm
    ``vit_*_patch16_dinov3[_qkvb]``."""
    out, groups, notes = OrderedDict(state), {}, []
    _set_aside(out, groups, PRETRAINING_GROUP,
               lambda key: key == 'mask_token' or key.startswith('local_cls_norm.'))
    _set_aside(out, groups, FIXED_ROPE_GROUP, lambda key: key.startswith('rope_embed.'))
    out['reg_token'] = out.pop('storage_tokens')
    zero_biases = []
    for key in [key for key in out if key.endswith('.attn.qkv.bias')]:
        mask = out.pop(key[:-len('bias')] + 'bias_mask', None)
        bias = out[key] if mask is None else out[key] * mask.to(out[key].dtype)
        if bias.count_nonzero() == 0:
            zero_biases.append(key)
            del out[key]
        else:
            out[key] = bias
    if zero_biases:
        groups.setdefault('all-zero qkv bias (DINOv3 distilled ViTs; timm builds them without '
                          'one)', []).extend(zero_biases)
        notes.append(f'DINOv3: {len(zero_biases)} all-zero qkv bias(es) left out (timm\'s '
                     f'vit_*_dinov3 has no qkv bias)')
    if any(key.endswith('.bias_mask') for key in out):
        _set_aside(out, groups, 'qkv bias mask (applied)', lambda key: key.endswith('.bias_mask'))
    return out, groups, notes


# ----------------------------------------------------------------------------- EVA-02

_EVA02_RULES = [  # timm eva.py checkpoint_filter_fn, the MIM release's names
    (r'\.mlp\.ffn_ln\.', '.mlp.norm.'), (r'\.attn\.inner_attn_ln\.', '.attn.norm.'),
    (r'\.mlp\.w12\.', '.mlp.fc1.'), (r'\.mlp\.w1\.', '.mlp.fc1_g.'),
    (r'\.mlp\.w2\.', '.mlp.fc1_x.'), (r'\.mlp\.w3\.', '.mlp.fc2.')]


def _convert_eva02(state):
    """EVA-02 masked-image-modelling release (github baaivision/EVA) -> timm
    ``eva02_*_patch14_224``."""
    out, groups, notes = OrderedDict(state), {}, []
    _set_aside(out, groups, PRETRAINING_GROUP,
               lambda key: key == 'mask_token' or key.startswith('lm_head.'))
    _set_aside(out, groups, FIXED_ROPE_GROUP, lambda key: key.startswith('rope.'))
    out = _renamed(out, _EVA02_RULES)
    if any(key.startswith('blocks.0.attn.q_proj.') for key in out):
        out = _renamed(out, [(r'\.attn\.q_bias$', '.attn.q_proj.bias'),
                             (r'\.attn\.v_bias$', '.attn.v_proj.bias')])
    if 'norm.weight' in out:
        # timm moves the pre-training head's norm to the pooled norm of the fine-tuned model
        for name in ('weight', 'bias'):
            out[f'fc_norm.{name}'] = out.pop(f'norm.{name}')
        notes.append('EVA-02: the pre-training final norm is read as the pooled-feature norm '
                     '(fc_norm), as timm does for fine-tuning')
    return out, groups, notes


def _has(pattern):
    compiled = re.compile(pattern)
    return lambda state: any(compiled.search(key) for key in state)


RELEASES = OrderedDict((release.name, release) for release in (
    Release('clip', 'clip',
            "OpenAI CLIP / OpenCLIP {'visual.class_embedding', 'visual.transformer.resblocks.N"
            "...', text tower} (the image tower is read)",
            lambda state: _clip_prefix(state) is not None, _convert_clip),
    Release('dinov3', 'dinov3',
            "DINOv3 release {'storage_tokens', 'rope_embed.periods', 'blocks.N.ls1.gamma', "
            "...}",
            lambda state: 'storage_tokens' in state, _convert_dinov3),
    Release('eva02', 'eva02',
            "EVA-02 MIM release {'mask_token', 'blocks.N.attn.q_bias', 'blocks.N.mlp.w1|w12', "
            "'lm_head', ...}",
            lambda state: 'mask_token' in state and _has(r'\.attn\.q_bias$')(state)
            and _has(r'\.mlp\.w(1|12)\.')(state), _convert_eva02),
    Release('dinov2', 'dinov2',
            "DINOv2 release {'mask_token', 'blocks.N.ls1.gamma', ['register_tokens'], ...}",
            lambda state: 'mask_token' in state and _has(r'\.ls1\.gamma$')(state),
            _convert_dinov2),
))


def find_release(state):
    """The :class:`Release` whose layout ``state`` has, or None."""
    return next((release for release in RELEASES.values() if release.detect(state)), None)


# -------------------------------------------------------------- timm's non-plain ViTs

_EVA_QV_BIAS = re.compile(r'^(.*\.attn\.)q_bias$')
_EVA_QKV_PROJ = re.compile(r'^(.*\.attn\.)q_proj\.weight$')
_SWIGLU_GATE = re.compile(r'^(.*\.mlp\.)fc1_g\.(weight|bias)$')


def merge_timm_variants(state):
    """Fold EVA's attention and SwiGLU's split layers into plain ViT names (module docstring).

    Returns:
        tuple: ``(state, notes)``; ``state`` is a new dict (tensors concatenated where
        merged), the input is left as it is.

    Raises:
        ValueError: separate q/k/v projections of which only one of q and v has a bias.
    """
    out, notes = OrderedDict(state), []
    merged = set()  # the kinds of layer folded
    for key in list(out):
        qv = _EVA_QV_BIAS.match(key)
        if qv and qv.group(1) + 'v_bias' in out:
            q_bias, v_bias = out.pop(key), out.pop(qv.group(1) + 'v_bias')
            out[qv.group(1) + 'qkv.bias'] = torch.cat([q_bias, torch.zeros_like(q_bias), v_bias])
            merged.add('bias')
        proj = _EVA_QKV_PROJ.match(key)
        if proj:
            attn = proj.group(1)
            out[attn + 'qkv.weight'] = torch.cat(
                [out.pop(f'{attn}{part}_proj.weight') for part in 'qkv'])
            q_bias = out.pop(f'{attn}q_proj.bias', None)
            v_bias = out.pop(f'{attn}v_proj.bias', None)
            if (q_bias is None) != (v_bias is None):
                # one bias alone has no place in a qkv bias whose other rows are zero
                raise ValueError(f'{attn}q_proj and {attn}v_proj: only one of them has a bias; '
                                 'EVA attention has both or neither')
            if q_bias is not None:
                out[attn + 'qkv.bias'] = torch.cat([q_bias, torch.zeros_like(q_bias), v_bias])
                merged.add('bias')
            merged.add('proj')
        gate = _SWIGLU_GATE.match(key)
        if gate:
            mlp, kind = gate.groups()
            out[f'{mlp}fc1.{kind}'] = torch.cat([out.pop(key), out.pop(f'{mlp}fc1_x.{kind}')])
            merged.add('swiglu')
    if 'bias' in merged:
        notes.append("EVA attention: the query and value biases (the key's fixed at zero) are "
                     'read as one qkv bias with zero key rows')
    if 'proj' in merged:
        notes.append('EVA attention: the separate q/k/v projections are read as one qkv')
    if 'swiglu' in merged:
        notes.append('SwiGLU: the gate (fc1_g) and value (fc1_x) layers are read as one packed '
                     'layer, gate rows first')
    return out, notes
