"""Hedgehog attention: the fast form and the map against the naive O(N^2) oracle (which
shares no helper with them) and against the plain formula written here, tied and untied
query / key maps, both initialisations, the forward against a transcription of LoLCATs'
feature map and attention, the stabiliser under inputs that overflow the plain exp, float32
states under autocast, the traits the transfer and the distillation hook read."""
from types import SimpleNamespace

import pytest
import torch
from mmengine.logging import MMLogger
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from linvit_mm.engine import AttentionDistillHook
from linvit_mm.models import LinearViT
from linvit_mm.models.attention import WHOLE, BaseAttention, HedgehogAttention, attention_class
from linvit_mm.models.attention import hedgehog, map_attention
from linvit_mm.models.attention.hedgehog import naive_hedgehog_attention
from linvit_mm.testing import assert_rel_close, rel_error
from linvit_mm.transfer import transfer_softmax_weights

FEATURE_MAPS = ['softmax', 'exp']
GRIDS = [(6, 6), (4, 7), (5, 3)]
ODD_GRIDS = [(7, 9), (5, 3)]
EXTRA = dict(argnames='num_extra', argvalues=[0, 1], ids=['no_cls', 'cls'])
TIE = dict(argnames='tie_qk', argvalues=[True, False], ids=['tied', 'untied'])
TINY_ARCH = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)


@pytest.fixture
def make_hedgehog(make_attention):
    """``make_attention('hedgehog', ...)`` with every head's W (and untied, W_k, by its own
    noise) moved off the identity by ``perturb`` (gradients at W = I would test a special
    point, and W_k = W would not tell the two maps apart)."""

    def make(feature_map, dtype=torch.float64, perturb=.3, **kwargs):
        module = make_attention('hedgehog', dtype=dtype, feature_map=feature_map, **kwargs)
        with torch.no_grad():
            for weight in (module.feature_proj, module.feature_proj_k):
                if weight is not None:
                    noise = torch.randn_like(weight)
                    weight.add_(perturb * noise / module.head_dims**.5)
        return module

    return make


def grid_id(hw):
    return f'{hw[0]}x{hw[1]}'


def assert_same(actual, expected, tol, what):
    """Outputs and every gradient of two ``output_and_grads`` results agree (a parameter
    neither uses has None in both)."""
    out, grads = actual
    ref, ref_grads = expected
    assert_rel_close(out, ref, tol, f'{what}: output')
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        if grads[name] is None or ref_grads[name] is None:
            assert grads[name] is None and ref_grads[name] is None, f'{what}: grad of {name}'
        else:
            assert_rel_close(grads[name], ref_grads[name], tol, f'{what}: grad of {name}')


# ------------------------------------------------------------------ oracles written out here
def heads(module, x):
    """q, k, v as ``(B, heads, N, d)``, reshaped here rather than by the module."""
    B, N, C = x.shape
    qkv = module.qkv(x).reshape(B, N, 3, module.num_heads, module.head_dims)
    return qkv.permute(2, 0, 3, 1, 4)


def own_weight(module, keys):
    """The W a query (``keys=False``) or key is mapped with, read off the parameters here."""
    if keys and not module.tie_qk:
        return module.feature_proj_k
    return module.feature_proj


def plain_log_features(module, t, keys=False):
    projected = torch.einsum('bhnd,hde->bhne', t, own_weight(module, keys))
    if module.feature_map == 'exp':
        return torch.cat([projected, -projected], dim=-1)
    return torch.cat([projected.log_softmax(-1), (-projected).log_softmax(-1)], dim=-1)


def plain_phi(module, t, keys=False):
    """The textbook feature map, no shift of any kind."""
    projected = torch.einsum('bhnd,hde->bhne', t, own_weight(module, keys))
    if module.feature_map == 'exp':
        return torch.cat([projected.exp(), (-projected).exp()], dim=-1)
    return torch.cat([projected.softmax(-1), (-projected).softmax(-1)], dim=-1)


