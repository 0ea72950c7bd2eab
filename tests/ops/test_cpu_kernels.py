"""linvit_mm's C++ CPU kernels against their PyTorch forms, and the fallback without them."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import linvit_mm.ops.extension as extension
from linvit_mm.ops import ttt_step
from linvit_mm.ops import (conv_tokens, correlate3x3_reference, correlate_tokens, cpu_kernels,
                           depthwise3x3_reference, position_code)
from linvit_mm.testing import assert_rel_close

GRIDS = [(7, 5), (1, 1), (14, 14)]


def grid_id(hw):
    return f'{hw[0]}x{hw[1]}'


@pytest.fixture(scope='module')
def kernels():
    built = cpu_kernels()
    assert built is not None, 'the C++ kernels did not build (see the warning)'
    return built


def token_slice(batch, hw, channels, dtype, seed=0, width=3):
    """``(B, H*W, C)`` tokens that are a column slice of a wider tensor (as in a fused qkv)."""
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(batch, hw[0] * hw[1], width * channels, generator=generator, dtype=dtype)
    return wide[..., channels:2 * channels]


@pytest.mark.parametrize('hw', GRIDS, ids=grid_id)
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


@pytest.mark.parametrize('hw', GRIDS, ids=grid_id)
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
    with pytest.raises(RuntimeError, match=r'w1 and w2 must be \(1, heads, d, d\)'):
        kernels.ttt_inner_forward(torch.randn(1, 4, 8 * 9), torch.randn(1, 2, 8, 8),
                                  torch.randn(1, 2, 8, 4), torch.randn(8, 1, 3, 3), 2, 0, 2, 2, 3.)
    with pytest.raises(RuntimeError, match='extra'):
        kernels.ttt_inner_forward(torch.randn(1, 5, 8 * 9), torch.randn(1, 2, 8, 8),
                                  torch.randn(1, 2, 8, 8), torch.randn(8, 1, 3, 3), 2, 0, 2, 2, 3.)


@pytest.mark.parametrize('hw', [(5, 7), (1, 1)], ids=grid_id)
def test_position_code_gradients(kernel_path, hw):
    C = 6
    x = torch.randn(2, hw[0] * hw[1], C, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(C, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(C, dtype=torch.float64, requires_grad=True)
    grid = x.transpose(1, 2).reshape(2, C, *hw)
    expected = x + F.conv2d(grid, weight, bias, padding=1, groups=C).flatten(2).transpose(1, 2)
    assert_rel_close(position_code(x, weight, bias, hw), expected, 1e-13)
    assert torch.autograd.gradcheck(lambda *t: position_code(*t, hw), (x, weight, bias))


def test_position_code_rejects_wrong_shapes():
    with pytest.raises(ValueError, match='grid 3x3'):
        position_code(torch.randn(1, 8, 4), torch.randn(4, 1, 3, 3), torch.randn(4), (3, 3))
    with pytest.raises(ValueError, match=r'weight must be \(4, 1, 3, 3\)'):
        position_code(torch.randn(1, 9, 4), torch.randn(4, 9), torch.randn(4), (3, 3))


def small_inner_inputs(num_extra, hw, dtype=torch.float64, heads=2, d=4, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.):
        return (std * torch.randn(*shape, generator=generator, dtype=dtype)).requires_grad_()

    qkv = randn(batch, num_extra + hw[0] * hw[1], (3 * heads + 3) * d)
    return qkv, randn(1, heads, d, d, std=.5), randn(1, heads, d, d, std=.5), randn(d, 1, 3, 3)


@pytest.mark.parametrize('num_extra,hw', [(0, (3, 4)), (1, (3, 3)), (2, (1, 2))],
                         ids=['3x4', 'cls_3x3', 'two_extra_1x2'])
def test_inner_step_gradcheck(kernel_path, num_extra, hw):
    inputs = small_inner_inputs(num_extra, hw)

    def step(*tensors):
        return ttt_step.ttt_inner_step(*tensors, 2, num_extra, hw, 9**-.5)

    assert torch.autograd.gradcheck(step, inputs)


def test_inner_step_cpp_matches_torch_in_float32(kernels, monkeypatch):
    """The C++ forward computes sigmoid with its own exp: float32 results agree to ~1e-6."""
    hw, num_extra = (14, 14), 1
    qkv, w1, w2, w3 = small_inner_inputs(num_extra, hw, dtype=torch.float32, heads=3, d=16)
    upstream = torch.randn(qkv.shape[0], qkv.shape[1], 4 * 16)

    def run():
        for t in (qkv, w1, w2, w3):
            t.grad = None
        out = ttt_step.ttt_inner_step(qkv, w1, w2, w3, 3, num_extra, hw, 9**-.5)
        out.backward(upstream)
        return [out.detach()] + [t.grad.clone() for t in (qkv, w1, w2, w3)]

    fast = run()
    monkeypatch.setattr(extension, '_enabled', False)
    reference = run()
    for name, a, b in zip(['out', 'qkv', 'w1', 'w2', 'w3'], fast, reference):
        assert_rel_close(a, b, 1e-5, name)


def test_inference_path_and_expanded_gradients(kernels):
    """Without grad the step skips the autograd node; ``.sum().backward()`` hands the backward
    an expanded (stride 0) gradient."""
    hw = (4, 5)
    qkv, w1, w2, w3 = small_inner_inputs(0, hw)
    args = (2, 0, hw, 9**-.5)
    with torch.no_grad():
        inferred = ttt_step.ttt_inner_step(qkv, w1, w2, w3, *args)
    out = ttt_step.ttt_inner_step(qkv, w1, w2, w3, *args)
    assert out.grad_fn is not None and inferred.grad_fn is None
    assert_rel_close(inferred, out.detach(), 1e-15)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (qkv, w1, w2, w3))


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(extension, '_extension', extension._UNLOADED)

    def no_compiler(*args, **kwargs):
        raise RuntimeError('no C++ compiler here')

    monkeypatch.setattr('torch.utils.cpp_extension.load', no_compiler)
    with pytest.warns(UserWarning, match='could not be built.*no C\\+\\+ compiler here'):
        assert cpu_kernels() is None
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert cpu_kernels() is None  # asked once only
        hw = (3, 3)
        x = torch.randn(1, 9, 4, dtype=torch.float64)
        taps = torch.randn(1, 9, 4, dtype=torch.float64)
        assert_rel_close(conv_tokens(x, taps, hw), depthwise3x3_reference(x, taps, hw), 1e-15)
        assert_rel_close(correlate_tokens(x, x, hw), correlate3x3_reference(x, x, hw), 1e-15)
        qkv, w1, w2, w3 = small_inner_inputs(0, hw)
        ttt_step.ttt_inner_step(qkv, w1, w2, w3, 2, 0, hw, 1.).sum().backward()


def test_environment_switch_skips_the_build(monkeypatch):
    monkeypatch.setattr(extension, '_extension', extension._UNLOADED)
    monkeypatch.setenv('LINVIT_MM_CPU_KERNELS', '0')
    monkeypatch.setattr('torch.utils.cpp_extension.load', lambda *a, **k: pytest.fail('built'))
    assert cpu_kernels() is None
    assert not extension.use_cpu_kernels(torch.randn(2))
