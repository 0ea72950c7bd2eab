"""LinearViT's switches for foundation-model sources (DINOv2 +registers, DINOv3, DeiT III,
CLIP, EVA-02) and the arch words that set them, against timm's models and layers."""
import copy

import pytest
import timm
import torch
from mmpretrain.models.utils import resize_pos_embed
from timm.layers import GluMlp, SwiGLU, resample_abs_pos_embed
from torch import nn

from linvit_mm.models import LinearViT, LinearViTAdapter
from linvit_mm.models.attention import BaseAttention, attention_class, attention_types
from linvit_mm.models.backbones.linear_vit import ARCH_ESSENTIALS
from linvit_mm.models.utils import RotaryPositionEmbedding2D

# word -> (timm model, timm kwargs, out_type, parameters LinearViT has beyond timm's)
# EVA-02's query/value biases (2C per block, the key bias fixed at zero) are a full qkv bias
# here (3C); its pooled norm (fc_norm) is ln2, built for out_type='avg_featmap'.
SOURCE_WORDS = {
    'dinov2-small': ('vit_small_patch14_dinov2', {}, None, 0),
    'dinov2-base': ('vit_base_patch14_dinov2', {}, None, 0),
    'dinov2-large': ('vit_large_patch14_dinov2', {}, None, 0),
    'dinov2-reg-small': ('vit_small_patch14_reg4_dinov2', {}, None, 0),
    'dinov2-reg-base': ('vit_base_patch14_reg4_dinov2', {}, None, 0),
    'dinov2-reg-large': ('vit_large_patch14_reg4_dinov2', {}, None, 0),
    'dinov3-small': ('vit_small_patch16_dinov3', {}, None, 0),
    'dinov3-base': ('vit_base_patch16_dinov3', {}, None, 0),
    'dinov3-large': ('vit_large_patch16_dinov3', {}, None, 0),
    'deit3-small': ('deit3_small_patch16_224', {}, None, 0),
    'deit3-base': ('deit3_base_patch16_224', {}, None, 0),
    'clip-base': ('vit_base_patch16_clip_quickgelu_224', {}, None, 0),
    'clip-base-gelu': ('vit_base_patch16_clip_224', {}, None, 0),
    'eva02-tiny': ('eva02_tiny_patch14_224', {}, 'avg_featmap', 12 * 192),
    'eva02-small': ('eva02_small_patch14_224', {}, 'avg_featmap', 12 * 384),
    'eva02-base': ('eva02_base_patch14_224', {}, 'avg_featmap', 12 * 768),
}
REDUCED = dict(embed_dims=64, num_layers=2, num_heads=4, feedforward_channels=128)


def reduced(word, **changes):
    """The arch of ``word`` at a test size: every switch kept, the four sizes shrunk."""
    return dict(LinearViT.arch_zoo[word], **dict(REDUCED, **changes))


def test_every_source_word_is_covered():
    # the words of the released linear ViTs are covered by tests/transfer/test_linear_releases.py
    from linvit_mm.transfer.linear_releases import LINEAR_RELEASES
    released = {word for release in LINEAR_RELEASES.values() for word in release.arch_words}
    zoo = set(LinearViT.arch_zoo) - released
    sizes_only = {word for word in zoo if set(LinearViT.arch_zoo[word]) == set(ARCH_ESSENTIALS)}
    assert zoo - sizes_only == set(SOURCE_WORDS)
    # the DeiT words set sizes only, so their models are what they were
    assert sizes_only == {'t', 'tiny', 'deit-tiny', 's', 'small', 'deit-small', 'b', 'base',
                          'deit-base'}


