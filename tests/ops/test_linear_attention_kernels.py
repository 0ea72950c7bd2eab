"""The Triton kernels of the normalised linear-attention core against an O(N^2) oracle.

Without a GPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, with the explicit
``LINVIT_MM_FUSED=1`` that lets CPU tensors take them); on a CUDA machine the same tests run
the compiled kernels on the GPU. The interpreter cannot run bfloat16 (triton's
``InterpreterBuilder`` has no bf16 type): the bf16 cases run on CUDA only. Sizes stay small:
interpreted kernels are slow.
"""
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # before the kernels are first imported: triton decides at decoration time
    os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton')

from linvit_mm.ops.linear_attention import (FEATURES, fused_applies,  # noqa: E402
                                            normalised_linear_attention,
                                            normalised_linear_attention_torch)

DEVICE = 'cuda' if CUDA else 'cpu'


@pytest.fixture(autouse=True)
def interpreted_kernels(monkeypatch):
    """CPU tensors take the kernels only when asked, under the interpreter."""
    if not CUDA:
        monkeypatch.setenv('TRITON_INTERPRET', '1')
        monkeypatch.setenv('LINVIT_MM_FUSED', '1')


def oracle(q, k, v, eps, feature):
    """The whole N x N map of the core, in float64, from the definition: shares nothing with
    either fast form."""
    maps = {'relu': lambda x: x.clamp_min(0),
            'elu': lambda x: torch.where(x > 0, x + 1, torch.exp(x.clamp_max(0))),
            'identity': lambda x: x}
    fq, fk = (maps[feature](t.double()) for t in (q, k))
    scores = torch.einsum('bhid,bhjd->bhij', fq, fk)
    return torch.einsum('bhij,bhje->bhie', scores, v.double()) / (
        scores.sum(dim=-1, keepdim=True) + eps)


def heads_of_fused_qkv(B, H, N, D, dtype, seed=0, positive=False, edit=None):
    """q, k, v as views of one (B, N, 3, H, D) projection, as the operators make them;
    ``edit`` changes the projection first."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, 3, H, D, generator=gen)
    if positive:
        qkv = qkv.exp()  # features computed before (hedgehog): positive
    if edit is not None:
        edit(qkv)
    qkv = qkv.to(device=DEVICE, dtype=dtype).requires_grad_(True)
    return qkv, qkv.permute(2, 0, 3, 1, 4).unbind(0)


def upstream_gradient(out, seed=1):
    """A fixed draw of the gradient reaching ``out``: the comparisons are reproducible. (At
    one token the query gradient is pure cancellation, about 1e-8 against float32 rounding
    of 1e-6; an unseeded draw crossed the 1e-6 floor below for 3 draws in 120.)"""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=generator).to(device=out.device, dtype=out.dtype)


def assert_matches(result, expected, rtol):
    """Relative to the largest expected magnitude, with a floor for gradients that cancel to
    nearly nothing (one token: the output is its value whatever q and k)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(result.double(), expected.double(), rtol=0,
                               atol=rtol * scale + 1e-6)


CASES = [(2, 3, 197, 32), (1, 2, 196, 64), (1, 1, 1, 32), (1, 2, 70, 24), (2, 1, 129, 16)]


@pytest.mark.parametrize('feature', FEATURES)
@pytest.mark.parametrize('B, H, N, D', CASES,
                         ids=[f'{b}x{h}x{n}x{d}' for b, h, n, d in CASES])
def test_fp32_outputs_and_gradients_match_the_oracle(feature, B, H, N, D):
    qkv, (q, k, v) = heads_of_fused_qkv(B, H, N, D, torch.float32,
                                        positive=feature == 'identity')
    assert fused_applies(q, k, v)
    out = normalised_linear_attention(q, k, v, 1e-6, feature)
    expected = oracle(q, k, v, 1e-6, feature)
    assert_matches(out, expected, 1e-5)
    grad = upstream_gradient(out)
    (fused_grad, ) = torch.autograd.grad(out, qkv, grad)
    (oracle_grad, ) = torch.autograd.grad(expected, qkv, grad.double())
    for part in range(3):  # q, k and v separately: each has its own scale
        assert_matches(fused_grad[:, :, part], oracle_grad[:, :, part], 1e-5)


LONG_CASES = [(1, 1, 4096, 128, 'relu'), (1, 1, 16384, 32, 'elu')]


@pytest.mark.slow  # interpreted, 4096 and 16384 tokens take a minute or two on 2 cores
@pytest.mark.parametrize('B, H, N, D, feature', LONG_CASES,
                         ids=[f'{n}x{d}-{f}' for _, _, n, d, f in LONG_CASES])
