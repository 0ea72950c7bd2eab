"""ViT^3's inner step (``ops/ttt_step.py``): gradchecks of both forms, the C++ form against the
PyTorch one, the inference path, the PyTorch operators and their decomposition, and the C++
kernel's input checks."""
import pytest
import torch

from linvit_mm.ops import set_cpu_kernels, torch_forms, ttt_inner_step
from linvit_mm.ops.ttt_step import ttt_inner_backward, ttt_inner_forward
from linvit_mm.testing import assert_rel_close


@pytest.mark.parametrize('num_extra,hw', [(0, (3, 4)), (1, (3, 3)), (2, (1, 2))],
                         ids=['3x4', 'cls_3x3', 'two_extra_1x2'])
def test_inner_step_gradcheck(device, kernel_path, num_extra, hw, inner_step_inputs):
    inputs = inner_step_inputs(num_extra, hw, device=device)

    def step(*tensors):
        return ttt_inner_step(*tensors, 2, num_extra, hw, 9**-.5)

    assert torch.autograd.gradcheck(step, inputs)


def test_inner_step_cpp_matches_torch_in_float32(kernels, inner_step_inputs):
    """The C++ forward computes sigmoid with its own exp: float32 results agree to ~1e-6."""
    hw, num_extra = (14, 14), 1
    qkv, w1, w2, w3 = inner_step_inputs(num_extra, hw, dtype=torch.float32, heads=3, d=16)
    upstream = torch.randn(qkv.shape[0], qkv.shape[1], 4 * 16)

    def run():
        for t in (qkv, w1, w2, w3):
            t.grad = None
        out = ttt_inner_step(qkv, w1, w2, w3, 3, num_extra, hw, 9**-.5)
        out.backward(upstream)
        return [out.detach()] + [t.grad.clone() for t in (qkv, w1, w2, w3)]

    with set_cpu_kernels(True):
        fast = run()
    with set_cpu_kernels(False):
        reference = run()
    for name, a, b in zip(['out', 'qkv', 'w1', 'w2', 'w3'], fast, reference):
        assert_rel_close(a, b, 1e-5, name)


def test_inference_path_and_expanded_gradients(kernels, inner_step_inputs):
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
def test_operators_pass_opcheck(kernel_path, num_extra, hw, inner_step_inputs):
    """Schema, shape functions (fake tensors), autograd registration and tracing of the step
    and of its backward, with the kernels and with the PyTorch forms."""
    inputs = inner_step_inputs(num_extra, hw)
    args = (2, num_extra, *hw, 9**-.5)
    torch.library.opcheck(ttt_inner_forward, (*inputs, *args))
    qkv, w1, w2, w3 = (t.detach() for t in inputs)
    out, *saved = ttt_inner_forward(qkv, w1, w2, w3, *args)
    torch.library.opcheck(ttt_inner_backward, (torch.randn_like(out), saved, qkv, *args))


def test_either_backward_serves_either_forward(kernels, inner_step_inputs):
    """Both forms keep the same tensors, so switching the kernels between a forward and its
    backward changes nothing."""
    hw, num_extra = (4, 3), 1
    upstream = None
    grads = {}
    for forward_cpp, backward_cpp in ((True, True), (True, False), (False, True)):
        inputs = inner_step_inputs(num_extra, hw)
        with set_cpu_kernels(forward_cpp):
            out = ttt_inner_step(*inputs, 2, num_extra, hw, 9**-.5)
        upstream = torch.randn_like(out) if upstream is None else upstream
        with set_cpu_kernels(backward_cpp):
            out.backward(upstream)
        grads[forward_cpp, backward_cpp] = [t.grad for t in inputs]
    for key in ((True, False), (False, True)):
        for name, a, b in zip(['qkv', 'w1', 'w2', 'w3'], grads[key], grads[True, True]):
            assert_rel_close(a, b, 1e-12, f'{name}, forward / backward in C++: {key}')


@pytest.mark.parametrize('dynamic', [False, True], ids=['static', 'dynamic'])
def test_decomposition_matches_the_operator(kernel_path, dynamic, inner_step_inputs):
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


def test_kernel_rejects_mismatched_inputs(kernels):
    with pytest.raises(RuntimeError, match=r'w1 and w2 must be \(1, heads, d, d\)'):
        kernels.ttt_inner_forward(torch.randn(1, 4, 8 * 9), torch.randn(1, 2, 8, 8),
                                  torch.randn(1, 2, 8, 4), torch.randn(8, 1, 3, 3), 2, 0, 2, 2, 3.)
    with pytest.raises(RuntimeError, match='extra'):
        kernels.ttt_inner_forward(torch.randn(1, 5, 8 * 9), torch.randn(1, 2, 8, 8),
                                  torch.randn(1, 2, 8, 8), torch.randn(8, 1, 3, 3), 2, 0, 2, 2, 3.)