@pytest.mark.parametrize('word', SOURCE_WORDS)
def test_source_words_have_timm_parameter_counts(word):
    """Built on the meta device (no memory, no init cost) at the real sizes."""
    name, kwargs, out_type, extra = SOURCE_WORDS[word]
    with torch.device('meta'):
        theirs = timm.create_model(name, pretrained=False, img_size=224, num_classes=0,
                                   **kwargs)
        ours = LinearViT(arch=word, attn_type='softmax', img_size=224, out_type=out_type)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) + extra
    assert (ours.patch_size, ours.num_layers, ours.embed_dims, ours.num_heads) == (
        theirs.patch_embed.patch_size[0], len(theirs.blocks), theirs.embed_dim,
        theirs.blocks[0].attn.num_heads)
    assert ours.num_extra_tokens == theirs.num_prefix_tokens


def test_the_documented_example_builds_and_drops_the_prefix_tokens():
    model = LinearViT(arch='dinov2-reg-small', attn_type='relu', img_size=224,
                      out_type='featmap').eval()
    assert model.num_extra_tokens == 5 and model.patch_size == 14
    out, = model(torch.randn(1, 3, 112, 84))
    assert out.shape == (1, 384, 8, 6)


def test_an_arch_word_fixes_its_switches():
    with pytest.raises(ValueError, match=r"arch 'dinov2-small' sets patch_size=14.*got "
                                         r'patch_size=16.*custom arch dict'):
        LinearViT(arch='dinov2-small', patch_size=16)
    with pytest.raises(ValueError, match="sets rope="):
        LinearViT(arch='dinov3-small', rope=dict(type='eva'))
    with pytest.raises(ValueError, match='sets num_register_tokens=4'):
        LinearViT(arch=reduced('dinov2-reg-small'), num_register_tokens=0)
    # the same value is no conflict, however spelt (a config's lists are the arch's tuples)
    model = LinearViT(arch=reduced('eva02-tiny'), patch_size=14, img_size=56,
                      rope=dict(type='eva', temperature=10000., ref_grid=[16, 16]))
    assert model.rope.ref_grid == (16, 16)
    # read-out switches may differ (the ViT-Adapter drops the final norm)
    assert not LinearViT(arch=reduced('dinov2-small'), img_size=56, final_norm=False).final_norm
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['registers'\]"):
        LinearViT(arch=dict(REDUCED, registers=4))


def test_bad_switch_values_are_refused():
    with pytest.raises(ValueError, match="unknown ffn_type 'glu'; choose from"):
        LinearViT(arch=REDUCED, ffn_type='glu')
    with pytest.raises(ValueError, match="ffn_norm .* exists for ffn_type='swiglu' only"):
        LinearViT(arch=REDUCED, ffn_norm=True)
    with pytest.raises(ValueError, match="act_cfg does not apply to ffn_type='swiglu'"):
        LinearViT(arch=reduced('eva02-tiny'), act_cfg=dict(type='GELU'))
    with pytest.raises(ValueError, match='num_register_tokens must be an int >= 0'):
        LinearViT(arch=REDUCED, num_register_tokens=-1)
    with pytest.raises(ValueError, match="unsupported pos_embed_type 'rope'"):
        LinearViT(arch=REDUCED, pos_embed_type='rope')
    with pytest.raises(ValueError, match="no_embed_class concerns a learned"):
        LinearViT(arch=REDUCED, pos_embed_type='sincos', no_embed_class=True)


def test_registers_follow_the_class_token_and_leave_the_outputs():
    model = LinearViT(arch=REDUCED, img_size=32, patch_size=8, num_register_tokens=3,
                      no_embed_class=True, out_type='raw').eval()
    assert model.num_extra_tokens == 4 and model.pos_embed.shape == (1, 16, 64)
    with torch.no_grad():
        tokens, hw_shape = model.embed(torch.randn(2, 3, 32, 32))
        patches, _ = model.patch_embed(torch.randn(2, 3, 32, 32))
    # timm's order and no_embed_class: class token, registers (no position), patches + pos
    assert torch.equal(tokens[:, 0], model.cls_token[0].expand(2, -1))
    assert torch.equal(tokens[:, 1:4], model.register_tokens.expand(2, -1, -1))
    raw, = model(torch.randn(2, 3, 32, 32))
    assert raw.shape == (2, 4 + 16, 64)
    for out_type, shape in [('featmap', (2, 64, 4, 4)), ('avg_featmap', (2, 64)),
                            ('cls_token', (2, 64))]:
        model.out_type = out_type
        out, = model(torch.randn(2, 3, 32, 32))
        assert out.shape == shape
    model.out_type = 'featmap'
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens, hw_shape = model.embed(x)
        for layer in model.layers:
            tokens = layer(tokens, hw_shape)
        expected = model.ln1(tokens)[:, 4:].transpose(1, 2).reshape(2, 64, 4, 4)
        torch.testing.assert_close(model(x)[0], expected)


