"""Depthwise convolutions (``ops/depthwise.py``): the C++ 3x3 kernels against ``F.conv2d``,
their PyTorch operators and decompositions, the position code, and MHLA's value convolution
with a backward built from forward convolutions."""
import pytest
import torch
import torch.nn.functional as F

from linvit_mm.ops import (correlate3x3_reference, depthwise3x3_reference, depthwise_conv2d,
                           position_code, torch_forms)
from linvit_mm.ops.depthwise import (correlate3x3, correlate3x3_by_taps, depthwise3x3,
                                     depthwise3x3_by_taps, depthwise3x3_tokens)
from linvit_mm.testing import assert_rel_close

GRIDS = [(7, 5), (1, 1), (14, 14)]


def token_slice(batch, hw, channels, dtype, seed=0, device='cpu'):
    """``(B, H*W, C)`` tokens that are a column slice of a wider tensor (as in a fused qkv)."""
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(batch, hw[0] * hw[1], 3 * channels, generator=generator, dtype=dtype)
    return wide.to(device)[..., channels:2 * channels]


def channels_last_image(batch, channels, hw, dtype, seed=0, device='cpu'):
    """A ``(B, C, H, W)`` channels-last view of a column slice of tokens, as MHLA passes its
    values (a leaf)."""
    values = token_slice(batch, hw, channels, dtype, seed, device)
    return values.reshape(batch, *hw, channels).permute(0, 3, 1, 2).requires_grad_()


# ---------------------------------------------------------------- 3x3 kernels on token grids

@pytest.mark.parametrize('hw', GRIDS)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['f64', 'f32'])
@pytest.mark.parametrize('shared', [True, False], ids=['shared_kernel', 'per_image_kernel'])
@pytest.mark.parametrize('flip', [False, True], ids=['conv', 'transposed'])
def test_depthwise_conv_matches_conv2d(kernels, hw, dtype, shared, flip):
    B, C = 3, 20  # C is not a multiple of the vector width
    x = token_slice(B, hw, C, dtype)
    weight = torch.randn(1 if shared else B, 9, C, dtype=dtype)
    expected = depthwise3x3_reference(x, weight.flip(1) if flip else weight, hw)
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    assert_rel_close(kernels.depthwise3x3(x, weight, None, False, *hw, flip), expected, tol)
    bias = torch.randn(C, dtype=dtype)
    assert_rel_close(kernels.depthwise3x3(x, weight, bias, True, *hw, flip), x + expected + bias,
                     tol, 'with residual and bias')


@pytest.mark.parametrize('hw', GRIDS)
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['f64', 'f32'])
def test_tap_correlation_matches_conv2d(kernels, hw, dtype):
    B, C = 2, 70  # one full block of 64 channels and a remainder
    a, g = token_slice(B, hw, C, dtype, seed=0), token_slice(B, hw, C, dtype, seed=1)
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    assert_rel_close(kernels.correlate3x3(a, g, *hw), correlate3x3_reference(a, g, hw), tol)


def test_kernels_reject_mismatched_inputs(kernels):
    x = torch.randn(1, 12, 8)
    with pytest.raises(RuntimeError, match='tokens, the grid 3x3 needs 9'):
        kernels.depthwise3x3(x, torch.randn(1, 9, 8), None, False, 3, 3, False)
    with pytest.raises(RuntimeError, match=r'weight must be \(B or 1, 9, C=8\)'):
        kernels.depthwise3x3(x, torch.randn(1, 9, 7), None, False, 3, 4, False)
    with pytest.raises(RuntimeError, match='shapes differ'):
        kernels.correlate3x3(x, torch.randn(1, 12, 7), 3, 4)


# ---------------------------------------------------------------- as PyTorch operators

