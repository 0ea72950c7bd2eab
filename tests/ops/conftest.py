"""Fixtures of the ``linvit_mm.ops`` tests."""
import pytest
import torch


def inner_step_inputs(num_extra, hw, dtype=torch.float64, heads=2, d=4, batch=2, seed=0,
                      device='cpu'):
    """``qkv, w1, w2, w3`` of ``ttt_inner_step`` (leaves that require grad), drawn on the CPU."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.):
        t = std * torch.randn(*shape, generator=generator, dtype=dtype)
        return t.to(device).requires_grad_()

    qkv = randn(batch, num_extra + hw[0] * hw[1], (3 * heads + 3) * d)
    return qkv, randn(1, heads, d, d, std=.5), randn(1, heads, d, d, std=.5), randn(d, 1, 3, 3)


@pytest.fixture(name='inner_step_inputs')
def inner_step_inputs_fixture():
    """:func:`inner_step_inputs`."""
    return inner_step_inputs
