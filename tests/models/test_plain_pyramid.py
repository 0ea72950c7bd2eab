"""LinearViTPlainPyramid (ViT-Adapter's plain-ViT baseline around LinearViT): shapes for
patch 14 and 16 and odd sizes, the pyramid's values against modules built here, the
resampling of patch-14 levels, the strict checkpoint load, and the refusals."""
import logging
import math
import re

import pytest
import torch
from mmengine.logging import MMLogger
from torch import nn

from linvit_mm.models import LinearViT, LinearViTPlainPyramid
from linvit_mm.testing import assert_rel_close

ARCH = dict(embed_dims=64, num_layers=4, num_heads=2, feedforward_channels=128)
STRIDES = (4, 8, 16, 32)


def size_id(hw):
    return f'{hw[0]}x{hw[1]}'


def make(attn_type='relu', dtype=torch.float32, seed=0, vit=None, **kwargs):
    torch.manual_seed(seed)
    vit_cfg = dict(arch=ARCH, attn_type=attn_type, img_size=64)
    vit_cfg.update(vit or {})
    model = LinearViTPlainPyramid(vit=vit_cfg, **kwargs)
    model.init_weights()
    with torch.no_grad():
        # norms away from their identity init, so a skipped or swapped norm shows
        for name, param in model.named_parameters():
            if not name.startswith('vit.'):
                param.add_(torch.randn_like(param) * .1)
    return model.to(dtype)


def images(hw, batch=2, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *hw, generator=generator, dtype=dtype)


@pytest.mark.parametrize('hw', [(64, 64), (100, 75), (33, 47), (17, 15)], ids=size_id)
@pytest.mark.parametrize('patch_size', [16, 14], ids=['patch16', 'patch14'])
@pytest.mark.parametrize('attn_type', ['softmax', 'ttt'])
def test_four_maps_at_strides_4_to_32(attn_type, patch_size, hw):
    model = make(attn_type, vit=dict(patch_size=patch_size)).eval()
    with torch.no_grad():
        outs = model(images(hw))
    assert isinstance(outs, tuple) and len(outs) == 4
    for out, stride in zip(outs, STRIDES):
        assert out.shape == (2, 64, math.ceil(hw[0] / stride), math.ceil(hw[1] / stride)), \
            f'stride {stride}'
        assert torch.isfinite(out).all()


def hand_built(model):
    """The pyramid of ViT-Adapter's plain ViT as plain torch modules, with the model's
    weights: LN per output, deconv-GN(32)-GELU-deconv, deconv, identity, max-pool."""
    C = model.embed_dims
    norms = [nn.LayerNorm(C, eps=1e-6).double() for _ in range(4)]
    up4 = nn.Sequential(nn.ConvTranspose2d(C, C, 2, 2), nn.GroupNorm(32, C), nn.GELU(),
                        nn.ConvTranspose2d(C, C, 2, 2)).double()
    up2 = nn.ConvTranspose2d(C, C, 2, 2).double()
    for norm, source in zip(norms, model.token_norms):
        norm.load_state_dict(source.state_dict())
    up4.load_state_dict(model.up4.state_dict())
    up2.load_state_dict(model.up2.state_dict())
    return norms, [up4, up2, nn.Identity(), nn.MaxPool2d(2, 2)]


@pytest.mark.parametrize('attn_type', ['softmax', 'relu'])
def test_pyramid_values_match_hand_built_modules(attn_type):
    """From the tokens after blocks 0..3 of the ViT run alone (class token dropped), on a
    patch-16 even grid where nothing is cropped or resampled."""
    model = make(attn_type, dtype=torch.float64).eval()
    assert model.out_indices == (0, 1, 2, 3)
    vit = model.vit
    image = images((64, 96), dtype=torch.float64)
    with torch.no_grad():
        tokens, hw = vit.embed(image)
        per_block = []
        for layer in vit.layers:
            tokens = layer(tokens, hw)
            per_block.append(tokens[:, vit.num_extra_tokens:])
        norms, ops = hand_built(model)
        expected = [op(norm(t).transpose(1, 2).reshape(2, 64, *hw))
                    for norm, op, t in zip(norms, ops, per_block)]
        outs = model(image)
    assert vit.num_extra_tokens == 1  # the class token, dropped from the maps
    for out, ref, stride in zip(outs, expected, STRIDES):
        assert out.shape == ref.shape, f'stride {stride}'
        assert_rel_close(out, ref, 1e-12, f'stride {stride}')


def test_default_levels_are_the_last_block_of_each_quarter():
    model = LinearViTPlainPyramid(vit=dict(arch=dict(ARCH, num_layers=12), img_size=64))
    assert model.out_indices == (2, 5, 8, 11)
    assert model.vit.out_indices == [2, 5, 8, 11] and model.vit.out_type == 'featmap'
    assert not model.vit.final_norm


def test_patch14_levels_are_resampled_to_the_stride_grid():
    """A map constant along columns and linear in the row's pixel centre, ``c * y``: after the
    resampling of the 14-px ViT grid to the 16-px one, every inner output cell holds the value
    at its own pixel centre."""
    from linvit_mm.models.adapters.plain_pyramid import resample_to_stride
    rows = 9
    centres = (torch.arange(rows, dtype=torch.float64) + .5) * 14
    level = centres[None, None, :, None].expand(1, 1, rows, 5).contiguous()
    out = resample_to_stride(level, 14, 16, (8, 4))
    expected = ((torch.arange(8, dtype=torch.float64) + .5) * 16)
    inner = expected < centres[-1]
    assert_rel_close(out[0, 0, inner, 0], expected[inner], 1e-12)
    # past the last input centre: clamped to the border value
    assert_rel_close(out[0, 0, ~inner], torch.full_like(out[0, 0, ~inner], centres[-1]), 1e-12)


