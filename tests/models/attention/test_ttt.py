"""ViT^3 test-time-training attention: the closed-form inner step against autograd of its loss."""
import pytest
import torch
import torch.nn.functional as F

from linvit_mm.models.attention import TTTAttention, attention_class, build_attention
from linvit_mm.testing import assert_rel_close, rel_error

GRIDS = [(14, 14), (7, 9), (5, 3)]
EMBED_DIMS, NUM_HEADS = 24, 3
HEAD_DIMS = EMBED_DIMS // NUM_HEADS


def make(dtype=torch.float64, seed=0, spread=0.3, device='cpu', **kwargs):
    """A TTT operator whose parameters are spread wide enough that the SiLU gate is nonlinear
    and the normalised gradients' norms fall on both sides of 1 (the default init is tiny)."""
    torch.manual_seed(seed)
    kwargs.setdefault('embed_dims', EMBED_DIMS)
    kwargs.setdefault('num_heads', NUM_HEADS)
    module = build_attention('ttt', **kwargs).to(device=device, dtype=dtype)
    if spread:
        with torch.no_grad():
            for param in module.parameters():
                param.normal_(0., spread)
    return module


@pytest.mark.parametrize('hw', GRIDS)
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
def test_closed_form_step_matches_autograd_step(device, kernel_path, num_extra, hw, tokens,
                                                assert_matches_reference):
    module = make(device=device)
    grads = assert_matches_reference(module, tokens(hw, num_extra, device=device), hw, 1e-9)
    # cpe belongs to the block (encode_position), not to the attention forward
    used = {name: grad for name, grad in grads.items() if grad is not None}
    assert set(used) == {'x', 'qkv.weight', 'qkv.bias', 'w1', 'w2', 'w3', 'proj.weight',
                         'proj.bias'}
    for name, grad in used.items():
        assert grad.abs().sum() > 0, f'{name} gets no gradient'


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
def test_inner_models_are_fitted_per_image(num_extra, tokens):
    module = make()
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


def test_parameter_shapes_and_flags():
    C, d = EMBED_DIMS, HEAD_DIMS
    module = make(spread=0)
    assert attention_class('ttt') is TTTAttention
    assert module.qkv.weight.shape == (3 * C + 3 * d, C)
    assert module.qkv.bias.shape == (3 * C + 3 * d, )
    assert module.proj.weight.shape == (C, C + d)
    assert module.w1.shape == module.w2.shape == (1, NUM_HEADS, d, d)
    assert module.w3.shape == (d, 1, 3, 3)
    assert module.cpe.weight.shape == (C, 1, 3, 3) and module.cpe.bias.shape == (C, )
    assert not module.uses_cls_token and not module.has_map
    assert make(spread=0, qkv_bias=False).qkv.bias is None
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


def test_qkv_rows_follow_the_standard_layout(tokens):
    """First C rows are q of heads 0, 1, ... (then k, then v), so Softmax qkv copies in."""
    module = make()
    hw = (5, 3)
    x = tokens(hw, 0)
    captured = []
    module.proj.register_forward_pre_hook(lambda mod, args: captured.append(args[0]))
    with torch.no_grad():
        module(x, hw)
    for image in range(x.shape[0]):
        expected = explicit_readouts(module, x[image], hw)
        assert_rel_close(captured[0][image], expected, 1e-12, f'proj input of image {image}')


def test_class_token_reads_the_centre_tap_and_joins_the_swiglu_fit(tokens):
    module = make()
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
def test_position_encoding_is_a_residual_depthwise_conv(kernel_path, num_extra, tokens):
    module = make()
    hw = (7, 9)
    x = tokens(hw, num_extra)
    B, N, C = x.shape
    with torch.no_grad():
        encoded = module.encode_position(x, hw)
        grid = x[:, num_extra:].transpose(1, 2).reshape(B, C, *hw)
        conv = F.conv2d(grid, module.cpe.weight, module.cpe.bias, padding=1, groups=C)
        assert_rel_close(encoded[:, num_extra:], x[:, num_extra:] + conv.flatten(2).transpose(1, 2),
                         1e-13, 'patch tokens')
        # an extra token is a 1 x 1 image of its own
        alone = x[:, :num_extra].transpose(1, 2).reshape(B * num_extra, C, 1, 1)
        conv = F.conv2d(alone, module.cpe.weight, module.cpe.bias, padding=1, groups=C)
        assert_rel_close(encoded[:, :num_extra], x[:, :num_extra] + conv.reshape(B, num_extra, C),
                         1e-13, 'extra tokens')


def test_memory_is_linear_in_tokens(tokens, recorded_ops):
    module = make(dtype=torch.float32, embed_dims=16, num_heads=2)
    largest = {}
    for side in (16, 32):
        x = tokens((side, side), 1, batch=1, dims=16, dtype=torch.float32)
        ops = recorded_ops(lambda: module(x, (side, side)).sum().backward())
        largest[side] = max(numel for _, _, numel in ops)
        n = x.shape[1]
        assert largest[side] < n * n / 2, f'an intermediate of {largest[side]} elements at N={n}'
    # 4x the tokens -> about 4x the largest intermediate (16x if anything were N x N)
    assert largest[32] / largest[16] < 4.5


def test_bf16_autocast_at_16k_tokens_keeps_the_inner_step_in_float32(tokens, recorded_ops):
    hw = (128, 128)  # 16384 tokens
    module = make(dtype=torch.float32, spread=0, embed_dims=32, num_heads=2)
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


def test_invalid_arguments(tokens):
    with pytest.raises(ValueError, match='attn_drop'):
        build_attention('ttt', embed_dims=EMBED_DIMS, num_heads=NUM_HEADS, attn_drop=0.1)
    with pytest.raises(ValueError, match='divisible'):
        build_attention('ttt', embed_dims=25, num_heads=NUM_HEADS)
    with pytest.raises(ValueError, match='inner_scale must be positive'):
        build_attention('ttt', embed_dims=EMBED_DIMS, num_heads=NUM_HEADS, inner_scale=-1.)
    module = make(spread=0)
    with pytest.raises(ValueError, match='tokens cannot hold'):
        module(tokens((7, 9), 0), (8, 9))
    with pytest.raises(TypeError, match='no attention map'):
        module.attention_map(tokens((5, 3), 0), (5, 3))
