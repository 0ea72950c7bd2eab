"""Hedgehog's fused C++ form (``ops/hedgehog_core.py``): a gradcheck of its own, the operator
with it against the operator's PyTorch form (outputs and every gradient), large inputs, when
it is taken and when not, and the kernel's input checks."""
import pytest
import torch

from linvit_mm.models.attention import HedgehogAttention
from linvit_mm.ops import set_cpu_kernels
from linvit_mm.ops.hedgehog_core import hedgehog_attention
from linvit_mm.testing import assert_rel_close

OPTIONS = {
    'softmax-tied': dict(),
    'exp-tied': dict(feature_map='exp'),
    'softmax-untied-kaiming': dict(tie_qk=False, feature_init='kaiming_uniform'),
    'exp-untied': dict(feature_map='exp', tie_qk=False),
}


def make(dtype, embed_dims=24, num_heads=3, seed=0, **kwargs):
    """A Hedgehog module whose maps are away from the identity (and, untied, from each other),
    so a swapped or transposed map cannot hide."""
    torch.manual_seed(seed)
    module = HedgehogAttention(embed_dims, num_heads, **kwargs).to(dtype)
    with torch.no_grad():
        for weight in (module.feature_proj, module.feature_proj_k):
            if weight is not None:
                weight.add_(torch.randn_like(weight), alpha=.3)
    return module




@pytest.mark.parametrize('scale', [1., 30.], ids=['unit', 'scale-30'])
@pytest.mark.parametrize('option', OPTIONS)
def test_cpp_form_matches_the_pytorch_form_in_float64(kernels, option, scale,
                                                      outputs_and_gradients, graph_names):
    """At scale 30 the features' exponentials would overflow unshifted: both forms shift."""
    module = make(torch.float64, **OPTIONS[option])
    generator = torch.Generator().manual_seed(1)
    hw = (4, 5)
    x = scale * torch.randn(2, 1 + 20, 24, generator=generator, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    fast, fast_graph = outputs_and_gradients(module, x, hw, upstream, kernels=True)
    reference, reference_graph = outputs_and_gradients(module, x, hw, upstream, kernels=False)
    assert '_HedgehogAttentionBackward' in graph_names(fast_graph)
    assert '_HedgehogAttentionBackward' not in graph_names(reference_graph)
    assert fast.keys() == reference.keys()
    for name in fast:
        assert torch.isfinite(fast[name]).all(), name
        assert_rel_close(fast[name], reference[name], 1e-10, name)


def test_cpp_form_matches_the_pytorch_form_in_float32_at_vit_s_width(kernels,
                                                                    outputs_and_gradients):
    """Heads of 64 channels (the vectorised reductions' full width), batch 2, 197 tokens;
    float32 exponentials of the C++ loops are within about one ulp of PyTorch's."""
    module = make(torch.float32, embed_dims=384, num_heads=6, tie_qk=False)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 197, 384, generator=generator)
    upstream = torch.randn(x.shape, generator=generator)
    fast, _ = outputs_and_gradients(module, x, (14, 14), upstream, kernels=True)
    reference, _ = outputs_and_gradients(module, x, (14, 14), upstream, kernels=False)
    for name in fast:
        assert_rel_close(fast[name], reference[name], 1e-4, name)