def test_long_sequences_and_the_widest_heads_match_the_oracle(B, H, N, D, feature):
    """Many chunks of partial sums (4096 and 16384 tokens) and the widest head the kernels
    take (128), outputs and gradients."""
    test_fp32_outputs_and_gradients_match_the_oracle(feature, B, H, N, D)


def test_the_pytorch_form_is_the_same_function():
    _, (q, k, v) = heads_of_fused_qkv(2, 2, 50, 16, torch.float64)
    for feature in FEATURES:
        torch.testing.assert_close(normalised_linear_attention_torch(q, k, v, 1e-6, feature),
                                   oracle(q, k, v, 1e-6, feature))


@pytest.mark.parametrize('dtype', [torch.float16] + ([torch.bfloat16] if CUDA else []),
                         ids=lambda dtype: str(dtype).split('.')[-1])
def test_half_precision_inputs_keep_float32_accumulation(dtype):
    """Measured: relu, 1024 tokens, fp16 in: output 4e-4 of its largest value, gradients
    2e-3 (the inputs' own rounding); the bound leaves 5x."""
    qkv, (q, k, v) = heads_of_fused_qkv(1, 2, 1024, 32, dtype)
    out = normalised_linear_attention(q, k, v, 1e-6, 'relu')
    assert out.dtype == dtype
    expected = oracle(q, k, v, 1e-6, 'relu')
    bound = 2e-3 if dtype == torch.float16 else 1.6e-2
    assert_matches(out, expected, bound)
    grad = upstream_gradient(out)
    (fused_grad, ) = torch.autograd.grad(out, qkv, grad)
    (oracle_grad, ) = torch.autograd.grad(expected, qkv, grad.double())
    for part in range(3):
        assert_matches(fused_grad[:, :, part], oracle_grad[:, :, part], 5 * bound)


def test_rows_without_any_weight_read_zero_through_eps():
    """relu zeroes a query with no positive component (and a head whose keys are all
    negative): the row is 0 / eps = 0, its gradients finite; with eps = 0 it would be 0 / 0,
    as in the oracle."""
    def no_weight(qkv):
        qkv[0, 5, 0] = -1.      # token 5's queries: zero features in both heads
        qkv[0, :, 1, 1] = -1.   # head 1's keys: all zero features

    qkv, (q, k, v) = heads_of_fused_qkv(1, 2, 197, 16, torch.float32, edit=no_weight)
    out = normalised_linear_attention(q, k, v, 1e-6, 'relu')
    assert torch.isfinite(out).all()
    assert out[0, :, 5].abs().max() == 0 and out[0, 1].abs().max() == 0
    (grad, ) = torch.autograd.grad(out.sum(), qkv)
    assert torch.isfinite(grad).all()
    assert_matches(out, oracle(q, k, v, 1e-6, 'relu'), 1e-5)


def test_zero_and_huge_inputs():
    _, (q, k, v) = heads_of_fused_qkv(1, 1, 100, 16, torch.float32)
    zeros = torch.zeros_like(q)
    assert normalised_linear_attention(zeros, zeros, v, 1e-6, 'relu').abs().max() == 0
    # elu + 1 of zeros is 1: a uniform average of the values
    torch.testing.assert_close(normalised_linear_attention(zeros, zeros, v, 1e-6, 'elu'),
                               v.mean(dim=-2, keepdim=True).expand_as(v), rtol=1e-5,
                               atol=1e-6)
    huge_q, huge_k = q.detach() * 1e4, k.detach() * 1e4
    out = normalised_linear_attention(huge_q, huge_k, v, 1e-6, 'relu')
    assert_matches(out, oracle(huge_q, huge_k, v, 1e-6, 'relu'), 1e-5)


def test_padding_tokens_add_no_phantom_key():
    """elu + 1 of a padded zero is 1: unmasked, each of the block's padding slots would add
    a key. 197 tokens leave 59 slots of the last 64-token block empty."""
    _, (q, k, v) = heads_of_fused_qkv(1, 1, 197, 16, torch.float32)
    out = normalised_linear_attention(q, k, v, 0., 'elu')
    assert_matches(out, oracle(q, k, v, 0., 'elu'), 1e-5)


