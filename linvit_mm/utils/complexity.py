"""Multiply-accumulate counts of LinearViT models, and mmengine's complexity analysis made to
count the attention operators the same way.

**MACs and FLOPs.** mmengine's analysers (like fvcore and detectron2) count one fused
multiply-add as one flop, so their "FLOPs" are multiply-accumulates: the numbers here and
theirs are in the same unit.

**Counting conventions** (:func:`count_macs`), for one image of ``P = H * W`` patch tokens,
``E`` extra (class) tokens, ``N = E + P``, ``C`` channels:

* every ``nn.Linear``: ``N * in * out`` (bias additions count zero);
* every ``nn.Conv2d`` on the patch grid: ``P * out * in / groups * k^2`` (same padding);
* each attention operator's core, everything between its projections that is not an
  ``nn.Linear`` / ``nn.Conv2d``: the operator's ``core_macs`` (defined on its class).
  Every product of a contraction is one MAC and so is every element a reduction over
  tokens sums; pointwise maps (feature maps, softmax's exponentials, divisions, GELU,
  LayerNorm, residual additions) count zero;
* the patch embedding, once.

**mmengine's analysers** trace the model and count the operations they have a handle for.
Inside linvit_mm's attention operators that falls short: ``scaled_dot_product_attention``
(softmax's fused path) has no handle, the custom autograd Functions (MHLA's value
convolution, the ttt inner step) are opaque, and key sums, means and normalisers are not
counted, so softmax showed fewer FLOPs than relu. :func:`operator_leaves` makes every
attention operator one leaf of the trace whose cost is :func:`attention_macs` (its linear
and convolution layers from their shapes plus its ``core_macs``, the very numbers
:func:`count_macs` adds up), and :func:`flop_handles` / :func:`activation_handles` are the
handles that read it, plus one for ``aten::scaled_dot_product_attention`` (used by models
outside linvit_mm, e.g. mmpretrain's ``VisionTransformer``).
:func:`get_model_complexity_info` is mmengine's function of that name with both.

**The one difference** between :func:`count_macs` and the analysis: mmengine also counts
normalisation layers (a LayerNorm with an affine transform: 5 per element), which the MAC
count leaves out. An operator's position encoding (ttt's 3x3 ``cpe`` convolution, run by
the block through ``encode_position``) belongs to the operator module and is counted in
the operator's leaf, with the rest of its layers.
"""
import math
from collections import Counter
from contextlib import contextmanager

import torch
from mmengine.analysis import ActivationAnalyzer, FlopAnalyzer, parameter_count
from mmengine.analysis.jit_handles import generic_activation_jit, get_shape
# mmengine's own formatting, so that the figures read like upstream's
from mmengine.analysis.print_helper import (_format_size, complexity_stats_str,
                                            complexity_stats_table)
from torch import nn

def linear_macs(linear, num_tokens):
    return num_tokens * linear.in_features * linear.out_features


