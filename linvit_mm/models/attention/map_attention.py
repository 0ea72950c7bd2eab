"""Base of the linear operators that are also an explicit N x N map (elu, relu, inline)."""
from abc import abstractmethod

from torch import nn

from .base import BaseAttention, autocast_disabled, float32_state


class LinearMapAttention(BaseAttention):
    """A linear operator whose output equals ``A V`` for an N x N map ``A`` it can also form.

    The fast form (``_linear``) sums a ``d x d`` state over the tokens and never forms
    ``A``; the map (``_map``) is what ``attention_map`` returns, the distillation target of
    ``target='map'``. Subclasses define both from the same ``q, k, v`` heads; weight shapes
    equal Softmax attention (``qkv``, ``proj``), so Softmax checkpoints load by name.

    ``forward_reference`` here is ``A V`` with ``A`` from ``_map``, which shares the
    subclass's helpers (feature maps, head split, float32 state) with ``_linear``, so a
    fault in one of those moves both alike. A subclass that writes its operator out from
    its definition with no shared helper overrides ``forward_reference`` with that form;
    the tests then check ``_linear`` and ``_map`` against it.

    Under autocast the map and its product with the values run in float32 with autocast
    disabled, like the fast form's state; the result returns to the dtype of the
    projections' output before ``proj``.

    With RoPE, ``_linear`` and ``_map`` receive the grid's ``GridRotation`` (``None``
    without RoPE) and apply it where the operator's form puts it; the map stays the
    operator's attention (``output = A V``).
    """

    has_map = True

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 rope=None, layer_scale_init_value=0.):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, rope=rope,
                         layer_scale_init_value=layer_scale_init_value)
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)

    @abstractmethod
    def _linear(self, q, k, v, rotation=None):
        """``(B, heads, N, d)`` heads -> the output heads, in O(N d^2)."""

    @abstractmethod
    def _map(self, q, k, rotation=None):
        """The ``(B, heads, N, N)`` map, in float32."""

    def _with_map(self, q, k, v, rotation=None):
        attn = self._map(q, k, rotation)
        with autocast_disabled(v):
            out = attn @ float32_state(v)[0]
        return out.to(v.dtype), attn

    def _heads(self, x, hw_shape):
        """``q, k, v`` heads and the RoPE rotation of the sequence (``None`` without)."""
        num_extra = self.num_extra_tokens(x, hw_shape)  # validates the grid
        q, k, v = self.split_heads(self.qkv(x))
        return q, k, v, self.rotation(hw_shape, num_extra, q)

    def _project(self, heads):
        return self.project(self.merge_heads(heads))

    def forward(self, x, hw_shape):
        return self._project(self._linear(*self._heads(x, hw_shape)))

    def forward_reference(self, x, hw_shape):
        q, k, v, rotation = self._heads(x, hw_shape)
        if rotation is not None:
            # The map is formed from explicit per-token rotation matrices (the oracle).
            rotation = rotation.as_reference()
        out, _ = self._with_map(q, k, v, rotation)
        return self._project(out)

    def attention_map(self, x, hw_shape):
        q, k, _, rotation = self._heads(x, hw_shape)
        return self._map(q, k, rotation)