def test_torch_compile_sees_one_node_each_way():
    """fullgraph: no graph break; the custom op's fake implementation gives the shapes and its
    autograd formula the backward (aot_eager runs both without inductor)."""
    qkv, (q, k, v) = heads_of_fused_qkv(1, 2, 70, 16, torch.float32)

    def core(q, k, v):
        return normalised_linear_attention(q, k, v, 1e-6, 'relu', fused=True)

    compiled = torch.compile(core, fullgraph=True, backend='aot_eager')
    out = compiled(q, k, v)
    torch.testing.assert_close(out, core(q, k, v))
    (grad, ) = torch.autograd.grad(out.sum(), qkv)
    (eager_grad, ) = torch.autograd.grad(core(q, k, v).sum(), qkv)
    torch.testing.assert_close(grad, eager_grad)


def test_the_custom_op_passes_torch_library_checks():
    q, k, v = (torch.randn(1, 2, 40, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch.ops.linvit_mm.normalised_linear_attention.default,
                          (q, k, v, 1e-6, 'elu'),
                          test_utils=('test_schema', 'test_faketensor',
                                      'test_autograd_registration'))


def test_the_kernels_are_taken_only_where_they_apply(monkeypatch):
    q = torch.randn(1, 1, 8, 16, device=DEVICE)
    assert fused_applies(q, q, q)
    monkeypatch.setenv('LINVIT_MM_FUSED', '0')
    assert not fused_applies(q, q, q)
    monkeypatch.delenv('LINVIT_MM_FUSED')
    assert fused_applies(q, q, q) == CUDA  # a CPU tensor: only when asked for
    monkeypatch.setenv('LINVIT_MM_FUSED', '1')
    wide = torch.randn(1, 1, 8, 256, device=DEVICE)
    assert not fused_applies(wide, wide, wide)
    if not CUDA:
        half = q.bfloat16()
        assert not fused_applies(half, half, half)  # the interpreter has no bf16
    with pytest.raises(ValueError, match="feature 'gelu': choose from identity, relu, elu"):
        normalised_linear_attention(q, q, q, 1e-6, 'gelu')


@pytest.mark.parametrize('attn_type, options', [
    ('relu', {}), ('elu', {}), ('hedgehog', {}), ('hedgehog', dict(feature_map='exp',
                                                                   tie_qk=False)),
    ('inline', {}), ('inline', dict(rope=dict(type='eva', ref_grid=(7, 9)))),
    ('inline', dict(residual=True))],
    ids=['relu', 'elu', 'hedgehog', 'hedgehog-exp-untied', 'inline', 'inline-rope',
         'inline-residual'])
def test_the_operators_run_their_core_on_the_kernels(attn_type, options, monkeypatch):
    """The operator's fused path equals its O(N^2) oracle and its PyTorch form, outputs and
    parameter gradients, and really calls the custom op."""
    from linvit_mm.models.attention import build_attention
    torch.manual_seed(0)
    attention = build_attention(attn_type, embed_dims=64, num_heads=2, **options).to(DEVICE)
    if attn_type == 'hedgehog':
        with torch.no_grad():
            attention.feature_proj.add_(torch.randn_like(attention.feature_proj) * .3)
    x = torch.randn(2, 1 + 7 * 9, 64, device=DEVICE)
    calls = []
    op = torch.ops.linvit_mm.normalised_linear_attention.default
    original = torch.ops.linvit_mm.normalised_linear_attention

    class Counting:
        default = op

        def __call__(self, *args):
            calls.append(args[-1])
            return original(*args)

    import linvit_mm.ops.linear_attention as module
    monkeypatch.setattr(module, '_forward', Counting())
    fused = attention(x, (7, 9))
    assert calls, 'the fused path did not run'
    torch.testing.assert_close(fused, attention.forward_reference(x, (7, 9)), rtol=1e-4,
                               atol=1e-5)
    fused_grads = torch.autograd.grad(fused.square().sum(), list(attention.parameters()))
    attention.fused = False
    plain = attention(x, (7, 9))
    plain_grads = torch.autograd.grad(plain.square().sum(), list(attention.parameters()))
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    for a, b in zip(fused_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_an_exported_program_holds_the_pytorch_form():
    """torch.export (and ONNX, which exports first) gets the PyTorch form, which runs
    anywhere, even where the kernels would apply."""
    from linvit_mm.models.attention import build_attention
    attention = build_attention('relu', embed_dims=32, num_heads=2).to(DEVICE).eval()
    x = torch.randn(1, 17, 32, device=DEVICE)
    assert fused_applies(*attention.split_heads(attention.qkv(x)))
    program = torch.export.export(attention, (x, (4, 4)))
    targets = {str(node.target) for node in program.graph.nodes}
    assert not [t for t in targets if 'normalised_linear_attention' in t], targets
    torch.testing.assert_close(program.module()(x, (4, 4)), attention(x, (4, 4)))
