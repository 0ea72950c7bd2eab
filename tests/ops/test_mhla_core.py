"""MHLA's fused C++ form (``ops/mhla_core.py``): a gradcheck of its own, the operator with
it against the operator's PyTorch form (outputs and every gradient), when it is taken and
when not, and the kernel's input checks."""
import pytest
import torch

from linvit_mm.models.attention import MultiHeadLinearAttention
from linvit_mm.models.attention.mhla import OFFICIAL_IMAGENET
from linvit_mm.models.attention.mhla.blocks import BlockLayout
from linvit_mm.ops import set_cpu_kernels
from linvit_mm.ops.mhla_core import mhla_attention
from linvit_mm.testing import assert_rel_close

# divisible by the layout; odd sides (blocks overhang the grid); smaller than the layout
# (empty blocks); 4 x 4 blocks with the authors' norms; plain relu; a fixed block size
# larger than needed with a 3 x 3 value convolution
CASES = {
    '14x14': ((14, 14), {}),
    '7x9-padded': ((7, 9), {}),
    '1x1-empty-blocks': ((1, 1), {}),
    '16x16-4x4-blocks-norms': ((16, 16), dict(num_blocks=(4, 4), qk_norm=True, attn_norm=True)),
    '5x3-no-floor': ((5, 3), dict(feature_floor=0.)),
    '9x7-fixed-blocks-3x3-conv': ((9, 7), dict(num_blocks=(3, 2), block_size=(4, 4),
                                               value_kernel_size=3)),
    # the authors' normaliser: on a divisible grid, with overhanging blocks, with their
    # ImageNet module's switches, and on a grid smaller than the layout
    '14x14-official': ((14, 14), dict(normaliser='official')),
    '7x9-padded-official': ((7, 9), dict(normaliser='official')),
    '16x16-authors-module': ((16, 16), dict(OFFICIAL_IMAGENET)),
    '1x1-empty-blocks-official': ((1, 1), dict(normaliser='official')),
}


def make(dtype, embed_dims=24, num_heads=3, seed=0, **kwargs):
    """An MHLA module with a dense, asymmetric mixing matrix and a non-zero conv bias, so a
    transposed mixing or a dropped bias cannot hide."""
    torch.manual_seed(seed)
    module = MultiHeadLinearAttention(embed_dims, num_heads, **kwargs).to(dtype)
    with torch.no_grad():
        module.block_mixing.uniform_(.1, 1.)
        module.value_conv.bias.uniform_(-1., 1.)
    return module




@pytest.mark.parametrize('case', CASES)
def test_cpp_form_matches_the_pytorch_form_in_float64(kernels, case, outputs_and_gradients,
                                                      graph_names):
    hw, kwargs = CASES[case]
    module = make(torch.float64, **kwargs)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, hw[0] * hw[1], 24, generator=generator, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    fast, fast_graph = outputs_and_gradients(module, x, hw, upstream, kernels=True)
    reference, reference_graph = outputs_and_gradients(module, x, hw, upstream, kernels=False)
    assert '_MHLAAttentionBackward' in graph_names(fast_graph)
    assert '_MHLAAttentionBackward' not in graph_names(reference_graph)
    assert fast.keys() == reference.keys()
    for name in fast:
        # 1e-9, not 1e-15: on a 1 x 1 grid the mixing weight cancels between numerator and
        # normaliser up to eps, so its gradient is a difference of nearly equal terms
        assert_rel_close(fast[name], reference[name], 1e-9, name)


@pytest.mark.parametrize('normaliser', ['consistent', 'official'])
def test_cpp_form_matches_the_pytorch_form_in_float32_at_vit_s_width(kernels, normaliser,
                                                                    outputs_and_gradients):
    """Heads of 64 channels (the vectorised loops' full width), batch 2, 224 px grid."""
    module = make(torch.float32, embed_dims=384, num_heads=6, normaliser=normaliser)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 196, 384, generator=generator)
    upstream = torch.randn(x.shape, generator=generator)
    fast, _ = outputs_and_gradients(module, x, (14, 14), upstream, kernels=True)
    reference, _ = outputs_and_gradients(module, x, (14, 14), upstream, kernels=False)
    for name in fast:
        assert_rel_close(fast[name], reference[name], 1e-4, name)