def plain_attention(module, x):
    """Output and map of ``A_ij = phi(q_i)^T phi(k_j) / sum_l phi(q_i)^T phi(k_l)``."""
    q, k, v = heads(module, x)
    scores = plain_phi(module, q) @ plain_phi(module, k, keys=True).transpose(-2, -1)
    attn = scores / scores.sum(dim=-1, keepdim=True)
    B, N, C = x.shape
    return module.proj((attn @ v).transpose(1, 2).reshape(B, N, C)), attn


def log_space_map(module, q, k):
    """The map from log-scores ``log sum_m exp(L(q_i)_m + L(k_j)_m)``: exact for any scale
    (O(N^2 d) memory, small inputs only)."""
    log_q, log_k = plain_log_features(module, q), plain_log_features(module, k, keys=True)
    log_scores = torch.logsumexp(log_q.unsqueeze(-2) + log_k.unsqueeze(-3), dim=-1)
    return log_scores.softmax(dim=-1)


# ------------------------------------------------------------------ against the naive oracle
@pytest.mark.parametrize('hw', ODD_GRIDS, ids=grid_id)
@pytest.mark.parametrize(**EXTRA)
@pytest.mark.parametrize(**TIE)
@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_fast_form_matches_reference(feature_map, tie_qk, num_extra, hw, make_hedgehog, tokens,
                                     assert_matches_reference):
    """Outputs and the gradients of the input and of every parameter (W's included), in
    float64, against ``forward_reference`` (the naive form)."""
    module = make_hedgehog(feature_map, tie_qk=tie_qk)
    grads = assert_matches_reference(module, tokens(hw, num_extra, scale=2.), hw)
    assert set(grads) == {'x', 'qkv.weight', 'qkv.bias', 'proj.weight', 'proj.bias',
                          'feature_proj'} | (set() if tie_qk else {'feature_proj_k'})
    assert all(grad.abs().max() > 0 for grad in grads.values())


@pytest.mark.parametrize('hw', ODD_GRIDS, ids=grid_id)
@pytest.mark.parametrize(**EXTRA)
@pytest.mark.parametrize(**TIE)
@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_map_matches_naive_map(feature_map, tie_qk, num_extra, hw, make_hedgehog, tokens,
                               output_and_grads):
    """``attention_map`` (the distillation target) against the naive map: values and the
    gradients that reach the input, ``qkv`` and W (W_k too, untied)."""
    module = make_hedgehog(feature_map, tie_qk=tie_qk)
    x = tokens(hw, num_extra, scale=2.)
    naive = output_and_grads(module, lambda t: module.naive_forward(t, hw)[1], x)
    assert naive[0].shape == (x.shape[0], module.num_heads, x.shape[1], x.shape[1])
    assert_same(output_and_grads(module, lambda t: module.attention_map(t, hw), x), naive,
                1e-10, 'map vs naive map')
    assert naive[1]['feature_proj'].abs().max() > 0
    if not tie_qk:
        assert naive[1]['feature_proj_k'].abs().max() > 0


# Everything the fast form and the map are computed with, apart from the projections and
# the parameters.
FAST_HELPERS = [(BaseAttention, 'split_heads'), (BaseAttention, 'merge_heads'),
                (hedgehog, 'float32_state'), (map_attention, 'float32_state')] + [
    (HedgehogAttention, name) for name in ('forward', 'signed_proj', 'key_feature_proj',
                                           'log_features',
                                           '_writable', '_key_features', '_linear', '_map',
                                           '_with_map', '_heads', '_project',
                                           'attention_map')]


@pytest.mark.parametrize(**TIE)
@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_reference_shares_no_helper_with_the_fast_form(feature_map, tie_qk, make_hedgehog,
                                                      tokens, monkeypatch):
    """With every helper of the fast form and the map made to raise, ``forward_reference``
    still runs and gives the fast form's output: a fault in a helper cannot move both."""
    hw = (5, 3)
    module = make_hedgehog(feature_map, tie_qk=tie_qk)
    x = tokens(hw, 1, scale=2.)
    with torch.no_grad():
        fast = module(x, hw)

    def broken(*args, **kwargs):
        raise AssertionError('the oracle called a helper of the fast form')

    for owner, name in FAST_HELPERS:
        monkeypatch.setattr(owner, name, broken)
    with torch.no_grad():
        reference = module.forward_reference(x, hw)
    assert_rel_close(reference, fast, 1e-10, 'reference vs fast output')


