"""linvit_mm's attention operators as timm ``attn_layer`` classes."""
from ..models.attention import BaseAttention, attention_class


class TimmAttention:
    """Mixin that gives a linvit_mm operator timm's attention signature,
    ``forward(x, attn_mask=None, is_causal=False)``; the patch grid comes from the model's
    :class:`~linvit_mm.deployment.patch_grid.PatchGrid` (``patch_grid``).

    Classes are made by :func:`timm_attn_layer`: a subclass of the operator's own class, so a
    converted block holds the operator's parameters under the operator's names
    (``attn.qkv``, ``attn.proj``, ``attn.w1``, ...) and computes with the operator's code.
    """

    patch_grid = None

    def forward(self, x, attn_mask=None, is_causal=False):
        if attn_mask is not None or is_causal:
            raise ValueError(f'the {self.attn_type!r} operator takes neither an attention mask '
                             f'nor is_causal (timm passes them for masked or causal attention)')
        return super().forward(x, self.patch_grid.of(x))

    def encode_position(self, x, hw_shape=None):
        """The operator's position encoding of the block input (identity for most)."""
        return super().encode_position(x, self.patch_grid.of(x) if hw_shape is None
                                       else hw_shape)


def has_position_encoding(attn_type):
    """Whether the operator changes the block input before the norm (``encode_position``),
    which timm's ``Block`` has no place for (see ``timm_block.PositionEncodingBlock``)."""
    return attention_class(attn_type).encode_position is not BaseAttention.encode_position


def timm_attn_layer(attn_type, patch_grid, attn_cfg=None, rope=None):
    """The ``attn_layer`` class for timm's ``VisionTransformer``: the operator ``attn_type``
    built with ``attn_cfg`` (its own keyword arguments) and ``rope`` (a RoPE config or
    module), reading the grid from ``patch_grid``.

    timm builds every block's attention with the same arguments (width, heads, ``qkv_bias``,
    dropouts) and passes them to the class; what is not timm's travels in the class, made
    here for one model. Switches the operators do not have (``qk_norm``, ``scale_norm``,
    ``proj_bias=False``) are refused.
    """
    operator = attention_class(attn_type)
    attn_cfg = dict(attn_cfg or {})
    switches = {} if rope is None else {'rope': rope}

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_norm=False, scale_norm=False,
                 proj_bias=True, attn_drop=0., proj_drop=0., norm_layer=None, device=None,
                 dtype=None, **others):
        asked = dict(qk_norm=qk_norm, scale_norm=scale_norm, proj_bias=not proj_bias,
                     **{name: True for name in others if name != 'depth'})
        unsupported = sorted(name for name, on in asked.items() if on)
        if unsupported:
            raise ValueError(f'the {attn_type!r} operator as a timm attn_layer does not take '
                             f'{unsupported} (qk_norm / scale_norm off, proj_bias on)')
        operator.__init__(self, dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                          proj_drop=proj_drop, **attn_cfg, **switches)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)
        self.patch_grid = patch_grid

    return type(f'{operator.__name__}ForTimm', (TimmAttention, operator),
                {'__init__': __init__, '__module__': __name__,
                 '__doc__': f'{operator.__name__} with timm\'s attention signature.'})