def test_position_embedding_with_slots_for_every_extra_token():
    model = LinearViT(arch=REDUCED, img_size=32, patch_size=8, num_register_tokens=2).eval()
    assert model.pos_embed.shape == (1, 3 + 16, 64) and model.pos_embed_extra_tokens == 3
    with torch.no_grad():
        tokens, _ = model.embed(torch.randn(1, 3, 32, 32))
    # concatenate, then add: each extra token gets its own slot
    torch.testing.assert_close(tokens[:, 0], model.cls_token[:, 0] + model.pos_embed[:, 0])
    torch.testing.assert_close(tokens[:, 1:3], model.register_tokens + model.pos_embed[:, 1:3])


@pytest.mark.parametrize('word,slots', [('dinov2-small', 1), ('dinov2-reg-small', 0),
                                        ('deit3-small', 0)])
def test_position_embedding_resamples_like_timm(word, slots):
    """timm resamples the patch part only (bicubic, with antialias): upsampled, downsampled,
    non-square."""
    model = LinearViT(arch=reduced(word), img_size=224)
    assert model.pos_embed_extra_tokens == slots
    for grid in [(20, 24), (9, 13), (16, 16)]:
        expected = resample_abs_pos_embed(model.pos_embed, new_size=grid,
                                          old_size=model.patch_resolution,
                                          num_prefix_tokens=slots)
        assert torch.equal(model.position_embedding(grid, model.pos_embed), expected)


def test_deit_words_keep_mmpretrain_resampling():
    model = LinearViT(arch='small', img_size=64)
    assert not model.pos_embed_antialias
    expected = resize_pos_embed(model.pos_embed, (4, 4), (3, 2), 'bicubic', 1)
    torch.testing.assert_close(model.position_embedding((3, 2), model.pos_embed), expected,
                               rtol=0, atol=0)


def test_loading_resizes_a_patch_only_embedding():
    source = LinearViT(arch=reduced('deit3-small'), img_size=64)
    target = LinearViT(arch=reduced('deit3-small'), img_size=96)
    target.load_state_dict(source.state_dict())
    expected = resample_abs_pos_embed(source.pos_embed, new_size=(6, 6), num_prefix_tokens=0)
    torch.testing.assert_close(target.pos_embed, expected)


def test_layer_scale_on_both_branches():
    model = LinearViT(arch=REDUCED, img_size=32, patch_size=8, layer_scale_init_value=0.1)
    names = dict(model.named_parameters())
    for name in ('layers.0.attn.gamma1.weight', 'layers.0.ffn.gamma2.weight'):
        torch.testing.assert_close(names[name], torch.full((64, ), 0.1))
    layer = model.layers[0].eval()
    x = torch.randn(2, 1 + 16, 64)
    with torch.no_grad():
        gamma1 = torch.rand(64)
        gamma2 = torch.rand(64)
        layer.attn.gamma1.weight.copy_(gamma1)
        layer.ffn.gamma2.weight.copy_(gamma2)
        after_attn = x + gamma1 * layer.attn.proj(_unscaled_core(layer.attn, layer.ln1(x)))
        expected = after_attn + gamma2 * layer.ffn.layers(layer.ln2(after_attn))
        torch.testing.assert_close(layer(x, (4, 4)), expected)
    plain = LinearViT(arch=REDUCED, img_size=32, patch_size=8)
    assert not any('gamma' in name for name in plain.state_dict())


