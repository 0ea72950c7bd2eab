"""LinearViT: a DeiT-shaped Vision Transformer whose attention operator is chosen by name."""
import functools
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
from mmpretrain.models.utils import build_norm_layer, resize_pos_embed, to_2tuple
from mmpretrain.registry import MODELS
from torch import nn

from ..attention import attention_class, build_attention


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


@functools.lru_cache(maxsize=16)
def _cached_sincos_pos_embed(hw_shape, embed_dims, device, dtype):
    # Built in float64 with a sin/cos per element on every forward, it took about a tenth
    # of a ViT-S block's time on a CPU at 224 px (0.3-0.7 ms). One entry per (grid, width,
    # device, dtype) covers a run's few sizes. Callers only read it (the tokens get
    # ``x + pos``), so sharing one tensor is safe.
    return sincos_pos_embed(hw_shape, embed_dims, device=device, dtype=dtype)


class LinearViTLayer(BaseModule):
    """Pre-norm ViT block ``x + attn(ln1(x)); x + ffn(ln2(x))`` around any operator.

    Parameter names follow mmpretrain's ``TransformerEncoderLayer`` (``ln1``,
    ``attn.qkv``, ``attn.proj``, ``ln2``, ``ffn.layers.0.0``, ``ffn.layers.1``) so
    DeiT checkpoints load by name; operator-specific parameters live under ``attn``.
    """

    def __init__(self, embed_dims, num_heads, feedforward_channels, attn_type='softmax',
                 attn_cfg=None, drop_rate=0., attn_drop_rate=0., drop_path_rate=0.,
                 qkv_bias=True, act_cfg=dict(type='GELU'), norm_cfg=dict(type='LN', eps=1e-6),
                 with_cp=False, init_cfg=None):
        super().__init__(init_cfg=init_cfg)
        self.embed_dims = embed_dims
        self.with_cp = with_cp
        self.ln1 = build_norm_layer(norm_cfg, embed_dims)
        self.attn = build_attention(attn_type, embed_dims=embed_dims, num_heads=num_heads,
                                    qkv_bias=qkv_bias, attn_drop=attn_drop_rate,
                                    proj_drop=drop_rate, **(attn_cfg or {}))
        self.ln2 = build_norm_layer(norm_cfg, embed_dims)
        self.ffn = FFN(embed_dims=embed_dims, feedforward_channels=feedforward_channels,
                       num_fcs=2, ffn_drop=drop_rate, dropout_layer=None, act_cfg=act_cfg,
                       add_identity=False)
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0 else nn.Identity()

    def _forward(self, x, hw_shape):
        x = self.attn.encode_position(x, hw_shape)
        x = x + self.drop_path(self.attn(self.ln1(x), hw_shape))
        x = x + self.drop_path(self.ffn(self.ln2(x)))
        return x

    def forward(self, x, hw_shape):
        if self.with_cp and x.requires_grad:
            return cp.checkpoint(self._forward, x, hw_shape, use_reentrant=False)
        return self._forward(x, hw_shape)


