"""LinearViT: a Vision Transformer whose attention operator is chosen by name.

Its pieces live beside it: the block (:mod:`.linear_vit_block`), the position embedding
(:mod:`.position_embedding`), the arch words and source families as plain data
(:mod:`.arch_zoo`) and what an arch resolves to (:mod:`.arch_settings`). The names users
import from here stay importable from here.
"""
from typing import Sequence

import numpy as np
from mmcv.cnn.bricks.transformer import PatchEmbed
from mmengine.model import ModuleList
from mmengine.model.weight_init import trunc_normal_
from mmpretrain.models.backbones.base_backbone import BaseBackbone
from mmpretrain.models.utils import build_norm_layer, to_2tuple
from mmpretrain.registry import MODELS
from torch import nn

from ..utils.options import check_arguments
from ..utils.rope import build_rope
from .arch_settings import POS_EMBED_TYPES, build_arch_zoo, resolve_arch, resolve_switches
from .arch_zoo import ARCH_ESSENTIALS, ARCH_SWITCH_DEFAULTS, FFN_TYPES, OVERRIDABLE_SWITCHES
from .hybrid import class_token_of, describe_attn_types, resolve_attn_types
from .linear_vit_block import LinearViTLayer, check_shared_attn_cfg
from .position_embedding import PositionEmbeddingMixin, sincos_pos_embed
from .windows import normalise_window_size
from ...utils.blocks import block_index_list

__all__ = ['LinearViT', 'LinearViTLayer', 'sincos_pos_embed', 'ARCH_ESSENTIALS',
           'ARCH_SWITCH_DEFAULTS', 'FFN_TYPES', 'OVERRIDABLE_SWITCHES']

@MODELS.register_module()
class LinearViT(PositionEmbeddingMixin, BaseBackbone):
    """Vision Transformer with a swappable (linear) attention operator.

    Args:
        arch (str | dict): a word of ``arch_zoo`` or a dict with ``embed_dims``,
            ``num_layers``, ``num_heads``, ``feedforward_channels`` and optionally any of
            the architecture switches below. The DeiT words ``'tiny'``, ``'small'``,
            ``'base'`` (``'deit-*'``; 192/3, 384/6, 768/12 heads, depth 12, MLP ratio 4)
            set sizes only. The source words set everything that defines a pre-trained
            family, so its checkpoints compute the same function (the table is in
            docs/user_guides/foundation_sources.md): ``dinov2-{small,base,large}``,
            ``dinov2-reg-{small,base,large}``,
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

    arch_zoo = build_arch_zoo()
    OUT_TYPES = ('cls_token', 'featmap', 'avg_featmap', 'raw')
    POS_EMBED_TYPES = POS_EMBED_TYPES


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
        check_arguments(type(self).__init__, 'LinearViT', in_channels=in_channels,
                        drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
                        drop_path_rate=drop_path_rate, frozen_stages=frozen_stages,
                        interpolate_mode=interpolate_mode, with_cp=with_cp,
                        with_cls_token=with_cls_token, optional_bools=('with_cls_token', ))
        for name, rate in dict(drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
                               drop_path_rate=drop_path_rate).items():
            if not 0 <= rate < 1:
                raise ValueError(f'LinearViT: {name} must be in [0, 1), got {rate}')
        self.arch_settings = self.resolve_arch(arch)
        self.embed_dims = self.arch_settings['embed_dims']
        self.num_layers = self.arch_settings['num_layers']
        self.num_heads = self.arch_settings['num_heads']
        switches = resolve_switches(arch, self.arch_settings, dict(
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
        check_shared_attn_cfg(attn_cfg, self.attn_types, layer_cfgs)
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

        self.interpolate_mode = interpolate_mode
        self._build_extra_tokens_and_pos_embed(num_patches)
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
        return resolve_arch(arch, cls.arch_zoo)


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