def test_reference_runs_in_float32_under_autocast(make_hedgehog, tokens):
    """Under bf16 autocast the oracle's map and sums run in float32; its output returns to
    the projections' dtype and stays within bf16's accuracy of the exact output."""
    hw = (4, 5)
    module = make_hedgehog('softmax', dtype=torch.float32)
    x = tokens(hw, 1, dtype=torch.float32)
    with torch.no_grad():
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out, attn = module.naive_forward(x, hw)
            reference = module.forward_reference(x, hw)
        exact = module.double()(x.double(), hw)
    assert attn.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert rel_error(reference, exact) < 2e-2


@pytest.mark.parametrize(**EXTRA)
@pytest.mark.parametrize(**TIE)
@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_stabiliser_cancels(feature_map, tie_qk, num_extra, make_hedgehog, tokens,
                            output_and_grads):
    """The fast form, the oracle and the map equal the plain formula written here, outputs
    and every gradient (W's included), at inputs whose shifts are far from zero: a shift
    that did not cancel would show."""
    hw = (4, 7)
    module = make_hedgehog(feature_map, tie_qk=tie_qk)
    x = tokens(hw, num_extra, scale={'exp': 12., 'softmax': 40.}[feature_map])
    with torch.no_grad():
        q, k, _ = heads(module, x)
        key_shift = plain_log_features(module, k, keys=True).amax(dim=-2, keepdim=True)
        query_shift = (plain_log_features(module, q) + key_shift).amax(dim=-1)
    # exp: every query's shift is beyond e^5 (the plain features reach e^20 and more);
    # softmax: some feature is below e^-5 for all keys of its head.
    assert key_shift.abs().max() > 5
    if feature_map == 'exp':
        assert query_shift.abs().min() > 5

    plain = output_and_grads(module, lambda t: plain_attention(module, t)[0], x)
    assert_same(output_and_grads(module, lambda t: module(t, hw), x), plain, 1e-10,
                'fast form vs plain formula')
    assert_same(output_and_grads(module, lambda t: module.forward_reference(t, hw), x), plain,
                1e-10, 'oracle vs plain formula')
    assert_same(output_and_grads(module, lambda t: module.attention_map(t, hw), x),
                output_and_grads(module, lambda t: plain_attention(module, t)[1], x), 1e-10,
                'map vs plain map')


@pytest.mark.parametrize('hw', [(6, 6), (4, 7)], ids=grid_id)
@pytest.mark.parametrize(**EXTRA)
@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_map_rows_sum_to_one_and_reproduce_output(feature_map, num_extra, hw, make_hedgehog,
                                                  tokens):
    module = make_hedgehog(feature_map)
    x = tokens(hw, num_extra, scale=2.)
    n = x.shape[1]
    with torch.no_grad():
        fast = module(x, hw)
        attn = module.attention_map(x, hw)
        _, _, v = heads(module, x)
        from_map = module.proj((attn @ v).transpose(1, 2).reshape(x.shape))
    assert attn.shape == (x.shape[0], module.num_heads, n, n)
    assert attn.min() > 0  # every feature is positive: no key is ever switched off
    row_sums = attn.sum(dim=-1)
    assert_rel_close(row_sums, torch.ones_like(row_sums), 1e-13, 'row sums')
    assert_rel_close(from_map, fast, 1e-10, 'proj(merge(map @ V)) vs fast output')


