"""How each family of Softmax ViT checkpoints names its tensors, as data.

The initialisation settings read a checkpoint under the names of mmpretrain's
``ImageClassifier`` + ``VisionTransformer`` + ``VisionTransformerClsHead``, which LinearViT
follows::

    backbone.patch_embed.projection.{weight,bias}
    backbone.cls_token                      (1, 1, C)
    backbone.register_tokens                (1, R, C) registers (DINOv2 / DINOv3)
    backbone.pos_embed                      (1, slots + H*W, C), a slot per extra token or none
    backbone.pre_norm.*                     (CLIP-style norm before the blocks)
    backbone.layers.N.ln1.*                 norm before attention
    backbone.layers.N.attn.qkv.*            (3C, C) rows ordered q, k, v
    backbone.layers.N.attn.proj.*
    backbone.layers.N.attn.gamma1.weight    layer scale (DeiT III)
    backbone.layers.N.ln2.*                 norm before the MLP
    backbone.layers.N.ffn.layers.0.0.*      fc1
    backbone.layers.N.ffn.layers.1.*        fc2
    backbone.layers.N.ffn.w12.*             SwiGLU gate and value rows (EVA-02; replaces fc1)
    backbone.layers.N.ffn.norm.*            SwiGLU hidden norm (EVA-02 sub-LN)
    backbone.layers.N.ffn.w3.*              SwiGLU output (replaces fc2)
    backbone.layers.N.ffn.gamma2.weight     layer scale (DeiT III)
    backbone.ln1.*                          final norm over all tokens (final_norm=True)
    backbone.ln2.*                          norm after average pooling (out_type='avg_featmap')
    head.layers.pre_logits.*                optional representation layer
    head.layers.head.{weight,bias}          the linear classifier

A :class:`KeyMap` says how one family of checkpoints spells those names; :data:`KEY_MAPS`
holds them by name. Another family is one more ``KeyMap`` here (and, in
:mod:`linvit_mm.transfer.formats`, the layout that selects it).
"""
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

__all__ = ['KeyMap', 'KEY_MAPS', 'TIMM_KEYS', 'TIMM_SWIGLU_KEYS', 'MMPRETRAIN_KEYS', 'map_keys',
           'place_pooled_norm', 'timm_key_map', 'DIST_GROUP', 'UNMAPPED_GROUP']

# Why a source tensor was left unused; shared by the key maps and the layout readers.
DIST_GROUP = 'distillation token / head (DeiT distilled)'
MAE_DECODER_GROUP = 'MAE decoder'
NOT_A_CLASSIFIER_GROUP = 'head that is not a linear classifier (projection MLP)'
UNMAPPED_GROUP = 'no counterpart in mmpretrain VisionTransformer'


@dataclass(frozen=True)
class KeyMap:
    """The names one family of checkpoints gives a Softmax ViT's tensors.

    Attributes:
        name: the key map's name in :data:`KEY_MAPS`.
        top: source name -> mmpretrain name, for the tensors outside the blocks.
        block_pattern: regular expression of a block tensor's source name; group 1 is the
            block index, group 2 the name inside the block.
        block: name inside a source block -> name inside ``backbone.layers.N``. Exact names
            only: anything else in a block (relative position tables, q/k norms, BEiT q/v
            biases) has no counterpart in mmpretrain's VisionTransformer and is reported.
        unused: ``(pattern, group)`` pairs tried in order on a source name that is not
            mapped; the first pattern that matches (``re.match``) says why it is unused.
            ``group`` may name the match's groups (``'{1}'``).
        dist_token: the source name of a DeiT distillation token, whose slot the position
            embedding then carries too.
        notes: source name -> note recorded when that tensor is mapped (renamings a user
            should hear about).
    """
    name: str
    top: Mapping[str, str]
    block_pattern: str
    block: Mapping[str, str]
    unused: Tuple[Tuple[str, str], ...] = ((r'', UNMAPPED_GROUP), )
    dist_token: Optional[str] = None
    notes: Mapping[str, str] = field(default_factory=dict)

    def target(self, key):
        """The mmpretrain name of the source tensor ``key``, or None."""
        if key in self.top:
            return self.top[key]
        match = re.match(self.block_pattern, key)
        if match and match.group(2) in self.block:
            return f'backbone.layers.{match.group(1)}.{self.block[match.group(2)]}'
        return None

    def unused_group(self, key):
        for pattern, group in self.unused:
            match = re.match(pattern, key)
            if match:
                return group.format(*((match.group(0), ) + match.groups()))
        return UNMAPPED_GROUP

    def has_blocks(self, state):
        """Whether ``state`` holds at least one block's ``qkv`` weight in these names."""
        return any((self.target(key) or '').endswith('.attn.qkv.weight') for key in state)


def map_keys(state, key_map):
    """Rename the tensors of ``state`` with ``key_map``.

    Returns:
        tuple: ``(mapped, origins, unused_groups, notes)``: the tensors under mmpretrain
        names (in source order), each mmpretrain name's source name, the unmapped source
        names grouped by why, and the notes of the renamings that happened.

    Raises:
        ValueError: two source tensors map to the same name (e.g. both spellings of a layer
            scale), so which one the model would get is undefined.
    """
    mapped, origins, unused, notes = OrderedDict(), {}, {}, []
    for key, value in state.items():
        target = key_map.target(key)
        if target is None:
            unused.setdefault(key_map.unused_group(key), []).append(key)
            continue
        if target in mapped:
            raise ValueError(f'the checkpoint holds both {origins[target]!r} and {key!r}, which '
                             f'are the same tensor ({target}) in the {key_map.name} names; '
                             f'remove one of them')
        mapped[target], origins[target] = value, key
        if key in key_map.notes:
            notes.append(key_map.notes[key])
    return mapped, origins, unused, notes


