"""The operator registry and the interface every registered operator keeps (``base.py``)."""
import pytest
import torch
from mmpretrain.registry import MODELS
from torch import nn

from linvit_mm.models import LinearViT
from linvit_mm.models.attention import (ATTENTIONS, SOFTMAX_FILLS, BaseAttention,
                                        ELUAttention, InLineAttention, MultiHeadLinearAttention,
                                        ReLUAttention, SoftmaxAttention, TTTAttention,
                                        attention_class, attention_types, build_attention,
                                        register_attention)
from linvit_mm.testing import assert_rel_close

OPERATORS = attention_types()
MAP_OPERATORS = [name for name in OPERATORS if attention_class(name).has_map]
GRIDS = [(14, 14), (7, 9), (5, 3)]


def test_builtin_operators_are_registered_softmax_first():
    builtin = {'softmax': SoftmaxAttention, 'elu': ELUAttention, 'relu': ReLUAttention,
               'inline': InLineAttention, 'mhla': MultiHeadLinearAttention, 'ttt': TTTAttention}
    assert OPERATORS[0] == 'softmax'
    for name, cls in builtin.items():
        assert attention_class(name) is cls and cls.attn_type == name


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_traits_are_declared(attn_type):
    cls = attention_class(attn_type)
    assert set(cls.softmax_fill) == {'qkv', 'proj'}
    assert set(cls.softmax_fill.values()) <= set(SOFTMAX_FILLS)
    assert cls.has_qk_form or isinstance(cls.qk_form_absent_because, str)
    module = build_attention(attn_type, embed_dims=24, num_heads=3)
    assert module.core_macs(10, (3, 3)) > 0
    assert not hasattr(module, 'init_weights')  # the backbone's init reaches the linears


@pytest.mark.parametrize('name', ['nope', None, 'VisionTransformer', ''],
                         ids=['unregistered', 'none', 'parent-registry', 'empty'])
def test_unknown_attention_type_lists_valid_names(name):
    if name == 'VisionTransformer':
        # in the parent registry (mmpretrain's models), which lookups also search
        assert ATTENTIONS.get(name) is MODELS.get(name) is not None
    with pytest.raises(ValueError, match=f'unknown attention type {name!r}') as info:
        build_attention(name, embed_dims=24, num_heads=3)
    for valid in OPERATORS:
        assert valid in str(info.value)


def test_an_empty_attn_type_of_a_linear_vit_lists_valid_names():
    with pytest.raises(ValueError, match="attn_type: unknown attention type ''; valid types "
                       'are: softmax'):
        LinearViT(arch=dict(embed_dims=24, num_layers=1, num_heads=3, feedforward_channels=48),
                  attn_type='', img_size=16, patch_size=8)


def test_build_attention_from_a_config_dict():
    cfg = {'type': 'relu', 'embed_dims': 24, 'num_heads': 3, 'eps': 1e-3}
    module = build_attention(cfg)
    assert isinstance(module, ReLUAttention)
    assert (module.embed_dims, module.num_heads, module.eps) == (24, 3, 1e-3)
    assert cfg['type'] == 'relu'  # the caller's dict is left as it was
    # keyword arguments override the dict's
    assert build_attention(cfg, num_heads=2).num_heads == 2
    with pytest.raises(ValueError, match='unknown attention type None'):
        build_attention({'embed_dims': 24, 'num_heads': 3})


def test_register_attention_refuses_non_operators_and_taken_names():
    with pytest.raises(TypeError, match='not a BaseAttention subclass'):
        register_attention('linear')(nn.Linear)

    class Impostor(SoftmaxAttention):
        pass

    with pytest.raises(KeyError, match='softmax'):
        register_attention('softmax')(Impostor)
    assert attention_class('softmax') is SoftmaxAttention