def _unscaled_core(attn, x):
    q, k, v = attn.split_heads(attn.qkv(x))
    return attn.merge_heads(((q * attn.scale) @ k.transpose(-2, -1)).softmax(-1) @ v)


@pytest.mark.parametrize('timm_mlp', ['packed', 'with_norm'])
def test_swiglu_ffn_is_timms(timm_mlp):
    """EVA-02's MLP: timm's GluMlp (packed, EVA-02 Ti/S) or SwiGLU with its sub-LN (B)."""
    word = 'eva02-tiny' if timm_mlp == 'packed' else 'eva02-base'
    model = LinearViT(arch=reduced(word), img_size=56)
    ffn = model.layers[0].ffn
    if timm_mlp == 'packed':
        theirs = GluMlp(64, 2 * 128, act_layer=nn.SiLU, gate_last=False)
        theirs.load_state_dict({'fc1.weight': ffn.w12.weight, 'fc1.bias': ffn.w12.bias,
                                'fc2.weight': ffn.w3.weight, 'fc2.bias': ffn.w3.bias})
    else:
        theirs = SwiGLU(64, 128, norm_layer=nn.LayerNorm)
        gate, value = ffn.w12.weight.chunk(2), ffn.w12.bias.chunk(2)
        theirs.load_state_dict({
            'fc1_g.weight': gate[0], 'fc1_g.bias': value[0], 'fc1_x.weight': gate[1],
            'fc1_x.bias': value[1], 'norm.weight': torch.rand(128), 'norm.bias': torch.rand(128),
            'fc2.weight': ffn.w3.weight, 'fc2.bias': ffn.w3.bias})
        ffn.norm.load_state_dict(theirs.norm.state_dict())
        ffn.norm.eps = theirs.norm.eps
    x = torch.randn(2, 7, 64)
    torch.testing.assert_close(ffn(x), theirs(x))


def test_clip_switches():
    model = LinearViT(arch=reduced('clip-base'), img_size=32).eval()
    assert model.patch_embed.projection.bias is None  # timm: no bias before a pre-norm
    assert type(model.layers[0].ffn.layers[0][1]).__name__ == 'QuickGELU'
    assert model.layers[0].ln1.eps == 1e-5
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        model.pre_norm.weight.normal_()
        tokens, _ = model.embed(x)
        model.pre_norm = nn.Identity()
        unnormed, _ = model.embed(x)
    assert not torch.allclose(tokens, unnormed)
    gelu = LinearViT(arch=reduced('clip-base-gelu'), img_size=32)
    assert isinstance(gelu.layers[0].ffn.layers[0][1], nn.GELU)


def test_rope_words_share_one_parameter_free_module():
    model = LinearViT(arch=reduced('dinov3-small'), img_size=64)
    assert model.pos_embed is None and model.pos_embed_type == 'none'
    assert isinstance(model.rope, RotaryPositionEmbedding2D)
    assert model.rope.config == ('dinov3', 16, 100., None)
    assert all(layer.attn.rope is model.rope for layer in model.layers)
    assert not any('rope' in name for name in model.state_dict())
    assert model.layers[0].attn.qkv.bias is None
    eva = LinearViT(arch=reduced('eva02-small'), img_size=56)
    assert eva.rope.config == ('eva', 16, 10000., (16, 16))


def test_pooled_norm_follows_out_type():
    model = LinearViT(arch=reduced('eva02-tiny'), img_size=56, out_type='avg_featmap').eval()
    assert not model.final_norm and model.pooled_norm
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        model.ln2.weight.normal_()
        model.out_type = 'featmap'
        featmap, = model(x)
        model.out_type = 'avg_featmap'
        pooled, = model(x)
    torch.testing.assert_close(pooled, model.ln2(featmap.mean(dim=(2, 3))))
    assert not hasattr(LinearViT(arch=reduced('eva02-tiny'), img_size=56, out_type='featmap'),
                       'ln2')


