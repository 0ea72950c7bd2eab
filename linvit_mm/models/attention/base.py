"""The one interface every attention operator implements, and the registry that picks by name.

Everything the rest of linvit_mm needs to know about an operator is a class attribute or a
method of its class: whether its models carry a class token, whether it has an N x N map,
whether it has a ``Q K^T`` form (for the analytic initialisations), which rows of its
layers a Softmax checkpoint fills, and its multiply-accumulate count. The transfer, the
distillation hook, the benchmark tools and the demo read them from the class, so a new
operator is one file (plus its tests) registered in :data:`ATTENTIONS`.
"""
import contextlib
from abc import ABCMeta, abstractmethod

import torch
from mmengine.registry import Registry
from mmpretrain.models.utils import LayerScale
from mmpretrain.registry import MODELS
from torch import nn

from ..utils.options import bound_options
from ..utils.rope import build_rope

# A child of mmpretrain's model registry, so a lookup needs no default scope (mmdet and
# mmseg runs find operators too). Third-party operators register with
# ``@register_attention(name)`` in a module that ``custom_imports`` loads: it also records
# the name as the class's ``attn_type``, which a bare ``ATTENTIONS.register_module()`` does not.
ATTENTIONS = Registry('attention operator', parent=MODELS, scope='linvit_mm',
                      locations=['linvit_mm.models.attention'])

# What a Softmax checkpoint's ``qkv`` / ``proj`` tensor gives a layer of an operator:
WHOLE = 'whole'                   # the layer has a Softmax block's shape: copied as is
LEADING_ROWS = 'leading rows'     # the layer is wider: the checkpoint fills its first rows
OWN_INIT = 'own init'             # the layer is not a Softmax block's: it keeps its init
SOFTMAX_FILLS = (WHOLE, LEADING_ROWS, OWN_INIT)


def register_attention(name):
    """Class decorator: register an operator under ``name`` and record it as its ``attn_type``."""

    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, BaseAttention)):
            raise TypeError(f'{cls!r} is not a BaseAttention subclass')
        cls.attn_type = name
        ATTENTIONS.register_module(name=name, module=cls)
        return cls

    return wrap


def attention_types():
    """The registered operator names, Softmax first (the reference row)."""
    names = sorted(ATTENTIONS.module_dict)
    return sorted(names, key=lambda name: name != 'softmax')


def attention_class(attn_type):
    """The operator class registered as ``attn_type``; the error lists the valid names."""
    # mmengine's registry raises a bare 'Failed to get ' for an empty name
    operator = ATTENTIONS.get(attn_type) if isinstance(attn_type, str) and attn_type else None
    # The registry also searches its parent (mmpretrain's models): only operators count.
    if not (isinstance(operator, type) and issubclass(operator, BaseAttention)):
        raise ValueError(f'unknown attention type {attn_type!r}; valid types are: '
                         f'{", ".join(attention_types())} (operators of other packages '
                         f'register in linvit_mm.models.attention.ATTENTIONS and are imported '
                         f'with custom_imports)')
    return operator


def build_attention(cfg, **kwargs):
    """Build an operator from its name (``build_attention('relu', embed_dims=..., ...)``) or
    from a config dict whose ``type`` is the name.

    Each switch is checked against the kind of its default first (a bool switch takes True
    or False, not ``'False'`` or None; a number is finite). The operator records what it was
    built with, defaults filled in, as ``built_options``: checkpoints carry the options that
    change what it computes (:meth:`BaseAttention.computed_options`).
    """
    if isinstance(cfg, dict):
        kwargs = {**{k: v for k, v in cfg.items() if k != 'type'}, **kwargs}
        cfg = cfg.get('type')
    operator = attention_class(cfg)
    options = bound_options(operator, f'the {operator.attn_type!r} operator', **kwargs)
    attention = operator(**kwargs)
    attention.built_options = options
    return attention


class BaseAttention(nn.Module, metaclass=ABCMeta):
    """Tokens ``(B, N, C)`` plus the patch grid ``(H, W)`` to ``(B, N, C)``.

    ``N = num_extra + H * W``: extra tokens (a class token) lead the sequence and
    are inferred from ``N``, so the same module serves models with and without a
    class token and any grid, square or not.

    Every operator owns ``qkv`` and ``proj`` linears named like mmpretrain's
    ``MultiheadAttention`` so Softmax checkpoints load by name; operator-specific
    parameters live beside them. Subclasses implement ``forward`` (the fast form, a
    tensor), ``forward_reference`` (an explicit O(N^2) form from the same parameters,
    the test oracle) and ``core_macs``. Operators whose attention can be written as an
    N x N map set ``has_map`` and implement ``attention_map``, the one way to get it.

    Two switches every operator takes, so that the signature stays ``(x, hw_shape)``
    wherever an operator is called (the blocks, the ViT-Adapter, the distillation hook):

    * ``rope``: a 2-D rotary position embedding (``RotaryPositionEmbedding2D`` or its config
      dict) that the operator holds and applies to the patch tokens of the grid it is given;
      leading extra tokens are never rotated. Each operator's docstring says where it
      rotates; ``core_macs`` counts the rotation (two multiply-accumulates per rotated
      element).
    * ``layer_scale_init_value``: > 0 adds LayerScale ``gamma1`` (mmpretrain's
      ``MultiheadAttention`` name and place, ``attn.gamma1.weight``) after ``proj``. It is
      part of the operator's output, so the distillation hook, which records that output,
      compares what each block adds to its residual stream: a function of the checkpoint,
      whereas the output before ``gamma1`` depends on how training happened to split a
      per-channel scale between ``proj`` and ``gamma1``.
    """

    attn_type = None
    # Whether the output equals ``A V`` for an N x N map ``attention_map`` can form.
    has_map = False
    # Whether models using this operator carry a class token and learned position
    # embedding (softmax, elu, relu, inline) or pool patch tokens (mhla, ttt).
    uses_cls_token = True
    # Attention dropout acts on the N x N map; only operators whose forward forms it
    # (softmax) can apply it, the linear ones refuse a nonzero rate.
    supports_attn_drop = False
    # Whether the operator applies a 2-D RoPE (``rope``); one that cannot says why in
    # ``rope_absent_because`` and refuses it.
    supports_rope = True
    rope_absent_because = None
    # Whether each head scores token pairs through a bilinear form q_i^T k_j of the
    # ``qkv`` rows, which the analytic initialisations (Mimetic, Impulse) shape. An
    # operator without one says why in ``qk_form_absent_because``.
    has_qk_form = True
    qk_form_absent_because = None
    # What a Softmax checkpoint's ``attn.qkv`` / ``attn.proj`` gives this operator's
    # layer of the same name: one of ``SOFTMAX_FILLS``.
    softmax_fill = {'qkv': WHOLE, 'proj': WHOLE}
    # The constructor contract: the keyword arguments an operator's ``__init__`` takes besides
    # ``embed_dims`` and ``num_heads``. Every operator takes these (and passes ``rope`` and
    # ``layer_scale_init_value`` on to ``BaseAttention``, which applies both) and lists its
    # own after them (``options = BaseAttention.options + ('eps', )``). The backbone reads it
    # to refuse an ``attn_cfg`` key or a switch an operator does not take before any block
    # is built; an operator of another package that takes fewer lists only those it takes.
    options = ('qkv_bias', 'attn_drop', 'proj_drop', 'rope', 'layer_scale_init_value')

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 rope=None, layer_scale_init_value=0.):
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
        if rope is not None and not self.supports_rope:
            raise ValueError(f'rope={rope!r}: the {self.attn_type!r} operator does not carry '
                             f'RoPE ({self.rope_absent_because}); use rope=None')
        self.rope = build_rope(rope, self.head_dims)
        if layer_scale_init_value < 0:
            raise ValueError(f'layer_scale_init_value must be >= 0 (0: no LayerScale), got '
                             f'{layer_scale_init_value}')
        self.gamma1 = (LayerScale(embed_dims, layer_scale_init_value)
                       if layer_scale_init_value > 0 else nn.Identity())

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

    def rotation(self, hw_shape, num_extra, like):
        """The RoPE ``GridRotation`` of ``num_extra`` extra tokens and the grid (extra
        tokens unrotated), in ``like``'s device and at least float32; ``None`` without RoPE."""
        return None if self.rope is None else self.rope(hw_shape, num_extra, like)

    def rotation_matrices(self, hw_shape, num_extra, like):
        """The same rotation as explicit ``(N, d, d)`` per-token matrices (identity for the
        extra tokens), the form the O(N^2) oracles rotate with; ``None`` without RoPE."""
        rotation = self.rotation(hw_shape, num_extra, like)
        return None if rotation is None else rotation.as_reference().matrices()

    def rotation_macs(self, num_rotated_tokens):
        """Multiply-accumulates of rotating queries and keys of ``num_rotated_tokens`` tokens
        (``t cos + partner(t) sin``: two per element); 0 without RoPE."""
        return 0 if self.rope is None else 2 * 2 * num_rotated_tokens * self.embed_dims

    def project(self, x):
        """``proj``, its dropout and LayerScale: ``(B, N, proj inputs)`` -> ``(B, N, C)``."""
        return self.gamma1(self.proj_drop(self.proj(x)))

    @abstractmethod
    def forward(self, x, hw_shape):
        """The fast form: ``(B, N, C)`` -> ``(B, N, C)``."""

    @abstractmethod
    def forward_reference(self, x, hw_shape):
        """The explicit O(N^2) form of the same computation, from the same parameters."""

    @abstractmethod
    def core_macs(self, num_tokens, hw_shape):
        """Multiply-accumulates of the attention core of one image: everything between the
        ``qkv`` and ``proj`` projections except the ``nn.Linear`` / ``nn.Conv2d`` layers,
        which are counted from their shapes by whoever counts (the benchmark tools)."""

    def encode_position(self, x, hw_shape):
        """Applied by the block to its input before ``ln1``; identity here.

        Operators that carry a conditional position encoding (TTT's 3x3 depthwise
        conv) override it, so their parameters live under ``attn`` beside the rest
        of the operator and the backbone stays operator-agnostic.
        """
        return x

    def attention_map(self, x, hw_shape):
        """The ``(B, heads, N, N)`` map whose product with the values gives the output."""
        with_map = [name for name in attention_types() if attention_class(name).has_map]
        raise TypeError(f'the {self.attn_type!r} operator has no attention map; operators with '
                        f'one: {", ".join(with_map)}')

    def extra_repr(self):
        return f'attn_type={self.attn_type!r}, embed_dims={self.embed_dims}, heads={self.num_heads}'

    # Constructor arguments that do not change what a trained operator computes: dropout acts
    # in training only, and the bias and LayerScale show in the tensors a checkpoint holds.
    options_outside_the_function = ('embed_dims', 'num_heads', 'qkv_bias', 'attn_drop',
                                    'proj_drop', 'layer_scale_init_value')

    def computed_options(self):
        """The options this operator was built with that change what it computes from its
        tensors (a feature map, a normaliser, an eps, RoPE), as plain values; None for an
        operator built without :func:`build_attention`."""
        options = getattr(self, 'built_options', None)
        if options is None:
            return None
        return {name: _plain(value) for name, value in sorted(options.items())
                if name not in self.options_outside_the_function}


