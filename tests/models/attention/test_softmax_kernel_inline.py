"""Softmax, elu/relu kernel and InLine attention: fast forms against their O(N^2) references."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from linvit_mm.models.attention import (attention_class, attention_types, ELUAttention, InLineAttention,
                                        KernelAttention, ReLUAttention, SoftmaxAttention,
                                        build_attention)
from linvit_mm.testing import assert_rel_close, rel_error

OPERATORS = ['softmax', 'elu', 'relu', 'inline']
LINEAR_OPERATORS = ['elu', 'relu', 'inline']
GRIDS = [(14, 14), (7, 9), (5, 3)]
EMBED_DIMS, NUM_HEADS = 48, 3


def grid_id(hw):
    return f'{hw[0]}x{hw[1]}'


def make(attn_type, dtype=torch.float64, seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs.setdefault('embed_dims', EMBED_DIMS)
    kwargs.setdefault('num_heads', NUM_HEADS)
    return build_attention(attn_type, **kwargs).to(dtype)


def tokens(hw, num_extra, batch=2, dims=EMBED_DIMS, dtype=torch.float64, seed=1, scale=1.):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, num_extra + hw[0] * hw[1], dims, generator=generator, dtype=dtype)
    return x * scale


def output_and_grads(module, fn, x):
    """Output, input gradient and qkv parameter gradients for a fixed upstream gradient."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    out.backward(upstream)
    grads = {'x': x.grad, 'qkv.weight': module.qkv.weight.grad}
    if module.qkv.bias is not None:
        grads['qkv.bias'] = module.qkv.bias.grad
    return out.detach(), grads


class LargestIntermediate(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def largest_intermediate(fn):
    with LargestIntermediate() as probe:
        fn()
    return probe.largest


@pytest.mark.parametrize('hw', GRIDS, ids=grid_id)
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('attn_type', OPERATORS)
def test_forward_matches_reference(attn_type, num_extra, hw):
    module = make(attn_type)
    x = tokens(hw, num_extra)
    out, grads = output_and_grads(module, lambda t: module(t, hw), x)
    ref, ref_grads = output_and_grads(module, lambda t: module.forward_reference(t, hw), x)
    assert out.shape == x.shape
    assert_rel_close(out, ref, 1e-10, 'output')
    for name, grad in grads.items():
        assert_rel_close(grad, ref_grads[name], 1e-10, f'grad of {name}')


@pytest.mark.parametrize('hw', [(14, 14), (7, 9)], ids=grid_id)
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('attn_type', OPERATORS)
def test_map_reproduces_output(attn_type, num_extra, hw):
    module = make(attn_type)
    x = tokens(hw, num_extra)
    n = x.shape[1]
    with torch.no_grad():
        fast = module(x, hw)
        attn = module.attention_map(x, hw)
        _, _, v = module.split_heads(module.qkv(x))
        from_map = module.proj(module.merge_heads(attn @ v))

    assert attn.shape == (x.shape[0], NUM_HEADS, n, n)
    assert_rel_close(from_map, fast, 1e-10, 'proj(merge(map @ V)) vs fast output')

    row_sums = attn.sum(dim=-1)
    if attn_type == 'relu':
        # eps = 1e-6 shrinks rows by eps / (raw row sum); an all-zero relu row stays zero.
        live = row_sums > 0
        assert live.float().mean() > 0.9
        assert_rel_close(row_sums[live], torch.ones_like(row_sums[live]), 1e-5, 'row sums')
    elif attn_type == 'elu':
        assert_rel_close(row_sums, torch.ones_like(row_sums), 1e-5, 'row sums')
    else:
        assert_rel_close(row_sums, torch.ones_like(row_sums), 1e-12, 'row sums')
    if attn_type == 'inline':
        assert attn.min() < 0, 'InLine maps are signed; this one has no negative entry'
    else:
        assert attn.min() >= 0


@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
def test_softmax_fused_matches_eager_float32(training):
    module = make('softmax', dtype=torch.float32)
    module.train(training)
    hw = (7, 9)
    x = tokens(hw, 1, dtype=torch.float32)
    module.fused = True
    fused, fused_grads = output_and_grads(module, lambda t: module(t, hw), x)
    module.fused = False
    eager, eager_grads = output_and_grads(module, lambda t: module(t, hw), x)
    assert_rel_close(fused, eager, 1e-5, 'output')
    for name, grad in fused_grads.items():
        assert_rel_close(grad, eager_grads[name], 1e-5, f'grad of {name}')


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'eager'])
def test_softmax_attention_dropout_only_in_training(fused):
    module = make('softmax', dtype=torch.float32, attn_drop=0.5, fused=fused)
    hw = (5, 3)
    x = tokens(hw, 1, dtype=torch.float32)
    module.eval()
    first, second = module(x, hw), module(x, hw)
    assert torch.equal(first, second)
    module.train()
    torch.manual_seed(3)
    dropped = module(x, hw)
    assert rel_error(dropped, first) > 1e-2


@pytest.mark.parametrize('attn_type', LINEAR_OPERATORS)
def test_bf16_autocast_16k_tokens_is_finite_and_close(attn_type):
    module = make(attn_type, dtype=torch.float32, embed_dims=64, num_heads=2)
    hw = (128, 128)
    x = tokens(hw, 0, batch=1, dims=64, dtype=torch.float32)
    with torch.no_grad():
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = module(x, hw)
        exact = module.double()(x.double(), hw)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    # bf16 projections limit the accuracy to a few 1e-3; a bf16 state would add more.
    assert rel_error(out, exact) < 2e-2