@pytest.mark.parametrize('shared', [True, False], ids=['shared_kernel', 'per_image_kernel'])
@pytest.mark.parametrize('flip', [False, True], ids=['conv', 'transposed'])
def test_operators_pass_opcheck(kernel_path, shared, flip):
    """Schema, shape function (fake tensors), autograd registration and tracing, with the
    kernels and with the PyTorch forms."""
    B, C, hw = 2, 5, (3, 4)
    options = dict(dtype=torch.float64, requires_grad=True)
    x = token_slice(B, hw, C, torch.float64).requires_grad_()
    taps = torch.randn(1 if shared else B, 9, C, **options)
    for bias, residual in ((torch.randn(C, **options), True), (None, False)):
        torch.library.opcheck(depthwise3x3, (x, taps, bias, residual, *hw, flip))
    torch.library.opcheck(correlate3x3, (x.detach(), x.detach(), *hw))


@pytest.mark.parametrize('hw', GRIDS)
@pytest.mark.parametrize('shared', [True, False], ids=['shared_kernel', 'per_image_kernel'])
def test_tap_by_tap_forms_match_conv2d(hw, shared):
    """The decompositions' forms (nine shifted products, no batch-sized group count)."""
    B, C = 3, 4
    x, g = token_slice(B, hw, C, torch.float64), token_slice(B, hw, C, torch.float64, seed=1)
    weight = torch.randn(1 if shared else B, 9, C, dtype=torch.float64)
    assert_rel_close(depthwise3x3_by_taps(x, weight, hw), depthwise3x3_reference(x, weight, hw),
                     1e-14)
    assert_rel_close(correlate3x3_by_taps(x, g, hw), correlate3x3_reference(x, g, hw), 1e-14)


def test_torch_forms_decompose_the_operators():
    """``torch_forms()`` turns a program calling the operators into PyTorch operators that
    compute the same."""
    hw = (3, 4)
    x = token_slice(2, hw, 5, torch.float32)
    taps, bias = torch.randn(1, 9, 5), torch.randn(5)

    class Conv(torch.nn.Module):

        def forward(self, tokens):
            return depthwise3x3(tokens, taps, bias, True, *hw, False) \
                + correlate3x3(tokens, tokens, *hw).sum(1, keepdim=True)

    program = torch.export.export(Conv(), (x, ))
    targets = {str(node.target) for node in program.graph.nodes}
    assert {'linvit_mm.depthwise3x3.default', 'linvit_mm.correlate3x3.default'} <= targets
    decomposed = program.run_decompositions(torch_forms())
    assert not [t for t in map(str, (n.target for n in decomposed.graph.nodes))
                if t.startswith('linvit_mm.')]
    assert_rel_close(decomposed.module()(x), Conv()(x), 1e-6)


# ---------------------------------------------------------------- position code

@pytest.mark.parametrize('hw', [(5, 7), (1, 1)])
def test_position_code_gradients(device, kernel_path, hw):
    C = 6
    options = dict(dtype=torch.float64, device=device, requires_grad=True)
    x = torch.randn(2, hw[0] * hw[1], C, **options)
    weight = torch.randn(C, 1, 3, 3, **options)
    bias = torch.randn(C, **options)
    grid = x.transpose(1, 2).reshape(2, C, *hw)
    expected = x + F.conv2d(grid, weight, bias, padding=1, groups=C).flatten(2).transpose(1, 2)
    assert_rel_close(position_code(x, weight, bias, hw), expected, 1e-13)
    assert torch.autograd.gradcheck(lambda *t: position_code(*t, hw), (x, weight, bias))


