"""The settings of the paper (Table A) as presets of components, and which component a tensor
belongs to."""
import pytest

from linvit_mm.transfer import COMPONENTS, SETTINGS
from linvit_mm.transfer.settings import (block_index, component_of, is_softmax_tensor,
                                         resolve_setting)


def test_settings_are_presets_of_components():
    assert resolve_setting('copy') == ('copy', ('attention', ), None)
    assert resolve_setting('mlpcopy') == ('mlpcopy', ('mlp', ), None)
    assert resolve_setting('fullcopy') == ('fullcopy', COMPONENTS, None)
    assert resolve_setting('impulse') == ('impulse', (), 'impulse')
    # components come back in the canonical order, whatever order they were given in
    assert resolve_setting(components=['head', 'mlp']) == (None, ('mlp', 'head'), None)
    assert resolve_setting(components='norms') == (None, ('norms', ), None)
    assert set(SETTINGS) == {'random', 'mimetic', 'impulse', 'copy', 'mlpcopy', 'fullcopy'}


def test_bad_settings_list_the_valid_ones():
    with pytest.raises(ValueError, match='random, mimetic, impulse, copy, mlpcopy, fullcopy'):
        resolve_setting('fullcpy')
    with pytest.raises(ValueError, match='attention, mlp, norms, patch_embed, pos_embed, '
                                         'cls_token, registers, head'):
        resolve_setting(components=['mlp', 'ffn'])
    with pytest.raises(ValueError, match='not both'):
        resolve_setting('copy', ['mlp'])
    with pytest.raises(ValueError, match='give a setting'):
        resolve_setting()
    with pytest.raises(TypeError, match='list of component names'):
        resolve_setting(components={'mlp': True})


# mmpretrain names of a Softmax ViT by component, written out independently of the code
NAMES = {
    'attention': ['backbone.layers.3.attn.qkv.weight', 'backbone.layers.3.attn.gamma1.weight'],
    'mlp': ['backbone.layers.3.ln2.bias', 'backbone.layers.3.ffn.layers.0.0.weight'],
    'norms': ['backbone.layers.3.ln1.weight', 'backbone.ln1.weight', 'backbone.pre_norm.bias'],
    'patch_embed': ['backbone.patch_embed.projection.weight'],
    'pos_embed': ['backbone.pos_embed'],
    'cls_token': ['backbone.cls_token'],
    'head': ['head.layers.head.weight', 'head.layers.pre_logits.bias'],
}


@pytest.mark.parametrize('component,name', [(c, n) for c, names in NAMES.items() for n in names])
def test_component_of_every_softmax_name(component, name):
    assert component_of(name) == component
    assert is_softmax_tensor(name)


def test_names_a_softmax_vit_lacks():
    # an operator's own tensor belongs to the component whose place it takes
    assert component_of('backbone.layers.3.attn.block_mixing') == 'attention'
    assert not is_softmax_tensor('backbone.layers.3.attn.block_mixing')
    assert component_of('backbone.adapter.weight') is None
    assert not is_softmax_tensor('backbone.adapter.weight')


def test_block_index():
    assert block_index('backbone.layers.11.attn.qkv.weight') == 11
    assert block_index('backbone.ln1.weight') is None