class MeanValueAttention(BaseAttention):
    """Every token reads the mean of the values: a uniform map, computed in O(N)."""

    uses_cls_token = False

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop)
        self.qkv = nn.Linear(embed_dims, 3 * embed_dims, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)

    def _values(self, x, hw_shape):
        self.num_extra_tokens(x, hw_shape)
        return self.qkv(x).chunk(3, dim=-1)[2]

    def forward(self, x, hw_shape):
        v = self._values(x, hw_shape)
        return self.proj(v.mean(dim=1, keepdim=True).expand_as(v))

    def forward_reference(self, x, hw_shape):
        v = self._values(x, hw_shape)
        n = v.shape[1]
        uniform = torch.full((n, n), 1 / n, dtype=v.dtype, device=v.device)
        return self.proj(uniform @ v)

    def core_macs(self, num_tokens, hw_shape):
        return num_tokens * self.embed_dims


def test_an_operator_that_declares_no_trait_gets_the_documented_ones():
    class Plain(BaseAttention):
        def forward(self, x, hw_shape):
            return self.proj(x)

    assert (Plain.has_map, Plain.uses_cls_token, Plain.supports_attn_drop) == (False, True, False)


def test_an_operator_that_passes_no_switch_gets_the_documented_defaults():
    """``BaseAttention(embed_dims, num_heads)``: no attention dropout (which an operator
    without the N x N map must refuse), no output dropout, no LayerScale. (``qkv_bias`` is
    each operator's own: the base builds no ``qkv``; every built-in operator's default is
    pinned in its own file.)"""
    class Plain(BaseAttention):
        def forward(self, x, hw_shape):
            return x

        forward_reference = forward

        def core_macs(self, num_tokens, hw_shape):
            return 0

    attn = Plain(24, 3).train()
    assert attn.attn_drop == 0 and attn.proj_drop.p == 0
    assert isinstance(attn.gamma1, nn.Identity)
    x = torch.randn(2, 5, 24)
    torch.testing.assert_close(attn.gamma1(attn.proj_drop(x)), x, rtol=0, atol=0)


def test_third_party_operator_builds_into_a_linear_vit(assert_matches_reference, tokens):
    try:
        register_attention('myop')(MeanValueAttention)
        assert 'myop' in attention_types() and attention_class('myop') is MeanValueAttention
        model = LinearViT(arch=dict(embed_dims=24, num_layers=2, num_heads=3,
                                    feedforward_channels=48), attn_type='myop', img_size=32)
        model.init_weights()
        assert all(type(layer.attn) is MeanValueAttention for layer in model.layers)
        assert not model.with_cls_token  # the operator's trait, read by the backbone
        out, = model(torch.randn(2, 3, 32, 32))
        assert out.shape == (2, 24) and torch.isfinite(out).all()
        attn = build_attention({'type': 'myop', 'embed_dims': 24, 'num_heads': 3}).double()
        assert attn.attn_type == 'myop'
        assert_matches_reference(attn, tokens((3, 3), 0), (3, 3))
    finally:
        ATTENTIONS.module_dict.pop('myop', None)
    assert 'myop' not in attention_types()


# ---------------------------------------------------------------- every registered operator

@pytest.mark.parametrize('hw', GRIDS)
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('attn_type', OPERATORS)
def test_fast_form_matches_reference(attn_type, num_extra, hw, device, make_attention, tokens,
                                     assert_matches_reference):
    """Output and gradients of ``forward`` against ``forward_reference``, default parameters
    (the operators' own tests add parameters that default initialisations leave out)."""
    module = make_attention(attn_type, device=device)
    grads = assert_matches_reference(module, tokens(hw, num_extra, device=device), hw)
    assert grads['qkv.weight'] is not None and grads['proj.weight'] is not None


@pytest.mark.parametrize('hw', [(14, 14), (7, 9)])
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('attn_type', MAP_OPERATORS)
def test_map_reproduces_output(attn_type, num_extra, hw, make_attention, tokens):
    module = make_attention(attn_type)
    x = tokens(hw, num_extra)
    n = x.shape[1]
    with torch.no_grad():
        attn = module.attention_map(x, hw)
        _, _, v = module.split_heads(module.qkv(x))
        from_map = module.proj(module.merge_heads(attn @ v))
        assert attn.shape == (x.shape[0], module.num_heads, n, n)
        assert_rel_close(from_map, module(x, hw), 1e-10, 'proj(merge(map @ V)) vs fast output')


@pytest.mark.parametrize('attn_type', [name for name in OPERATORS if name not in MAP_OPERATORS])
def test_operators_without_a_map_refuse_attention_map(attn_type, make_attention, tokens):
    with pytest.raises(TypeError, match=f'{attn_type!r} operator has no attention map; '
                       f'operators with one: {", ".join(MAP_OPERATORS)}'):
        make_attention(attn_type).attention_map(tokens((3, 3), 0), (3, 3))


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_grid_larger_than_sequence_is_rejected(attn_type, make_attention, tokens):
    module = make_attention(attn_type)
    with pytest.raises(ValueError, match='9 tokens cannot hold a 4x4 grid'):
        module(tokens((3, 3), 0), (4, 4))


@pytest.mark.parametrize('attn_type', [name for name in OPERATORS
                                       if hasattr(attention_class(name), 'naive_forward')])
def test_the_oracle_rejects_the_grid_the_fast_form_rejects(attn_type, make_attention, tokens):
    module = make_attention(attn_type)
    with pytest.raises(ValueError, match='9 tokens cannot hold a 4x4 grid'):
        module.naive_forward(tokens((3, 3), 0), (4, 4))


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_attention_dropout_only_where_a_map_is_formed(attn_type, make_attention):
    if attention_class(attn_type).supports_attn_drop:
        assert make_attention(attn_type, attn_drop=0.1).attn_drop == 0.1
        return
    with pytest.raises(ValueError, match=f'attn_drop=0.1: the {attn_type!r} operator never'):
        make_attention(attn_type, attn_drop=0.1)


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_heads_must_divide_channels(attn_type):
    with pytest.raises(ValueError, match='embed_dims=25 is not divisible by num_heads=3'):
        build_attention(attn_type, embed_dims=25, num_heads=3)


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_layer_scale_scales_the_operator_output(attn_type, make_attention, tokens):
    """LayerScale ``gamma1`` (mmpretrain's name) acts after ``proj``, inside the operator, so
    what a forward hook on the operator (the distillation hook) records is scaled."""
    hw = (4, 5)
    plain = make_attention(attn_type)
    scaled = make_attention(attn_type, layer_scale_init_value=0.5)
    assert plain.state_dict().keys() | {'gamma1.weight'} == scaled.state_dict().keys()
    torch.testing.assert_close(scaled.gamma1.weight, torch.full((24, ), .5, dtype=torch.float64))
    with torch.no_grad():
        scaled.gamma1.weight.uniform_(-1, 1)
    recorded = []
    scaled.register_forward_hook(lambda module, args, out: recorded.append(out))
    x = tokens(hw, 1)
    with torch.no_grad():
        for form in ('__call__', 'forward_reference'):
            expected = scaled.gamma1.weight * getattr(plain, form)(x, hw)
            assert_rel_close(getattr(scaled, form)(x, hw), expected, 1e-12, form)
        assert_rel_close(recorded[0], scaled.gamma1.weight * plain(x, hw), 1e-12, 'recorded')
    with pytest.raises(ValueError, match='layer_scale_init_value must be >= 0'):
        make_attention(attn_type, layer_scale_init_value=-1.)


def test_state_inputs_upcast_fp16_only():
    from linvit_mm.models.attention.base import float32_state, state_inputs
    half, brain, single = (torch.ones(2, dtype=d) for d in (torch.float16, torch.bfloat16,
                                                            torch.float32))
    assert [t.dtype for t in state_inputs(half, brain, single)] == [
        torch.float32, torch.bfloat16, torch.float32]
    assert [t.dtype for t in float32_state(half, brain)] == [torch.float32] * 2
