"""ViT^3 test-time-training attention: the fast form (closed-form inner step) and the position
encoding against their oracles written from the definitions (which
share no helper with them), the oracles' own convolution against ``F.conv2d``, the qkv layout,
the class token's place in each inner model, memory and precision."""
import pytest
import torch
import torch.nn.functional as F

from linvit_mm import ops
from linvit_mm.models.attention import TTTAttention, attention_class, build_attention, ttt
from linvit_mm.models.attention.ttt import naive_depthwise3x3
from linvit_mm.ops import depthwise, ttt_step
from linvit_mm.testing import assert_rel_close, rel_error

ODD_GRIDS = [(7, 9), (5, 3)]
EXTRA = dict(argnames='num_extra', argvalues=[0, 1], ids=['no_cls', 'cls'])
# the RoPE configurations of test_operator_rope.py
ROPES = {'no_rope': None, 'eva': dict(type='eva', ref_grid=(4, 4)), 'dinov3': dict(type='dinov3')}
EMBED_DIMS, NUM_HEADS = 24, 3
HEAD_DIMS = EMBED_DIMS // NUM_HEADS
ATTENTION_PARAMETERS = {'qkv.weight', 'qkv.bias', 'w1', 'w2', 'w3', 'proj.weight', 'proj.bias'}
POSITION_PARAMETERS = {'cpe.weight', 'cpe.bias'}


@pytest.fixture
def make_ttt(make_attention):
    """``make_attention('ttt', ...)`` with every parameter drawn from N(0, ``spread``^2), wide
    enough that the SiLU gate is nonlinear and the inner gradients' norms are of order 1,
    where the norm clip ``g / (||g|| + 1)`` is far from linear (the default init is tiny)."""

    def make(spread=0.3, **kwargs):
        module = make_attention('ttt', **kwargs)
        if spread:
            with torch.no_grad():
                for param in module.parameters():
                    param.normal_(0., spread)
        return module

    return make


# ------------------------------------------------------------------ against the oracles
@pytest.mark.parametrize('hw', ODD_GRIDS)
@pytest.mark.parametrize(**EXTRA)
@pytest.mark.parametrize('rope', ROPES)
def test_fast_form_matches_reference(device, rope, num_extra, hw, tokens,
                                     assert_matches_reference, make_ttt):
    """Output and the gradients of the input and of every parameter, in float64, on both
    kernel paths of the inner step."""
    module = make_ttt(device=device, rope=ROPES[rope])
    grads = assert_matches_reference(module, tokens(hw, num_extra, device=device), hw, 1e-9)
    # cpe belongs to the block (encode_position), not to the attention forward
    used = {name: grad for name, grad in grads.items() if grad is not None}
    assert set(used) == {'x'} | ATTENTION_PARAMETERS
    for name, grad in used.items():
        assert grad.abs().sum() > 0, f'{name} gets no gradient'


@pytest.mark.parametrize('hw', ODD_GRIDS)
@pytest.mark.parametrize(**EXTRA)
def test_position_encoding_matches_reference(device, num_extra, hw, tokens,
                                             output_and_grads, make_ttt):
    """``encode_position`` (run by the block before ``ln1``, outside ``forward``) against
    ``encode_position_reference``: output and the gradients of the input, kernel and bias."""
    module = make_ttt(device=device)
    x = tokens(hw, num_extra, device=device)
    out, grads = output_and_grads(module, lambda t: module.encode_position(t, hw), x)
    ref, ref_grads = output_and_grads(module, lambda t: module.encode_position_reference(t, hw),
                                      x)
    assert_rel_close(out, ref, 1e-12, 'output')
    used = {name for name, grad in grads.items() if grad is not None}
    assert used == {name for name, grad in ref_grads.items() if grad is not None}
    assert used == {'x'} | POSITION_PARAMETERS
    for name in used:
        assert_rel_close(grads[name], ref_grads[name], 1e-12, f'grad of {name}')


# Everything the fast forms are computed with, apart from qkv, proj and the RoPE tables.
FAST_HELPERS = [(ttt, 'ttt_inner_step'), (ttt, 'position_code'), (ttt, '_inner_precision'),
                (ops, 'ttt_inner_step'), (ops, 'position_code'), (F, 'conv2d')] + [
    (TTTAttention, name) for name in ('forward', 'encode_position', '_rotate_qk', '_inner')] + [
    (depthwise, name) for name in ('kernel_taps', 'depthwise3x3_reference', 'position_code',
                                   'depthwise3x3_tokens', 'correlate3x3_reference',
                                   'depthwise3x3_by_taps', 'correlate3x3_by_taps')] + [
    (ttt_step, name) for name in ('ttt_inner_step', '_forward', '_backward', '_step',
                                  '_heads', '_conv', '_inner_terms')]