@pytest.mark.parametrize('shared', [False, True], ids=['per-image', 'shared'])
def test_token_convolution_gradients(device, kernel_path, shared):
    """``depthwise3x3_tokens`` against ``F.conv2d`` and finite differences: tokens that are a
    column slice (as InLine's values are), taps per image or shared."""
    hw, C = (4, 3), 5
    x = token_slice(2, hw, C, torch.float64, device=device).requires_grad_()
    taps = torch.randn(1 if shared else 2, 9, C, dtype=torch.float64, device=device,
                       requires_grad=True)
    grid = x.transpose(1, 2).reshape(1, 2 * C, *hw)
    kernel = taps.expand(2, 9, C).transpose(1, 2).reshape(2 * C, 1, 3, 3)
    expected = F.conv2d(grid, kernel, padding=1, groups=2 * C).reshape(2, C, -1).transpose(1, 2)
    assert_rel_close(depthwise3x3_tokens(x, taps, hw), expected, 1e-13)
    assert torch.autograd.gradcheck(lambda *t: depthwise3x3_tokens(*t, hw), (x, taps))


def test_position_code_rejects_wrong_shapes():
    with pytest.raises(ValueError, match='grid 3x3'):
        position_code(torch.randn(1, 8, 4), torch.randn(4, 1, 3, 3), torch.randn(4), (3, 3))
    with pytest.raises(ValueError, match=r'weight must be \(4, 1, 3, 3\)'):
        position_code(torch.randn(1, 9, 4), torch.randn(4, 9), torch.randn(4), (3, 3))


# ---------------------------------------------------------------- any odd kernel, image layout

@pytest.mark.parametrize('batch,kernel,bias', [(1, 5, True), (2, 5, True), (3, 3, False)],
                         ids=['b1_k5', 'b2_k5', 'b3_k3_nobias'])
def test_depthwise_conv2d_gradients_match_autograd_of_conv2d(device, batch, kernel, bias):
    C, hw = 6, (7, 5)
    options = dict(dtype=torch.float64, device=device, requires_grad=True)
    image = channels_last_image(batch, C, hw, torch.float64, device=device)
    weight = torch.randn(C, 1, kernel, kernel, **options)
    bias_t = torch.randn(C, **options) if bias else None
    inputs = (image, weight) + ((bias_t, ) if bias else ())
    upstream = torch.randn(batch, C, *hw, dtype=torch.float64, device=device)

    out = depthwise_conv2d(image, weight, bias_t, kernel // 2)
    expected = F.conv2d(image, weight, bias_t, padding=kernel // 2, groups=C)
    assert_rel_close(out, expected, 1e-14, 'output')
    grads = torch.autograd.grad(out, inputs, upstream)
    expected_grads = torch.autograd.grad(expected, inputs, upstream)
    for name, grad, ref in zip(('image', 'weight', 'bias'), grads, expected_grads):
        assert grad.dtype == ref.dtype
        assert_rel_close(grad, ref, 1e-12, f'grad of {name}')


def test_depthwise_conv2d_second_order_gradients(device):
    C, hw = 3, (4, 5)
    options = dict(dtype=torch.float64, device=device, requires_grad=True)
    image = channels_last_image(2, C, hw, torch.float64, device=device)
    weight = torch.randn(C, 1, 5, 5, **options)
    bias = torch.randn(C, **options)
    assert torch.autograd.gradgradcheck(lambda i, w, b: depthwise_conv2d(i, w, b, 2),
                                        (image, weight, bias))


def test_depthwise_conv2d_bf16_autocast_backward_returns_parameter_dtypes(device):
    """Forward under autocast runs in bf16 with float32 parameters; the backward, outside
    autocast, must not mix dtypes and must hand float32 gradients to the parameters."""
    C, hw = 8, (6, 6)
    conv = torch.nn.Conv2d(C, C, 5, padding=2, groups=C).to(device)
    image = channels_last_image(1, C, hw, torch.float32, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = depthwise_conv2d(image, conv.weight, conv.bias, 2)
        expected = conv(image)
    assert out.dtype == expected.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().sum(), (image, conv.weight, conv.bias))
    expected_grads = torch.autograd.grad(expected.float().sum(), (image, conv.weight, conv.bias))
    for grad, ref in zip(grads, expected_grads):
        assert grad.dtype == ref.dtype == torch.float32
        assert_rel_close(grad, ref, 2e-2, 'bf16 gradient')