# ------------------------------------------------------------------ initialisation
@pytest.mark.parametrize(**TIE)
@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_feature_proj_starts_at_the_identity(feature_map, tie_qk, make_attention, tokens):
    module = make_attention('hedgehog', feature_map=feature_map, tie_qk=tie_qk)
    h, d = module.num_heads, module.head_dims
    eye = torch.eye(d, dtype=torch.float64)
    assert module.feature_proj.shape == (h, d, d)
    assert all(torch.equal(w, eye) for w in module.feature_proj)
    if tie_qk:
        assert module.feature_proj_k is None
        assert 'feature_proj_k' not in dict(module.named_parameters())
    else:
        assert module.feature_proj_k.shape == (h, d, d)
        assert all(torch.equal(w, eye) for w in module.feature_proj_k)
    # At W = I the map is the fixed one of the feature map, from q and k alone.
    x = tokens((3, 5), 1)
    with torch.no_grad():
        q, k, _ = heads(module, x)
        if feature_map == 'exp':
            phi = lambda t: torch.cat([t.exp(), (-t).exp()], dim=-1)  # noqa: E731
        else:
            phi = lambda t: torch.cat([t.softmax(-1), (-t).softmax(-1)], dim=-1)  # noqa: E731
        scores = phi(q) @ phi(k).transpose(-2, -1)
        expected = scores / scores.sum(dim=-1, keepdim=True)
        assert_rel_close(module.attention_map(x, (3, 5)), expected, 1e-12, 'map at W = I')
        module.feature_proj.mul_(3.)
        if not tie_qk:
            module.feature_proj_k.mul_(2.)
        module.reset_feature_proj()
    assert all(torch.equal(w, eye) for w in module.feature_proj)
    if not tie_qk:
        assert all(torch.equal(w, eye) for w in module.feature_proj_k)


@pytest.mark.parametrize(**TIE)
def test_kaiming_uniform_init_is_lolcats(tie_qk, make_attention):
    """``feature_init='kaiming_uniform'``: ``kaiming_uniform_`` on the whole ``(heads, d, d)``
    tensor, as LoLCATs' ``FeatureMapMLP`` draws its layer (bound ``sqrt(6 / (d * d))``:
    PyTorch's fan-in of a 3-d tensor is ``d`` inputs times ``d`` "receptive field"); untied,
    the keys' map starts as a copy of the queries' (LoLCATs deep-copies it)."""
    module = make_attention('hedgehog', embed_dims=64, num_heads=2, seed=3, tie_qk=tie_qk,
                            feature_init='kaiming_uniform')
    h, d = module.num_heads, module.head_dims
    torch.manual_seed(3)
    module.reset_feature_proj()
    drawn = module.feature_proj.detach().clone()
    torch.manual_seed(3)
    expected = torch.empty(h, d, d, dtype=torch.float64)
    torch.nn.init.kaiming_uniform_(expected)
    assert torch.equal(drawn, expected)
    bound = (6 / (d * d))**.5
    assert drawn.abs().max() <= bound and drawn.abs().max() > .9 * bound
    assert_rel_close(drawn.std(), torch.tensor(bound / 3**.5, dtype=drawn.dtype), .05,
                     'std of U(-b, b)')
    if not tie_qk:
        assert torch.equal(module.feature_proj_k, module.feature_proj)
        assert module.feature_proj_k.data_ptr() != module.feature_proj.data_ptr()


def test_untied_key_map_is_its_own(make_hedgehog, tokens):
    """Untied, flipping W_k moves the output to the plain formula with the keys' map alone
    flipped (the queries keep W)."""
    hw = (4, 5)
    module = make_hedgehog('softmax', tie_qk=False)
    x = tokens(hw, 1, scale=2.)
    with torch.no_grad():
        before = module(x, hw)
        q, k, v = heads(module, x)
        module.feature_proj_k.mul_(-1.)
        after = module(x, hw)
        # The plain formula with the keys' map alone flipped.
        scores = plain_phi(module, q) @ plain_phi(module, k, keys=True).transpose(-2, -1)
        attn = scores / scores.sum(dim=-1, keepdim=True)
        expected = module.proj((attn @ v).transpose(1, 2).reshape(x.shape))
    assert rel_error(after, before) > 1e-2
    assert_rel_close(after, expected, 1e-10, 'output with W_k flipped')


# ------------------------------------------------------------------ LoLCATs' own forward
# Written here from LoLCATs' code (``src/model/feature_map.py``, ``FeatureMapMLP`` and the
# ``softmax_dim`` / ``exp_dim`` activations; the quadratic attention of
# ``src/model/linear_attention/linear_attention.py``, without its causal mask): the layer
# is ``einsum('hdf,bhld->bhlf', W, x)``, the activations clamp at eps = 1e-12, and the map
# is ``a / (a.sum(-1) + eps)`` of the unscaled feature products.
LOLCATS_EPS = 1e-12


