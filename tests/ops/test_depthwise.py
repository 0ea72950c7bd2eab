"""Depthwise 3x3 convolutions on token grids (``ops/depthwise.py``): the tap-by-tap forms
against ``F.conv2d``, the traced form with a symbolic batch, the position code and the token
convolution with their gradients."""
import pytest
import torch
import torch.nn.functional as F

from linvit_mm.ops import (correlate3x3_reference, depthwise3x3_reference, depthwise3x3_tokens,
                           position_code)
from linvit_mm.ops.depthwise import correlate3x3_by_taps, depthwise3x3_by_taps
from linvit_mm.testing import assert_rel_close

GRIDS = [(7, 5), (1, 1), (14, 14)]


def token_slice(batch, hw, channels, dtype, seed=0, device='cpu'):
    """``(B, H*W, C)`` tokens that are a column slice of a wider tensor (as in a fused qkv)."""
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(batch, hw[0] * hw[1], 3 * channels, generator=generator, dtype=dtype)
    return wide.to(device)[..., channels:2 * channels]


# ---------------------------------------------------------------- forms

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


def test_traced_convolution_takes_any_batch():
    """Traced, the token convolution runs tap by tap: an export with a symbolic batch computes
    ``F.conv2d``'s result for other batch sizes (the grouped form would pin the batch)."""
    from torch.export import Dim
    hw, C = (3, 4), 5
    taps = torch.randn(1, 9, C, dtype=torch.float64)

    class Conv(torch.nn.Module):

        def forward(self, tokens):
            return depthwise3x3_tokens(tokens, taps, hw)

    x = token_slice(2, hw, C, torch.float64)
    program = torch.export.export(Conv(), (x, ), dynamic_shapes=({0: Dim('batch')}, ))
    assert 'aten.conv2d.default' not in {str(n.target) for n in program.graph.nodes}
    for batch in (2, 3):
        x = token_slice(batch, hw, C, torch.float64, seed=batch)
        assert_rel_close(program.module()(x), depthwise3x3_reference(x, taps, hw), 1e-14)


# ---------------------------------------------------------------- position code

@pytest.mark.parametrize('hw', [(5, 7), (1, 1)])
def test_position_code_gradients(device, hw):
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
def test_token_convolution_gradients(device, shared):
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