def test_patch16_crop_equals_a_padded_run():
    """A 100 x 75 image gives the maps of the same image padded by hand to 112 x 80 (whole
    patches), cropped: the patch embedding pads the same way."""
    model = make('softmax', dtype=torch.float64).eval()
    image = images((100, 75), dtype=torch.float64)
    padded = nn.functional.pad(image, (0, 80 - 75, 0, 112 - 100))
    with torch.no_grad():
        outs, padded_outs = model(image), model(padded)
    for out, padded_out in zip(outs, padded_outs):
        assert_rel_close(out, padded_out[..., :out.shape[-2], :out.shape[-1]], 1e-12)


def test_windowed_vit_feeds_it():
    model = make('softmax', vit=dict(window_size=2, window_block_indexes=[0, 2])).eval()
    assert [layer.window_size for layer in model.vit.layers] == [(2, 2), None, (2, 2), None]
    with torch.no_grad():
        assert model(images((64, 64)))[0].shape == (2, 64, 16, 16)


def test_gradients_reach_every_parameter():
    model = make('ttt').train()
    sum(out.square().mean() for out in model(images((64, 48)))).backward()
    missing = [name for name, param in model.named_parameters() if param.grad is None]
    assert not missing


# ---------------------------------------------------------------------------- loading
class ListHandler(logging.Handler):

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def log_messages(request):
    logger = MMLogger.get_instance(f'test_plain_{request.node.name}', log_level='INFO')
    handler = ListHandler()
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def classifier_checkpoint(tmp_path, attn_type, patch_size=16, edit=None):
    torch.manual_seed(3)
    vit = LinearViT(arch=ARCH, attn_type=attn_type, img_size=64, patch_size=patch_size)
    with torch.no_grad():
        for param in vit.parameters():
            param.add_(torch.randn_like(param) * .1)
    state_dict = {f'backbone.{k}': v for k, v in vit.state_dict().items()}
    state_dict['head.layers.head.weight'] = torch.randn(10, 64)
    if edit is not None:
        edit(state_dict)
    path = tmp_path / f'{attn_type}_cls.pth'
    torch.save({'state_dict': state_dict, 'meta': {}}, path)
    return path, state_dict


@pytest.mark.parametrize('patch_size', [16, 14], ids=['patch16', 'patch14'])
@pytest.mark.parametrize('how', ['pretrained', 'init_cfg'])
def test_strict_load_of_a_classification_checkpoint(tmp_path, log_messages, how, patch_size):
    path, state_dict = classifier_checkpoint(tmp_path, 'relu', patch_size)
    kwargs = (dict(pretrained=str(path)) if how == 'pretrained' else
              dict(init_cfg=dict(type='Pretrained', checkpoint=str(path))))
    model = make('relu', vit=dict(patch_size=patch_size), **kwargs)
    for key, value in model.vit.state_dict().items():
        assert torch.equal(value, state_dict[f'backbone.{key}']), key
    log = '\n'.join(log_messages)
    assert 'LinearViTPlainPyramid: loaded' in log
    assert 'backbone.ln1.weight' in log and 'head.layers.head.weight' in log
    assert 'up4.1.weight' in log  # the pyramid keeps its own init


@pytest.mark.parametrize('edit, key', [
    (lambda sd: sd.pop('backbone.layers.2.ln2.bias'), 'backbone.layers.2.ln2.bias'),
    (lambda sd: sd.__setitem__('backbone.layers.1.attn.qkv.weight', torch.zeros(3, 64)),
     'backbone.layers.1.attn.qkv.weight'),
    (lambda sd: sd.__setitem__('backbone.layers.9.ln1.weight', torch.ones(64)),
     'backbone.layers.9.ln1.weight'),
], ids=['missing', 'wrong_shape', 'unexpected'])
def test_a_checkpoint_that_does_not_fit_is_refused_by_key(tmp_path, edit, key):
    path, _ = classifier_checkpoint(tmp_path, 'relu', edit=edit)
    with pytest.raises(ValueError, match=re.escape(key)):
        make('relu', pretrained=str(path))


@pytest.mark.parametrize('kwargs, message', [
    (dict(vit=dict(arch=ARCH, out_indices=[3])), 'set by LinearViTPlainPyramid'),
    (dict(vit=dict(arch=ARCH, final_norm=True)), 'final_norm must be False'),
    (dict(vit=dict(arch=ARCH), out_indices=[0, 1, 3]), 'four increasing'),
    (dict(vit=dict(arch=ARCH), out_indices=[0, 2, 1, 3]), 'four increasing'),
    (dict(vit=dict(arch=dict(ARCH, num_layers=6))), 'no four equal quarters'),
    (dict(vit=dict(arch=ARCH), init_cfg=dict(type='Normal')), 'LinearViTPlainPyramid accepts'),
], ids=['vit_out_indices', 'final_norm', 'three_levels', 'unordered', 'depth_6', 'init_cfg'])
def test_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LinearViTPlainPyramid(**kwargs)