_TIMM_BLOCK = {
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
# A SwiGLU MLP in timm names (GluMlp: fc1 holds the gate rows, then the value rows;
# releases.merge_timm_variants packs SwiGLU's fc1_g / fc1_x so): mmpretrain's SwiGLUFFN.
_TIMM_SWIGLU_BLOCK = dict(
    {key: value for key, value in _TIMM_BLOCK.items() if not key.startswith('mlp.')},
    **{'mlp.fc1.weight': 'ffn.w12.weight', 'mlp.fc1.bias': 'ffn.w12.bias',
       'mlp.norm.weight': 'ffn.norm.weight', 'mlp.norm.bias': 'ffn.norm.bias',
       'mlp.fc2.weight': 'ffn.w3.weight', 'mlp.fc2.bias': 'ffn.w3.bias'})

_TIMM_TOP = {
    'cls_token': 'backbone.cls_token',
    'reg_token': 'backbone.register_tokens',
    'pos_embed': 'backbone.pos_embed',
    'patch_embed.proj.weight': 'backbone.patch_embed.projection.weight',
    'patch_embed.proj.bias': 'backbone.patch_embed.projection.bias',
    # Home-trained ViTs often make the patch embedding a bare nn.Conv2d.
    'patch_embed.weight': 'backbone.patch_embed.projection.weight',
    'patch_embed.bias': 'backbone.patch_embed.projection.bias',
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

# timm's VisionTransformer and the releases written with its names (DeiT, DINO, iBOT,
# MoCo v3, MAE).
TIMM_KEYS = KeyMap(
    name='timm',
    top=_TIMM_TOP,
    block_pattern=r'^blocks\.(\d+)\.(.+)$',
    block=_TIMM_BLOCK,
    unused=((r'^dist_token$|^head_dist\.', DIST_GROUP),
            (r'^decoder_|^mask_token$', MAE_DECODER_GROUP),
            (r'^head\.', NOT_A_CLASSIFIER_GROUP),
            (r'', UNMAPPED_GROUP)),
    dist_token='dist_token',
    notes={'patch_embed.weight': 'the patch embedding is a bare conv (patch_embed.weight / '
                                 '.bias): read as backbone.patch_embed.projection'})

# timm's ViTs whose MLP is a SwiGLU (EVA-02): the same names but for the MLP's.
TIMM_SWIGLU_KEYS = KeyMap(
    name='timm-swiglu',
    top=TIMM_KEYS.top,
    block_pattern=TIMM_KEYS.block_pattern,
    block=_TIMM_SWIGLU_BLOCK,
    unused=TIMM_KEYS.unused,
    dist_token=TIMM_KEYS.dist_token,
    notes=TIMM_KEYS.notes)

# mmpretrain's own names, kept as they are; LinearClsHead's head.fc is the same classifier.
MMPRETRAIN_KEYS = KeyMap(
    name='mmpretrain',
    top=dict({name: name for name in _TIMM_TOP.values()},
             **{'head.fc.weight': 'head.layers.head.weight',
                'head.fc.bias': 'head.layers.head.bias'}),
    block_pattern=r'^backbone\.layers\.(\d+)\.(.+)$',
    block={name: name for name in (*_TIMM_BLOCK.values(), *_TIMM_SWIGLU_BLOCK.values())},
    unused=((r'^backbone\.dist_token$|^head\.layers\.head_dist\.', DIST_GROUP),
            (r'^backbone\.', UNMAPPED_GROUP),
            (r'^head\.', NOT_A_CLASSIFIER_GROUP),
            (r'^([^.]*)', "mmpretrain '{1}'")),
    dist_token='backbone.dist_token',
    notes={'head.fc.weight': 'LinearClsHead head.fc -> head.layers.head'})

KEY_MAPS: Dict[str, KeyMap] = {key_map.name: key_map for key_map in (
    TIMM_KEYS, TIMM_SWIGLU_KEYS, MMPRETRAIN_KEYS)}


def timm_key_map(state):
    """The timm key map for ``state``: SwiGLU's if its first MLP is a packed gated one
    (``fc1`` has twice the rows ``fc2`` reads), the plain ViT's otherwise."""
    fc1 = next((value for key, value in state.items()
                if re.match(r'^blocks\.\d+\.mlp\.fc1\.weight$', key)), None)
    fc2 = next((value for key, value in state.items()
                if re.match(r'^blocks\.\d+\.mlp\.fc2\.weight$', key)), None)
    gated = (fc1 is not None and fc2 is not None and fc1.dim() == fc2.dim() == 2
             and fc1.shape[0] == 2 * fc2.shape[1])
    return TIMM_SWIGLU_KEYS if gated else TIMM_KEYS


def place_pooled_norm(state, target, notes):
    """Put a pooled-token norm (``backbone.ln2``, from ``fc_norm``) where ``target`` says."""
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
