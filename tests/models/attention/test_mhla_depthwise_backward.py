"""MHLA's depthwise value convolution with a backward built from forward convolutions."""
import pytest
import torch
import torch.nn.functional as F

from linvit_mm.ops.depthwise import _DepthwiseConv2d
from linvit_mm.testing import assert_rel_close


def channels_last_image(batch, channels, hw, dtype, seed=0):
    """A ``(B, C, H, W)`` channels-last view of token-major data, as MHLA passes it."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(batch, hw[0] * hw[1], 3 * channels, generator=generator, dtype=dtype)
    return tokens[..., 2 * channels:].reshape(batch, *hw, channels).permute(0, 3, 1, 2)


@pytest.mark.parametrize('batch,kernel,bias', [(1, 5, True), (2, 5, True), (3, 3, False)],
                         ids=['b1_k5', 'b2_k5', 'b3_k3_nobias'])
def test_gradients_match_autograd_of_conv2d(batch, kernel, bias):
    C, hw = 6, (7, 5)
    image = channels_last_image(batch, C, hw, torch.float64).detach().requires_grad_()
    weight = torch.randn(C, 1, kernel, kernel, dtype=torch.float64, requires_grad=True)
    bias_t = torch.randn(C, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = (image, weight) + ((bias_t, ) if bias else ())
    upstream = torch.randn(batch, C, *hw, dtype=torch.float64)

    out = _DepthwiseConv2d.apply(image, weight, bias_t, kernel // 2)
    expected = F.conv2d(image, weight, bias_t, padding=kernel // 2, groups=C)
    assert_rel_close(out, expected, 1e-14, 'output')
    grads = torch.autograd.grad(out, inputs, upstream)
    expected_grads = torch.autograd.grad(expected, inputs, upstream)
    for name, grad, ref in zip(('image', 'weight', 'bias'), grads, expected_grads):
        assert grad.dtype == ref.dtype
        assert_rel_close(grad, ref, 1e-12, f'grad of {name}')


def test_second_order_gradients():
    C, hw = 3, (4, 5)
    image = channels_last_image(2, C, hw, torch.float64).detach().requires_grad_()
    weight = torch.randn(C, 1, 5, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(C, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda i, w, b: _DepthwiseConv2d.apply(i, w, b, 2),
                                        (image, weight, bias))


def test_bf16_autocast_backward_returns_parameter_dtypes():
    """Forward under autocast runs in bf16 with float32 parameters; the backward, outside
    autocast, must not mix dtypes and must hand float32 gradients to the parameters."""
    C, hw = 8, (6, 6)
    conv = torch.nn.Conv2d(C, C, 5, padding=2, groups=C)
    image = channels_last_image(1, C, hw, torch.float32).detach().requires_grad_()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = _DepthwiseConv2d.apply(image, conv.weight, conv.bias, 2)
        expected = conv(image)
    assert out.dtype == expected.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().sum(), (image, conv.weight, conv.bias))
    expected_grads = torch.autograd.grad(expected.float().sum(), (image, conv.weight, conv.bias))
    for grad, ref in zip(grads, expected_grads):
        assert grad.dtype == ref.dtype == torch.float32
        assert_rel_close(grad, ref, 2e-2, 'bf16 gradient')
