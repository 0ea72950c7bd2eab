"""Helpers of the attention operator tests, handed to the tests as fixtures.

A fixture here returns a function (pytest's factory-as-fixture form): a test module cannot
import a ``conftest.py`` reliably, as every test folder has one of that name. Default
operator sizes (:data:`EMBED_DIMS`, :data:`NUM_HEADS`) are those of ``make_attention``
and ``tokens``.
"""
import contextlib
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from linvit_mm.models.attention import BaseAttention, build_attention
from linvit_mm.models.utils.rope import GridRotation
from linvit_mm.testing import assert_rel_close, rel_error

EMBED_DIMS, NUM_HEADS = 24, 3


def make_attention(attn_type, dtype=torch.float64, seed=0, device='cpu', **kwargs):
    """``build_attention(attn_type, ...)`` with the default sizes, seeded, in float64."""
    torch.manual_seed(seed)
    kwargs.setdefault('embed_dims', EMBED_DIMS)
    kwargs.setdefault('num_heads', NUM_HEADS)
    return build_attention(attn_type, **kwargs).to(device=device, dtype=dtype)


def tokens(hw, num_extra, batch=2, dims=EMBED_DIMS, dtype=torch.float64, seed=1, scale=1.,
                  device='cpu'):
    """``(batch, num_extra + H*W, dims)`` standard normal tokens times ``scale``; the same
    values on every device (drawn on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, num_extra + hw[0] * hw[1], dims, generator=generator, dtype=dtype)
    return (x * scale).to(device)


def output_and_grads(module, fn, x):
    """``fn(x)`` and, for a fixed upstream gradient, the gradients of ``x`` (key ``'x'``) and of
    every parameter of ``module`` (None for a parameter ``fn`` does not use)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    generator = torch.Generator().manual_seed(7)
    upstream = torch.randn(out.shape, generator=generator, dtype=out.dtype).to(out.device)
    out.backward(upstream)
    grads = {'x': x.grad}
    grads.update({name: param.grad for name, param in module.named_parameters()})
    return out.detach(), grads


def assert_matches_reference(module, x, hw, tol=1e-10):
    """The fast form equals ``forward_reference`` (output and gradients) and uses the same
    parameters; returns the fast form's gradients (see :func:`output_and_grads`)."""
    out, grads = output_and_grads(module, lambda t: module(t, hw), x)
    ref, ref_grads = output_and_grads(module, lambda t: module.forward_reference(t, hw), x)
    assert out.shape == x.shape
    assert_rel_close(out, ref, tol, 'output')
    for name, grad in grads.items():
        if grad is None or ref_grads[name] is None:
            assert grad is None and ref_grads[name] is None, f'{name}: gradient in one form only'
        else:
            assert_rel_close(grad, ref_grads[name], tol, f'grad of {name}')
    return grads


def assert_fast_matches_naive(module, x, hw):
    """:func:`assert_matches_reference` with every parameter in play: a LayerScale, when on,
    is drawn away from its constant init (so a form that drops or misplaces it differs), and
    every parameter must receive a gradient."""
    if hasattr(module.gamma1, 'weight'):
        with torch.no_grad():
            module.gamma1.weight.uniform_(-1, 1)
    grads = assert_matches_reference(module, x, hw)
    assert all(grad is not None for grad in grads.values())


def assert_map_matches_naive(module, x, hw, tol=1e-12):
    """The production ``attention_map`` equals the map of the operator's ``naive_forward``."""
    with torch.no_grad():
        assert_rel_close(module.attention_map(x, hw), module.naive_forward(x, hw)[1], tol, 'map')


def autocast_output(module, x, hw, dtype):
    """Without grad: ``module(x, hw)`` under CPU autocast to ``dtype``, and the same module's
    exact output in float64 (the module is left in float64)."""
    with torch.no_grad():
        with torch.autocast('cpu', dtype=dtype):
            out = module(x, hw)
        exact = module.double()(x.double(), hw)
    return out, exact


def assert_float32_forms_compute_in_float32(module, x, hw, reference, tol=1e-5):
    """Without autocast and grad, float32 ``module`` and ``x``: ``module(x, hw)`` and
    ``reference(x, hw)`` stay float32 and agree with ``reference`` in float64 to ``tol`` (a
    bfloat16 step inside either, e.g. an ``autocast(enabled=...)`` left on, costs ~1e-2).
    The module is left in float64."""
    with torch.no_grad():
        fast, ref = module(x, hw), reference(x, hw)
        module.double()  # the reference is one of its methods: it now runs in float64
        exact = reference(x.double(), hw)
    assert fast.dtype == ref.dtype == torch.float32
    assert rel_error(fast, exact) < tol, 'fast form'
    assert rel_error(ref, exact) < tol, 'reference'


