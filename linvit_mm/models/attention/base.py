"""The one interface every attention operator implements, and the registry that picks by name."""
from abc import ABCMeta, abstractmethod

import torch
from torch import nn

ATTENTIONS = {}


def register_attention(name):
    """Class decorator: make an operator buildable as ``build_attention(name, ...)``."""

    def wrap(cls):
        if name in ATTENTIONS:
            raise KeyError(f'attention type {name!r} is registered twice')
        ATTENTIONS[name] = cls
        cls.attn_type = name
        return cls

    return wrap


def attention_class(attn_type):
    try:
        return ATTENTIONS[attn_type]
    except KeyError:
        raise ValueError(f'unknown attention type {attn_type!r}; valid types are: '
                         f'{", ".join(sorted(ATTENTIONS))}') from None


def build_attention(attn_type, **kwargs):
    return attention_class(attn_type)(**kwargs)


class BaseAttention(nn.Module, metaclass=ABCMeta):
    """Tokens ``(B, N, C)`` plus the patch grid ``(H, W)`` to ``(B, N, C)``.

    ``N = num_extra + H * W``: extra tokens (a class token) lead the sequence and
    are inferred from ``N``, so the same module serves models with and without a
    class token and any grid, square or not.

    Every operator owns ``qkv`` and ``proj`` linears named like mmpretrain's
    ``MultiheadAttention`` so Softmax checkpoints load by name; operator-specific
    parameters live beside them. Subclasses implement ``forward`` (the fast form)
    and ``forward_reference`` (an explicit O(N^2) form from the same parameters, the
    test oracle). Operators whose attention can be written as an N x N map set
    ``has_map`` and implement ``attention_map``.
    """

    attn_type = None
    has_map = False
    # Whether models using this operator carry a class token and learned position
    # embedding (softmax, elu, relu, inline) or pool patch tokens (mhla, ttt).
    uses_cls_token = True
    # Attention dropout acts on the N x N map; only operators whose forward forms it
    # (softmax) can apply it, the linear ones refuse a nonzero rate.
    supports_attn_drop = False

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.):
        super().__init__()
        if embed_dims % num_heads != 0:
            raise ValueError(f'embed_dims={embed_dims} is not divisible by num_heads={num_heads}')
        if attn_drop and not self.supports_attn_drop:
            raise ValueError(f'attn_drop={attn_drop}: the {self.attn_type!r} operator never forms '
                             f'the N x N map that attention dropout acts on; use attn_drop=0 '
                             f'(proj_drop is supported)')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.head_dims = embed_dims // num_heads
        self.scale = self.head_dims**-0.5
        self.attn_drop = attn_drop
        self.proj_drop = nn.Dropout(proj_drop)

    @staticmethod
    def num_extra_tokens(x, hw_shape):
        num_extra = x.shape[1] - hw_shape[0] * hw_shape[1]
        if num_extra < 0:
            raise ValueError(f'{x.shape[1]} tokens cannot hold a {hw_shape[0]}x{hw_shape[1]} grid')
        return num_extra

    def split_heads(self, qkv, num_parts=3):
        """``(B, N, parts*C)`` -> ``parts`` tensors of shape ``(B, heads, N, head_dims)``."""
        B, N, _ = qkv.shape
        qkv = qkv.reshape(B, N, num_parts, self.num_heads, self.head_dims).permute(2, 0, 3, 1, 4)
        return qkv.unbind(0)

    @staticmethod
    def merge_heads(x):
        """``(B, heads, N, head_dims)`` -> ``(B, N, heads*head_dims)``."""
        B, h, N, d = x.shape
        return x.transpose(1, 2).reshape(B, N, h * d)

    @abstractmethod
    def forward(self, x, hw_shape, return_map=False):
        """The fast form: ``(B, N, C)`` -> ``(B, N, C)``, plus the map if asked and defined."""

    @abstractmethod
    def forward_reference(self, x, hw_shape):
        """The explicit O(N^2) form of the same computation, from the same parameters."""

    def encode_position(self, x, hw_shape):
        """Applied by the block to its input before ``ln1``; identity here.

        Operators that carry a conditional position encoding (TTT's 3x3 depthwise
        conv) override it, so their parameters live under ``attn`` beside the rest
        of the operator and the backbone stays operator-agnostic.
        """
        return x

    def attention_map(self, x, hw_shape):
        """The ``(B, heads, N, N)`` map whose product with the values gives the output."""
        raise TypeError(f'the {self.attn_type!r} operator has no attention map; operators with '
                        f'one: {", ".join(sorted(k for k, c in ATTENTIONS.items() if c.has_map))}')

    def extra_repr(self):
        return f'attn_type={self.attn_type!r}, embed_dims={self.embed_dims}, heads={self.num_heads}'


def float32_state(*tensors):
    """Upcast for linear-attention state sums: they overflow in fp16 and lose mass in bf16."""
    return tuple(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors)