def lolcats_mlp(weight, x):
    return torch.einsum('hdf,bhld->bhlf', weight, x)


def lolcats_softmax_dim(x):
    return torch.cat([torch.softmax(x, dim=-1), torch.softmax(-x, dim=-1)],
                     dim=-1).clamp(min=LOLCATS_EPS)


def lolcats_exp_dim(x):
    top = torch.amax(x, dim=-1, keepdim=True)
    bottom = torch.amin(x, dim=-1, keepdim=True)
    return torch.cat([torch.exp(x - top), torch.exp(-x + bottom)], dim=-1).clamp(min=LOLCATS_EPS)


def lolcats_attention(q, k, v, query_weight, key_weight, activation):
    """LoLCATs' non-causal attention of ``(B, heads, N, d)`` heads."""
    phi_q = activation(lolcats_mlp(query_weight, q))
    phi_k = activation(lolcats_mlp(key_weight, k))
    a = torch.einsum('bhmd,bhnd->bhmn', phi_q, phi_k)
    a = a / (a.sum(dim=-1, keepdim=True) + LOLCATS_EPS)
    return torch.einsum('bhmn,bhnd->bhmd', a, v)


@pytest.mark.parametrize(**TIE)
@pytest.mark.parametrize('init', ['kaiming_uniform', 'identity'])
def test_softmax_map_equals_lolcats(init, tie_qk, make_hedgehog, tokens):
    """``feature_map='softmax'`` is LoLCATs' ``softmax_dim`` attention, tied and untied (the
    released configs: ``untied_head_einsum``, ``tie_qk_kernels: false``, ``zero_init:
    false``), at LoLCATs' init and off it, to 1e-6 in float64."""
    hw = (6, 5)
    module = make_hedgehog('softmax', tie_qk=tie_qk, feature_init=init)
    x = tokens(hw, 1, scale=2.)
    with torch.no_grad():
        q, k, v = heads(module, x)
        key_weight = module.feature_proj if tie_qk else module.feature_proj_k
        theirs = lolcats_attention(q, k, v, module.feature_proj, key_weight, lolcats_softmax_dim)
        expected = module.proj(theirs.transpose(1, 2).reshape(x.shape))
        ours = module(x, hw)
    assert_rel_close(ours, expected, 1e-6, "output vs LoLCATs' softmax_dim attention")


def test_exp_map_is_hedgehogs_not_lolcats_exp_dim(make_hedgehog, tokens):
    """``feature_map='exp'`` is the Hedgehog formula (plain exponentials; here with each
    query's features divided by one common factor, which the row normalisation cancels);
    LoLCATs' ``exp_dim`` divides each half of every query and key by its own extreme, and
    that is another attention."""
    hw = (6, 5)
    module = make_hedgehog('exp', tie_qk=False, feature_init='kaiming_uniform')
    x = tokens(hw, 1, scale=2.)
    with torch.no_grad():
        q, k, v = heads(module, x)
        ours = module(x, hw)
        merged = lambda t: module.proj(t.transpose(1, 2).reshape(x.shape))  # noqa: E731
        phi_q = lolcats_mlp(module.feature_proj, q)
        phi_q = torch.cat([phi_q, -phi_q], dim=-1)
        phi_q = (phi_q - phi_q.amax(dim=-1, keepdim=True)).exp()
        phi_k = lolcats_mlp(module.feature_proj_k, k)
        phi_k = torch.cat([phi_k.exp(), (-phi_k).exp()], dim=-1)
        a = phi_q @ phi_k.transpose(-2, -1)
        hedgehog = merged((a / a.sum(dim=-1, keepdim=True)) @ v)
        lolcats = merged(lolcats_attention(q, k, v, module.feature_proj, module.feature_proj_k,
                                           lolcats_exp_dim))
    assert_rel_close(ours, hedgehog, 1e-6, 'output vs the Hedgehog formula')
    assert rel_error(ours, lolcats) > 1e-2