# Input scales at which a 16k-token fp16 state overflows while the true output fits fp16:
# the kernel normaliser sum_j phi(k_j) grows like N * |k|, InLine's K^T V like sqrt(N) |k||v|.
OVERFLOW_SCALES = {'elu': 30., 'relu': 30., 'inline': 10.}


@pytest.mark.parametrize('attn_type', LINEAR_OPERATORS)
def test_state_is_float32_under_fp16_autocast(attn_type):
    """Sums over 16k large tokens overflow fp16 (max 65504); the float32 state does not."""
    module = make(attn_type, dtype=torch.float32, embed_dims=64, num_heads=2)
    hw = (128, 128)
    x = tokens(hw, 0, batch=1, dims=64, dtype=torch.float32, scale=OVERFLOW_SCALES[attn_type])
    with torch.no_grad():
        with torch.autocast('cpu', dtype=torch.float16):
            q, k, v = module.split_heads(module.qkv(x))
            out = module(x, hw)
        exact = module.double()(x.double(), hw)
    assert q.dtype == torch.float16 and torch.isfinite(q).all()
    # The inputs are large enough that an fp16 state would overflow.
    if attn_type == 'inline':
        assert not torch.isfinite(k.transpose(-2, -1) @ v).all()
    else:
        phi_k = module._features(q, k)[1]
        assert not torch.isfinite(phi_k.sum(dim=-2)).all()
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()
    assert rel_error(out, exact) < 1e-2


@pytest.mark.parametrize('attn_type', LINEAR_OPERATORS)
def test_fast_path_never_forms_n_by_n(attn_type):
    hw = (64, 64)
    num_tokens = hw[0] * hw[1]
    module = make(attn_type, dtype=torch.float32, embed_dims=32, num_heads=2)
    x = tokens(hw, 0, batch=1, dims=32, dtype=torch.float32).requires_grad_(True)

    def fast():
        module(x, hw).sum().backward()

    # Largest legitimate tensors are (B, N, 3C) = 4096 * 96 elements; a map is 2 * 4096^2.
    assert largest_intermediate(fast) < num_tokens * num_tokens // 8

    small_hw = (16, 16)
    small_x = tokens(small_hw, 0, batch=1, dims=32, dtype=torch.float32)
    # The probe does see a map when one is formed.
    assert largest_intermediate(lambda: module.forward_reference(small_x, small_hw)) >= 256 * 256


def test_relu_all_zero_rows_stay_finite():
    module = make('relu')
    hw = (3, 3)
    x = tokens(hw, 1)
    with torch.no_grad():
        # A query head whose every component is negative has phi(q) = 0: 0 / (0 + eps).
        module.qkv.weight[:module.head_dims].zero_()
        module.qkv.bias[:module.head_dims].fill_(-1.)
    x.requires_grad_(True)
    attn = module.attention_map(x, hw)
    fast = module(x, hw)
    fast.sum().backward()
    assert torch.isfinite(fast).all() and torch.isfinite(x.grad).all()
    assert torch.count_nonzero(attn[:, 0]) == 0
    assert_rel_close(module.forward_reference(x, hw), fast, 1e-10, 'reference vs fast output')


def test_inline_counts_the_class_token():
    """N and the key/value means span every token, class token included (official DeiT model)."""
    module = make('inline')
    hw = (4, 4)
    x = tokens(hw, 1)
    with torch.no_grad():
        attn = module.attention_map(x, hw)
        q, k, _ = module.split_heads(module.qkv(x))
        n = x.shape[1]
        expected = (module.scale / n) * (q @ k.transpose(-2, -1)) \
            + (1 - module.scale * q @ k.mean(dim=2, keepdim=True).transpose(-2, -1)) / n
    assert_rel_close(attn, expected, 1e-12, 'InLine map')


def test_registry_and_classes():
    assert {'softmax', 'elu', 'relu', 'inline'} <= set(attention_types())
    assert attention_class('softmax') is SoftmaxAttention
    assert attention_class('elu') is ELUAttention and attention_class('relu') is ReLUAttention
    assert attention_class('inline') is InLineAttention
    for name in OPERATORS:
        cls = attention_class(name)
        assert cls.has_map and cls.uses_cls_token
        module = make(name)
        assert module.qkv.weight.shape == (3 * EMBED_DIMS, EMBED_DIMS)
        assert module.proj.weight.shape == (EMBED_DIMS, EMBED_DIMS)
        assert not hasattr(module, 'init_weights')
    assert make('elu').feature_map == 'elu' and make('relu').feature_map == 'relu'
    assert make('relu', qkv_bias=False).qkv.bias is None


def test_unknown_attention_type_lists_valid_names():
    with pytest.raises(ValueError, match='nope') as info:
        build_attention('nope', embed_dims=EMBED_DIMS, num_heads=NUM_HEADS)
    for name in OPERATORS:
        assert name in str(info.value)


@pytest.mark.parametrize('attn_type', LINEAR_OPERATORS)
def test_linear_operators_reject_attention_dropout(attn_type):
    with pytest.raises(ValueError, match='attn_drop'):
        make(attn_type, attn_drop=0.1)


def test_kernel_rejects_bad_feature_map_and_eps():
    with pytest.raises(ValueError, match='elu, relu'):
        KernelAttention(EMBED_DIMS, NUM_HEADS, feature_map='gelu')
    with pytest.raises(ValueError, match='eps'):
        KernelAttention(EMBED_DIMS, NUM_HEADS, eps=0.)


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_grid_larger_than_sequence_is_rejected(attn_type):
    module = make(attn_type)
    with pytest.raises(ValueError, match='cannot hold'):
        module(tokens((3, 3), 0), (4, 4))