def extreme_heads(dtype):
    """``q, k, v`` ``(1, 2, 8, 4)`` heads with entries far outside what a probability can
    hold in ``dtype`` (about exp(-87) in float32, with the kernels' exponential floored there;
    exp(-708) in float64): in head 0 every key's coordinate 0 lies far below its others, so
    feature 0's key sum is too small for the probability form, and some queries' coordinate
    0 far above theirs; in head 1 one key's coordinates 0 and 1 lie at two different depths
    past the floor, which the reciprocals of its positive half cannot tell apart."""
    generator = torch.Generator().manual_seed(3)
    depth = 95. if dtype == torch.float32 else 720.
    q, k, v = torch.randn(3, 1, 2, 8, 4, generator=generator, dtype=dtype).unbind(0)
    spread = 15 * torch.rand(8, generator=generator, dtype=dtype)
    k[0, 0, :, 0] = -(depth + spread)
    q[0, 0, ::2, 0] = depth + spread[::2]
    k[0, 1, 0, :2] = torch.tensor([-depth - 15., -depth], dtype=dtype)
    return q, k, v


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['float64', 'float32'])
def test_features_past_the_probability_range_take_the_log_form(kernels, dtype):
    """Head 0 falls back to the log form (its features are divided by their largest key, so
    each feature's maximum is 1), head 1 keeps the probability form (unshifted features)
    with its deep row's second half taken by exponentials; the result is the PyTorch
    form's, output and every gradient."""
    q, k, v = extreme_heads(dtype)
    identity = torch.eye(4, dtype=dtype).expand(2, 4, 4).contiguous()
    _, prob_k, phi, *_ = kernels.hedgehog_forward(q, k, v, identity, identity, True)
    assert torch.equal(phi[:, 0].amax(dim=-2), torch.ones(1, 8, dtype=dtype))
    assert torch.equal(phi[:, 1], prob_k[:, 1])
    module = make(dtype, embed_dims=8, num_heads=2)
    with torch.no_grad():
        module.feature_proj.copy_(identity)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
    results = []
    for on in (True, False):
        heads = [t.clone().requires_grad_() for t in (q, k, v)]
        module.zero_grad(set_to_none=True)
        with set_cpu_kernels(on):
            out = module._linear(*heads)
            out.backward(upstream)
        results.append([out.detach(), *(t.grad for t in heads), module.feature_proj.grad])
    tolerance = 1e-4 if dtype == torch.float32 else 1e-10
    for name, fast, reference in zip(['out', 'q', 'k', 'v', 'map'], *results):
        assert torch.isfinite(fast).all(), name
        assert_rel_close(fast, reference, tolerance, name)


@pytest.mark.parametrize('softmax_map', [True, False], ids=['softmax', 'exp'])
def test_fused_step_gradcheck(kernels, softmax_map):
    """The hand-written backward against finite differences of the C++ forward, every input
    (untied maps, so each map's gradient is checked on its own)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, std=1.):
        return (std * torch.randn(*shape, generator=generator,
                                  dtype=torch.float64)).requires_grad_()

    heads, N, d = 2, 5, 3
    # heads as a permuted view of one tensor, as the qkv split passes them
    qkv = randn(2, N, 3, heads, d).permute(2, 0, 3, 1, 4)
    inputs = (*qkv.unbind(0), randn(heads, d, d, std=.7), randn(heads, d, d, std=.7))

    def attention(q, k, v, map_q, map_k):
        return hedgehog_attention(q, k, v, map_q, map_k, softmax_map)

    assert torch.autograd.gradcheck(attention, inputs)


def test_inference_makes_no_autograd_node(kernels, graph_names):
    module = make(torch.float64)
    x = torch.randn(1, 17, 24, dtype=torch.float64)
    with torch.no_grad():
        inferred = module(x, (4, 4))
    out = module(x, (4, 4))
    assert '_HedgehogAttentionBackward' in graph_names(out.grad_fn)
    assert_rel_close(inferred, out.detach(), 1e-15)


@pytest.mark.parametrize('what,expected', [('default', True), ('kernels off', False),
                                           ('bf16 autocast', False)])
def test_the_fused_form_runs_exactly_where_it_applies(kernels, what, expected, graph_names):
    module = make(torch.float32)
    x = torch.randn(1, 17, 24)
    with set_cpu_kernels(what != 'kernels off'), torch.autocast(
            'cpu', torch.bfloat16, enabled=what == 'bf16 autocast'):
        out = module(x, (4, 4))
    assert ('_HedgehogAttentionBackward' in graph_names(out.grad_fn)) is expected


def test_heads_of_another_dtype_than_the_maps_take_the_pytorch_form(kernels, graph_names):
    """float64 heads with float32 maps: the PyTorch form casts the maps, the kernels would
    refuse the mix, so it is not given to them."""
    module = make(torch.float32)
    q, k, v = torch.randn(3, 1, 3, 17, 8, dtype=torch.float64).unbind(0)
    out = module._linear(q, k, v)
    assert out.dtype == torch.float64
    assert '_HedgehogAttentionBackward' not in graph_names(out.grad_fn)


def test_kernel_refuses_what_it_cannot_hold(kernels):
    q, k, v = torch.randn(3, 1, 2, 5, 4, dtype=torch.float64).unbind(0)
    maps = torch.randn(2, 4, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match='the maps must be'):
        kernels.hedgehog_forward(q, k, v, maps[:1], maps, True)
    with pytest.raises(RuntimeError, match='dtypes differ'):
        kernels.hedgehog_forward(q, k, v.float(), maps, maps, True)
    with pytest.raises(RuntimeError, match='k must be shaped like q'):
        kernels.hedgehog_forward(q, k[:, :, :4], v, maps, maps, True)