def test_stem_depth_and_freezing_include_registers_and_pre_norm():
    model = LinearViT(arch=REDUCED, img_size=32, num_register_tokens=2, pre_norm=True,
                      frozen_stages=1)
    for name in ('register_tokens', 'pre_norm.weight'):
        assert model.get_layer_depth(f'backbone.{name}', 'backbone.') == (0, 4)
    assert not model.register_tokens.requires_grad and not model.pre_norm.weight.requires_grad


class NoSwitchesAttention(BaseAttention):
    """An operator of another package: the plain signature, no RoPE, no LayerScale."""

    options = ('qkv_bias', 'attn_drop', 'proj_drop')

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias)
        self.qkv = nn.Linear(embed_dims, 3 * embed_dims, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)

    def forward(self, x, hw_shape):
        return self.proj(self.qkv(x).chunk(3, dim=-1)[2])

    forward_reference = forward

    def core_macs(self, num_tokens, hw_shape):
        return 0


def test_an_operator_without_the_switches_builds_plain_models_and_refuses_the_others():
    from linvit_mm.models.attention import ATTENTIONS, register_attention
    try:
        register_attention('noswitches')(NoSwitchesAttention)
        LinearViT(arch=REDUCED, attn_type='noswitches', img_size=32)
        with pytest.raises(ValueError, match="'noswitches' operator does not take rope / "
                                             "layer_scale_init_value"):
            LinearViT(arch=reduced('dinov3-small'), attn_type='noswitches', img_size=32)
    finally:
        ATTENTIONS.module_dict.pop('noswitches', None)


@pytest.mark.parametrize('attn_type', attention_types())
@pytest.mark.parametrize('word', ['dinov2-reg-small', 'dinov3-small', 'deit3-small', 'clip-base',
                                  'eva02-base'])
def test_every_operator_builds_from_every_source_and_trains(word, attn_type):
    arch = reduced(word)
    operator = attention_class(attn_type)
    if arch.get('rope') and not operator.supports_rope:
        with pytest.raises(ValueError, match='does not carry RoPE'):
            LinearViT(arch=arch, attn_type=attn_type, img_size=56)
        return
    torch.manual_seed(0)
    model = LinearViT(arch=copy.deepcopy(arch), attn_type=attn_type, img_size=56,
                      out_type='featmap')
    x = torch.randn(2, 3, 56, 42)
    out, = model(x)
    grid = (-(-56 // model.patch_size), -(-42 // model.patch_size))  # padded to whole patches
    assert out.shape == (2, 64, *grid) and torch.isfinite(out).all()
    out.square().mean().backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize('word', ['dinov2-reg-small', 'dinov3-small', 'eva02-tiny'])
def test_sources_run_in_the_vit_adapter(word, tmp_path):
    """Registers ride with the class token, RoPE stays inside the blocks the adapter calls,
    EVA-02's pooled norm is not built, and a patch-only position embedding of another grid
    loads (resized)."""
    arch = reduced(word, num_layers=4)
    source = LinearViT(arch=arch, attn_type='relu', img_size=56)  # 4 x 4, the adapter 5 x 5
    torch.save({'state_dict': {f'backbone.{k}': v for k, v in source.state_dict().items()}},
               tmp_path / 'vit.pth')
    torch.manual_seed(0)
    model = LinearViTAdapter(vit=dict(arch=arch, attn_type='relu', img_size=64),
                             interaction_indexes=[[0, 0], [1, 1], [2, 2], [3, 3]],
                             conv_inplane=16, deform_num_heads=2, deform_ratio=1.0,
                             pretrained=str(tmp_path / 'vit.pth'))
    model.init_weights()
    assert not hasattr(model.vit, 'ln2')
    outs = model(torch.randn(1, 3, 64, 64))
    assert [out.shape[-1] for out in outs] == [16, 8, 4, 2]
    sum(out.square().mean() for out in outs).backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []
