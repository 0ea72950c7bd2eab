"""LinearViT with a different attention operator per block (a hybrid): each block computes
what the single-operator model's block computes with the same weights; the class token of a
mix; what the model reports of its blocks; the refusals."""
import pytest
import torch

from linvit_mm.models import LinearViT
from linvit_mm.utils.complexity import count_macs

TINY = dict(embed_dims=64, num_layers=4, num_heads=2, feedforward_channels=128)
IMG = 32


def vit(attn_type, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = LinearViT(arch=TINY, attn_type=attn_type, img_size=IMG, patch_size=8, **kwargs)
    model.init_weights()
    return model.eval()


def single_operator_models(hybrid, **kwargs):
    """For each operator of ``hybrid``, the model of that operator throughout, carrying the
    hybrid's tensors wherever it has the same name and shape (so its blocks of that operator,
    stem and final norm are the hybrid's)."""
    hybrid_state = hybrid.state_dict()
    models = {}
    for name in set(hybrid.attn_types):
        model = vit(name, seed=1, **kwargs)
        own = model.state_dict()
        shared = {key: value for key, value in hybrid_state.items()
                  if key in own and own[key].shape == value.shape}
        model.load_state_dict(shared, strict=False)
        models[name] = model
    return models


@pytest.mark.parametrize('attn_type, kwargs', [
    (dict(default='relu', softmax=[0, -1]), {}),
    (['softmax', 'hedgehog', 'elu', 'inline'], {}),
    (dict(default='mhla', softmax=[1]), dict(with_cls_token=True)),
    (dict(default='ttt', softmax=[0, 3]), dict(with_cls_token=False)),
], ids=['relu-softmax', 'four-operators', 'mhla-with-class-token', 'ttt-without'])
def test_each_block_computes_its_single_operator_block(attn_type, kwargs):
    hybrid = vit(attn_type, **kwargs)
    singles = single_operator_models(hybrid, **kwargs)
    images = torch.randn(2, 3, IMG, IMG)
    with torch.no_grad():
        tokens, hw_shape = hybrid.embed(images)
        for single in singles.values():
            torch.testing.assert_close(single.embed(images)[0], tokens, rtol=0, atol=0)
        x = tokens
        for index, (layer, name) in enumerate(zip(hybrid.layers, hybrid.attn_types)):
            expected = singles[name].layers[index](x, hw_shape)
            x = layer(x, hw_shape)
            torch.testing.assert_close(x, expected, rtol=0, atol=0, msg=f'block {index}')
        output = hybrid(images)[0]
    assert output.shape[0] == 2 and torch.isfinite(output).all()
    # the forward is exactly the blocks chained
    chained = hybrid.ln1(x)
    chained = chained[:, 0] if hybrid.out_type == 'cls_token' else chained.mean(dim=1)
    torch.testing.assert_close(output, chained, rtol=0, atol=0)


def test_the_model_reports_its_blocks_and_a_description_that_builds_them_again():
    model = vit(dict(default='relu', softmax=[0, -1]))
    assert model.attn_types == ['softmax', 'relu', 'relu', 'softmax']
    assert model.attn_type == 'relu+softmax@0,3'
    assert [layer.attn.attn_type for layer in model.layers] == model.attn_types
    assert vit(model.attn_type).attn_types == model.attn_types
    assert vit('elu').attn_type == 'elu' and vit('elu').attn_types == ['elu'] * 4


def test_a_block_operator_given_through_layer_cfgs_is_reported():
    model = vit('relu', layer_cfgs=[{}, {}, dict(attn_type='elu'), {}])
    assert model.attn_types == ['relu', 'relu', 'elu', 'relu']
    assert model.attn_type == 'relu+elu@2'
    with pytest.raises(ValueError, match=r"attn_type\[1\]: unknown attention type 'gelu'"):
        vit('relu', layer_cfgs=[{}, dict(attn_type='gelu'), {}, {}])


def test_a_mix_of_class_token_conventions_is_refused_unless_chosen():
    with pytest.raises(ValueError, match=r"attn_type 'mhla\+softmax@1' mixes operators whose "
                                         r'models carry a class token'):
        vit(dict(default='mhla', softmax=[1]))
    carried = vit(dict(default='mhla', softmax=[1]), with_cls_token=True)
    assert carried.with_cls_token and carried.out_type == 'cls_token'
    assert carried.pos_embed is not None  # learned, with a slot for the class token
    pooled = vit(dict(default='mhla', softmax=[1]), with_cls_token=False)
    assert not pooled.with_cls_token and pooled.out_type == 'avg_featmap'
    assert pooled.pos_embed is None  # fixed sin-cos


@pytest.mark.parametrize('attn_type, message', [
    (['relu'] * 3, 'attn_type lists 3 operators for a model of 4 blocks'),
    (['relu', 'relu', 'performer', 'relu'], r"attn_type\[2\]: unknown attention type"),
    (dict(default='relu', softmax=[0, 4]), 'holds block 4, outside the 4 blocks'),
    (dict(default='relu', softmax=[3, -1]), 'block 3 is given twice'),
    (dict(softmax=[0]), "has no 'default'"),
], ids=['length', 'unknown', 'range', 'duplicate', 'no-default'])
def test_bad_layouts_are_refused_before_any_block_is_built(attn_type, message, monkeypatch):
    from linvit_mm.models.backbones import linear_vit
    built = []
    monkeypatch.setattr(linear_vit, 'LinearViTLayer',
                        lambda **kwargs: built.append(kwargs) or pytest.fail('block built'))
    with pytest.raises(ValueError, match=message):
        LinearViT(arch=TINY, attn_type=attn_type, img_size=IMG, patch_size=8)
    assert not built


def test_attn_cfg_an_operator_of_the_mix_does_not_take_is_refused():
    with pytest.raises(ValueError, match=r"\['feature_map'\] for the 'softmax' operator "
                                         r'\(blocks \[0, 3\]\).*layer_cfgs'):
        vit(dict(default='hedgehog', softmax=[0, 3]), attn_cfg=dict(feature_map='exp'))
    own = dict(attn_cfg=dict(feature_map='exp'))
    model = vit(dict(default='hedgehog', softmax=[0, 3]), layer_cfgs=[{}, own, own, {}])
    assert model.layers[1].attn.feature_map == 'exp'


def test_macs_of_a_hybrid_are_those_of_its_blocks():
    hybrid = vit(dict(default='relu', softmax=[0, -1]))
    singles = {name: count_macs(vit(name), 64) for name in ('softmax', 'relu')}
    macs = count_macs(hybrid, 64)
    per_block = {name: counts['blocks'] / TINY['num_layers'] for name, counts in singles.items()}
    assert macs['blocks'] == pytest.approx(2 * per_block['softmax'] + 2 * per_block['relu'],
                                           rel=1e-12)
    assert macs['patch_embed'] == singles['relu']['patch_embed']


def test_a_hybrid_checkpoint_round_trips(tmp_path):
    model = vit(['softmax', 'hedgehog', 'relu', 'softmax'])
    path = tmp_path / 'hybrid.pth'
    torch.save(model.state_dict(), path)
    other = vit(model.attn_type, seed=5)
    other.load_state_dict(torch.load(path, weights_only=True), strict=True)
    images = torch.randn(1, 3, IMG, IMG)
    with torch.no_grad():
        torch.testing.assert_close(other(images)[0], model(images)[0], rtol=0, atol=0)