def fused_inputs(hw, layout, heads=2, d=3, batch=2, kernel=5, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    C, N = heads * d, hw[0] * hw[1]
    # queries and keys as a column slice of a wider tensor, as the qkv split passes them
    qk = randn(batch, N, 3 * C)[..., :2 * C]
    mixing = (torch.rand(layout.num_blocks, layout.num_blocks, generator=generator,
                         dtype=torch.float64) + .1).requires_grad_()
    return qk, randn(batch, N, C), mixing, randn(C, 1, kernel, kernel), randn(C)


@pytest.mark.parametrize('official', [False, True], ids=['consistent', 'official'])
@pytest.mark.parametrize('hw,layout', [((4, 5), BlockLayout(2, 2, 2, 3)),
                                       ((3, 3), BlockLayout(2, 1, 2, 3))],
                         ids=['4x5-padded', '3x3-two-blocks'])
def test_fused_step_gradcheck(kernels, hw, layout, official):
    """The hand-written backward against finite differences of the C++ forward, every input."""
    qk, v, mixing, weight, bias = fused_inputs(hw, layout)

    def attention(qk, v, mixing, weight, bias):
        return mhla_attention(qk, v, mixing, weight, bias, 2, hw, layout, 1e-6, 1e-6, official)

    assert torch.autograd.gradcheck(attention, (qk, v, mixing, weight, bias))


def test_inference_makes_no_autograd_node(kernels, graph_names):
    module = make(torch.float64)
    x = torch.randn(1, 49, 24, dtype=torch.float64)
    with torch.no_grad():
        inferred = module(x, (7, 7))
    out = module(x, (7, 7))
    assert '_MHLAAttentionBackward' in graph_names(out.grad_fn)
    assert_rel_close(inferred, out.detach(), 1e-15)


@pytest.mark.parametrize('what,expected', [
    ('default', True),
    ('official normaliser', True),
    ('rope', False),
    ('class token', False),
    ('kernels off', False),
    ('bf16 autocast', False),
])
def test_the_fused_form_runs_exactly_where_it_applies(kernels, what, expected, graph_names):
    kwargs = {'official normaliser': dict(normaliser='official'),
              'rope': dict(rope=dict(type='dinov3'))}.get(what, {})
    module = make(torch.float32, **kwargs)
    x = torch.randn(1, 16 + (what == 'class token'), 24)
    with set_cpu_kernels(what != 'kernels off'), torch.autocast(
            'cpu', torch.bfloat16, enabled=what == 'bf16 autocast'):
        out = module(x, (4, 4))
    assert ('_MHLAAttentionBackward' in graph_names(out.grad_fn)) is expected


def test_kernel_refuses_what_it_cannot_hold(kernels):
    layout = BlockLayout(2, 2, 2, 2)
    qk, v, mixing, weight, bias = (t.detach() for t in fused_inputs((4, 4), layout))
    with pytest.raises(RuntimeError, match='mixing must be'):
        kernels.mhla_forward(qk, v, mixing[:1], weight, bias, 2, 4, 4, *layout, 0., 1e-6, False)
    with pytest.raises(RuntimeError, match='do not cover the grid'):
        kernels.mhla_forward(qk, v, mixing, weight, bias, 2, 4, 5, *layout, 0., 1e-6, False)
    with pytest.raises(RuntimeError, match='dtypes differ'):
        kernels.mhla_forward(qk, v.float(), mixing, weight, bias, 2, 4, 4, *layout, 0., 1e-6,
                             False)
    with pytest.raises(RuntimeError, match='qk must be'):
        kernels.mhla_forward(qk[:, :15], v, mixing, weight, bias, 2, 4, 4, *layout, 0., 1e-6,
                             False)
