"""Released linear ViTs (ViT³, InLine-DeiT, the MHLA ViTs) converted into LinearViT: state
dicts built here with the keys and shapes the official models have (random weights), the
official forward written out here from reading the official model code, and the converted
LinearViT held against it; the strict loader's refusals, by name."""
import dataclasses
import math
import re
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

import linvit_mm.staged  # noqa: F401  (registers LinearViTCheckpoint)
from linvit_mm.models import LinearViT
from linvit_mm.testing import assert_rel_close
from linvit_mm.transfer.linear_releases import (build_release_vit, convert_linear_release,
                                                converted_checkpoint, load_linear_release,
                                                release_state_dict)

WIDTH, HEADS, DEPTH, MLP, PATCH, IMAGE, CLASSES = 24, 6, 2, 48, 4, 16, 5
FAMILIES = ['vit3', 'inline', 'mhla']
MHLA_HEADS, PIECE = 3, 2    # MHLA: 3 heads of 8; 2 x 2 blocks of 2 x 2 patches


# ------------------------------------------------------------------ release layouts
def _draw(shape, scale, generator):
    return torch.randn(shape, generator=generator, dtype=torch.float64) * scale


def release_state(family, width=WIDTH, heads=HEADS, depth=DEPTH, mlp=MLP, patch=PATCH,
                  image=IMAGE, classes=CLASSES, seed=0, device=None, piece=PIECE):
    """A state dict with the keys and shapes of the official model (ViTTT
    ``vittt/models/vittt.py`` + ``ttt_block.py``; InLine ``models/inline_deit.py``; both
    timm ViTs with ``qkv_bias=True``), random values of moderate scale. ``device='meta'``
    gives shapes only."""
    g = torch.Generator().manual_seed(seed)
    d = width // heads

    def t(shape, scale=None):
        if device == 'meta':
            return torch.empty(shape, device='meta')
        fan_in = shape[1] * math.prod(shape[2:]) if len(shape) > 1 else 1
        return _draw(shape, scale if scale is not None else fan_in**-.5, g)

    def norm(prefix):
        return {f'{prefix}.weight': 1 + t((width, ), .1) if device != 'meta' else t((width, )),
                f'{prefix}.bias': t((width, ), .1)}

    state = OrderedDict({'patch_embed.proj.weight': t((width, 3, patch, patch)),
                         'patch_embed.proj.bias': t((width, ), .1)})
    if family == 'inline':
        state['cls_token'] = t((1, 1, width), .5)
        state['pos_embed'] = t((1, (image // patch)**2 + 1, width), .5)
    if family == 'mhla':
        state['pos_embed'] = t((1, (image // patch)**2, width), .5)
    for i in range(depth):
        b = f'blocks.{i}.'
        if family == 'mhla':
            # timm's Block (norm1, norm2, mlp) around MHLA_Normed_Torch (attn), no qkv bias
            blocks = ((image // patch) // piece)**2
            state.update({b + k: v for k, v in norm('norm1').items()})
            state.update({b + 'attn.' + k: v for k, v in norm('norm').items()})
            state[b + 'attn.to_qkv.weight'] = t((3 * width, width))
            state[b + 'attn.q_norm.weight'] = state[b + 'attn.norm.weight'] * 1.5
            state[b + 'attn.k_norm.weight'] = state[b + 'attn.norm.bias'] + 1
            state[b + 'attn.lepe.weight'] = t((width, 1, 5, 5), .2)
            state[b + 'attn.lepe.bias'] = t((width, ), .1)
            state[b + 'attn.piece_attn.conv.weight'] = (
                t((blocks, blocks, 1, 1)) if device == 'meta'
                else torch.rand(blocks, blocks, 1, 1, generator=g, dtype=torch.float64) + .1)
            state[b + 'attn.to_out.0.weight'] = t((width, width))
            state[b + 'attn.to_out.0.bias'] = t((width, ), .1)
            state.update({b + k: v for k, v in norm('norm2').items()})
            state[b + 'mlp.fc1.weight'] = t((mlp, width))
            state[b + 'mlp.fc1.bias'] = t((mlp, ), .1)
            state[b + 'mlp.fc2.weight'] = t((width, mlp))
            state[b + 'mlp.fc2.bias'] = t((width, ), .1)
            continue
        if family == 'vit3':
            state[b + 'cpe.weight'] = t((width, 1, 3, 3), .3)
            state[b + 'cpe.bias'] = t((width, ), .1)
        state.update({b + k: v for k, v in norm('norm1').items()})
        qkv_rows = 3 * width + (3 * d if family == 'vit3' else 0)
        state[b + 'attn.qkv.weight'] = t((qkv_rows, width))
        state[b + 'attn.qkv.bias'] = t((qkv_rows, ), .1)
        if family == 'vit3':
            state[b + 'attn.w1'] = t((1, heads, d, d), .3)
            state[b + 'attn.w2'] = t((1, heads, d, d), .3)
            state[b + 'attn.w3'] = t((d, 1, 3, 3), .3)
            state[b + 'attn.proj.weight'] = t((width, width + d))
        else:
            state[b + 'attn.proj.weight'] = t((width, width))
        state[b + 'attn.proj.bias'] = t((width, ), .1)
        if family == 'inline':
            state[b + 'attn.residual.0.weight'] = t((width, d, 1))
            state[b + 'attn.residual.0.bias'] = t((width, ), .1)
            state[b + 'attn.residual.2.weight'] = t((9 * width, d, 1))
            state[b + 'attn.residual.2.bias'] = t((9 * width, ), .1)
        state.update({b + k: v for k, v in norm('norm2').items()})
        state[b + 'mlp.fc1.weight'] = t((mlp, width))
        state[b + 'mlp.fc1.bias'] = t((mlp, ), .1)
        state[b + 'mlp.fc2.weight'] = t((width, mlp))
        state[b + 'mlp.fc2.bias'] = t((width, ), .1)
    state.update(norm('fc_norm' if family == 'mhla' else 'norm'))
    state['head.weight'] = t((classes, width))
    state['head.bias'] = t((classes, ), .1)
    return state


# ------------------------------------------------------------------ the official forwards
def _ln(x, s, name):
    return F.layer_norm(x, x.shape[-1:], s[f'{name}.weight'], s[f'{name}.bias'], eps=1e-6)


def _mlp(x, s, b):
    hidden = F.gelu(F.linear(x, s[b + 'mlp.fc1.weight'], s[b + 'mlp.fc1.bias']))
    return F.linear(hidden, s[b + 'mlp.fc2.weight'], s[b + 'mlp.fc2.bias'])


def _patches(images, s):
    x = F.conv2d(images, s['patch_embed.proj.weight'], s['patch_embed.proj.bias'],
                 stride=s['patch_embed.proj.weight'].shape[-1])
    return x.flatten(2).transpose(1, 2)


def _vit3_attention(x, s, b, heads):
    """ViT³'s TTT attention: one normalised gradient step of each inner model, then read."""
    B, n, c = x.shape
    d = c // heads
    side = int(n**.5)
    scale = 9**-.5
    q1, k1, v1, q2, k2, v2 = F.linear(x, s[b + 'attn.qkv.weight'],
                                      s[b + 'attn.qkv.bias']).split([c, c, c, d, d, d], -1)
    q1, k1, v1 = (t.reshape(B, n, heads, d).transpose(1, 2) for t in (q1, k1, v1))
    q2, k2, v2 = (t.reshape(B, side, side, d).permute(0, 3, 1, 2) for t in (q2, k2, v2))
    # SwiGLU inner model F(k) = (k W1) * silu(k W2), loss -scale * mean_n <F(k), v>:
    w1, w2 = s[b + 'attn.w1'], s[b + 'attn.w2']
    z1, z2 = k1 @ w1, k1 @ w2
    sig = torch.sigmoid(z2)
    dl_df = -scale * v1 / n
    g1 = k1.transpose(-2, -1) @ (dl_df * z2 * sig)
    g2 = k1.transpose(-2, -1) @ (dl_df * z1 * sig * (1 + z2 * (1 - sig)))
    w1 = w1 - g1 / (g1.norm(dim=-2, keepdim=True) + 1)
    w2 = w2 - g2 / (g2.norm(dim=-2, keepdim=True) + 1)
    swiglu = ((q1 @ w1) * F.silu(q1 @ w2)).transpose(1, 2).reshape(B, n, c)
    # 3x3 depthwise inner model, loss -scale * mean_pixels <conv(k), v>: its gradient at tap
    # (dy, dx) is the correlation of v with k shifted by (dy, dx).
    dl_dconv = -scale * v2 / (side * side)
    padded = F.pad(k2, (1, 1, 1, 1))
    taps = [(padded[:, :, 1 + dy:1 + dy + side, 1 + dx:1 + dx + side] * dl_dconv).sum((-2, -1))
            for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    g3 = torch.stack(taps, -1).reshape(B * d, 1, 3, 3)
    w3 = s[b + 'attn.w3'].repeat(B, 1, 1, 1) - g3 / (g3.norm(dim=(-2, -1), keepdim=True) + 1)
    conv = F.conv2d(q2.reshape(1, B * d, side, side), w3, padding=1, groups=B * d)
    conv = conv.reshape(B, d, n).transpose(1, 2)
    return F.linear(torch.cat([swiglu, conv], -1), s[b + 'attn.proj.weight'],
                    s[b + 'attn.proj.bias'])


def official_vit3(images, s, heads=HEADS):
    """ViT³ ``VisionTransformer.forward``: patches, blocks ``x + cpe(x)``, ``x + attn(norm1
    x)``, ``x + mlp(norm2 x)``; final norm, mean over the tokens, head."""
    x = _patches(images, s)
    depth = len({k.split('.')[1] for k in s if k.startswith('blocks.')})
    for i in range(depth):
        b = f'blocks.{i}.'
        B, n, c = x.shape
        side = int(n**.5)
        grid = x.reshape(B, side, side, c).permute(0, 3, 1, 2)
        x = x + F.conv2d(grid, s[b + 'cpe.weight'], s[b + 'cpe.bias'], padding=1,
                         groups=c).flatten(2).transpose(1, 2)
        x = x + _vit3_attention(_ln(x, s, b + 'norm1'), s, b, heads)
        x = x + _mlp(_ln(x, s, b + 'norm2'), s, b)
    features = _ln(x, s, 'norm').mean(dim=1)
    return features, F.linear(features, s['head.weight'], s['head.bias'])


def _inline_attention(x, s, b, heads):
    """InLine-DeiT's ``InLineAttention.forward`` (class token first, square grid)."""
    B, n, c = x.shape
    d = c // heads
    scale = d**-.5
    side = int(n**.5)
    q, k, v = (t.reshape(B, n, heads, d).transpose(1, 2) for t in F.linear(
        x, s[b + 'attn.qkv.weight'], s[b + 'attn.qkv.bias']).chunk(3, dim=-1))
    hidden = F.gelu(F.conv1d(x.mean(1)[..., None], s[b + 'attn.residual.0.weight'],
                             s[b + 'attn.residual.0.bias'], groups=heads))
    kernels = F.conv1d(hidden, s[b + 'attn.residual.2.weight'], s[b + 'attn.residual.2.bias'],
                       groups=heads).reshape(B * c, 1, 3, 3)
    state = (k.transpose(-2, -1) @ v) * (scale / n)
    out = q @ state + (1 - scale * q @ k.mean(2, keepdim=True).transpose(-2, -1)) \
        * v.mean(2, keepdim=True)
    out = out.transpose(1, 2).reshape(B, n, c)
    values = v[:, :, 1:].transpose(1, 2).reshape(B, side, side, c).permute(0, 3, 1, 2)
    local = F.conv2d(values.reshape(1, B * c, side, side), kernels, padding=1, groups=B * c)
    out = torch.cat([out[:, :1], out[:, 1:] + local.reshape(B, c, n - 1).transpose(1, 2)], 1)
    return F.linear(out, s[b + 'attn.proj.weight'], s[b + 'attn.proj.bias'])


def official_inline(images, s, heads=HEADS):
    """InLine-DeiT ``VisionTransformer.forward``: patches, class token, ``+ pos_embed``,
    pre-norm blocks, final norm, class token, head."""
    x = _patches(images, s)
    x = torch.cat([s['cls_token'].expand(x.shape[0], -1, -1), x], 1) + s['pos_embed']
    depth = len({k.split('.')[1] for k in s if k.startswith('blocks.')})
    for i in range(depth):
        b = f'blocks.{i}.'
        x = x + _inline_attention(_ln(x, s, b + 'norm1'), s, b, heads)
        x = x + _mlp(_ln(x, s, b + 'norm2'), s, b)
    features = _ln(x, s, 'norm')[:, 0]
    return features, F.linear(features, s['head.weight'], s['head.bias'])


def _mhla_attention(x, s, b, heads, side):
    """``MHLA_Normed_Torch.forward`` on blocked tokens ``(B, blocks, window, C)``: its own
    LayerNorm, bias-free q, k, v, the 5x5 'lepe' of the values in image layout, RMSNorm of q
    and k over the channels, ``relu + eps`` features, per-block ``K^T V`` and the normaliser
    ``q . k_sum`` each mixed over the blocks by the 1x1 conv, ``/ (normaliser + eps)``."""
    eps = 1e-6
    B, n, w, c = x.shape
    d = c // heads
    per_side, piece = math.isqrt(n), math.isqrt(w)
    x = F.layer_norm(x, (c, ), s[b + 'attn.norm.weight'], s[b + 'attn.norm.bias'])
    q, k, v = F.linear(x, s[b + 'attn.to_qkv.weight']).chunk(3, dim=-1)
    image = v.reshape(B, per_side, per_side, piece, piece, c).permute(0, 5, 1, 3, 2, 4)
    image = image.reshape(B, c, side, side)
    lepe = F.conv2d(image, s[b + 'attn.lepe.weight'], s[b + 'attn.lepe.bias'], padding=2,
                    groups=c)
    lepe = lepe.reshape(B, c, per_side, piece, per_side, piece).permute(0, 2, 4, 3, 5, 1)
    lepe = lepe.reshape(B, n, w, c)
    q = F.relu(F.rms_norm(q, (c, ), s[b + 'attn.q_norm.weight'])) + eps
    k = F.relu(F.rms_norm(k, (c, ), s[b + 'attn.k_norm.weight'])) + eps
    q, k, v = (t.reshape(B, n, w, heads, d).permute(0, 3, 1, 2, 4).reshape(B * heads, n, w, d)
               for t in (q, k, v))
    mixing = s[b + 'attn.piece_attn.conv.weight']
    kv = F.conv2d(k.transpose(-2, -1) @ v, mixing)
    normaliser = F.conv2d(q @ k.sum(dim=-2).unsqueeze(-1), mixing) + eps
    out = (q @ kv) / normaliser
    out = out.reshape(B, heads, n, w, d).permute(0, 2, 3, 1, 4).reshape(B, n, w, c) + lepe
    return F.linear(out, s[b + 'attn.to_out.0.weight'], s[b + 'attn.to_out.0.bias'])


def official_mhla(images, s, heads=MHLA_HEADS, piece=PIECE):
    """``MHLA_ViT.forward`` (no padding: the images are already the model's size): patches
    ``+ pos_embed``, cut into blocks of ``piece x piece`` patches ``(hb wb) (p1 p2)``, timm
    blocks around the attention, no final norm, the mean token, ``fc_norm``, head."""
    x = _patches(images, s) + s['pos_embed']
    B, N, c = x.shape
    side = math.isqrt(N)
    per_side = side // piece
    x = x.reshape(B, per_side, piece, per_side, piece, c).permute(0, 1, 3, 2, 4, 5)
    x = x.reshape(B, per_side * per_side, piece * piece, c)
    depth = len({k.split('.')[1] for k in s if k.startswith('blocks.')})
    for i in range(depth):
        b = f'blocks.{i}.'
        x = x + _mhla_attention(_ln(x, s, b + 'norm1'), s, b, heads, side)
        x = x + _mlp(_ln(x, s, b + 'norm2'), s, b)
    features = _ln(x.reshape(B, N, c).mean(dim=1), s, 'fc_norm')
    return features, F.linear(features, s['head.weight'], s['head.bias'])


OFFICIAL = {'vit3': official_vit3, 'inline': official_inline, 'mhla': official_mhla}
NUM_HEADS = {'vit3': None, 'inline': None, 'mhla': MHLA_HEADS}


def images(seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, IMAGE, IMAGE, generator=g, dtype=torch.float64)


def converted_model(family, state=None):
    converted = convert_linear_release(state if state is not None else release_state(family),
                                       num_heads=NUM_HEADS[family])
    vit = build_release_vit(converted).double()
    load_linear_release(vit, converted)
    return vit.eval(), converted


def head_logits(converted, features):
    return F.linear(features, converted.head['head.layers.head.weight'],
                    converted.head['head.layers.head.bias'])


# ------------------------------------------------------------------ the official forward
@pytest.mark.parametrize('family', FAMILIES)
def test_converted_release_computes_the_official_forward(family):
    state = release_state(family)
    vit, converted = converted_model(family, state)
    x = images()
    with torch.no_grad():
        features, = vit(x)
        official_features, official_logits = OFFICIAL[family](x, state)
    assert_rel_close(features, official_features, 1e-6, 'features vs the official forward')
    assert_rel_close(head_logits(converted, features), official_logits, 1e-6, 'logits')


@pytest.mark.parametrize('family', FAMILIES)
def test_model_config_is_the_release(family):
    _, converted = converted_model(family)
    cfg = converted.model_cfg
    assert cfg['attn_type'] == {'vit3': 'ttt', 'inline': 'inline', 'mhla': 'mhla'}[family]
    heads = MHLA_HEADS if family == 'mhla' else HEADS
    assert cfg['arch']['num_heads'] == heads and cfg['arch']['patch_size'] == PATCH
    assert cfg['arch']['num_layers'] == DEPTH and cfg['arch']['feedforward_channels'] == MLP
    assert cfg['arch']['qkv_bias'] == (family != 'mhla')
    # ViT³ has no position embedding to tell the training size: the release's 224 is kept
    # (any grid runs); the learned ones cover the grid they were stored for.
    assert cfg['img_size'] == {'vit3': 224, 'inline': IMAGE, 'mhla': IMAGE}[family]
    expected = {'vit3': None, 'inline': {'residual': True},
                'mhla': dict(num_blocks=(2, 2), mixing_init='linear', normaliser='official',
                             attn_norm=True, qk_norm=True)}[family]
    assert cfg.get('attn_cfg') == expected
    if family == 'mhla':
        assert {k: cfg['arch'][k] for k in ('pos_embed_type', 'final_norm', 'pooled_norm')} \
            == dict(pos_embed_type='learned', final_norm=False, pooled_norm=True)


@pytest.mark.parametrize('size,heads,width', [('tiny', 6, 192), ('small', None, None),
                                              ('base', None, None)])
@pytest.mark.parametrize('family', FAMILIES)
def test_released_sizes_get_their_arch_word(family, size, heads, width):
    """Full-size layouts (shapes only) give the arch words; ViT³-T and InLine-DeiT-T have 6
    heads at width 192."""
    sizes = {'vit3': {'tiny': (192, 6), 'small': (384, 6), 'base': (768, 12)},
             'inline': {'tiny': (192, 6), 'small': (320, 10), 'base': (384, 12)},
             'mhla': {'tiny': (192, 3), 'small': (384, 6), 'base': (768, 12)}}
    width, heads = sizes[family][size]
    image = 256 if family == 'mhla' else 224
    state = release_state(family, width=width, heads=heads, depth=12, mlp=4 * width, patch=16,
                          image=image, device='meta', piece=4)
    cfg = convert_linear_release(state).model_cfg
    word = {'vit3': 'vit3', 'inline': 'inline-deit', 'mhla': 'mhla'}[family] + f'-{size}'
    assert cfg['arch'] == word and cfg['img_size'] == image
    if family == 'mhla':
        assert cfg['attn_cfg']['num_blocks'] == (4, 4)
    arch = LinearViT.arch_zoo[word]
    assert (arch['embed_dims'], arch['num_heads']) == (width, heads)


# ------------------------------------------------------------------ the converted checkpoint
@pytest.mark.parametrize('family', FAMILIES)
def test_converted_checkpoint_loads_strictly(family, tmp_path):
    """The written checkpoint carries the record; ``LinearViTCheckpoint`` loads it strictly
    into the model of ``model_cfg`` and that model computes the official forward."""
    state = release_state(family)
    vit, converted = converted_model(family, state)
    path = tmp_path / 'converted.pth'
    torch.save(converted_checkpoint(converted, vit), path)
    cfg = {k: v for k, v in converted.model_cfg.items() if k != 'type'}
    fresh = LinearViT(**cfg, init_cfg=dict(type='LinearViTCheckpoint', checkpoint=str(path)))
    fresh.init_weights()
    fresh = fresh.double().eval()
    x = images()
    with torch.no_grad():
        assert_rel_close(fresh(x)[0], OFFICIAL[family](x, state)[0], 1e-6, 'loaded model')
    saved = torch.load(path)
    assert set(saved['state_dict']) == ({f'backbone.{k}' for k in vit.state_dict()}
                                        | {'head.layers.head.weight', 'head.layers.head.bias'})
    record = saved['meta']['linvit_mm']['backbones']['backbone.']
    assert record['attn_types'] == [converted.model_cfg['attn_type']] * DEPTH
    assert record['num_heads'] == [NUM_HEADS[family] or HEADS] * DEPTH


def test_containers_and_ddp_prefix_are_read():
    state = release_state('vit3')
    wrapped = {'model': OrderedDict((f'module.{k}', v) for k, v in state.items()),
               'optimizer': {}, 'epoch': 300}
    assert list(release_state_dict(wrapped)) == list(state)
    assert list(release_state_dict({'state_dict': state})) == list(state)
    with pytest.raises(ValueError, match='holds no tensors'):
        release_state_dict({'epoch': 3})


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize('family', FAMILIES)
def test_a_tensor_without_a_place_is_refused_by_name(family):
    state = release_state(family)
    state['blocks.1.attn.relative_bias'] = torch.zeros(3)
    state['dist_token'] = torch.zeros(1, 1, WIDTH)
    with pytest.raises(ValueError, match=r'no place in its layout.*blocks\.1\.attn\.'
                                         r'relative_bias, dist_token; nothing was converted'):
        convert_linear_release(state, num_heads=NUM_HEADS[family])


def test_a_missing_tensor_is_refused_by_name():
    state = release_state('vit3')
    del state['blocks.1.attn.w3']
    converted = convert_linear_release(state)
    vit = build_release_vit(converted).double()
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    with pytest.raises(ValueError, match=r'tensors of the model the release does not have: '
                                         r'layers\.1\.attn\.w3$'):
        load_linear_release(vit, converted)
    assert all(torch.equal(v, before[k]) for k, v in vit.state_dict().items())


@pytest.mark.parametrize('family,model,match', [
    ('vit3', dict(attn_type='softmax'), r"(?s)blocks \[0, 1\] run \['softmax'\], the release runs "
                                        r"'ttt'.*tensors of the release the model does not "
                                        r'have: layers\.0\.attn\.cpe\.weight'),
    ('vit3', dict(attn_type='ttt', heads=3), r'shapes that differ: layers\.0\.attn\.qkv\.weight: '
                                             r'release \(84, 24\), model \(96, 24\)'),
    ('mhla', dict(attn_type='mhla', heads=MHLA_HEADS, qkv_bias=False, pos_embed_type='learned',
                  final_norm=False, pooled_norm=True,
                  attn_cfg=dict(num_blocks=(2, 2), attn_norm=True, qk_norm=True)),
     r"fit the model.*\n  - blocks \[0, 1\] do not use the official normaliser[^\n]*$"),
    ('inline', dict(attn_type='inline'), r'(?s)blocks \[0, 1\] have no local residual branch.*'
                                         r'does not have: layers\.0\.attn\.residual\.0\.weight'),
])
def test_a_model_that_does_not_fit_is_refused(family, model, match):
    converted = convert_linear_release(release_state(family), num_heads=NUM_HEADS[family])
    arch = dict(embed_dims=WIDTH, num_layers=DEPTH, num_heads=model.pop('heads', HEADS),
                feedforward_channels=MLP, patch_size=PATCH)
    vit = LinearViT(arch=arch, img_size=IMAGE, **model)
    with pytest.raises(ValueError, match=match):
        load_linear_release(vit, converted)


def test_mhla_heads_are_given_or_released():
    """An MHLA ViT's tensors do not hold its heads: the released widths know theirs, any
    other width needs num_heads; where the tensors hold them, a wrong count is refused."""
    with pytest.raises(ValueError, match='MHLA ViT of width 24.*num_heads='):
        convert_linear_release(release_state('mhla'))
    with pytest.raises(ValueError, match=r'num_heads=3 was given, but blocks\.0\.attn\.w1'):
        convert_linear_release(release_state('vit3'), num_heads=3)
    with pytest.raises(ValueError, match='5 heads do not divide the width 24'):
        convert_linear_release(release_state('mhla'), num_heads=5)


def test_non_finite_release_is_refused():
    state = release_state('inline')
    state['blocks.0.attn.residual.2.bias'][3] = float('nan')
    with pytest.raises(ValueError, match=r'layers\.0\.attn\.residual\.2\.bias: 1 NaN'):
        converted_model('inline', state)


def test_a_softmax_vit_or_another_family_is_refused():
    softmax = {k: v for k, v in release_state('inline').items() if '.residual.' not in k}
    with pytest.raises(ValueError, match='not one of a released linear ViT.*SoftmaxTransfer'):
        convert_linear_release(softmax)
    hedgehog = dict(softmax, **{'layers.0.self_attn.feature_map_q.mlp.layer': torch.zeros(2)})
    with pytest.raises(ValueError, match='(?s)Hedgehog.*which this converter does not read'):
        convert_linear_release(hedgehog)
    with pytest.raises(ValueError, match="unknown release family 'vit4'"):
        convert_linear_release(softmax, family='vit4')


def test_other_patch_size_gets_a_custom_arch():
    """The T sizes with 8-pixel patches are not the released T: a custom arch dict that
    carries the patch size (and, for ViT³, no position embedding)."""
    state = release_state('vit3', width=192, heads=6, depth=12, mlp=768, patch=8, device='meta')
    arch = convert_linear_release(state).model_cfg['arch']
    assert arch == dict(embed_dims=192, num_layers=12, num_heads=6, feedforward_channels=768,
                        patch_size=8, pos_embed_type='none', qkv_bias=True)


@pytest.mark.parametrize('shape', [(WIDTH, 3, PATCH, PATCH // 2), (WIDTH, 3, PATCH)],
                         ids=['not-square', 'not-a-conv'])
def test_a_patch_embedding_that_is_no_square_conv_is_refused(shape):
    state = release_state('inline')
    state['patch_embed.proj.weight'] = torch.zeros(shape)
    with pytest.raises(ValueError, match=r'a square patch conv \(C, in, p, p\) was expected'):
        convert_linear_release(state)


def test_one_head_is_a_head_count_and_none_is_refused():
    one = convert_linear_release(release_state('inline', heads=1))
    assert one.model_cfg['arch']['num_heads'] == 1
    state = release_state('vit3')
    state['blocks.0.attn.w1'] = torch.zeros(1, 0, WIDTH // HEADS, WIDTH // HEADS)
    with pytest.raises(ValueError, match='0 heads do not divide the width 24'):
        convert_linear_release(state)


@pytest.mark.parametrize('slots,img_size', [(1 + 1, PATCH), (1, None), (1 + 5, None)],
                         ids=['one-patch', 'class-slot-only', 'not-square'])
def test_the_image_size_comes_from_the_position_embedding(slots, img_size):
    state = release_state('inline')
    state['pos_embed'] = torch.zeros(1, slots, WIDTH)
    if img_size is None:
        with pytest.raises(ValueError, match=r'not 1 class token slot\(s\) and a square grid'):
            convert_linear_release(state)
    else:
        assert convert_linear_release(state).model_cfg['img_size'] == img_size


@pytest.mark.parametrize('family', FAMILIES)
def test_what_the_conversion_leaves_to_the_user_is_noted(family):
    padded = ('the official model zero-pads its normalised input to 256 px (16 x 16 patches) '
              'before the patch embedding; give the LinearViT the padded image')
    no_head = 'no classifier (head.weight / head.bias) in the checkpoint'
    state = release_state(family)
    notes = convert_linear_release(state, num_heads=NUM_HEADS[family]).notes
    assert notes == ([padded] if family == 'mhla' else [])
    headless = {k: v for k, v in state.items() if not k.startswith('head.')}
    assert convert_linear_release(headless, num_heads=NUM_HEADS[family]).notes[-1] == no_head


def test_the_load_is_logged_with_the_notes(logged):
    converted = convert_linear_release(release_state('mhla'), num_heads=MHLA_HEADS)
    with logged('test_linear_release_load') as messages:
        load_linear_release(build_release_vit(converted), converted,
                            logger='test_linear_release_load')
    assert [m for m in messages if m.startswith('loaded the')] == [
        f'loaded the {converted.release.description} release ({converted.release.repository}): '
        f'{len(converted.backbone)} tensors into a mhla LinearViT; {converted.notes[0]}']


def test_a_checkpoint_written_without_a_model_is_checked_by_loading_one():
    state = release_state('inline')
    state['blocks.1.mlp.fc2.weight'][0, 0] = float('inf')
    with pytest.raises(ValueError, match=r'layers\.1\.ffn\.layers\.1\.weight: 1 Inf'):
        converted_checkpoint(convert_linear_release(state))


@pytest.mark.parametrize('shape', [(4, 3, 1, 1), (3, 3, 1, 1), (4, 4, 1)],
                         ids=['not-square', 'blocks-not-a-square-grid', 'not-a-conv'])
def test_an_mhla_mixing_conv_of_another_shape_is_refused(shape):
    state = release_state('mhla')
    state['blocks.0.attn.piece_attn.conv.weight'] = torch.zeros(shape)
    with pytest.raises(ValueError, match=r'\(M, M, 1, 1\) with M a square was expected'):
        convert_linear_release(state, num_heads=MHLA_HEADS)


def test_a_release_layout_is_data_that_stays_put():
    from linvit_mm.transfer.linear_release_layouts import LINEAR_RELEASES
    with pytest.raises(dataclasses.FrozenInstanceError):
        LINEAR_RELEASES['mhla'].extra_slots = 1


def test_a_later_block_whose_mixing_is_no_1x1_conv_is_refused():
    state = release_state('mhla')
    mixing = state['blocks.1.attn.piece_attn.conv.weight']
    state['blocks.1.attn.piece_attn.conv.weight'] = mixing.expand(-1, -1, 3, 3).clone()
    with pytest.raises(ValueError, match=r'a piece_attn.conv.weight has shape \(4, 4, 3, 3\); '
                                         r'\(M, M, 1, 1\) was expected'):
        convert_linear_release(state, num_heads=MHLA_HEADS)


def test_a_release_that_is_cut_short_or_not_a_mapping_is_refused():
    state = release_state('inline')
    with pytest.raises(TypeError, match='a release checkpoint is a mapping, got list'):
        convert_linear_release([state])
    without = {k: v for k, v in state.items() if k != 'blocks.0.mlp.fc1.weight'}
    with pytest.raises(ValueError, match=r'has no blocks\.0\.mlp\.fc1\.weight, which its layout '
                                         r'always has; is it cut short\?'):
        convert_linear_release(without)
    gap = {k.replace('blocks.1.', 'blocks.2.'): v for k, v in state.items()}
    with pytest.raises(ValueError, match=r'numbered \[0, 2\], not 0\.\.N-1'):
        convert_linear_release(gap)
    with pytest.raises(TypeError, match='a release loads into a LinearViT, got Linear'):
        load_linear_release(torch.nn.Linear(2, 2), convert_linear_release(state))


def test_a_family_given_is_the_family_read():
    assert convert_linear_release(release_state('inline'), family='inline').release.name == \
        'inline'


@pytest.mark.parametrize('family', FAMILIES)
def test_an_integer_or_boolean_weight_is_refused_by_name(family):
    state = release_state(family)
    state['blocks.1.mlp.fc2.weight'] = state['blocks.1.mlp.fc2.weight'].to(torch.int8)
    state['blocks.0.mlp.fc1.bias'] = state['blocks.0.mlp.fc1.bias'] > 0
    with pytest.raises(ValueError, match=r'(?s)2 weight tensor\(s\) are not floating point.*'
                                         r'blocks\.0\.mlp\.fc1\.bias: torch\.bool.*'
                                         r'blocks\.1\.mlp\.fc2\.weight: torch\.int8'):
        convert_linear_release(state, num_heads=NUM_HEADS[family])


def test_another_head_count_at_a_released_mhla_width_is_refused_unless_forced():
    state = release_state('mhla', width=192, depth=1, mlp=96)
    assert convert_linear_release(state).model_cfg['arch']['num_heads'] == 3  # mhla-tiny's
    assert convert_linear_release(state, num_heads=3).model_cfg['arch']['num_heads'] == 3
    with pytest.raises(ValueError, match='num_heads=8 was given for a .* of width 192, which is '
                                         'released with 3 heads.*--force-num-heads'):
        convert_linear_release(state, num_heads=8)
    forced = convert_linear_release(state, num_heads=8, force_num_heads=True)
    assert forced.model_cfg['arch']['num_heads'] == 8


@pytest.mark.parametrize('family, change, named', [
    # a hand-written arch dict without the release's pos_embed_type: ttt's default sin-cos
    ('vit3', dict(arch_without='pos_embed_type'), "pos_embed_type: the release 'none', the "
                                                  "model 'sincos'"),
    ('vit3', dict(attn_cfg=dict(inner_scale=0.5)),
     'attn_cfg.inner_scale of blocks [0, 1]: the release 0.3333333333333333, the model 0.5'),
    ('mhla', dict(attn_cfg=dict(feature_floor=0.5)),
     'attn_cfg.feature_floor of blocks [0, 1]: the release 1e-06, the model 0.5'),
    ('mhla', dict(norm_cfg=dict(type='LN', eps=1e-5)), 'norm eps: the release 1e-06, the model '
                                                       '1e-05'),
], ids=['added-sincos', 'inner-scale', 'mhla-floor', 'norm-eps'])
def test_a_model_that_computes_another_function_on_the_release_is_refused(family, change, named):
    converted = convert_linear_release(release_state(family), num_heads=NUM_HEADS[family])
    cfg = {k: v for k, v in converted.model_cfg.items() if k != 'type'}
    change = dict(change)
    if 'arch_without' in change:
        dropped = change.pop('arch_without')
        cfg['arch'] = {k: v for k, v in cfg['arch'].items() if k != dropped}
    vit = LinearViT(**{**cfg, **{k: v for k, v in change.items() if k != 'attn_cfg'},
                       'attn_cfg': {**cfg.get('attn_cfg', {}), **change.get('attn_cfg', {})}})
    # every tensor fits: the difference is in what the model computes with them
    assert set(vit.state_dict()) == set(converted.backbone)
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape(named)):
        load_linear_release(vit, converted)
    assert all(torch.equal(v, before[k]) for k, v in vit.state_dict().items())