@pytest.mark.parametrize('rope', ['eva', 'dinov3'])
def test_references_share_no_helper_with_the_fast_forms(rope, tokens, output_and_grads,
                                                        fast_helpers_broken, make_ttt):
    module = make_ttt(rope=ROPES[rope])
    hw = (5, 3)
    x = tokens(hw, 1)
    forms = {'forward': module.forward_reference, 'encode_position':
             module.encode_position_reference}
    expected = {name: output_and_grads(module, lambda t: form(t, hw), x)
                for name, form in forms.items()}
    with fast_helpers_broken(*FAST_HELPERS):
        for fast in (module, module.encode_position):
            with pytest.raises(AssertionError, match='an oracle called a helper'):
                fast(x, hw)
        for name, form in forms.items():
            out, grads = output_and_grads(module, lambda t: form(t, hw), x)
            assert torch.equal(out, expected[name][0]), f'{name}: output'
            for param, grad in grads.items():
                assert (grad is None) == (expected[name][1][param] is None), param
                assert grad is None or torch.equal(grad, expected[name][1][param]), param


@pytest.mark.parametrize('hw', ODD_GRIDS + [(1, 1), (1, 4)])
def test_oracle_convolution_is_conv2d(hw):
    """The oracles' per-pixel 3x3 depthwise sum is ``F.conv2d``'s zero-padded convolution
    (a cross-correlation: a kernel whose only tap is row 0, column 2 reads the pixel one up
    and one right)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, hw[0] * hw[1], 5, generator=generator, dtype=torch.float64)
    kernel = torch.randn(5, 3, 3, generator=generator, dtype=torch.float64)
    image = x.transpose(1, 2).reshape(2, 5, *hw)
    expected = F.conv2d(image, kernel[:, None], padding=1, groups=5).flatten(2).transpose(1, 2)
    assert_rel_close(naive_depthwise3x3(x, kernel, hw), expected, 1e-14, 'convolution')
    corner = torch.zeros(5, 3, 3, dtype=torch.float64)
    corner[:, 0, 2] = 1
    shifted = F.pad(image, (0, 1, 1, 0))[:, :, :hw[0], 1:]     # x[i - 1, j + 1], zero outside
    assert torch.equal(naive_depthwise3x3(x, corner, hw), shifted.flatten(2).transpose(1, 2))


def test_float32_forms_compute_in_float32(tokens, make_ttt,
                                          assert_float32_forms_compute_in_float32):
    module = make_ttt(dtype=torch.float32, rope=ROPES['eva'])
    hw = (5, 3)
    assert_float32_forms_compute_in_float32(module, tokens(hw, 1, dtype=torch.float32), hw,
                                            module.forward_reference)


def test_reference_runs_under_bf16_autocast(tokens, make_ttt):
    module = make_ttt(dtype=torch.float32, rope=ROPES['eva'])
    hw = (5, 3)
    x = tokens(hw, 1, dtype=torch.float32)
    with torch.no_grad():
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = module.forward_reference(x, hw)
        exact = module.double().forward_reference(x.double(), hw)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, exact) < 2e-2


# ------------------------------------------------------------------ the operator itself
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
def test_inner_models_are_fitted_per_image(num_extra, tokens, make_ttt):
    module = make_ttt()
    hw = (7, 9)
    x = tokens(hw, num_extra)
    changed = x.clone()
    changed[1] = tokens(hw, num_extra, batch=1, seed=5)[0]
    with torch.no_grad():
        out, out_changed = module(x, hw), module(changed, hw)
        alone = module(x[:1], hw)
        ref = module.forward_reference(changed, hw)
    assert_rel_close(out_changed[0], out[0], 1e-13, 'image 0 after changing image 1')
    assert_rel_close(alone[0], out[0], 1e-13, 'image 0 alone vs. in a batch')
    assert rel_error(out_changed[1], out[1]) > 1e-2
    # the oracle also runs under no_grad (it opens its own graph for the inner step)
    assert not ref.requires_grad
    assert_rel_close(out_changed, ref, 1e-9, 'reference under no_grad')


def test_parameter_shapes_and_flags(make_ttt):
    C, d = EMBED_DIMS, HEAD_DIMS
    module = make_ttt(spread=0)
    assert attention_class('ttt') is TTTAttention
    assert module.qkv.weight.shape == (3 * C + 3 * d, C)
    assert module.qkv.bias.shape == (3 * C + 3 * d, )
    assert module.proj.weight.shape == (C, C + d)
    assert module.w1.shape == module.w2.shape == (1, NUM_HEADS, d, d)
    assert module.w3.shape == (d, 1, 3, 3)
    assert module.cpe.weight.shape == (C, 1, 3, 3) and module.cpe.bias.shape == (C, )
    assert not module.uses_cls_token and not module.has_map
    assert make_ttt(spread=0, qkv_bias=False).qkv.bias is None
    # the inner models start near zero (truncated normal, std 0.02)
    for init in (module.w1, module.w2, module.w3):
        assert 0.01 < init.std().item() < 0.03


def explicit_readouts(module, image, hw):
    """The proj input of ONE image, read off named row slices of ``qkv`` (patch tokens only)."""
    C, d = module.embed_dims, module.head_dims
    weight, bias = module.qkv.weight, module.qkv.bias
    N, scale = image.shape[0], module.inner_scale

    def rows(start):
        return image @ weight[start:start + d].T + bias[start:start + d]

    def swiglu(t, w1, w2):
        return (t @ w1) * F.silu(t @ w2)

    columns = []
    for head in range(module.num_heads):
        q, k, v = (rows(part * C + head * d) for part in range(3))
        w1 = module.w1[0, head].detach().clone().requires_grad_()
        w2 = module.w2[0, head].detach().clone().requires_grad_()
        loss = -scale / N * (swiglu(k, w1, w2) * v).sum()
        g1, g2 = torch.autograd.grad(loss, (w1, w2))
        w1 = w1 - g1 / (g1.norm(dim=0) + 1)
        w2 = w2 - g2 / (g2.norm(dim=0) + 1)
        columns.append(swiglu(q, w1, w2))
    # conv head: its q, k, v are rows 3C + [0, d), [d, 2d), [2d, 3d)
    q, k, v = (rows(3 * C + part * d).T.reshape(1, d, *hw) for part in range(3))
    w3 = module.w3.detach().clone().requires_grad_()
    loss = -scale / N * (F.conv2d(k, w3, padding=1, groups=d) * v).sum()
    (g3, ) = torch.autograd.grad(loss, (w3, ))
    w3 = w3 - g3 / (g3.norm(dim=(-2, -1), keepdim=True) + 1)
    columns.append(F.conv2d(q, w3, padding=1, groups=d).reshape(d, N).T)
    return torch.cat(columns, dim=-1)


def test_qkv_rows_follow_the_standard_layout(tokens, make_ttt):
    """First C rows are q of heads 0, 1, ... (then k, then v), so Softmax qkv copies in."""
    module = make_ttt()
    hw = (5, 3)
    x = tokens(hw, 0)
    captured = []
    module.proj.register_forward_pre_hook(lambda mod, args: captured.append(args[0]))
    with torch.no_grad():
        module(x, hw)
    for image in range(x.shape[0]):
        expected = explicit_readouts(module, x[image], hw)
        assert_rel_close(captured[0][image], expected, 1e-12, f'proj input of image {image}')


def test_class_token_reads_the_centre_tap_and_joins_the_swiglu_fit(tokens, make_ttt):
    module = make_ttt()
    hw = (7, 9)
    x = tokens(hw, 1)
    C, d = EMBED_DIMS, HEAD_DIMS
    captured = []
    module.proj.register_forward_pre_hook(lambda mod, args: captured.append(args[0]))
    with torch.no_grad():
        with_cls = module(x, hw)
        patches_only = module(x[:, 1:], hw)
    # the conv kernel is fitted on patches only: patch conv channels ignore the class token
    assert_rel_close(captured[0][:, 1:, C:], captured[1][:, :, C:], 1e-13, 'patch conv channels')
    # the SwiGLU fit includes the class token, so patch outputs do change
    assert rel_error(with_cls[:, 1:], patches_only) > 1e-3
    # class token conv channels: its own conv-head query times a centre tap fitted on the
    # patches, so replacing the class token leaves that ratio unchanged
    other_cls = x.clone()
    other_cls[:, :1] = tokens((1, 1), 0, seed=9)
    with torch.no_grad():
        module(other_cls, hw)

    def centre_taps(inputs, proj_input):
        q_conv = module.qkv(inputs[:, :1])[..., 3 * C:3 * C + d]
        return proj_input[:, :1, C:] / q_conv

    taps = centre_taps(x, captured[0])
    assert_rel_close(centre_taps(other_cls, captured[2]), taps, 1e-12, 'centre taps')
    assert rel_error(captured[2][:, :1, C:], captured[0][:, :1, C:]) > 1e-2


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
def test_position_encoding_is_a_residual_depthwise_conv(num_extra, tokens, make_ttt):
    module = make_ttt()
    hw = (7, 9)
    x = tokens(hw, num_extra)
    B, N, C = x.shape
    with torch.no_grad():
        encoded = module.encode_position(x, hw)
        grid = x[:, num_extra:].transpose(1, 2).reshape(B, C, *hw)
        # the module's own conv, as a converted ViT^3 checkpoint's cpe runs it
        conv = module.cpe(grid)
        assert_rel_close(encoded[:, num_extra:], x[:, num_extra:] + conv.flatten(2).transpose(1, 2),
                         1e-13, 'patch tokens')
        # an extra token is a 1 x 1 image of its own
        alone = x[:, :num_extra].transpose(1, 2).reshape(B * num_extra, C, 1, 1)
        conv = module.cpe(alone)
        assert_rel_close(encoded[:, :num_extra], x[:, :num_extra] + conv.reshape(B, num_extra, C),
                         1e-13, 'extra tokens')


@pytest.mark.parametrize('num_extra', [0, 1, 2])
def test_core_macs_by_hand(num_extra, make_ttt):
    """C 24, 3 heads of 8, a 5 x 3 grid: qkv-side products 6 N C d, the two head-wise
    d x d products, 18 per patch and channel for the conv branch, the centre tap of each
    extra token, the kernel norms."""
    module = make_ttt(spread=0)
    N = 15 + num_extra
    expected = 6 * N * 24 * 8 + 2 * 3 * 8 * 8 + 18 * 15 * 8 + num_extra * 8 + 9 * 8
    assert module.core_macs(N, (5, 3)) == expected


def test_memory_is_linear_in_tokens(tokens, recorded_ops, make_ttt):
    module = make_ttt(dtype=torch.float32, embed_dims=16, num_heads=2)
    largest = {}
    for side in (16, 32):
        x = tokens((side, side), 1, batch=1, dims=16, dtype=torch.float32)
        ops = recorded_ops(lambda: module(x, (side, side)).sum().backward())
        largest[side] = max(numel for _, _, numel in ops)
        n = x.shape[1]
        assert largest[side] < n * n / 2, f'an intermediate of {largest[side]} elements at N={n}'
    # 4x the tokens -> about 4x the largest intermediate (16x if anything were N x N)
    assert largest[32] / largest[16] < 4.5


def test_bf16_autocast_at_16k_tokens_keeps_the_inner_step_in_float32(tokens, recorded_ops,
                                                                     make_ttt):
    hw = (128, 128)  # 16384 tokens
    module = make_ttt(dtype=torch.float32, spread=0, embed_dims=32, num_heads=2)
    x = tokens(hw, 1, batch=1, dims=32, dtype=torch.float32)
    outputs = []
    with torch.no_grad():
        expected = module(x, hw)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            ops = recorded_ops(lambda: outputs.append(module(x, hw)))
    out, = outputs
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_error(out, expected) < 2e-2
    # the linears follow autocast; every token sum of the inner step stays float32 (the
    # step is one linvit_mm operator, whose products a dispatch mode does not see)
    assert any(name == 'addmm' and dtype == torch.bfloat16 for name, dtype, _ in ops)
    inner_sums = [(name, dtype) for name, dtype, _ in ops
                  if name in ('bmm', 'im2col', 'convolution', 'ttt_inner_forward')]
    assert inner_sums and all(dtype == torch.float32 for _, dtype in inner_sums), inner_sums


def test_invalid_arguments(tokens, make_ttt):
    with pytest.raises(ValueError, match='attn_drop'):
        build_attention('ttt', embed_dims=EMBED_DIMS, num_heads=NUM_HEADS, attn_drop=0.1)
    with pytest.raises(ValueError, match='divisible'):
        build_attention('ttt', embed_dims=25, num_heads=NUM_HEADS)
    for scale in (-1., 0.):
        with pytest.raises(ValueError, match='inner_scale must be positive'):
            build_attention('ttt', embed_dims=EMBED_DIMS, num_heads=NUM_HEADS, inner_scale=scale)
    module = make_ttt(spread=0)
    with pytest.raises(ValueError, match='tokens cannot hold'):
        module(tokens((7, 9), 0), (8, 9))
    with pytest.raises(TypeError, match='no attention map'):
        module.attention_map(tokens((5, 3), 0), (5, 3))


def test_documented_defaults(assert_common_defaults):
    """The inner models' step scale defaults to 1/sqrt(9) (the conv inner model's 3x3 kernel
    as its head dim), and the operator declares it has no q_i^T k_j form to initialise."""
    assert_common_defaults('ttt', inner_scale=9**-0.5, has_qk_form=False, has_map=False,
                           uses_cls_token=False)