class OpRecorder(TorchDispatchMode):
    """Records name, output dtype and size of every aten op that runs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.ops.append((func.overloadpacket.__name__, t.dtype, t.numel()))
        return out


def recorded_ops(fn):
    """``(op name, dtype, numel)`` of every tensor an aten op returns while ``fn()`` runs."""
    with OpRecorder() as recorder:
        fn()
    return recorder.ops


def largest_intermediate(fn):
    """The most elements of any tensor an aten op returns while ``fn()`` runs."""
    return max(numel for _, _, numel in recorded_ops(fn))


@contextlib.contextmanager
def fast_helpers_broken(*more):
    """Within the block, the helpers the fast forms share raise when called: head split and
    merge, the elementwise RoPE rotation, ``float32_state`` and ``state_inputs`` (in every
    attention module
    that imports it), plus each ``(owner, attribute name)`` of ``more``. An oracle that runs
    through the block shares none of them with the fast forms."""

    def broken(*args, **kwargs):
        raise AssertionError('an oracle called a helper of the fast forms')

    targets = [(BaseAttention, 'split_heads'), (BaseAttention, 'merge_heads'),
               (GridRotation, 'rotate'), *more]
    targets += [(module, helper) for name, module in list(sys.modules.items())
                if name.startswith('linvit_mm.models.attention') and module is not None
                for helper in ('float32_state', 'state_inputs') if hasattr(module, helper)]
    with pytest.MonkeyPatch.context() as patch:
        for owner, attribute in targets:
            patch.setattr(owner, attribute, broken)
        yield


def assert_common_defaults(attn_type, **specific):
    """An operator built from ``embed_dims`` and ``num_heads`` alone (``attn_type``: its
    registered name, or a class) has the defaults every operator documents (a qkv bias, no
    LayerScale, no dropout, no RoPE) and the operator's own ``specific`` attribute values."""
    if isinstance(attn_type, str):
        module = build_attention(attn_type, embed_dims=EMBED_DIMS, num_heads=NUM_HEADS)
    else:
        module = attn_type(embed_dims=EMBED_DIMS, num_heads=NUM_HEADS)
    assert module.qkv.bias is not None, 'qkv_bias defaults to True'
    assert isinstance(module.gamma1, torch.nn.Identity), 'no LayerScale by default'
    assert module.proj_drop.p == 0 and module.attn_drop == 0, 'no dropout by default'
    assert module.rope is None, 'no RoPE by default'
    for name, value in specific.items():
        assert getattr(module, name) == value, f'{name} defaults to {value!r}'


def assert_oracle_ignores_autocast(oracle, qkv, *args, tol=1e-5):
    """``oracle(qkv, *args)`` of float32 ``qkv`` under bf16 autocast is float32 and equals the
    oracle in float64 (which autocast never touches): the oracle checks the fast forms'
    autocast paths, so it must not itself run in bf16."""
    expected = oracle(qkv.double(), *args)
    with torch.autocast(qkv.device.type, dtype=torch.bfloat16):
        got = oracle(qkv.float(), *args)
    for e, g in zip(tree_leaves(expected), tree_leaves(got), strict=True):
        assert g.dtype == torch.float32, f'oracle ran in {g.dtype} under bf16 autocast'
        assert_rel_close(g.double(), e, tol, 'oracle under bf16 autocast')


def _as_fixture(helper):
    """A fixture named like ``helper`` that returns it."""
    return pytest.fixture(name=helper.__name__)(lambda: helper)


make_attention_fixture = _as_fixture(make_attention)
tokens_fixture = _as_fixture(tokens)
output_and_grads_fixture = _as_fixture(output_and_grads)
assert_matches_reference_fixture = _as_fixture(assert_matches_reference)
autocast_output_fixture = _as_fixture(autocast_output)
assert_fast_matches_naive_fixture = _as_fixture(assert_fast_matches_naive)
assert_map_matches_naive_fixture = _as_fixture(assert_map_matches_naive)
recorded_ops_fixture = _as_fixture(recorded_ops)
largest_intermediate_fixture = _as_fixture(largest_intermediate)
fast_helpers_broken_fixture = _as_fixture(fast_helpers_broken)
assert_common_defaults_fixture = _as_fixture(assert_common_defaults)
assert_oracle_ignores_autocast_fixture = _as_fixture(assert_oracle_ignores_autocast)
assert_float32_forms_compute_in_float32_fixture = _as_fixture(
    assert_float32_forms_compute_in_float32)