# ------------------------------------------------------------------ numerics
@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_large_inputs_stay_finite_in_float32(feature_map, make_hedgehog, tokens,
                                             output_and_grads):
    """Inputs where the plain float32 exp overflows: the output stays finite and equals the
    float64 plain formula, and the backward pass is finite."""
    hw = (4, 7)
    module = make_hedgehog(feature_map, dtype=torch.float32)
    x = tokens(hw, 1, dtype=torch.float32, scale=60.)
    with torch.no_grad():
        q, k, _ = heads(module, x)
        projected = torch.einsum('bhnd,hde->bhne', q, module.feature_proj)
        assert torch.isinf(projected.abs().exp()).any(), 'the plain exp does not overflow'
        if feature_map == 'exp':
            assert not torch.isfinite(plain_attention(module, x)[0]).all()
        out = module(x, hw)
        exact = plain_attention(module.double(), x.double())[0]
        module.float()
    assert torch.isfinite(out).all()
    assert rel_error(out, exact) < 1e-4
    _, grads = output_and_grads(module, lambda t: module(t, hw), x)
    assert all(torch.isfinite(grad).all() for grad in grads.values())


@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_misaligned_queries_and_keys_keep_their_map(feature_map, make_attention):
    """Every query peaks on features no key has (q = s(e0 - e1), k = s(e2 - e3) + noise): the
    plain float32 scores underflow to 0 (softmax) or overflow (exp), giving 0/0 rows; both
    forms keep the exact log-space map."""
    module = make_attention('hedgehog', dtype=torch.float32, feature_map=feature_map)
    h, d = module.num_heads, module.head_dims
    n, s = 12, 200.
    basis = torch.eye(d)
    q = (s * (basis[0] - basis[1])).expand(1, h, n, d).clone()
    k = s * (basis[2] - basis[3]) + 3 * torch.randn(1, h, n, d)
    v = torch.randn(1, h, n, d)
    with torch.no_grad():
        plain_scores = plain_phi(module, q) @ plain_phi(module, k).transpose(-2, -1)
        plain = plain_scores / plain_scores.sum(dim=-1, keepdim=True)
        assert not torch.isfinite(plain).any()
        exact = log_space_map(module.double(), q.double(), k.double())
        module.float()
        attn = module._map(q, k)
        out = module._linear(q, k, v)
    assert torch.isfinite(attn).all() and torch.isfinite(out).all()
    assert_rel_close(attn, exact, 1e-4, 'map vs log-space map')
    assert_rel_close(out, exact @ v.double(), 1e-4, 'output vs log-space map @ V')


