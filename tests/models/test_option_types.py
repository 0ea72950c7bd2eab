"""Every operator and backbone switch is checked by kind when the module is built: a bool
switch takes True / False only (not 'False', not None), a number is finite, a word is a str."""
import inspect
import math

import pytest
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.models.attention import attention_class, attention_types, build_attention
from linvit_mm.testing.staged import tiny_vit_cfg

# (a wrong value, the error, the words of the message) for a switch by the kind of its default
WRONG = {
    bool: [('False', TypeError, 'must be True or False'),
           (None, TypeError, 'must be True or False'),
           (1, TypeError, 'must be True or False')],
    float: [(math.inf, ValueError, 'must be a finite number'),
            (math.nan, ValueError, 'must be a finite number'),
            ('1e-6', TypeError, 'must be a number'),
            (True, TypeError, 'must be a number')],
    str: [(1, TypeError, 'must be a string'), (None, TypeError, 'must be a string')],
}


def switch_cases():
    cases = []
    for attn_type in attention_types():
        operator = attention_class(attn_type)
        parameters = inspect.signature(operator).parameters
        for name in operator.options:
            default = parameters[name].default
            kind = bool if isinstance(default, bool) else float if isinstance(
                default, (int, float)) else str if isinstance(default, str) else None
            for value, error, words in WRONG.get(kind, []):
                cases.append(pytest.param(attn_type, name, value, error, words,
                                          id=f'{attn_type}-{name}={value!r}'))
    return cases


@pytest.mark.parametrize('attn_type, name, value, error, words', switch_cases())
def test_an_operator_switch_of_the_wrong_kind_is_refused_by_name(attn_type, name, value, error,
                                                                 words):
    with pytest.raises(error, match=rf"the '{attn_type}' operator: {name} {words}, got "):
        build_attention(attn_type, embed_dims=32, num_heads=2, **{name: value})


def test_every_operator_has_switches_of_each_kind_checked():
    """The cases above reach the switches that were read by truthiness."""
    ids = {case.id.split('=')[0] for case in switch_cases()}
    assert {'hedgehog-tie_qk', 'mhla-attn_norm', 'mhla-feature_floor', 'inline-residual',
            'ttt-inner_scale', 'relu-eps'} <= ids


@pytest.mark.parametrize('overrides, error, words', [
    (dict(with_cls_token='False'), TypeError, 'with_cls_token must be True, False or None'),
    (dict(final_norm='no'), TypeError, 'final_norm must be True or False'),
    (dict(pre_norm=0), TypeError, 'pre_norm must be True or False'),
    (dict(with_cp='yes'), TypeError, 'with_cp must be True or False'),
    (dict(drop_path_rate=math.nan), ValueError, 'drop_path_rate must be a finite number'),
    (dict(drop_path_rate=-0.1), ValueError, r'drop_path_rate must be in \[0, 1\)'),
    (dict(drop_rate=1.0), ValueError, r'drop_rate must be in \[0, 1\)'),
    (dict(layer_scale_init_value=True), TypeError, 'layer_scale_init_value must be a number'),
    (dict(interpolate_mode=3), TypeError, 'interpolate_mode must be a string'),
], ids=lambda value: str(value) if isinstance(value, dict) else '')
def test_a_backbone_switch_of_the_wrong_kind_is_refused_by_name(overrides, error, words):
    with pytest.raises(error, match=f'LinearViT: {words}'):
        MODELS.build(tiny_vit_cfg('relu', **overrides))


def test_switches_of_the_right_kind_build():
    MODELS.build(tiny_vit_cfg('hedgehog', with_cls_token=True, drop_path_rate=0,
                              attn_cfg=dict(tie_qk=False, feature_map='exp')))
    build_attention('mhla', embed_dims=32, num_heads=2, eps=1, feature_floor=0)
