import pytest
import torch

from linvit_mm.models import LinearViT
from linvit_mm.models.attention import attention_types
from linvit_mm.models.backbones.linear_vit import sincos_pos_embed
from linvit_mm.testing import assert_rel_close

TINY = dict(embed_dims=64, num_layers=3, num_heads=2, feedforward_channels=128)
OPERATORS = ['softmax', 'elu', 'relu', 'inline', 'hedgehog', 'mhla', 'ttt']
CLS_OPERATORS = ['softmax', 'elu', 'relu', 'inline', 'hedgehog']


def tiny_vit(attn_type, **kwargs):
    kwargs.setdefault('img_size', 64)
    model = LinearViT(arch=TINY, attn_type=attn_type, **kwargs)
    model.init_weights()
    return model


def test_every_registered_operator_is_covered():
    assert sorted(attention_types()) == sorted(OPERATORS)


@pytest.mark.parametrize('arch,dims,heads', [('tiny', 192, 3), ('small', 384, 6),
                                             ('base', 768, 12)])
def test_arch_zoo_follows_deit(arch, dims, heads):
    model = LinearViT(arch=arch, attn_type='relu')
    assert (model.embed_dims, model.num_heads, model.num_layers) == (dims, heads, 12)
    assert model.layers[0].ffn.layers[0][0].out_features == 4 * dims
    assert model.patch_embed.projection.kernel_size == (16, 16)


def test_parameter_names_follow_mmpretrain():
    names = set(tiny_vit('relu').state_dict())
    for expected in ('patch_embed.projection.weight', 'cls_token', 'pos_embed',
                     'layers.0.ln1.weight', 'layers.0.attn.qkv.weight',
                     'layers.0.attn.proj.weight', 'layers.0.ln2.weight',
                     'layers.0.ffn.layers.0.0.weight', 'layers.0.ffn.layers.1.weight',
                     'ln1.weight'):
        assert expected in names


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_class_token_and_position_embedding_conventions(attn_type):
    model = tiny_vit(attn_type)
    if attn_type in CLS_OPERATORS:
        assert model.with_cls_token and model.pos_embed is not None
        assert model.out_type == 'cls_token'
    else:
        assert not model.with_cls_token and model.pos_embed is None and model.cls_token is None
        assert model.out_type == 'avg_featmap'
    if attn_type == 'ttt':
        assert all(hasattr(layer.attn, 'cpe') for layer in model.layers)


@pytest.mark.parametrize('attn_type', OPERATORS)
@pytest.mark.parametrize('out_type', ['cls_token', 'featmap', 'avg_featmap', 'raw'])
def test_out_types(attn_type, out_type):
    if out_type == 'cls_token' and attn_type not in CLS_OPERATORS:
        with pytest.raises(ValueError, match='needs a class token'):
            tiny_vit(attn_type, out_type=out_type)
        return
    model = tiny_vit(attn_type, out_type=out_type, out_indices=[0, -1]).eval()
    outs = model(torch.randn(2, 3, 64, 48))
    assert len(outs) == 2
    extra = 1 if attn_type in CLS_OPERATORS else 0
    expected = {'cls_token': (2, 64), 'avg_featmap': (2, 64), 'featmap': (2, 64, 4, 3),
                'raw': (2, extra + 12, 64)}[out_type]
    for out in outs:
        assert out.shape == expected
        if out_type == 'featmap':
            # a neck's convs keep a channels-last layout, which mmcv's CPU RoIAlign misreads
            assert out.is_contiguous()