def conv_macs(conv, num_positions):
    kh, kw = conv.kernel_size
    return num_positions * conv.out_channels * (conv.in_channels // conv.groups) * kh * kw


def _layer_macs(modules, num_tokens, num_patches, skip=()):
    """``linear`` and ``conv`` MACs of the ``nn.Linear`` / ``nn.Conv2d`` among ``modules``
    (convolutions run on the patch grid), leaving out the modules in ``skip``."""
    counts = Counter(linear=0, conv=0)
    for module in modules:
        if module in skip:
            continue
        if isinstance(module, nn.Linear):
            counts['linear'] += linear_macs(module, num_tokens)
        elif isinstance(module, nn.Conv2d):
            counts['conv'] += conv_macs(module, num_patches)
    return counts


def attention_macs(attn, num_tokens, hw_shape):
    """MACs of one attention operator module on one image of ``num_tokens`` tokens on an
    ``hw_shape`` patch grid: ``{'linear', 'conv', 'attention_core'}``.

    Its linear and convolution layers (all of them, a position-encoding convolution run
    through ``encode_position`` included) from their shapes, and its ``core_macs``.
    """
    counts = _layer_macs(attn.modules(), num_tokens, hw_shape[0] * hw_shape[1])
    counts['attention_core'] = attn.core_macs(num_tokens, tuple(hw_shape))
    return counts


def patch_grid(model, size):
    """The ``(rows, cols)`` patch grid of a ``size``-px image (an int or ``(height, width)``)."""
    height, width = (size, size) if isinstance(size, int) else size
    patch = model.patch_size
    if getattr(model.patch_embed, 'adaptive_padding', None) is not None:
        # mmcv's PatchEmbed pads a partial patch at the border into a whole one
        return -(-height // patch), -(-width // patch)
    return height // patch, width // patch


def count_macs(model, size):
    """Multiply-accumulates of one forward pass of a LinearViT ``model`` on one image.

    ``size`` is the side of a square image or its ``(height, width)`` in px. Returns a dict
    with ``patch_embed``, ``linear``, ``conv``, ``attention_core``, ``blocks`` (the last
    three summed) and ``total``; the conventions are in the module docstring. Each block is
    counted with its own operator, so a hybrid's count is the sum of its blocks'.
    """
    hw_shape = patch_grid(model, size)
    num_patches = hw_shape[0] * hw_shape[1]
    num_tokens = model.num_extra_tokens + num_patches
    counts = Counter(linear=0, conv=0, attention_core=0)
    for layer in model.layers:
        counts.update(attention_macs(layer.attn, num_tokens, hw_shape))
        counts.update(_layer_macs(layer.modules(), num_tokens, num_patches,
                                  skip=set(layer.attn.modules())))
    counts = dict(counts, patch_embed=conv_macs(model.patch_embed.projection, num_patches))
    counts['blocks'] = counts['linear'] + counts['conv'] + counts['attention_core']
    counts['total'] = counts['blocks'] + counts['patch_embed']
    return counts


# ---------------------------------------------------------------- the analysis
class _OperatorLeaf(torch.autograd.Function):
    """One node of a trace standing for a whole attention operator call.

    ``cost`` travels as a scalar argument of the node, where the handles read it; the
    computation itself runs with tracing paused, so none of its operations reach the
    graph to be counted a second time (a custom Function's body would otherwise be
    traced into a subgraph, which fails on tensors it reads that are not its inputs).
    Analysis only: there is no backward.
    """

    @staticmethod
    def forward(ctx, cost, run, x):
        tracing_state = torch._C._get_tracing_state()
        torch._C._set_tracing_state(None)
        try:
            return run(x)
        finally:
            torch._C._set_tracing_state(tracing_state)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError('operator leaves exist for complexity analysis only; they are not '
                           'differentiable')


LEAF_KIND = f'prim::PythonOp.{_OperatorLeaf.__name__}'


def _leaf_forward(attn):
    """``attn.forward`` as a leaf whose cost is :func:`attention_macs` of the call."""
    from linvit_mm.models.attention import BaseAttention

    def forward(x, hw_shape):
        # under tracing, sizes may be 0-dim tensors
        batch, num_tokens = map(int, x.shape[:2])
        grid = tuple(map(int, hw_shape))
        macs = attention_macs(attn, num_tokens, grid)
        activations = sum(num_tokens * m.out_features for m in attn.modules()
                          if isinstance(m, nn.Linear))
        activations += sum(grid[0] * grid[1] * m.out_channels for m in attn.modules()
                           if isinstance(m, nn.Conv2d))
        # by_operator() then lists 'linear' and 'conv' with the layers mmengine's own
        # handles count under those names, and 'attention_core' on its own
        cost = dict(macs={op: batch * count for op, count in macs.items() if count},
                    activations=batch * activations)
        return _OperatorLeaf.apply(cost, lambda t: type(attn).forward(attn, t, hw_shape), x)

    def encode_position(x, hw_shape):
        # counted with the operator's layers in its forward leaf
        return _OperatorLeaf.apply(
            None, lambda t: type(attn).encode_position(attn, t, hw_shape), x)

    own_position = type(attn).encode_position is not BaseAttention.encode_position
    return forward, encode_position if own_position else None


@contextmanager
def operator_leaves(model):
    """Within the block, every attention operator of ``model`` traces as one leaf.

    Tracing (mmengine's analysers) inside it records one node per operator call, whose
    cost the handles of :func:`flop_handles` and :func:`activation_handles` read. The
    operators compute what they always do; the block restores their methods on exit.
    """
    from linvit_mm.models.attention import BaseAttention
    patched = []
    try:
        for module in model.modules():
            if isinstance(module, BaseAttention):
                forward, encode_position = _leaf_forward(module)
                module.forward = forward
                patched.append((module, 'forward'))
                if encode_position is not None:
                    module.encode_position = encode_position
                    patched.append((module, 'encode_position'))
        yield model
    finally:
        for module, name in patched:
            delattr(module, name)  # the instance attribute hid the class's method


def _leaf_cost(outputs):
    return outputs[0].node().scalar_args()[0]


def _leaf_flops(inputs, outputs):
    cost = _leaf_cost(outputs)
    return Counter() if cost is None else Counter(cost['macs'])


def _leaf_activations(inputs, outputs):
    cost = _leaf_cost(outputs)
    return Counter() if cost is None else Counter(attention=cost['activations'])


def sdpa_flop_jit(inputs, outputs):
    """``scaled_dot_product_attention(q, k, v)``: ``q k^T`` and the map times ``v``.

    ``q`` is ``(..., L, E)``, ``k`` ``(..., S, E)``, ``v`` ``(..., S, Ev)``:
    ``prod(...) * L * S * (E + Ev)`` multiply-accumulates, which for ``h`` heads of
    ``d`` is softmax's ``core_macs``, ``2 N^2 h d`` per image.
    """
    q_shape, k_shape, v_shape = (get_shape(value) for value in inputs[:3])
    *batch, length, dims = q_shape
    return math.prod(batch) * length * k_shape[-2] * (dims + v_shape[-1])


def flop_handles():
    """Handles to add to an mmengine ``FlopAnalyzer`` (``set_op_handle(**flop_handles())``)."""
    return {LEAF_KIND: _leaf_flops, 'aten::scaled_dot_product_attention': sdpa_flop_jit}


def activation_handles():
    """Handles to add to an mmengine ``ActivationAnalyzer``.

    A leaf's activations are the outputs of the operator's linear and convolution layers,
    what mmengine counts for those layers when it traces them.
    """
    return {LEAF_KIND: _leaf_activations,
            'aten::scaled_dot_product_attention': generic_activation_jit()}


def get_model_complexity_info(model, input_shape=None, inputs=None, show_table=True,
                              show_arch=True):
    """``mmengine.analysis.get_model_complexity_info`` with linvit_mm's attention operators
    counted by :func:`attention_macs` (see the module docstring); same arguments, same
    returned dict (``flops``, ``flops_str``, ``activations``, ``activations_str``,
    ``params``, ``params_str``, ``out_table``, ``out_arch``).
    """
    if (input_shape is None) == (inputs is None):
        raise ValueError('give exactly one of input_shape (e.g. (3, 224, 224)) and inputs')
    if inputs is None:
        device = next(model.parameters()).device
        inputs = (torch.randn(1, *input_shape, device=device), )
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs, )
    with torch.no_grad(), operator_leaves(model):
        # The traces are taken lazily; everything that reads them runs inside the block.
        flop_handler = FlopAnalyzer(model, inputs).set_op_handle(**flop_handles())
        activation_handler = ActivationAnalyzer(model, inputs).set_op_handle(
            **activation_handles())
        flops = flop_handler.total()
        activations = activation_handler.total()
        table = arch = ''
        if show_table:
            table = '\n' + complexity_stats_table(flops=flop_handler,
                                                   activations=activation_handler,
                                                   show_param_shapes=True)
        if show_arch:
            arch = '\n' + complexity_stats_str(flops=flop_handler, activations=activation_handler)
    params = parameter_count(model)['']
    return dict(flops=flops, flops_str=_format_size(flops), activations=activations,
                activations_str=_format_size(activations), params=params,
                params_str=_format_size(params), out_table=table, out_arch=arch)
