"""ViT^3's inner step (``ops/ttt_step.py``): gradchecks, the inference path, the PyTorch
operators and their decomposition."""
import pytest
import torch

from linvit_mm.ops import torch_forms, ttt_inner_step
from linvit_mm.ops.ttt_step import ttt_inner_backward, ttt_inner_forward
from linvit_mm.testing import assert_rel_close


@pytest.mark.parametrize('num_extra,hw', [(0, (3, 4)), (1, (3, 3)), (2, (1, 2))],
                         ids=['3x4', 'cls_3x3', 'two_extra_1x2'])
def test_inner_step_gradcheck(device, num_extra, hw, inner_step_inputs):
    inputs = inner_step_inputs(num_extra, hw, device=device)

    def step(*tensors):
        return ttt_inner_step(*tensors, 2, num_extra, hw, 9**-.5)

    assert torch.autograd.gradcheck(step, inputs)


def test_inference_path_and_expanded_gradients(inner_step_inputs):
    """Without grad the step skips the autograd node; ``.sum().backward()`` hands the backward
    an expanded (stride 0) gradient."""
    hw = (4, 5)
    qkv, w1, w2, w3 = inner_step_inputs(0, hw)
    args = (2, 0, hw, 9**-.5)
    with torch.no_grad():
        inferred = ttt_inner_step(qkv, w1, w2, w3, *args)
    out = ttt_inner_step(qkv, w1, w2, w3, *args)
    assert out.grad_fn is not None and inferred.grad_fn is None
    assert_rel_close(inferred, out.detach(), 1e-15)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (qkv, w1, w2, w3))


@pytest.mark.parametrize('num_extra,hw', [(0, (3, 4)), (1, (3, 3))], ids=['3x4', 'cls_3x3'])
def test_operators_pass_opcheck(num_extra, hw, inner_step_inputs):
    """Schema, shape functions (fake tensors), autograd registration and tracing of the step
    and of its backward."""
    inputs = inner_step_inputs(num_extra, hw)
    args = (2, num_extra, *hw, 9**-.5)
    torch.library.opcheck(ttt_inner_forward, (*inputs, *args))
    qkv, w1, w2, w3 = (t.detach() for t in inputs)
    out, *saved = ttt_inner_forward(qkv, w1, w2, w3, *args)
    torch.library.opcheck(ttt_inner_backward, (torch.randn_like(out), saved, qkv, *args))


@pytest.mark.parametrize('dynamic', [False, True], ids=['static', 'dynamic'])
def test_decomposition_matches_the_operator(dynamic, inner_step_inputs):
    """``torch_forms()`` replaces the step by PyTorch operators (tap-by-tap convolutions, so
    also for a symbolic batch) that compute the same readouts."""
    from torch.export import Dim
    hw, num_extra = (3, 4), 1
    qkv, w1, w2, w3 = (t.detach().float() for t in inner_step_inputs(num_extra, hw))

    class Step(torch.nn.Module):

        def forward(self, qkv):
            return ttt_inner_step(qkv, w1, w2, w3, 2, num_extra, hw, 9**-.5)

    program = torch.export.export(Step(), (qkv, ), dynamic_shapes=(
        {0: Dim('batch')}, ) if dynamic else None)
    decomposed = program.run_decompositions(torch_forms())
    assert not [n for n in decomposed.graph.nodes if str(n.target).startswith('linvit_mm.')]
    for batch in (2, 3) if dynamic else (2, ):
        x = torch.randn(batch, *qkv.shape[1:])
        assert_rel_close(decomposed.module()(x), Step()(x), 1e-5)


def test_the_step_keeps_no_per_token_tensor_but_qkv(inner_step_inputs):
    """For the backward the step keeps qkv and the inner weights with their gradients
    (``(d, 2d)`` per head), and computes ``k W``, the gradient terms and ``q W'`` again: one
    per-token ``(N, 2d)`` tensor per head more would be 4 N d elements per head and image."""
    from linvit_mm.utils.benchmark.common import saved_activations
    hw, heads, d, batch = (16, 16), 2, 4, 2
    qkv, w1, w2, w3 = inner_step_inputs(1, hw, dtype=torch.float32, heads=heads, d=d,
                                        batch=batch)
    with saved_activations() as saved:
        out = ttt_inner_step(qkv, w1, w2, w3, heads, 1, hw, 9**-.5)
    out.sum().backward()
    per_token_tensor = batch * heads * qkv.shape[1] * 2 * d * 4
    leaves = sum(t.nbytes for t in (w1, w2, w3))
    assert qkv.nbytes <= saved['bytes'] - leaves < qkv.nbytes + per_token_tensor / 4