def autocast_disabled(tensor):
    """``torch.autocast(..., enabled=False)`` for ``tensor``'s device; nothing to switch off on
    a device autocast does not know (the meta device, where a model is traced for its shapes,
    has no autocast state and torch refuses to build the context for it)."""
    device_type = tensor.device.type
    if device_type == 'meta':
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def _plain(value):
    """Containers as plain dicts and lists, other objects by their repr: what a checkpoint's
    meta holds and a weights-only load reads back."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def float32_state(*tensors):
    """Upcast to float32 (fp16 and bf16): for the N x N maps the distillation reads and for
    steps whose precision the operator needs (ttt's closed-form inner step)."""
    return tuple(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors)


def state_inputs(*tensors):
    """The fast forms' inputs of their sums over the tokens: fp16 upcast to float32 (a sum
    over thousands of tokens leaves fp16's range), bf16 kept. bf16 has float32's range, and
    its products and sums accumulate in float32 (cuBLAS, cuDNN and the CPU kernels alike):
    only the stored state rounds to bf16, which at 4096 tokens gave an output error of
    1.92e-3 against 1.87e-3 with a float32 state (both rounded to bf16), while float32 copies
    of q, k and v would double the activations a training step keeps."""
    return tuple(t.float() if t.dtype == torch.float16 else t for t in tensors)


# The O(N^2) oracles (``forward_reference``) split, merge, rotate and upcast with the helpers
# below and never with ``split_heads``, ``merge_heads``, ``GridRotation.rotate`` or
# ``float32_state``, which the fast forms use: a fault in one of those then shows as a
# difference between the fast form and its oracle instead of moving both alike.

def naive_heads(qkv, num_heads, num_parts=3):
    """``(B, N, parts*C)`` -> ``parts`` tensors ``(B, heads, N, C / heads)`` by channel slices:
    head ``h`` of part ``p`` is channels ``[p*C + h*d, p*C + (h+1)*d)``."""
    C = qkv.shape[-1] // num_parts
    d = C // num_heads
    return [torch.stack([qkv[..., p * C + h * d:p * C + (h + 1) * d] for h in range(num_heads)],
                        dim=1) for p in range(num_parts)]


def naive_merge_heads(heads):
    """``(B, heads, N, d)`` -> ``(B, N, heads*d)``, head ``h`` in channels ``[h*d, (h+1)*d)``."""
    return torch.cat([heads[:, h] for h in range(heads.shape[1])], dim=-1)


def naive_rotate(matrices, t):
    """Multiply every token of ``(B, heads, N, d)`` by its ``(N, d, d)`` rotation matrix."""
    return torch.einsum('nij,bhnj->bhni', matrices.to(t.dtype), t)


def naive_precision(t):
    """``t`` in float32 at least: the oracles, like the fast forms' sums, avoid half precision."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