@pytest.mark.parametrize('attn_type', OPERATORS)
@pytest.mark.parametrize('size', [(100, 75), (16, 16), (50, 130)], ids=lambda s: f'{s[0]}x{s[1]}')
def test_odd_input_sizes_pad_to_whole_patches(attn_type, size):
    model = tiny_vit(attn_type, out_type='featmap').eval()
    out, = model(torch.randn(1, 3, *size))
    assert out.shape == (1, 64, -(-size[0] // 16), -(-size[1] // 16))
    assert torch.isfinite(out).all()


def test_unknown_operator_lists_valid_ones():
    with pytest.raises(ValueError) as err:
        LinearViT(arch=TINY, attn_type='performer')
    for name in OPERATORS:
        assert name in str(err.value)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match='unknown arch'):
        LinearViT(arch='huge')
    with pytest.raises(ValueError, match='custom arch'):
        LinearViT(arch=dict(embed_dims=64))
    with pytest.raises(ValueError, match='out_type'):
        LinearViT(arch=TINY, out_type='tokens')
    with pytest.raises(ValueError, match='outside'):
        LinearViT(arch=TINY, out_indices=[3])


def test_softmax_matches_mmpretrain_vision_transformer():
    from mmpretrain.models import VisionTransformer
    torch.manual_seed(0)
    for out_type in ('cls_token', 'featmap', 'raw'):
        reference = VisionTransformer(arch='deit-small', out_type=out_type, out_indices=[5, 11])
        reference.init_weights()
        ours = LinearViT(arch='small', attn_type='softmax', out_type=out_type,
                         out_indices=[5, 11])
        ours.load_state_dict(reference.state_dict(), strict=True)
        reference.eval()
        ours.eval()
        x = torch.randn(2, 3, 224, 224)
        with torch.no_grad():
            for expected, actual in zip(reference(x), ours(x)):
                torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_frozen_stages_freeze_stem_and_first_blocks():
    model = tiny_vit('relu', frozen_stages=2)
    model.train()
    frozen = [model.patch_embed, model.layers[0], model.layers[1]]
    for module in frozen:
        assert not module.training
        assert not any(p.requires_grad for p in module.parameters())
    assert not model.pos_embed.requires_grad and not model.cls_token.requires_grad
    assert model.layers[2].training
    assert all(p.requires_grad for p in model.layers[2].parameters())
    assert all(p.requires_grad for p in model.ln1.parameters())


def test_position_embedding_resizes_on_load_and_for_any_input():
    source = tiny_vit('relu', img_size=64)  # 4 x 4 grid
    target = LinearViT(arch=TINY, attn_type='relu', img_size=96)  # 6 x 6 grid
    target.load_state_dict(source.state_dict(), strict=True)
    assert target.pos_embed.shape == (1, 1 + 36, 64)
    # The class-token slot is carried over, the patch slots are interpolated.
    torch.testing.assert_close(target.pos_embed[:, :1], source.pos_embed[:, :1])
    out, = target.eval()(torch.randn(1, 3, 160, 64))
    assert out.shape == (1, 64)


def test_wrong_width_checkpoint_names_the_keys():
    small = LinearViT(arch=dict(TINY, embed_dims=32), attn_type='relu', img_size=64)
    with pytest.raises(RuntimeError, match='pos_embed'):
        tiny_vit('relu').load_state_dict(small.state_dict())


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_checkpoint_round_trip(attn_type, tmp_path):
    model = tiny_vit(attn_type).eval()
    torch.save(model.state_dict(), tmp_path / 'vit.pth')
    torch.manual_seed(123)
    clone = tiny_vit(attn_type).eval()
    clone.load_state_dict(torch.load(tmp_path / 'vit.pth', weights_only=True), strict=True)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(clone(x)[0], model(x)[0], rtol=0, atol=0)


def test_init_cfg_runs_after_the_default_init(tmp_path):
    source = tiny_vit('relu')
    torch.save(source.state_dict(), tmp_path / 'vit.pth')
    model = LinearViT(arch=TINY, attn_type='relu', img_size=64,
                      init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'vit.pth')))
    model.init_weights()
    for name, value in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_default_init_is_deterministic_and_keeps_operator_parameters():
    torch.manual_seed(0)
    first = tiny_vit('mhla')
    torch.manual_seed(0)
    second = tiny_vit('mhla')
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # MHLA's distance-initialised mixing matrix is not a plain linear weight: the
    # backbone's truncated-normal init must leave it alone (columns sum to one).
    mixing = first.layers[0].attn.block_mixing
    torch.testing.assert_close(mixing.sum(0), torch.ones(mixing.shape[1]))


def test_get_layer_depth():
    model = tiny_vit('relu')
    assert model.get_layer_depth('backbone.pos_embed', 'backbone.') == (0, 5)
    assert model.get_layer_depth('backbone.patch_embed.projection.weight', 'backbone.') == (0, 5)
    assert model.get_layer_depth('backbone.layers.1.attn.qkv.weight', 'backbone.') == (2, 5)
    assert model.get_layer_depth('backbone.ln1.weight', 'backbone.') == (4, 5)
    assert model.get_layer_depth('head.fc.weight', 'backbone.') == (4, 5)


def test_block_runner_reproduces_forward():
    model = tiny_vit('inline', out_type='raw').eval()
    x = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        tokens, hw_shape = model.embed(x)
        for layer in model.layers:
            tokens = layer(tokens, hw_shape)
        torch.testing.assert_close(model.ln1(tokens), model(x)[0])
    assert hw_shape == (3, 5)


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_gradient_checkpointing_matches(attn_type):
    torch.manual_seed(0)
    plain = tiny_vit(attn_type, out_type='featmap')
    checkpointed = tiny_vit(attn_type, out_type='featmap', with_cp=True)
    checkpointed.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 64, 48)
    plain(x)[0].square().mean().backward()
    checkpointed(x)[0].square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        assert_rel_close(b.grad, a.grad, 1e-5, name)


@pytest.mark.slow  # 12-16 s each on 2 cores
@pytest.mark.parametrize('attn_type', OPERATORS)
def test_bf16_autocast_at_16384_tokens_is_finite(attn_type):
    model = LinearViT(arch=dict(TINY, num_layers=1), attn_type=attn_type, img_size=64,
                      patch_size=16, out_type='featmap').eval()
    model.init_weights()
    x = torch.randn(1, 3, 2048, 2048)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        out, = model(x)
    assert out.shape == (1, 64, 128, 128)
    assert torch.isfinite(out.float()).all()


def test_sincos_position_embedding():
    embed = sincos_pos_embed((3, 5), 16)
    assert embed.shape == (1, 15, 16)
    # Distinct positions get distinct codes; sin^2 + cos^2 = 1 per frequency.
    assert torch.cdist(embed[0], embed[0]).add(torch.eye(15)).min() > 0
    torch.testing.assert_close(embed[0, :, :4].square() + embed[0, :, 4:8].square(),
                               torch.ones(15, 4))
    with pytest.raises(ValueError, match='divisible by 4'):
        sincos_pos_embed((2, 2), 18)
