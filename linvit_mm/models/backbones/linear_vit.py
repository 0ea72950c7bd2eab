"""LinearViT: a Vision Transformer whose attention operator is chosen by name."""
import copy
import inspect
import math
from typing import Sequence

import numpy as np
import torch
import torch.utils.checkpoint as cp
from mmcv.cnn.bricks.drop import DropPath
from mmcv.cnn.bricks.transformer import FFN, PatchEmbed
from mmengine.model import BaseModule, ModuleList
from mmengine.model.weight_init import trunc_normal_
from mmpretrain.models.backbones.base_backbone import BaseBackbone
from mmpretrain.models.utils import SwiGLUFFN, build_norm_layer, to_2tuple
from mmpretrain.registry import MODELS
from torch import nn

from ..attention import attention_class, build_attention
from ..utils.rope import build_rope
from .hybrid import class_token_of, describe_attn_types, resolve_attn_types
from .windows import normalise_window_size, windowed_attention
from ...utils.blocks import block_index_list
from ...utils.tracing import eager_cache, is_tracing


def sincos_pos_embed(hw_shape, embed_dims, temperature=10000., device=None, dtype=None):
    """Fixed 2D sin-cos position embedding ``(1, H*W, C)`` for any grid (MAE / MoCo v3 form).

    Half the channels encode the row, half the column, each as sin and cos of
    ``pos / temperature**(i / (C/4))``; computed for the grid at hand, so there is
    nothing to interpolate when the resolution changes.
    """
    if embed_dims % 4 != 0:
        raise ValueError(f'sin-cos position embedding needs embed_dims divisible by 4, '
                         f'got {embed_dims}')
    h, w = hw_shape
    quarter = embed_dims // 4
    omega = 1. / temperature**(torch.arange(quarter, dtype=torch.float64) / quarter)
    rows = torch.arange(h, dtype=torch.float64)[:, None].expand(h, w).reshape(-1)
    cols = torch.arange(w, dtype=torch.float64)[None, :].expand(h, w).reshape(-1)
    row_angles = rows[:, None] * omega[None]
    col_angles = cols[:, None] * omega[None]
    embed = torch.cat([col_angles.sin(), col_angles.cos(), row_angles.sin(), row_angles.cos()], 1)
    return embed.unsqueeze(0).to(device=device, dtype=dtype or torch.get_default_dtype())


@eager_cache(maxsize=16)
def _cached_sincos_pos_embed(hw_shape, embed_dims, device, dtype):
    # Built in float64 with a sin/cos per element on every forward, it took about a tenth
    # of a ViT-S block's time on a CPU at 224 px (0.3-0.7 ms). One entry per (grid, width,
    # device, dtype) covers a run's few sizes. Callers only read it (the tokens get
    # ``x + pos``), so sharing one tensor is safe.
    return sincos_pos_embed(hw_shape, embed_dims, device=device, dtype=dtype)


FFN_TYPES = ('mlp', 'swiglu')


class LinearViTLayer(BaseModule):
    """Pre-norm ViT block ``x + attn(ln1(x)); x + ffn(ln2(x))`` around any operator.

    Parameter names follow mmpretrain's ``TransformerEncoderLayer`` (``ln1``,
    ``attn.qkv``, ``attn.proj``, ``ln2``, ``ffn.layers.0.0``, ``ffn.layers.1``) so
    DeiT checkpoints load by name; operator-specific parameters live under ``attn``.
    LayerScale, when on, is ``attn.gamma1`` (inside the operator, after ``proj``: see
    ``BaseAttention``) and ``ffn.gamma2``, as in mmpretrain. ``ffn_type='swiglu'`` is
    mmpretrain's ``SwiGLUFFN`` (``ffn.w12`` = [gate; value] rows, ``ffn.norm``, ``ffn.w3``):
    ``w3(norm(silu(gate) * value))``, EVA-02's MLP, whose sub-LN ``ffn.norm`` is
    ``ffn_norm``; it has one dropout, on its output. ``window_size`` > 0 (an int or
    ``(rows, cols)``) runs the operator on windows of the patch grid
    (:mod:`linvit_mm.models.backbones.windows`); 0 is global attention.
    """

    def __init__(self, embed_dims, num_heads, feedforward_channels, attn_type='softmax',
                 attn_cfg=None, drop_rate=0., attn_drop_rate=0., drop_path_rate=0.,
                 qkv_bias=True, act_cfg=dict(type='GELU'), norm_cfg=dict(type='LN', eps=1e-6),
                 layer_scale_init_value=0., ffn_type='mlp', ffn_norm=False, rope=None,
                 window_size=0, with_cp=False, init_cfg=None):
        super().__init__(init_cfg=init_cfg)
        self.embed_dims = embed_dims
        self.with_cp = with_cp
        self.window_size = normalise_window_size(window_size)
        self.ln1 = build_norm_layer(norm_cfg, embed_dims)
        self.attn = build_attention(attn_type, embed_dims=embed_dims, num_heads=num_heads,
                                    qkv_bias=qkv_bias, attn_drop=attn_drop_rate,
                                    proj_drop=drop_rate, **(attn_cfg or {}),
                                    **_operator_switches(attn_type, rope,
                                                         layer_scale_init_value))
        self.ln2 = build_norm_layer(norm_cfg, embed_dims)
        if ffn_type == 'swiglu':
            self.ffn = SwiGLUFFN(
                embed_dims=embed_dims, feedforward_channels=feedforward_channels,
                layer_scale_init_value=layer_scale_init_value,
                dropout_layer=dict(type='Dropout', drop_prob=drop_rate) if drop_rate else None,
                norm_cfg=norm_cfg if ffn_norm else None, add_identity=False)
        else:
            self.ffn = FFN(embed_dims=embed_dims, feedforward_channels=feedforward_channels,
                           num_fcs=2, ffn_drop=drop_rate, dropout_layer=None, act_cfg=act_cfg,
                           add_identity=False, layer_scale_init_value=layer_scale_init_value)
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0 else nn.Identity()

    def _forward(self, x, hw_shape):
        x = self.attn.encode_position(x, hw_shape)
        if self.window_size is None:
            attended = self.attn(self.ln1(x), hw_shape)
        else:
            attended = windowed_attention(self.attn, self.ln1(x), hw_shape, self.window_size)
        x = x + self.drop_path(attended)
        x = x + self.drop_path(self.ffn(self.ln2(x)))
        return x

    def forward(self, x, hw_shape):
        if self.with_cp and x.requires_grad:
            return cp.checkpoint(self._forward, x, hw_shape, use_reentrant=False)
        return self._forward(x, hw_shape)


def _operator_switches(attn_type, rope, layer_scale_init_value):
    """The RoPE / LayerScale arguments of an operator, passed only when switched on, so an
    operator of another package that takes neither still builds plain models; one that is
    asked for them and lacks them is refused by name."""
    switches = {}
    if rope is not None:
        switches['rope'] = rope
    if layer_scale_init_value:
        switches['layer_scale_init_value'] = layer_scale_init_value
    parameters = inspect.signature(attention_class(attn_type).__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    missing = [name for name in switches if name not in parameters and not takes_any]
    if missing:
        raise ValueError(f'the {attn_type!r} operator does not take {" / ".join(missing)}, which '
                         f'this arch switches on; its constructor must accept them and pass them '
                         f'to BaseAttention (which applies both)')
    return switches


def _check_shared_attn_cfg(attn_cfg, attn_types, layer_cfgs):
    """Refuse, before any block is built, an ``attn_cfg`` argument that the operator of a
    block using it does not take (a hybrid passes ``attn_cfg`` to every block)."""
    refused = {}
    for index, (name, cfg) in enumerate(zip(attn_types, layer_cfgs)):
        if not attn_cfg or 'attn_cfg' in cfg:
            continue
        parameters = inspect.signature(attention_class(name).__init__).parameters
        if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            continue
        unknown = tuple(sorted(set(attn_cfg) - set(parameters)))
        if unknown:
            refused.setdefault((name, unknown), []).append(index)
    if refused:
        listed = '; '.join(f'{list(unknown)} for the {name!r} operator (blocks {blocks})'
                           for (name, unknown), blocks in refused.items())
        raise ValueError(f'attn_cfg gives arguments an operator does not take: {listed}. In a '
                         f'hybrid attn_cfg goes to every block; give an operator\'s own '
                         f'arguments to its blocks through layer_cfgs=[dict(attn_cfg=...), ...]')


# The architecture switches an arch can set besides its four sizes, with the value a plain
# DeiT-shaped ViT has. ``None`` for ``pos_embed_type``: the operator's convention.
ARCH_SWITCH_DEFAULTS = dict(
    patch_size=16,
    qkv_bias=True,
    layer_scale_init_value=0.,
    num_register_tokens=0,
    pos_embed_type=None,
    no_embed_class=False,
    pos_embed_antialias=False,
    rope=None,
    ffn_type='mlp',
    act_cfg=dict(type='GELU'),
    ffn_norm=False,
    pre_norm=False,
    norm_cfg=dict(type='LN', eps=1e-6),
    final_norm=True,
    pooled_norm=False,
)
# Switches a model may set differently from its arch word: how features are read out (the
# ViT-Adapter drops the final norm) or resampled, not what a checkpoint's tensors compute.
OVERRIDABLE_SWITCHES = ('final_norm', 'pooled_norm', 'pos_embed_antialias')
ARCH_ESSENTIALS = ('embed_dims', 'num_layers', 'num_heads', 'feedforward_channels')


def _sizes(embed_dims, num_layers, num_heads, feedforward_channels):
    return dict(embed_dims=embed_dims, num_layers=num_layers, num_heads=num_heads,
                feedforward_channels=feedforward_channels)


# What defines each source family (timm's model definitions; see docs/transfer.md).
_DINOV2 = dict(patch_size=14, layer_scale_init_value=1e-5, pos_embed_type='learned',
               pos_embed_antialias=True)
_DINOV2_REG = dict(_DINOV2, num_register_tokens=4, no_embed_class=True)
_DINOV3 = dict(patch_size=16, qkv_bias=False, layer_scale_init_value=1e-5,
               num_register_tokens=4, pos_embed_type='none',
               rope=dict(type='dinov3', temperature=100.), norm_cfg=dict(type='LN', eps=1e-5))
_DEIT3 = dict(patch_size=16, layer_scale_init_value=1e-6, pos_embed_type='learned',
              no_embed_class=True, pos_embed_antialias=True)
_CLIP = dict(patch_size=16, pre_norm=True, act_cfg=dict(type='mmpretrain.QuickGELU'),
             norm_cfg=dict(type='LN', eps=1e-5), pos_embed_type='learned',
             pos_embed_antialias=True)
_EVA02 = dict(patch_size=14, ffn_type='swiglu', pos_embed_type='learned',
              pos_embed_antialias=True,
              rope=dict(type='eva', temperature=10000., ref_grid=(16, 16)),
              final_norm=False, pooled_norm=True)


@MODELS.register_module()
class LinearViT(BaseBackbone):
    """Vision Transformer with a swappable (linear) attention operator.

    Args:
        arch (str | dict): a word of ``arch_zoo`` or a dict with ``embed_dims``,
            ``num_layers``, ``num_heads``, ``feedforward_channels`` and optionally any of
            the architecture switches below. The DeiT words ``'tiny'``, ``'small'``,
            ``'base'`` (``'deit-*'``; 192/3, 384/6, 768/12 heads, depth 12, MLP ratio 4)
            set sizes only. The source words set everything that defines a pre-trained
            family, so its checkpoints compute the same function (docs/transfer.md has the
            table): ``dinov2-{small,base,large}``, ``dinov2-reg-{small,base,large}``,
            ``dinov3-{small,base,large}``, ``deit3-{small,base}``, ``clip-base``
            (QuickGELU, OpenAI CLIP), ``clip-base-gelu`` (GELU, OpenCLIP / timm
            ``vit_base_patch16_clip_224``), ``eva02-{tiny,small,base}``. A switch the
            arch sets may not be given a different value (a ``ValueError`` says so; use a
            custom dict) except ``final_norm``, ``pooled_norm`` and
            ``pos_embed_antialias``, which only change how features are read out.
        attn_type (str | list[str] | dict): a registered operator (``softmax``, ``elu``,
            ``relu``, ``inline``, ``hedgehog``, ``mhla``, ``ttt``, ...) for every block, or a
            hybrid: a list of one operator per block, or
            ``dict(default='relu', softmax=[0, 11])`` (blocks not listed run ``default``;
            negative indices count from the end), or the compact form
            ``'relu+softmax@0,11'`` (see :mod:`linvit_mm.models.backbones.hybrid`). The
            resolved list is ``attn_types``; ``attn_type`` is then the operator's name, or
            the compact form of a hybrid (which builds the same layout again).
        attn_cfg (dict): extra keyword arguments of the operator (of every block's operator
            in a hybrid; per-block ones through ``layer_cfgs``).
        img_size (int | tuple): the training input size; the learned position
            embedding is stored for this grid and interpolated for others.
        in_channels (int): image channels.
        out_indices (int | Sequence[int]): blocks whose output is returned.
        out_type (str, optional): ``'cls_token'``, ``'featmap'``, ``'avg_featmap'``
            or ``'raw'``. Defaults to ``'cls_token'`` for operators that carry a
            class token and ``'avg_featmap'`` for the others. ``featmap`` is the
            final-normed patch tokens as ``(B, C, H, W)`` (class token and registers
            dropped); ``avg_featmap`` their mean (the pooling of the paper's MHLA / TTT
            models, which keeps DeiT's final norm usable for them), then ``ln2`` if
            ``pooled_norm``; ``raw`` every token.
        with_cls_token (bool, optional): defaults to the operator's convention
            (softmax, elu, relu, inline, hedgehog: yes; mhla, ttt: no; paper Table A). A
            hybrid of operators that disagree (softmax and mhla) must set it: True carries
            the class token through every block (an operator without one treats it as a
            leading extra token, as it does registers), False pools the patch tokens.
        drop_rate, attn_drop_rate, drop_path_rate (float): dropout rates;
            drop-path grows linearly over depth.
        frozen_stages (int): freeze the stem (patch and position embeddings, class
            token, registers, pre-norm) and the first ``frozen_stages`` blocks (-1: nothing).
        interpolate_mode (str): position-embedding resize mode.
        with_cp (bool): gradient checkpointing of every block.
        patch_cfg (dict): overrides of mmcv's ``PatchEmbed`` arguments.
        layer_cfgs (dict | list[dict]): overrides of each block's arguments.
        window_size (int | tuple[int, int]): > 0: windowed attention (ViTDet style, border
            windows cut to the grid, extra tokens in every window, RoPE at global positions;
            :mod:`linvit_mm.models.backbones.windows`) in the blocks of
            ``window_block_indexes``; 0: global attention everywhere.
        window_block_indexes (Sequence[int], optional): the windowed blocks (negative
            indices from the end); every block when unset. ViT-Adapter's plain ViT-B
            detectors: ``window_size=14`` in all blocks but 2, 5, 8, 11.
        init_cfg (dict | list[dict], optional): applied by ``init_weights`` on top
            of the DeiT/timm default initialisation done at construction, so
            checkpoint-based initialisers (``Pretrained``, ``SoftmaxTransfer``) are
            never overwritten by it.

    Architecture switches (``None``: the arch's value, else the plain-ViT default):
        patch_size (int): 16.
        qkv_bias (bool): bias of ``qkv`` (True). EVA-02's query and value biases with a
            key bias fixed at zero load as a ``qkv`` bias whose key rows are zero; here they
            are trainable (a key bias changes nothing in Softmax attention, whose rows are
            shift-invariant, but is a free parameter of the linear operators).
        layer_scale_init_value (float): > 0 adds LayerScale to both branches
            (``attn.gamma1``, ``ffn.gamma2``); 0.
        num_register_tokens (int): learned register tokens (``register_tokens``),
            placed after the class token and before the patches (timm's order) and run
            through every block; 0. ``num_extra_tokens`` counts them with the class token.
        pos_embed_type (str): ``'learned'``, ``'sincos'`` (fixed) or ``'none'`` (RoPE
            models); defaults to the operator's convention: learned with a class token,
            sin-cos without.
        no_embed_class (bool): the learned embedding covers the patches only; the class
            token and registers get none (timm ``no_embed_class``: DeiT III, DINOv2 with
            registers). Otherwise it has a leading slot for every extra token.
        pos_embed_antialias (bool): antialias when the learned embedding is resampled
            to a smaller grid (timm resamples with antialias; mmpretrain without); False.
        rope (dict): 2-D rotary position embedding of the attention,
            ``dict(type='eva' | 'dinov3', temperature=..., ref_grid=...)`` (see
            ``linvit_mm.models.utils.rope``); every operator carries it; None.
        ffn_type (str): ``'mlp'`` (two linears, ``act_cfg``) or ``'swiglu'``.
        act_cfg (dict): the MLP activation, ``dict(type='GELU')``; CLIP's is
            ``'mmpretrain.QuickGELU'``. Not used by ``'swiglu'`` (its gate is SiLU).
        ffn_norm (bool): SwiGLU's norm of the hidden features (EVA-02 sub-LN); False.
        pre_norm (bool): a norm (``pre_norm``) after the embeddings, before the blocks
            (CLIP); the patch embedding then has no bias, as in timm and mmpretrain.
        norm_cfg (dict): ``dict(type='LN', eps=1e-6)``.
        final_norm (bool): normalise the output of the last block (``ln1``); True.
        pooled_norm (bool): with ``out_type='avg_featmap'``, normalise the pooled
            tokens (``ln2``, mmpretrain's name; timm's ``fc_norm``); False.
    """

    arch_zoo = {
        **dict.fromkeys(['t', 'tiny', 'deit-tiny'], _sizes(192, 12, 3, 768)),
        **dict.fromkeys(['s', 'small', 'deit-small'], _sizes(384, 12, 6, 1536)),
        **dict.fromkeys(['b', 'base', 'deit-base'], _sizes(768, 12, 12, 3072)),
        'dinov2-small': dict(_sizes(384, 12, 6, 1536), **_DINOV2),
        'dinov2-base': dict(_sizes(768, 12, 12, 3072), **_DINOV2),
        'dinov2-large': dict(_sizes(1024, 24, 16, 4096), **_DINOV2),
        'dinov2-reg-small': dict(_sizes(384, 12, 6, 1536), **_DINOV2_REG),
        'dinov2-reg-base': dict(_sizes(768, 12, 12, 3072), **_DINOV2_REG),
        'dinov2-reg-large': dict(_sizes(1024, 24, 16, 4096), **_DINOV2_REG),
        'dinov3-small': dict(_sizes(384, 12, 6, 1536), **_DINOV3),
        'dinov3-base': dict(_sizes(768, 12, 12, 3072), **_DINOV3),
        'dinov3-large': dict(_sizes(1024, 24, 16, 4096), **_DINOV3),
        'deit3-small': dict(_sizes(384, 12, 6, 1536), **_DEIT3),
        'deit3-base': dict(_sizes(768, 12, 12, 3072), **_DEIT3),
        'clip-base': dict(_sizes(768, 12, 12, 3072), **_CLIP),
        'clip-base-gelu': dict(_sizes(768, 12, 12, 3072), **dict(_CLIP, act_cfg=dict(type='GELU'))),
        # EVA-02's MLP ratio is 4 * 2/3: int(C * 8/3) hidden units per SwiGLU half.
        'eva02-tiny': dict(_sizes(192, 12, 3, 512), **_EVA02),
        'eva02-small': dict(_sizes(384, 12, 6, 1024), **_EVA02),
        'eva02-base': dict(_sizes(768, 12, 12, 2048), **dict(_EVA02, ffn_norm=True)),
        # Released linear ViTs (linvit_mm.transfer.linear_releases converts them). ViT^3
        # (LeapLabTHU/ViTTT, attn_type='ttt') has no class token and no position embedding
        # besides each block's cpe; its tiny has 6 heads at width 192, not DeiT-T's 3.
        'vit3-tiny': dict(_sizes(192, 12, 6, 768), pos_embed_type='none'),
        'vit3-small': dict(_sizes(384, 12, 6, 1536), pos_embed_type='none'),
        'vit3-base': dict(_sizes(768, 12, 12, 3072), pos_embed_type='none'),
        # InLine-DeiT (LeapLabTHU/InLine, attn_type='inline'): DeiT's layout at other widths
        # (T 192 / 6 heads, S 320 / 10, B 384 / 12; head dim 32).
        'inline-deit-tiny': _sizes(192, 12, 6, 768),
        'inline-deit-small': _sizes(320, 12, 10, 1280),
        'inline-deit-base': _sizes(384, 12, 12, 1536),
        # The MHLA ViTs (DAGroup-PKU/MHLA, attn_type='mhla' with its official switches):
        # DeiT's sizes, no qkv bias, a learned embedding without a class token, no final
        # norm and a norm of the pooled tokens (timm's fc_norm).
        **{f'mhla-{size}': dict(_sizes(*sizes), qkv_bias=False, pos_embed_type='learned',
                                final_norm=False, pooled_norm=True)
           for size, sizes in (('tiny', (192, 12, 3, 768)), ('small', (384, 12, 6, 1536)),
                               ('base', (768, 12, 12, 3072)))},
    }
    OUT_TYPES = ('cls_token', 'featmap', 'avg_featmap', 'raw')
    POS_EMBED_TYPES = ('learned', 'sincos', 'none')

    def __init__(self,
                 arch='small',
                 attn_type='softmax',
                 attn_cfg=None,
                 img_size=224,
                 patch_size=None,
                 in_channels=3,
                 out_indices=-1,
                 out_type=None,
                 with_cls_token=None,
                 pos_embed_type=None,
                 drop_rate=0.,
                 attn_drop_rate=0.,
                 drop_path_rate=0.,
                 qkv_bias=None,
                 norm_cfg=None,
                 final_norm=None,
                 frozen_stages=-1,
                 interpolate_mode='bicubic',
                 with_cp=False,
                 patch_cfg=dict(),
                 layer_cfgs=dict(),
                 layer_scale_init_value=None,
                 num_register_tokens=None,
                 no_embed_class=None,
                 pos_embed_antialias=None,
                 rope=None,
                 ffn_type=None,
                 act_cfg=None,
                 ffn_norm=None,
                 pre_norm=None,
                 pooled_norm=None,
                 window_size=0,
                 window_block_indexes=None,
                 init_cfg=None):
        super().__init__(init_cfg)
        self.arch_settings = self.resolve_arch(arch)
        self.embed_dims = self.arch_settings['embed_dims']
        self.num_layers = self.arch_settings['num_layers']
        self.num_heads = self.arch_settings['num_heads']
        switches = self._resolve_switches(arch, dict(
            patch_size=patch_size, qkv_bias=qkv_bias, norm_cfg=norm_cfg, final_norm=final_norm,
            pos_embed_type=pos_embed_type, layer_scale_init_value=layer_scale_init_value,
            num_register_tokens=num_register_tokens, no_embed_class=no_embed_class,
            pos_embed_antialias=pos_embed_antialias, rope=rope, ffn_type=ffn_type,
            act_cfg=act_cfg, ffn_norm=ffn_norm, pre_norm=pre_norm, pooled_norm=pooled_norm))
        if isinstance(layer_cfgs, dict):
            layer_cfgs = [layer_cfgs] * self.num_layers
        # Checked before any block is built; the error lists the valid operators. A block's
        # own layer_cfgs attn_type counts, so attn_types says what every block runs.
        self.attn_types = resolve_attn_types(attn_type, self.num_layers)
        self.attn_types = resolve_attn_types(
            [cfg.get('attn_type', name) for cfg, name in zip(layer_cfgs, self.attn_types)],
            self.num_layers)
        self.attn_type = describe_attn_types(self.attn_types)
        _check_shared_attn_cfg(attn_cfg, self.attn_types, layer_cfgs)
        self.img_size = to_2tuple(img_size)
        self.patch_size = switches['patch_size']

        self.with_cls_token = class_token_of(self.attn_types, with_cls_token)
        self.num_register_tokens = switches['num_register_tokens']
        # Every leading non-patch token (class token, registers), as the adapter reads it.
        self.num_extra_tokens = int(self.with_cls_token) + self.num_register_tokens
        if out_type is None:
            out_type = 'cls_token' if self.with_cls_token else 'avg_featmap'
        if out_type not in self.OUT_TYPES:
            raise ValueError(f'unsupported out_type {out_type!r}; choose from {self.OUT_TYPES}')
        if out_type == 'cls_token' and not self.with_cls_token:
            raise ValueError(f'out_type="cls_token" needs a class token, which the '
                             f'{self.attn_type!r} model does not carry (with_cls_token=False); '
                             f'use "avg_featmap", "featmap" or "raw"')
        self.out_type = out_type
        pos_embed_type = switches['pos_embed_type']
        if pos_embed_type is None:
            pos_embed_type = 'learned' if self.with_cls_token else 'sincos'
        self.pos_embed_type = pos_embed_type
        # Leading slots of pos_embed for the extra tokens: none when it covers patches only
        # (a fixed sin-cos embedding always does).
        self.no_embed_class = switches['no_embed_class'] or pos_embed_type == 'sincos'
        self.pos_embed_extra_tokens = 0 if self.no_embed_class else self.num_extra_tokens
        self.pos_embed_antialias = switches['pos_embed_antialias']
        self.ffn_type = switches['ffn_type']

        self.patch_embed = PatchEmbed(**{
            **dict(in_channels=in_channels, input_size=img_size, embed_dims=self.embed_dims,
                   conv_type='Conv2d', kernel_size=self.patch_size, stride=self.patch_size,
                   bias=not switches['pre_norm']),
            **patch_cfg})
        self.patch_resolution = self.patch_embed.init_out_size
        num_patches = self.patch_resolution[0] * self.patch_resolution[1]

        self.cls_token = (nn.Parameter(torch.zeros(1, 1, self.embed_dims))
                          if self.with_cls_token else None)
        self.register_tokens = (
            nn.Parameter(torch.zeros(1, self.num_register_tokens, self.embed_dims))
            if self.num_register_tokens else None)
        self.interpolate_mode = interpolate_mode
        if pos_embed_type == 'learned':
            self.pos_embed = nn.Parameter(
                torch.zeros(1, num_patches + self.pos_embed_extra_tokens, self.embed_dims))
            self._register_load_state_dict_pre_hook(self._resize_pos_embed_on_load)
        else:
            self.pos_embed = None
        self.drop_after_pos = nn.Dropout(p=drop_rate)
        norm_cfg = switches['norm_cfg']
        self.pre_norm = (build_norm_layer(norm_cfg, self.embed_dims) if switches['pre_norm']
                         else nn.Identity())
        # One parameter-free module shared by every block: the tables depend on the grid only.
        self.rope = build_rope(switches['rope'], self.embed_dims // self.num_heads)

        self.out_indices = self._normalise_out_indices(out_indices)
        windowed = self._windowed_blocks(window_size, window_block_indexes)
        dpr = np.linspace(0, drop_path_rate, self.num_layers)
        self.layers = ModuleList()
        for i in range(self.num_layers):
            layer_cfg = dict(
                embed_dims=self.embed_dims,
                num_heads=self.num_heads,
                feedforward_channels=self.arch_settings['feedforward_channels'],
                attn_type=self.attn_types[i],
                attn_cfg=attn_cfg,
                drop_rate=drop_rate,
                attn_drop_rate=attn_drop_rate,
                drop_path_rate=float(dpr[i]),
                qkv_bias=switches['qkv_bias'],
                act_cfg=switches['act_cfg'],
                norm_cfg=norm_cfg,
                layer_scale_init_value=switches['layer_scale_init_value'],
                ffn_type=self.ffn_type,
                ffn_norm=switches['ffn_norm'],
                rope=self.rope,
                window_size=window_size if i in windowed else 0,
                with_cp=with_cp)
            layer_cfg.update(layer_cfgs[i])
            self.layers.append(LinearViTLayer(**layer_cfg))

        self.final_norm = switches['final_norm']
        if self.final_norm:
            self.ln1 = build_norm_layer(norm_cfg, self.embed_dims)
        self.pooled_norm = switches['pooled_norm'] and out_type == 'avg_featmap'
        if self.pooled_norm:
            self.ln2 = build_norm_layer(norm_cfg, self.embed_dims)

        # The DeiT/timm default initialisation happens here, at construction (as in
        # timm), so that ``init_weights`` only applies ``init_cfg`` on top of it and a
        # checkpoint-based initialiser (Pretrained, SoftmaxTransfer) is never undone.
        self._init_default_weights()

        self.frozen_stages = frozen_stages
        if frozen_stages > 0:
            self._freeze_stages()

    # ------------------------------------------------------------------ construction
    @classmethod
    def resolve_arch(cls, arch):
        """The settings dict of an ``arch_zoo`` word or a custom dict: the four sizes
        (``embed_dims``, ``num_layers``, ``num_heads``, ``feedforward_channels``) and the
        architecture switches the arch sets."""
        if isinstance(arch, str):
            if arch.lower() not in cls.arch_zoo:
                raise ValueError(f'unknown arch {arch!r}; valid archs are '
                                 f'{sorted(set(cls.arch_zoo))} or a dict')
            return copy.deepcopy(cls.arch_zoo[arch.lower()])
        if not isinstance(arch, dict) or not set(ARCH_ESSENTIALS) <= set(arch):
            raise ValueError(f'a custom arch needs a dict with keys {sorted(ARCH_ESSENTIALS)}, '
                             f'got {arch!r}')
        unknown = sorted(set(arch) - set(ARCH_ESSENTIALS) - set(ARCH_SWITCH_DEFAULTS))
        if unknown:
            raise ValueError(f'unknown key(s) {unknown} in the arch dict; an arch holds '
                             f'{list(ARCH_ESSENTIALS)} and any of {list(ARCH_SWITCH_DEFAULTS)}')
        return copy.deepcopy(dict(arch))

    def _resolve_switches(self, arch, given):
        """Each switch: the argument, the arch's value, or the plain-ViT default; an argument
        that contradicts the arch (outside ``OVERRIDABLE_SWITCHES``) is refused."""
        name = repr(arch) if isinstance(arch, str) else 'the arch dict'
        switches = {}
        for key, default in ARCH_SWITCH_DEFAULTS.items():
            value = given[key]
            if key in self.arch_settings:
                fixed = self.arch_settings[key]
                if (value is not None and _normalised(value) != _normalised(fixed)
                        and key not in OVERRIDABLE_SWITCHES):
                    raise ValueError(
                        f'arch {name} sets {key}={fixed!r}, which defines the models of its '
                        f'checkpoints; got {key}={value!r}. Leave {key} unset, or pass a custom '
                        f'arch dict (e.g. dict(LinearViT.arch_zoo[...], {key}=...))')
                value = fixed if value is None else value
            switches[key] = copy.deepcopy(default if value is None else value)
        self._check_switches(switches, given)
        return switches

    def _check_switches(self, switches, given):
        if switches['pos_embed_type'] not in (None, ) + self.POS_EMBED_TYPES:
            raise ValueError(f"unsupported pos_embed_type {switches['pos_embed_type']!r}; choose "
                             f'from {self.POS_EMBED_TYPES}')
        if switches['ffn_type'] not in FFN_TYPES:
            raise ValueError(f"unknown ffn_type {switches['ffn_type']!r}; choose from {FFN_TYPES}")
        if switches['ffn_norm'] and switches['ffn_type'] != 'swiglu':
            raise ValueError("ffn_norm (a norm of the hidden features) exists for "
                             "ffn_type='swiglu' only")
        if switches['ffn_type'] == 'swiglu' and (given['act_cfg'] is not None
                                                 or 'act_cfg' in self.arch_settings):
            raise ValueError("act_cfg does not apply to ffn_type='swiglu' (its gate is SiLU); "
                             'leave it unset')
        registers = switches['num_register_tokens']
        if not (isinstance(registers, int) and not isinstance(registers, bool) and registers >= 0):
            raise ValueError(f'num_register_tokens must be an int >= 0, got {registers!r}')
        if not switches['layer_scale_init_value'] >= 0:
            raise ValueError(f"layer_scale_init_value must be >= 0 (0: no LayerScale), got "
                             f"{switches['layer_scale_init_value']}")
        if switches['no_embed_class'] and switches['pos_embed_type'] not in (None, 'learned'):
            raise ValueError(f"no_embed_class concerns a learned position embedding; "
                             f"pos_embed_type is {switches['pos_embed_type']!r}")

    def _windowed_blocks(self, window_size, window_block_indexes):
        """The blocks that run windowed attention (``window_block_indexes``, negative ones
        from the end; every block when unset), refused before any block is built."""
        if normalise_window_size(window_size) is None:
            if window_block_indexes is not None:
                raise ValueError(f'window_block_indexes={window_block_indexes!r} needs a '
                                 f'window_size > 0')
            return set()
        if window_block_indexes is None:
            return set(range(self.num_layers))
        indices = block_index_list(window_block_indexes, 'window')
        outside = [i for i in indices if not -self.num_layers <= i < self.num_layers]
        if outside:
            raise ValueError(f'window_block_indexes {outside} are outside the '
                             f'{self.num_layers} blocks')
        return {i % self.num_layers for i in indices}

    def _normalise_out_indices(self, out_indices):
        if isinstance(out_indices, int):
            out_indices = [out_indices]
        if not isinstance(out_indices, Sequence):
            raise TypeError(f'out_indices must be an int or a sequence, got {type(out_indices)}')
        normalised = []
        for index in out_indices:
            resolved = index + self.num_layers if index < 0 else index
            if not 0 <= resolved < self.num_layers:
                raise ValueError(f'out_indices entry {index} is outside the '
                                 f'{self.num_layers} blocks')
            normalised.append(resolved)
        return normalised

    def _init_default_weights(self):
        """timm's ViT init for the standard tensors; operator extras keep their own."""
        for layer in self.layers:
            standard = [layer.attn.qkv, layer.attn.proj]
            standard += [m for m in layer.ffn.modules() if isinstance(m, nn.Linear)]
            for linear in standard:
                trunc_normal_(linear.weight, std=.02)
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
            for norm in (layer.ln1, layer.ln2):
                nn.init.ones_(norm.weight)
                nn.init.zeros_(norm.bias)
        if self.pos_embed is not None:
            trunc_normal_(self.pos_embed, std=.02)
        for token in (self.cls_token, self.register_tokens):
            if token is not None:
                nn.init.normal_(token, std=1e-6)

    def _resample_pos_embed(self, pos_embed, src_shape, dst_shape):
        """timm's resampling of the patch part (leading extra-token slots kept as they are)."""
        # Traced, the resampling always runs (to the same grid it is the identity), so that
        # an exported graph is not tied to the example's grid.
        if not is_tracing() and tuple(src_shape) == tuple(dst_shape):
            return pos_embed
        # Imported here: importing timm's layers costs seconds, and most models never resize.
        from timm.layers import resample_abs_pos_embed
        return resample_abs_pos_embed(pos_embed, new_size=list(dst_shape),
                                      old_size=list(src_shape),
                                      num_prefix_tokens=self.pos_embed_extra_tokens,
                                      interpolation=self.interpolate_mode,
                                      antialias=self.pos_embed_antialias)

    def _resize_pos_embed_on_load(self, state_dict, prefix, *args, **kwargs):
        name = prefix + 'pos_embed'
        if name not in state_dict:
            return
        ckpt_pos_embed = state_dict[name]
        if ckpt_pos_embed.shape == self.pos_embed.shape:
            return
        ckpt_patches = ckpt_pos_embed.shape[1] - self.pos_embed_extra_tokens
        side = int(math.isqrt(max(ckpt_patches, 0)))
        if (side * side != ckpt_patches or ckpt_patches == 0
                or ckpt_pos_embed.shape[2] != self.embed_dims):
            # Leave it to load_state_dict to report the mismatch by name.
            return
        from mmengine.logging import MMLogger
        MMLogger.get_current_instance().info(
            f'Resize the pos_embed shape from {tuple(ckpt_pos_embed.shape)} to '
            f'{tuple(self.pos_embed.shape)}.')
        state_dict[name] = self._resample_pos_embed(ckpt_pos_embed, (side, side),
                                                    self.patch_resolution)

    def _freeze_stages(self):
        frozen = [self.patch_embed, self.drop_after_pos, self.pre_norm]
        frozen += list(self.layers[:self.frozen_stages])
        if self.frozen_stages >= self.num_layers and self.final_norm:
            frozen.append(self.ln1)
        for module in frozen:
            module.eval()
            for param in module.parameters():
                param.requires_grad = False
        for param in (self.pos_embed, self.cls_token, self.register_tokens):
            if param is not None:
                param.requires_grad = False

    def train(self, mode=True):
        super().train(mode)
        if mode and self.frozen_stages > 0:
            self._freeze_stages()
        return self

    # ------------------------------------------------------------------ forward pieces
    def position_embedding(self, hw_shape, x):
        """The absolute position embedding for the grid ``hw_shape``, ``(1, slots + H*W, C)``
        with ``slots = pos_embed_extra_tokens`` leading extra-token slots; ``None`` for a
        model without one (``pos_embed_type='none'``)."""
        if self.pos_embed_type == 'none':
            return None
        if self.pos_embed is None:
            return _cached_sincos_pos_embed(tuple(hw_shape), self.embed_dims, x.device, x.dtype)
        return self._resample_pos_embed(self.pos_embed, self.patch_resolution, hw_shape)

    def embed(self, x):
        """Images ``(B, 3, H, W)`` -> tokens (class token, registers, patches) and the grid.

        With ``embed`` and the blocks of ``layers`` (each called as
        ``layer(tokens, hw_shape)``), a wrapper such as the ViT-Adapter runs the
        backbone block by block.
        """
        x, hw_shape = self.patch_embed(x)
        extras = [token.expand(x.shape[0], -1, -1)
                  for token in (self.cls_token, self.register_tokens) if token is not None]
        if not extras:
            # PatchEmbed returns a transposed view of its NCHW output. Elementwise ops keep
            # their input's layout, so without an extra token (whose concatenation copies)
            # the whole residual stream would stay transposed, and every LayerNorm, forward
            # and backward, would copy it back to contiguous.
            x = x.contiguous()
        pos_embed = self.position_embedding(hw_shape, x)
        if pos_embed is not None and self.no_embed_class:
            # the embedding covers the patches: add it, then prepend the extra tokens
            x = x + pos_embed
            pos_embed = None
        if extras:
            x = torch.cat(extras + [x], dim=1)
        if pos_embed is not None:
            x = x + pos_embed
        return self.pre_norm(self.drop_after_pos(x)), hw_shape

    def forward(self, x):
        x, hw_shape = self.embed(x)
        outs = []
        for i, layer in enumerate(self.layers):
            x = layer(x, hw_shape)
            if i == self.num_layers - 1 and self.final_norm:
                x = self.ln1(x)
            if i in self.out_indices:
                outs.append(self._format_output(x, hw_shape))
        return tuple(outs)

    def _format_output(self, x, hw_shape):
        if self.out_type == 'raw':
            return x
        if self.out_type == 'cls_token':
            return x[:, 0]
        patch_tokens = x[:, self.num_extra_tokens:]
        if self.out_type == 'featmap':
            # contiguous: a permuted view has channels-last strides, which a neck's convs
            # keep and mmcv's CPU RoIAlign misreads (it indexes memory as B, C, h, w)
            feature_map = patch_tokens.reshape(x.shape[0], *hw_shape, -1).permute(0, 3, 1, 2)
            return feature_map.contiguous()
        pooled = patch_tokens.mean(dim=1)
        return self.ln2(pooled) if self.pooled_norm else pooled

    def get_layer_depth(self, param_name, prefix=''):
        """Layer-wise depth of a parameter for layer-wise learning-rate decay.

        Stem (patch embedding, class token, registers, position embedding, pre-norm) is
        depth 0, block ``i`` is ``i + 1``, anything after the blocks (final norm, head) is
        ``num_layers + 1``; returns ``(depth, num_layers + 2)``.
        """
        num_depths = self.num_layers + 2
        if not param_name.startswith(prefix):
            return num_depths - 1, num_depths
        name = param_name[len(prefix):]
        if (name in ('cls_token', 'pos_embed', 'register_tokens')
                or name.startswith(('patch_embed', 'pre_norm'))):
            depth = 0
        elif name.startswith('layers.'):
            depth = int(name.split('.')[1]) + 1
        else:
            depth = num_depths - 1
        return depth, num_depths


def _normalised(value):
    """Lists as tuples, recursively, so a config's ``[16, 16]`` equals an arch's ``(16, 16)``."""
    if isinstance(value, dict):
        return {key: _normalised(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_normalised(item) for item in value)
    return value