@MODELS.register_module()
class LinearViT(BaseBackbone):
    """Vision Transformer with a swappable (linear) attention operator.

    Args:
        arch (str | dict): ``'tiny'``, ``'small'``, ``'base'`` (DeiT widths and head
            counts: 192/3, 384/6, 768/12; depth 12, MLP ratio 4) or a dict with
            ``embed_dims``, ``num_layers``, ``num_heads``, ``feedforward_channels``.
        attn_type (str): ``'softmax'``, ``'elu'``, ``'relu'``, ``'inline'``,
            ``'mhla'`` or ``'ttt'``.
        attn_cfg (dict): extra keyword arguments of the operator.
        img_size (int | tuple): the training input size; the learned position
            embedding is stored for this grid and interpolated for others.
        patch_size (int): patch size. Defaults to 16.
        out_indices (int | Sequence[int]): blocks whose output is returned.
        out_type (str, optional): ``'cls_token'``, ``'featmap'``, ``'avg_featmap'``
            or ``'raw'``. Defaults to ``'cls_token'`` for operators that carry a
            class token and ``'avg_featmap'`` for the others. ``avg_featmap`` is the
            mean of the final-normed patch tokens (the pooling of the paper's
            MHLA / TTT models, which keeps DeiT's final norm usable for them).
        with_cls_token (bool, optional): defaults to the operator's convention
            (softmax, elu, relu, inline: yes; mhla, ttt: no; paper Table A).
        pos_embed_type (str, optional): ``'learned'`` or ``'sincos'`` (fixed);
            defaults to learned with a class token and sin-cos without.
        final_norm (bool): normalise the output of the last block (``ln1``).
        drop_rate, attn_drop_rate, drop_path_rate (float): dropout rates;
            drop-path grows linearly over depth.
        frozen_stages (int): freeze the patch embedding, position embedding,
            class token and the first ``frozen_stages`` blocks (-1: nothing).
        interpolate_mode (str): position-embedding resize mode.
        with_cp (bool): gradient checkpointing of every block.
        init_cfg (dict | list[dict], optional): applied by ``init_weights`` on top
            of the DeiT/timm default initialisation done at construction, so
            checkpoint-based initialisers (``Pretrained``, ``SoftmaxTransfer``) are
            never overwritten by it.
    """

    arch_zoo = {
        **dict.fromkeys(['t', 'tiny', 'deit-tiny'], {
            'embed_dims': 192, 'num_layers': 12, 'num_heads': 3, 'feedforward_channels': 768}),
        **dict.fromkeys(['s', 'small', 'deit-small'], {
            'embed_dims': 384, 'num_layers': 12, 'num_heads': 6, 'feedforward_channels': 1536}),
        **dict.fromkeys(['b', 'base', 'deit-base'], {
            'embed_dims': 768, 'num_layers': 12, 'num_heads': 12, 'feedforward_channels': 3072}),
    }
    OUT_TYPES = ('cls_token', 'featmap', 'avg_featmap', 'raw')
    POS_EMBED_TYPES = ('learned', 'sincos')

    def __init__(self,
                 arch='small',
                 attn_type='softmax',
                 attn_cfg=None,
                 img_size=224,
                 patch_size=16,
                 in_channels=3,
                 out_indices=-1,
                 out_type=None,
                 with_cls_token=None,
                 pos_embed_type=None,
                 drop_rate=0.,
                 attn_drop_rate=0.,
                 drop_path_rate=0.,
                 qkv_bias=True,
                 norm_cfg=dict(type='LN', eps=1e-6),
                 final_norm=True,
                 frozen_stages=-1,
                 interpolate_mode='bicubic',
                 with_cp=False,
                 patch_cfg=dict(),
                 layer_cfgs=dict(),
                 init_cfg=None):
        super().__init__(init_cfg)
        self.arch_settings = self.resolve_arch(arch)
        self.embed_dims = self.arch_settings['embed_dims']
        self.num_layers = self.arch_settings['num_layers']
        self.num_heads = self.arch_settings['num_heads']
        self.attn_type = attn_type
        operator = attention_class(attn_type)  # fails early, listing valid operators
        self.img_size = to_2tuple(img_size)
        self.patch_size = patch_size

        self.with_cls_token = (operator.uses_cls_token
                               if with_cls_token is None else bool(with_cls_token))
        self.num_extra_tokens = int(self.with_cls_token)
        if out_type is None:
            out_type = 'cls_token' if self.with_cls_token else 'avg_featmap'
        if out_type not in self.OUT_TYPES:
            raise ValueError(f'unsupported out_type {out_type!r}; choose from {self.OUT_TYPES}')
        if out_type == 'cls_token' and not self.with_cls_token:
            raise ValueError(f'out_type="cls_token" needs a class token, which the '
                             f'{attn_type!r} model does not carry (with_cls_token=False); use '
                             f'"avg_featmap", "featmap" or "raw"')
        self.out_type = out_type
        if pos_embed_type is None:
            pos_embed_type = 'learned' if self.with_cls_token else 'sincos'
        if pos_embed_type not in self.POS_EMBED_TYPES:
            raise ValueError(f'unsupported pos_embed_type {pos_embed_type!r}; choose from '
                             f'{self.POS_EMBED_TYPES}')
        self.pos_embed_type = pos_embed_type

        self.patch_embed = PatchEmbed(**{
            **dict(in_channels=in_channels, input_size=img_size, embed_dims=self.embed_dims,
                   conv_type='Conv2d', kernel_size=patch_size, stride=patch_size),
            **patch_cfg})
        self.patch_resolution = self.patch_embed.init_out_size
        num_patches = self.patch_resolution[0] * self.patch_resolution[1]

        self.cls_token = (nn.Parameter(torch.zeros(1, 1, self.embed_dims))
                          if self.with_cls_token else None)
        self.interpolate_mode = interpolate_mode
        if pos_embed_type == 'learned':
            self.pos_embed = nn.Parameter(
                torch.zeros(1, num_patches + self.num_extra_tokens, self.embed_dims))
            self._register_load_state_dict_pre_hook(self._resize_pos_embed_on_load)
        else:
            self.pos_embed = None
        self.drop_after_pos = nn.Dropout(p=drop_rate)

        self.out_indices = self._normalise_out_indices(out_indices)
        dpr = np.linspace(0, drop_path_rate, self.num_layers)
        if isinstance(layer_cfgs, dict):
            layer_cfgs = [layer_cfgs] * self.num_layers
        self.layers = ModuleList()
        for i in range(self.num_layers):
            layer_cfg = dict(
                embed_dims=self.embed_dims,
                num_heads=self.num_heads,
                feedforward_channels=self.arch_settings['feedforward_channels'],
                attn_type=attn_type,
                attn_cfg=attn_cfg,
                drop_rate=drop_rate,
                attn_drop_rate=attn_drop_rate,
                drop_path_rate=float(dpr[i]),
                qkv_bias=qkv_bias,
                norm_cfg=norm_cfg,
                with_cp=with_cp)
            layer_cfg.update(layer_cfgs[i])
            self.layers.append(LinearViTLayer(**layer_cfg))

        self.final_norm = final_norm
        if final_norm:
            self.ln1 = build_norm_layer(norm_cfg, self.embed_dims)

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
        """The settings dict (``embed_dims``, ``num_layers``, ``num_heads``,
        ``feedforward_channels``) of an ``arch_zoo`` name or a custom dict."""
        if isinstance(arch, str):
            if arch.lower() not in cls.arch_zoo:
                raise ValueError(f'unknown arch {arch!r}; valid archs are '
                                 f'{sorted(set(cls.arch_zoo))} or a dict')
            return dict(cls.arch_zoo[arch.lower()])
        essential = {'embed_dims', 'num_layers', 'num_heads', 'feedforward_channels'}
        if not isinstance(arch, dict) or not essential <= set(arch):
            raise ValueError(f'a custom arch needs a dict with keys {sorted(essential)}, '
                             f'got {arch!r}')
        return dict(arch)

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
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)

    def _resize_pos_embed_on_load(self, state_dict, prefix, *args, **kwargs):
        name = prefix + 'pos_embed'
        if name not in state_dict:
            return
        ckpt_pos_embed = state_dict[name]
        if ckpt_pos_embed.shape == self.pos_embed.shape:
            return
        ckpt_patches = ckpt_pos_embed.shape[1] - self.num_extra_tokens
        side = int(math.isqrt(ckpt_patches))
        if side * side != ckpt_patches or ckpt_pos_embed.shape[2] != self.embed_dims:
            # Leave it to load_state_dict to report the mismatch by name.
            return
        from mmengine.logging import MMLogger
        MMLogger.get_current_instance().info(
            f'Resize the pos_embed shape from {tuple(ckpt_pos_embed.shape)} to '
            f'{tuple(self.pos_embed.shape)}.')
        state_dict[name] = resize_pos_embed(ckpt_pos_embed, (side, side), self.patch_resolution,
                                            self.interpolate_mode, self.num_extra_tokens)

    def _freeze_stages(self):
        frozen = [self.patch_embed, self.drop_after_pos]
        frozen += list(self.layers[:self.frozen_stages])
        if self.frozen_stages >= self.num_layers and self.final_norm:
            frozen.append(self.ln1)
        for module in frozen:
            module.eval()
            for param in module.parameters():
                param.requires_grad = False
        for param in (self.pos_embed, self.cls_token):
            if param is not None:
                param.requires_grad = False

    def train(self, mode=True):
        super().train(mode)
        if mode and self.frozen_stages > 0:
            self._freeze_stages()
        return self

    # ------------------------------------------------------------------ forward pieces
    def position_embedding(self, hw_shape, x):
        """The position embedding for the grid ``hw_shape``, shaped like the tokens."""
        if self.pos_embed is None:
            return _cached_sincos_pos_embed(tuple(hw_shape), self.embed_dims, x.device, x.dtype)
        return resize_pos_embed(self.pos_embed, self.patch_resolution, hw_shape,
                                mode=self.interpolate_mode,
                                num_extra_tokens=self.num_extra_tokens)

    def embed(self, x):
        """Images ``(B, 3, H, W)`` -> tokens (class token first if any) and the patch grid.

        With ``embed`` and the blocks of ``layers`` (each called as
        ``layer(tokens, hw_shape)``), a wrapper such as the ViT-Adapter runs the
        backbone block by block.
        """
        x, hw_shape = self.patch_embed(x)
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        else:
            # PatchEmbed returns a transposed view of its NCHW output. Elementwise ops keep
            # their input's layout, so without a class token (whose concatenation copies)
            # the whole residual stream would stay transposed, and every LayerNorm, forward
            # and backward, would copy it back to contiguous.
            x = x.contiguous()
        x = x + self.position_embedding(hw_shape, x)
        return self.drop_after_pos(x), hw_shape

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
            return patch_tokens.reshape(x.shape[0], *hw_shape, -1).permute(0, 3, 1, 2)
        return patch_tokens.mean(dim=1)

    def get_layer_depth(self, param_name, prefix=''):
        """Layer-wise depth of a parameter for layer-wise learning-rate decay.

        Stem (patch embedding, class token, position embedding) is depth 0, block
        ``i`` is ``i + 1``, anything after the blocks (final norm, head) is
        ``num_layers + 1``; returns ``(depth, num_layers + 2)``.
        """
        num_depths = self.num_layers + 2
        if not param_name.startswith(prefix):
            return num_depths - 1, num_depths
        name = param_name[len(prefix):]
        if name in ('cls_token', 'pos_embed') or name.startswith('patch_embed'):
            depth = 0
        elif name.startswith('layers.'):
            depth = int(name.split('.')[1]) + 1
        else:
            depth = num_depths - 1
        return depth, num_depths
