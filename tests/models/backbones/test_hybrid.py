"""linvit_mm.models.backbones.hybrid: per-block operators from a name, a list, a dict or the
compact form; the compact description; the class-token rule of a mix."""
import pytest

from linvit_mm.models.backbones.hybrid import (class_token_of, describe_attn_types,
                                               parse_attn_spec, resolve_attn_types)

RELU_ENDS = ['softmax'] + ['relu'] * 10 + ['softmax']


@pytest.mark.parametrize('attn_type', [
    dict(default='relu', softmax=[0, 11]),
    dict(default='relu', softmax=[0, -1]),
    dict(default='relu', softmax=(-12, 11), relu=[5]),
    RELU_ENDS,
    tuple(RELU_ENDS),
    'relu+softmax@0,11',
    'relu+softmax@0,-1',
], ids=['dict', 'dict-negative', 'dict-default-listed', 'list', 'tuple', 'compact',
        'compact-negative'])
def test_every_form_gives_the_same_blocks(attn_type):
    assert resolve_attn_types(attn_type, 12) == RELU_ENDS


def test_a_name_is_every_block():
    assert resolve_attn_types('mhla', 3) == ['mhla'] * 3
    assert parse_attn_spec('mhla') == 'mhla'


@pytest.mark.parametrize('types', [
    ['relu'] * 4,
    ['softmax', 'relu', 'relu', 'softmax'],
    ['softmax', 'elu', 'hedgehog', 'softmax', 'elu', 'relu'],
    ['mhla', 'softmax'],
    ['softmax', 'softmax', 'relu'],
], ids=['uniform', 'tie', 'three-operators', 'two-blocks', 'mostly-softmax'])
def test_description_builds_the_same_blocks(types):
    described = describe_attn_types(types)
    assert resolve_attn_types(described, len(types)) == types


def test_description_reads_as_a_linear_model_with_softmax_blocks():
    assert describe_attn_types(RELU_ENDS) == 'relu+softmax@0,11'
    assert describe_attn_types(['relu'] * 3) == 'relu'
    # a tie goes to the operator that is not Softmax
    assert describe_attn_types(['softmax', 'relu', 'relu', 'softmax']) == 'relu+softmax@0,3'
    assert describe_attn_types(['softmax', 'softmax', 'relu']) == 'softmax+relu@2'
    assert describe_attn_types(['elu', 'hedgehog', 'relu', 'hedgehog']) == \
        'hedgehog+elu@0+relu@2'
    assert parse_attn_spec('hedgehog+elu@0+relu@2') == dict(default='hedgehog', elu=[0],
                                                            relu=[2])


@pytest.mark.parametrize('attn_type, error, message', [
    (['relu'] * 11, ValueError, 'attn_type lists 11 operators for a model of 12 blocks'),
    (['relu'] * 11 + ['performer'], ValueError,
     r"attn_type\[11\]: unknown attention type 'performer'; valid types are: softmax"),
    (dict(softmax=[0, 11]), ValueError, "has no 'default': the operator of the blocks not"),
    (dict(default='relu', softmax=[0, 12]), ValueError,
     r"attn_type\['softmax'\] holds block 12, outside the 12 blocks of the model \(valid: "
     r'-12 to 11\)'),
    (dict(default='relu', softmax=[-13]), ValueError, 'holds block -13, outside'),
    (dict(default='relu', softmax=[0, 0]), ValueError,
     "block 0 is given twice in attn_type .as 0 under 'softmax', already under 'softmax'"),
    (dict(default='relu', softmax=[11], elu=[-1]), ValueError,
     "block 11 is given twice in attn_type .as -1 under 'elu', already under 'softmax'"),
    (dict(default='relu', performer=[3]), ValueError,
     "attn_type key 'performer': unknown attention type 'performer'"),
    (dict(default='performer'), ValueError,
     r"attn_type\['default'\]: unknown attention type 'performer'"),
    (dict(default='relu', softmax=3), TypeError,
     r"attn_type\['softmax'\] must be a list of block indices, got 3"),
    (dict(default='relu', softmax=[0.0]), TypeError, 'holds 0.0; block indices are ints'),
    (dict(default='relu', softmax=[True]), TypeError, 'holds True; block indices are ints'),
    (dict(default=['relu']), TypeError, 'must be an operator name'),
    (7, TypeError, 'attn_type must be an operator name, a list of one per block or a dict'),
    ('relu+softmax', ValueError, "'softmax' is not an operator@blocks part"),
    ('relu+softmax@', ValueError, "'softmax@' is not an operator@blocks part"),
    ('relu+softmax@0+softmax@3', ValueError, "names the operator 'softmax' twice"),
    ('relu+softmax@a,b', ValueError, "the blocks of 'softmax' must be integers"),
    ('softmax@0', ValueError, "starts with 'softmax@0'; it must start with the default"),
    ('relu+softmax@0,12', ValueError, 'holds block 12, outside'),
], ids=['list-length', 'list-unknown', 'no-default', 'index-high', 'index-low', 'duplicate',
        'duplicate-negative', 'unknown-key', 'unknown-default', 'not-a-list', 'float-index',
        'bool-index', 'default-not-a-name', 'not-a-layout', 'spec-no-at', 'spec-no-blocks',
        'spec-twice', 'spec-not-ints', 'spec-no-default', 'spec-range'])
def test_bad_layouts_are_refused_by_name(attn_type, error, message):
    with pytest.raises(error, match=message):
        resolve_attn_types(attn_type, 12)


def test_class_token_follows_the_operators_or_the_argument():
    assert class_token_of(RELU_ENDS) is True
    assert class_token_of(['mhla', 'ttt']) is False
    assert class_token_of(['mhla', 'softmax'], with_cls_token=True) is True
    assert class_token_of(['mhla', 'softmax'], with_cls_token=False) is False
    assert class_token_of(['relu'], with_cls_token=False) is False


def test_a_mix_of_class_token_conventions_must_say_which():
    with pytest.raises(ValueError) as info:
        class_token_of(['softmax', 'mhla', 'mhla', 'ttt'])
    message = str(info.value)
    assert "attn_type 'mhla+softmax@0+ttt@3' mixes" in message
    assert 'carry a class token (softmax (blocks [0]))' in message
    assert 'pool the patch tokens (mhla (blocks [1, 2]), ttt (blocks [3]))' in message
    assert 'with_cls_token=True carries the class token through every block' in message
    assert 'with_cls_token=False drops it' in message