@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_bf16_autocast_keeps_q_k_v_and_states_in_bf16(feature_map, make_hedgehog, tokens,
                                                      recorded_ops, autocast_output):
    """No float32 copy of anything the size of q, k or v: bf16 has float32's range, and its
    products accumulate in float32; only fp16 is upcast (state_inputs)."""
    module = make_hedgehog(feature_map, dtype=torch.float32)
    hw = (16, 16)
    x = tokens(hw, 1, dtype=torch.float32)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        q, k, v = module.split_heads(module.qkv(x))
        ops = recorded_ops(lambda: module._linear(q, k, v))
    assert q.dtype == torch.bfloat16
    large_float32 = [(name, numel) for name, dtype, numel in ops
                     if dtype == torch.float32 and numel >= q.numel()]
    assert not large_float32, large_float32
    names = {name for name, _, _ in ops}
    assert {'bmm', 'exp_', 'div'} <= names and any('softmax' in name for name in names)
    out, exact = autocast_output(module, x, hw, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # bf16 projections limit the accuracy to a few 1e-3.
    assert rel_error(out, exact) < 2e-2


class StorageRecorder(TorchDispatchMode):
    """The storages of the tensors of ``numel`` elements that aten ops return."""

    def __init__(self, numel):
        super().__init__()
        self.numel = numel
        self.storages = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == self.numel:
            self.storages.add(out.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_inference_reuses_its_buffers(feature_map, make_hedgehog, tokens):
    """Without autograd every N x 2d intermediate of the PyTorch form overwrites the product it
    came from (two buffers: the products of q and k), with the output of the autograd path."""
    module = make_hedgehog(feature_map)
    hw = (6, 6)
    with torch.no_grad():
        q, k, v = module.split_heads(module.qkv(tokens(hw, 1, scale=2.)))
    with_autograd = module._linear(q, k, v)
    assert with_autograd.requires_grad  # feature_proj's
    with torch.no_grad(), StorageRecorder(numel=2 * q.numel()) as recorder:
        without = module._linear(q, k, v)
    assert len(recorder.storages) == 2
    assert_rel_close(without, with_autograd, 1e-14, 'output without autograd')


# ------------------------------------------------------------------ traits and costs
def test_traits(make_attention):
    cls = attention_class('hedgehog')
    assert cls is HedgehogAttention and cls.attn_type == 'hedgehog'
    assert cls.has_map and cls.uses_cls_token and cls.has_qk_form
    assert cls.softmax_fill == {'qkv': WHOLE, 'proj': WHOLE}
    assert not cls.supports_rope and cls.rope_absent_because
    assert ("feature_map='softmax', tie_qk=True, feature_init='identity'"
            in repr(make_attention('hedgehog')))
    assert ("tie_qk=False, feature_init='kaiming_uniform'"
            in repr(make_attention('hedgehog', tie_qk=False, feature_init='kaiming_uniform')))


def test_bad_settings_are_refused(make_attention):
    with pytest.raises(ValueError, match="unknown feature_map 'relu'.*softmax, exp"):
        make_attention('hedgehog', feature_map='relu')
    with pytest.raises(ValueError, match="unknown feature_map 'relu'"):
        naive_hedgehog_attention(torch.zeros(1, 2, 6), torch.zeros(1, 2, 2), 'relu')
    with pytest.raises(ValueError,
                       match="unknown feature_init 'zeros'.*identity, kaiming_uniform"):
        make_attention('hedgehog', feature_init='zeros')
    with pytest.raises(ValueError, match="'hedgehog' operator does not carry RoPE"):
        make_attention('hedgehog', rope=dict(type='eva', ref_grid=(4, 4)))
    with pytest.raises(ValueError, match='attn_drop=0.1'):
        make_attention('hedgehog', attn_drop=.1)


class MacCounter(TorchDispatchMode):
    """Multiply-accumulates of the contractions and token sums an aten op runs."""

    def __init__(self):
        super().__init__()
        self.macs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == 'bmm':
            (b, n, m), (_, _, p) = args[0].shape, args[1].shape
            self.macs += b * n * m * p
        elif name == 'mm':
            (n, m), (_, p) = args[0].shape, args[1].shape
            self.macs += n * m * p
        elif name in ('matmul', 'addmm', 'baddbmm', 'einsum', 'mv', 'dot'):
            raise AssertionError(f'count {name} too')
        elif name == 'sum':
            self.macs += args[0].numel()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_core_macs_counts_the_fast_form(feature_map, make_hedgehog, tokens):
    """``core_macs`` = 6 N C d + 2 N C: the contractions and token sums of the fast form,
    which multiplies by ``[W, -W]``, 2 N C d more than the -x W half needs."""
    module = make_hedgehog(feature_map, dtype=torch.float32)
    hw, num_extra, batch = (5, 6), 1, 2
    x = tokens(hw, num_extra, batch=batch, dtype=torch.float32)
    n, C, d = x.shape[1], module.embed_dims, module.head_dims
    with torch.no_grad():
        q, k, v = module.split_heads(module.qkv(x))
        with MacCounter() as counter:
            module._linear(q, k, v)
    assert module.core_macs(n, hw) == 6 * n * C * d + 2 * n * C
    assert counter.macs == batch * (module.core_macs(n, hw) + 2 * n * C * d)


# ------------------------------------------------------------------ in the model
def tiny_vit(attn_type, **kwargs):
    torch.manual_seed(0)
    model = LinearViT(arch=TINY_ARCH, attn_type=attn_type, img_size=32, patch_size=8, **kwargs)
    model.init_weights()
    return model


def identity_heads(layer):
    maps = [layer.attn.feature_proj] + ([] if layer.attn.tie_qk else [layer.attn.feature_proj_k])
    return all(torch.equal(w, torch.eye(w.shape[-1])) for weight in maps for w in weight)


@pytest.mark.parametrize(**TIE)
@pytest.mark.parametrize('setting', ['copy', 'fullcopy'])
def test_transfer_copies_qkv_and_proj_and_keeps_w_at_identity(setting, tie_qk):
    teacher = tiny_vit('softmax')
    student = tiny_vit('hedgehog', attn_cfg=dict(tie_qk=tie_qk))
    checkpoint = {f'backbone.{name}': t for name, t in teacher.state_dict().items()}
    report = transfer_softmax_weights(student, checkpoint, setting=setting)
    for index, (layer, teacher_layer) in enumerate(zip(student.layers, teacher.layers)):
        assert identity_heads(layer)
        names = ['feature_proj'] + ([] if tie_qk else ['feature_proj_k'])
        for name in names:
            assert report['kept own init'][f'layers.{index}.attn.{name}'] == 'operator-specific'
        for linear in ('qkv', 'proj'):
            for param in ('weight', 'bias'):
                assert f'layers.{index}.attn.{linear}.{param}' in report['copied']
                assert torch.equal(getattr(getattr(layer.attn, linear), param),
                                   getattr(getattr(teacher_layer.attn, linear), param))
    out, = student(torch.randn(2, 3, 32, 32))
    assert torch.isfinite(out).all()


def test_mimetic_shapes_the_qk_rows_and_leaves_w_alone():
    """``has_qk_form``: the analytic settings apply; W stays the identity."""
    student = tiny_vit('hedgehog')
    before = student.layers[0].attn.qkv.weight.detach().clone()
    report = transfer_softmax_weights(student, setting='mimetic')
    assert 'layers.0.attn.qkv.weight' in report['analytic']
    assert not torch.equal(student.layers[0].attn.qkv.weight, before)
    assert all(identity_heads(layer) for layer in student.layers)


@pytest.mark.parametrize('feature_map', FEATURE_MAPS)
def test_linear_vit_forward_backward(feature_map):
    model = tiny_vit('hedgehog', attn_cfg=dict(feature_map=feature_map))
    assert model.with_cls_token and model.pos_embed is not None
    assert all(layer.attn.feature_map == feature_map for layer in model.layers)
    images = torch.randn(2, 3, 32, 40)  # a 4 x 5 patch grid, not the 4 x 4 of img_size
    out, = model(images)
    assert out.shape == (2, TINY_ARCH['embed_dims']) and torch.isfinite(out).all()
    out.pow(2).mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert all(layer.attn.feature_proj.grad.abs().max() > 0 for layer in model.layers)


class LossModel(nn.Module):
    """The least a model needs for the hook: a ``backbone`` and a ``mode='loss'`` forward."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def forward(self, inputs, mode='loss'):
        features, = self.backbone(inputs)
        return dict(loss=0. * features.sum())


def test_map_distillation_trains_the_feature_map(teacher_ckpt):
    """Hedgehog's recipe through ``AttentionDistillHook(target='map')``: a student with the
    teacher's weights, W alone trained on the map loss; the loss reaches W and falls."""
    arch = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)
    geometry = dict(arch=arch, img_size=32, patch_size=8)
    student = LinearViT(attn_type='hedgehog', **geometry)
    assert not student.load_state_dict(torch.load(teacher_ckpt), strict=False).unexpected_keys
    model = LossModel(student)
    hook = AttentionDistillHook(
        teacher=dict(type='LinearViT', attn_type='softmax', **geometry,
                     init_cfg=dict(type='Pretrained', checkpoint=str(teacher_ckpt))),
        target='map', loss_weight=50.)
    runner = SimpleNamespace(model=model, logger=MMLogger.get_current_instance(), epoch=0,
                             iter=0)
    hook.before_train(runner)
    feature_projs = [layer.attn.feature_proj for layer in student.layers]
    optimizer = torch.optim.Adam(feature_projs, lr=.05)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    model.train()
    losses = []
    for step in range(8):
        runner.iter = step
        hook.before_train_iter(runner, step)
        optimizer.zero_grad()
        loss = model(images, mode='loss')['loss_distill']
        loss.backward()
        if step == 0:
            assert all(w.grad.abs().max() > 0 for w in feature_projs)
        optimizer.step()
        hook.after_train_iter(runner, step)
        losses.append(loss.item())
    hook.after_train(runner)
    assert losses[0] > 0 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < .7 * losses[0], losses
