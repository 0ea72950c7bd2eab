"""The LinearViT block: a pre-norm ViT block around any registered attention operator."""
import torch.utils.checkpoint as cp
from mmcv.cnn.bricks.drop import DropPath
from mmcv.cnn.bricks.transformer import FFN
from mmengine.model import BaseModule
from mmpretrain.models.utils import SwiGLUFFN, build_norm_layer
from torch import nn

from ..attention import attention_class, build_attention
from .windows import normalise_window_size, windowed_attention


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
                                    **operator_switches(attn_type, rope,
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


def operator_switches(attn_type, rope, layer_scale_init_value):
    """The RoPE / LayerScale arguments of an operator, passed only when switched on, so an
    operator of another package that takes neither (its ``options`` lack them) still builds
    plain models; one that is asked for them and lacks them is refused by name."""
    switches = {}
    if rope is not None:
        switches['rope'] = rope
    if layer_scale_init_value:
        switches['layer_scale_init_value'] = layer_scale_init_value
    missing = [name for name in switches if name not in attention_class(attn_type).options]
    if missing:
        raise ValueError(f'the {attn_type!r} operator does not take {" / ".join(missing)}, which '
                         f'this arch switches on; its constructor must accept them and pass them '
                         f'to BaseAttention (which applies both), and its options list them')
    return switches


def check_shared_attn_cfg(attn_cfg, attn_types, layer_cfgs):
    """Refuse, before any block is built, an ``attn_cfg`` argument that the operator of a
    block using it does not take (a hybrid passes ``attn_cfg`` to every block)."""
    refused = {}
    for index, (name, cfg) in enumerate(zip(attn_types, layer_cfgs)):
        if not attn_cfg or 'attn_cfg' in cfg:
            continue
        unknown = tuple(sorted(set(attn_cfg) - set(attention_class(name).options)))
        if unknown:
            refused.setdefault((name, unknown), []).append(index)
    if refused:
        listed = '; '.join(f'{list(unknown)} for the {name!r} operator (blocks {blocks})'
                           for (name, unknown), blocks in refused.items())
        raise ValueError(f'attn_cfg gives arguments an operator does not take: {listed}. In a '
                         f'hybrid attn_cfg goes to every block; give an operator\'s own '
                         f'arguments to its blocks through layer_cfgs=[dict(attn_cfg=...), ...]')
