"""LinearViT to timm's VisionTransformer (``linvit_mm.deployment.to_timm``): the same function
for every operator and architecture switch, in float64."""
import pytest
import torch
from mmpretrain.models import ImageClassifier
from timm.models.vision_transformer import VisionTransformer

from linvit_mm.deployment import (ConversionError, build_timm_vit, linvit_to_timm,
                                  load_timm_vit, save_timm_vit)
from linvit_mm.models.attention import attention_types
from linvit_mm.models.backbones import LinearViT

ARCH = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)
SHAPE = (48, 64)   # a 3 x 4 grid: not square, so the grid cannot come from N alone


def perturbed(model):
    """``model`` in float64, eval mode, every tensor moved off its init (LayerScale, zero
    biases and identity maps would hide mistakes), reproducibly."""
    torch.manual_seed(0)
    model = model.double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * .05)
    return model


def vit(attn_type, img_size=SHAPE, **kwargs):
    return perturbed(LinearViT(arch=dict(ARCH, **kwargs.pop('arch', {})), attn_type=attn_type,
                               img_size=img_size, **kwargs))


def images(shape=SHAPE, batch=2):
    return torch.randn(batch, 3, *shape, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1))


def assert_same_function(model, timm_model, shape=SHAPE, tolerance=1e-6):
    x = images(shape)
    with torch.no_grad():
        expected = model(x, mode='tensor') if isinstance(model, ImageClassifier) else model(x)[0]
        got = timm_model(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize('attn_type', attention_types())
def test_every_operator_converts_to_the_same_function(attn_type):
    model = vit(attn_type)
    timm_model, spec = linvit_to_timm(model)
    assert isinstance(timm_model, VisionTransformer)
    assert timm_model.global_pool == ('token' if model.with_cls_token else 'avg')
    # the operator's parameters under timm's attention names
    assert 'blocks.1.attn.qkv.weight' in timm_model.state_dict()
    assert_same_function(model, timm_model)


@pytest.mark.parametrize('attn_type,switches', [
    ('relu', dict(num_register_tokens=2, layer_scale_init_value=.1, no_embed_class=True,
                  pre_norm=True, act_cfg=dict(type='mmpretrain.QuickGELU'),
                  norm_cfg=dict(type='LN', eps=1e-5))),
    ('mhla', dict(arch=dict(ffn_type='swiglu', ffn_norm=True, final_norm=False,
                            pooled_norm=True, pos_embed_type='learned'),
                  rope=dict(type='eva', ref_grid=(4, 4)))),
    ('ttt', dict(arch=dict(qkv_bias=False, num_register_tokens=1, pos_embed_type='none',
                           layer_scale_init_value=1e-2),
                 rope=dict(type='dinov3'), out_type='raw')),
], ids=['registers-layerscale-prenorm-quickgelu', 'swiglu-pooled-norm-eva-rope',
        'dinov3-rope-registers-raw'])
def test_architecture_switches_convert(attn_type, switches):
    model = vit(attn_type, **switches)
    timm_model, _ = linvit_to_timm(model)
    assert_same_function(model, timm_model)


def test_dynamic_image_size_where_timm_resamples_alike():
    model = vit('relu', arch=dict(pos_embed_type='learned', pos_embed_antialias=True))
    timm_model, spec = linvit_to_timm(model, dynamic_img_size=True)
    assert spec['vit']['dynamic_img_size']
    for shape in (SHAPE, (32, 96), (80, 48)):
        assert_same_function(model, timm_model, shape)
    # a sin-cos embedding is computed per grid by the LinearViT, resampled by timm: refused
    with pytest.raises(ConversionError, match='sincos embedding is computed for each grid'):
        linvit_to_timm(vit('mhla'), dynamic_img_size=True)
    with pytest.raises(ConversionError, match="resampled 'bicubic', antialias=False"):
        linvit_to_timm(vit('relu'), dynamic_img_size=True)


@pytest.mark.parametrize('head', [dict(type='LinearClsHead', num_classes=5, in_channels=32),
                                  dict(type='VisionTransformerClsHead', num_classes=5,
                                       in_channels=32)], ids=['linear', 'vit'])
def test_classifier_converts_with_its_head(head):
    classifier = perturbed(ImageClassifier(
        backbone=dict(type='LinearViT', arch=ARCH, attn_type='ttt', img_size=SHAPE),
        head=head))
    timm_model, spec = linvit_to_timm(classifier)
    assert spec['vit']['num_classes'] == 5
    assert_same_function(classifier, timm_model)


def test_spec_and_state_rebuild_the_model(tmp_path):
    model = vit('mhla', attn_cfg=dict(num_blocks=(1, 2), eps=1e-4))
    timm_model, spec = linvit_to_timm(model, attn_cfg=dict(num_blocks=(1, 2), eps=1e-4))
    save_timm_vit(timm_model, spec, tmp_path / 'timm.pth')
    loaded = load_timm_vit(tmp_path / 'timm.pth')
    assert loaded.patch_embed.proj.weight.dtype == torch.float64
    assert_same_function(model, loaded)
    assert type(build_timm_vit(spec).blocks[0].attn).__name__ == \
        'MultiHeadLinearAttentionForTimm'


def test_operator_settings_must_match_the_linear_vit():
    model = vit('relu', attn_cfg=dict(eps=1e-3))
    with pytest.raises(ConversionError, match=r'block 0: the operator built for timm is not '
                                              r'the LinearViT.s(.|\n)*eps=0.001(.|\n)*attn_cfg'):
        linvit_to_timm(model)


def test_blocks_take_the_grid_of_the_embedded_image_only():
    model = vit('ttt')
    timm_model, _ = linvit_to_timm(model)
    block = build_timm_vit(linvit_to_timm(model)[1]).blocks[0]
    with pytest.raises(RuntimeError, match='no patch grid recorded'):
        block(torch.randn(1, 12, 32))
    timm_model(images())
    with pytest.raises(ValueError, match=r'13 tokens do not hold 0 prefix tokens and the 3x4'):
        timm_model.blocks[0](torch.randn(1, 13, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match='takes neither an attention mask nor is_causal'):
        timm_model(images(), attn_mask=torch.zeros(12, 12, dtype=torch.bool))


@pytest.mark.parametrize('kwargs,message', [
    (dict(out_type='featmap'), "out_type='featmap'"),
    (dict(out_indices=[0, 1]), r'out_indices=\[0, 1\]'),
    (dict(arch=dict(final_norm=True, pooled_norm=True), out_type='avg_featmap'),
     'a final norm and a pooled norm together'),
])
def test_what_timm_cannot_express_is_refused(kwargs, message):
    with pytest.raises(ConversionError, match=message):
        linvit_to_timm(vit('relu', **kwargs))


def test_a_hybrid_is_refused():
    with pytest.raises(ConversionError, match=r"a hybrid of \['relu', 'softmax'\]: timm builds "
                                              r"every block's attention from one attn_layer"):
        linvit_to_timm(vit(dict(default='relu', softmax=[0])))


@pytest.mark.parametrize('attn_type', ['relu', 'softmax'])
def test_a_converted_file_refuses_a_plain_timm_model(attn_type, tmp_path):
    """timm's own Attention has the operators' qkv / proj names: without a key of its own
    the file would load strictly into a plain timm ViT and compute Softmax attention."""
    import timm
    model = vit(attn_type)
    timm_model, spec = linvit_to_timm(model)
    save_timm_vit(timm_model, spec, tmp_path / 'timm.pth')
    state = torch.load(tmp_path / 'timm.pth', weights_only=True)['state_dict']
    plain = timm.create_model('vit_tiny_patch16_224', pretrained=False, **spec['vit']).double()
    with pytest.raises(RuntimeError, match='Unexpected key.*"linvit_mm_operator"'):
        plain.load_state_dict(state, strict=True)
    assert_same_function(model, load_timm_vit(tmp_path / 'timm.pth'))


def test_load_timm_vit_checks_the_recorded_operator(tmp_path):
    model = vit('relu')
    timm_model, spec = linvit_to_timm(model)
    checkpoint = {'state_dict': timm_model.state_dict(), 'timm_spec': spec}
    checkpoint['state_dict']['linvit_mm_operator'] = torch.tensor(list(b'elu'),
                                                                  dtype=torch.uint8)
    torch.save(checkpoint, tmp_path / 'damaged.pth')
    with pytest.raises(ValueError, match="record the operator 'elu', its timm_spec 'relu'"):
        load_timm_vit(tmp_path / 'damaged.pth')
    # a file written before the operator was recorded still loads
    del checkpoint['state_dict']['linvit_mm_operator']
    torch.save(checkpoint, tmp_path / 'older.pth')
    assert_same_function(model, load_timm_vit(tmp_path / 'older.pth'))
