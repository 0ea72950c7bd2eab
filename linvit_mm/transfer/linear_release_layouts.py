"""The layouts of the released linear-attention ViTs: for each family, where its tensors go in
LinearViT, how its sizes are read off them, and the operator and switches that compute its
forward (see :mod:`linvit_mm.transfer.linear_releases` for the conversion and the loader)."""
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

__all__ = ['HEAD_KEYS', 'LinearRelease', 'LINEAR_RELEASES']

# The classifier, under the names of mmpretrain's VisionTransformerClsHead (the head of
# linvit_mm's classifier configs).
HEAD_KEYS = {'head.weight': 'head.layers.head.weight', 'head.bias': 'head.layers.head.bias'}

_TIMM_BLOCK = {
    'norm1.weight': 'ln1.weight', 'norm1.bias': 'ln1.bias',
    'attn.qkv.weight': 'attn.qkv.weight', 'attn.qkv.bias': 'attn.qkv.bias',
    'attn.proj.weight': 'attn.proj.weight', 'attn.proj.bias': 'attn.proj.bias',
    'norm2.weight': 'ln2.weight', 'norm2.bias': 'ln2.bias',
    'mlp.fc1.weight': 'ffn.layers.0.0.weight', 'mlp.fc1.bias': 'ffn.layers.0.0.bias',
    'mlp.fc2.weight': 'ffn.layers.1.weight', 'mlp.fc2.bias': 'ffn.layers.1.bias',
}
_TIMM_TOP = {
    'patch_embed.proj.weight': 'patch_embed.projection.weight',
    'patch_embed.proj.bias': 'patch_embed.projection.bias',
    'norm.weight': 'ln1.weight', 'norm.bias': 'ln1.bias',
}


def _vit3_heads(state, embed_dims):
    return state['blocks.0.attn.w1'].shape[1]


def _inline_heads(state, embed_dims):
    # residual.0 is Conv1d(C, C, 1, groups=heads): its weight is (C, C / heads, 1).
    return embed_dims // state['blocks.0.attn.residual.0.weight'].shape[1]


# The MHLA ViT's heads are not in its tensors (q_norm / k_norm and the mixing act on all
# channels): timm's DeiT widths, 64 channels a head.
_MHLA_HEADS = {192: 3, 384: 6, 768: 12}


def _mhla_heads(state, embed_dims):
    if embed_dims not in _MHLA_HEADS:
        raise ValueError(f'an MHLA ViT of width {embed_dims}: its head count is not in its '
                         f'tensors, and only the released widths {sorted(_MHLA_HEADS)} are '
                         f'known; give it (num_heads=, --num-heads)')
    return _MHLA_HEADS[embed_dims]


def _mhla_attn_cfg(state):
    """The official switches, the block layout from the mixing conv ``(M, M, 1, 1)`` and
    the grid of the position embedding."""
    from linvit_mm.models.attention.mhla import OFFICIAL_IMAGENET
    mixing = state['blocks.0.attn.piece_attn.conv.weight']
    side = math.isqrt(mixing.shape[0])
    if mixing.dim() != 4 or mixing.shape[0] != mixing.shape[1] or side * side != mixing.shape[0]:
        raise ValueError(f'blocks.0.attn.piece_attn.conv.weight has shape '
                         f'{tuple(mixing.shape)}; (M, M, 1, 1) with M a square was expected')
    return dict(OFFICIAL_IMAGENET, num_blocks=(side, side),
                qk_norm='blocks.0.attn.q_norm.weight' in state,
                attn_norm='blocks.0.attn.norm.weight' in state)


def _mixing_matrix(conv_weight):
    """The ``(M, M)`` matrix of a block's mixing conv ``(M, M, 1, 1)``."""
    if conv_weight.dim() != 4 or tuple(conv_weight.shape[2:]) != (1, 1):
        raise ValueError(f'a piece_attn.conv.weight has shape {tuple(conv_weight.shape)}; '
                         f'(M, M, 1, 1) was expected')
    return conv_weight[:, :, 0, 0]


