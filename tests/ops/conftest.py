"""Fixtures of the ``linvit_mm.ops`` tests."""
import pytest
import torch

from linvit_mm.ops import cpu_kernels, set_cpu_kernels


@pytest.fixture(scope='module')
def kernels():
    """The compiled C++ kernels; a test that asks for them fails where they did not build."""
    built = cpu_kernels()
    assert built is not None, 'the C++ kernels did not build (see the warning)'
    return built


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


def outputs_and_gradients(module, x, hw, upstream, kernels):
    """An attention module's output on ``x`` and, after ``backward(upstream)``, the gradients
    of ``x`` and of every parameter by name, with the C++ kernels on or off; and the output's
    ``grad_fn``."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with set_cpu_kernels(kernels):
        out = module(x, hw)
        out.backward(upstream)
    grads = {name: p.grad for name, p in module.named_parameters()}
    return {'out': out.detach(), 'x': x.grad, **grads}, out.grad_fn


def graph_names(grad_fn):
    """The class names of every node of an autograd graph."""
    names, stack, seen = set(), [grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


@pytest.fixture(name='outputs_and_gradients')
def outputs_and_gradients_fixture():
    """:func:`outputs_and_gradients`."""
    return outputs_and_gradients


@pytest.fixture(name='graph_names')
def graph_names_fixture():
    """:func:`graph_names`."""
    return graph_names