@dataclass(frozen=True)
class LinearRelease:
    """One released layout.

    Attributes:
        name: the family's name, as :func:`detect_linear_source` gives it.
        description: what it is, for messages.
        repository: where its official code is.
        attn_type: the LinearViT operator, and ``attn_cfg`` its arguments.
        arch_words: arch word -> its sizes ``(embed_dims, num_heads)`` (depth 12, MLP 4x).
        top: release name -> LinearViT name of the tensors outside the blocks.
        block: name inside ``blocks.N`` -> name inside ``layers.N``.
        num_heads: the head count from the state dict and the width.
        heads_from: the tensor ``num_heads`` reads (named in errors).
        attn_cfg: the operator's arguments, or ``attn_cfg_from`` to read them off the
            state dict.
        arch_switches: the switches of a custom arch dict (sizes that are no arch word).
        reshape: LinearViT name suffix -> how that tensor's release form becomes ours.
        extra_slots: leading slots of the learned position embedding (class token).
    """
    name: str
    description: str
    repository: str
    attn_type: str
    arch_words: Mapping[str, tuple]
    top: Mapping[str, str]
    block: Mapping[str, str]
    num_heads: Callable[[Mapping[str, torch.Tensor], int], int]
    heads_from: str
    attn_cfg: Mapping = field(default_factory=dict)
    attn_cfg_from: Optional[Callable[[Mapping[str, torch.Tensor]], dict]] = None
    arch_switches: Mapping = field(default_factory=dict)
    reshape: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    extra_slots: int = 1


LINEAR_RELEASES = OrderedDict(
    vit3=LinearRelease(
        name='vit3', description='ViT³', repository='LeapLabTHU/ViTTT', attn_type='ttt',
        arch_words={'vit3-tiny': (192, 6), 'vit3-small': (384, 6), 'vit3-base': (768, 12)},
        top=_TIMM_TOP,
        # The block's cpe (before norm1) is the ttt operator's encode_position.
        block=dict(_TIMM_BLOCK, **{'cpe.weight': 'attn.cpe.weight', 'cpe.bias': 'attn.cpe.bias',
                                   'attn.w1': 'attn.w1', 'attn.w2': 'attn.w2',
                                   'attn.w3': 'attn.w3'}),
        num_heads=_vit3_heads, heads_from='blocks.0.attn.w1',
        arch_switches=dict(pos_embed_type='none')),
    inline=LinearRelease(
        name='inline', description='InLine-DeiT', repository='LeapLabTHU/InLine',
        attn_type='inline', attn_cfg=dict(residual=True),
        arch_words={'inline-deit-tiny': (192, 6), 'inline-deit-small': (320, 10),
                    'inline-deit-base': (384, 12)},
        top=dict(_TIMM_TOP, cls_token='cls_token', pos_embed='pos_embed'),
        block=dict(_TIMM_BLOCK, **{f'attn.residual.{i}.{p}': f'attn.residual.{i}.{p}'
                                   for i in (0, 2) for p in ('weight', 'bias')}),
        num_heads=_inline_heads, heads_from='blocks.0.attn.residual.0.weight'),
    mhla=LinearRelease(
        name='mhla', description='MHLA ViT', repository='DAGroup-PKU/MHLA', attn_type='mhla',
        arch_words={'mhla-tiny': (192, 3), 'mhla-small': (384, 6), 'mhla-base': (768, 12)},
        # timm's ViT with global_pool='avg': no final norm, fc_norm after the pooling.
        top={k: v for k, v in dict(_TIMM_TOP, pos_embed='pos_embed', **{
            'fc_norm.weight': 'ln2.weight', 'fc_norm.bias': 'ln2.bias'}).items()
             if not k.startswith('norm.')},
        block=dict(_TIMM_BLOCK, **{
            'attn.norm.weight': 'attn.norm.weight', 'attn.norm.bias': 'attn.norm.bias',
            'attn.to_qkv.weight': 'attn.qkv.weight', 'attn.to_qkv.bias': 'attn.qkv.bias',
            'attn.q_norm.weight': 'attn.q_norm.weight', 'attn.k_norm.weight': 'attn.k_norm.weight',
            'attn.lepe.weight': 'attn.value_conv.weight', 'attn.lepe.bias': 'attn.value_conv.bias',
            'attn.piece_attn.conv.weight': 'attn.block_mixing',
            'attn.to_out.0.weight': 'attn.proj.weight', 'attn.to_out.0.bias': 'attn.proj.bias'}),
        num_heads=_mhla_heads, heads_from='patch_embed.proj.weight',
        attn_cfg_from=_mhla_attn_cfg,
        arch_switches=dict(pos_embed_type='learned', final_norm=False, pooled_norm=True),
        # the mixing is a 1x1 conv over the block axis: its (M, M) matrix
        reshape={'attn.block_mixing': _mixing_matrix},
        extra_slots=0),
)
