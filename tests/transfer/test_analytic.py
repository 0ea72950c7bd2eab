"""Mimetic and Impulse: the structure each analytic initialisation gives the attention."""
import pytest
import torch
import torch.nn.functional as F

from linvit_mm.models.backbones.linear_vit import LinearViT
from linvit_mm.transfer import transfer_softmax_weights
from linvit_mm.transfer.analytic import IMPULSE_DEFAULTS, MIMETIC_DEFAULTS

SEED = 7
C, D, HEADS = 192, 64, 3  # DeiT-Tiny width, head dim, heads


def test_mimetic_products_have_identity_plus_noise_structure(build):
    model = build('softmax')
    transfer_softmax_weights(model, setting='mimetic')
    # The formula's own expectation: mean diagonal / mean |off-diagonal| of the best rank-D
    # approximation of 0.7 Z + 0.7 I, Z ~ N(0, 1/C), estimated from independent draws.
    torch.manual_seed(11)
    ratios = []
    for _ in range(8):
        target = 0.7 * torch.randn(C, C, dtype=torch.float64) / C**0.5 + 0.7 * torch.eye(C)
        u, s, vh = torch.linalg.svd(target)
        ratios.append(diagonal_ratio((u[:, :D] * s[:D]) @ vh[:D]))
    expected_ratio = sum(ratios) / len(ratios)

    off = ~torch.eye(C, dtype=torch.bool)
    with torch.no_grad():
        for layer in model.layers:
            weight = layer.attn.qkv.weight.double()
            for head in range(HEADS):
                w_q = weight[head * D:(head + 1) * D]
                w_k = weight[C + head * D:C + (head + 1) * D]
                qk = w_q.T @ w_k
                assert torch.linalg.matrix_rank(qk) == D
                ratio = diagonal_ratio(qk)
                assert ratio > 5
                assert abs(ratio / expected_ratio - 1) < 0.1, (ratio, expected_ratio)
            # Tokens are rows: x -> x W_v^T W_proj^T should be 0.4 Z - 0.4 I at full rank.
            vo = weight[2 * C:].T @ layer.attn.proj.weight.double().T
            assert abs(vo.diagonal().mean().item() + 0.4) < 0.03
            assert abs(vo[off].std().item() / (0.4 / C**0.5) - 1) < 0.1


def diagonal_ratio(matrix):
    off = ~torch.eye(matrix.shape[0], dtype=torch.bool)
    return (matrix.diagonal().mean() / matrix[off].abs().mean()).item()


@pytest.mark.parametrize('attn_type', ['softmax', 'mhla'], ids=['learned-pos', 'sincos-pos'])
def test_impulse_heads_attend_to_their_offset_from_position_embeddings(attn_type, build):
    model = build(attn_type)
    learned_before = None if model.pos_embed is None else model.pos_embed.detach().clone()
    report = transfer_softmax_weights(model, setting='impulse')
    if learned_before is not None:
        # every slot scaled by 18, the class slot included
        torch.testing.assert_close(model.pos_embed.detach(), 18. * learned_before)
    assert ('pos_embed' in report['analytic']) == (learned_before is not None)
    with torch.no_grad():
        for layer in model.layers:  # the value/output pair as Mimetic's: 0.4 Z - 0.4 I
            vo = layer.attn.qkv.weight[2 * C:].double().T @ layer.attn.proj.weight.double().T
            assert abs(vo.diagonal().mean().item() + 0.4) < 0.03
    H, W = model.patch_resolution
    rows, cols = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
    # centre first, then up and right (DeiT-Tiny has three heads)
    offsets = [(0, 0), (-1, 0), (0, 1)]
    with torch.no_grad():
        if model.pos_embed is not None:
            positions = model.pos_embed[0, model.num_extra_tokens:]
        else:
            positions = model.position_embedding((H, W), torch.empty(0))[0]
        hits, impulse_mass = [], []
        for layer in model.layers:
            # float64: the sin-cos scores are small enough for float32 rounding to tie them
            tokens = F.layer_norm(positions.double(), (C, ), layer.ln1.weight.double(),
                                  layer.ln1.bias.double(), layer.ln1.eps)
            qkv = F.linear(tokens, layer.attn.qkv.weight.double(), layer.attn.qkv.bias.double())
            maps = torch.stack([
                (qkv[:, h * D:(h + 1) * D] @ qkv[:, C + h * D:C + (h + 1) * D].T * D**-0.5)
                .softmax(-1) for h in range(HEADS)])
            for head, (dy, dx) in enumerate(offsets):
                inside = ((rows + dy >= 0) & (rows + dy < H) & (cols + dx >= 0)
                          & (cols + dx < W))
                target = ((rows + dy) * W + cols + dx)[inside]
                head_map = maps[head][inside]
                hits.append((head_map.argmax(-1) == target).double().mean().item())
                impulse_mass.append(head_map.gather(1, target[:, None]).mean().item())
    assert min(hits) > 0.9, hits
    assert sum(hits) / len(hits) > 0.97
    if attn_type == 'softmax':
        # the learned embedding, scaled by 18, gives sharp maps (measured ~0.86 here)
        assert sum(impulse_mass) / len(impulse_mass) > 0.7


def test_impulse_offsets_cycle_when_heads_exceed_nine():
    # ViT-B widths (12 heads of 64) on a 7x7 grid: fewer tokens than a head has channels, so
    # the Gram's numerical rank (49) limits the pseudo-inverse.
    width, heads, d = 768, 12, 64
    torch.manual_seed(SEED)
    model = LinearViT(arch=dict(embed_dims=width, num_layers=1, num_heads=heads,
                                feedforward_channels=width), img_size=112, attn_type='softmax')
    model.init_weights()
    transfer_softmax_weights(model, setting='impulse')
    order = [(0, 0), (-1, 0), (0, 1), (0, -1), (1, 0), (-1, -1), (-1, 1), (1, -1), (1, 1)]
    H, W = model.patch_resolution
    rows, cols = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
    attn = model.layers[0].attn
    with torch.no_grad():
        tokens = model.layers[0].ln1(model.pos_embed[0, 1:]).double()
        qkv = F.linear(tokens, attn.qkv.weight.double(), attn.qkv.bias.double())
        for head in range(heads):
            dy, dx = order[head % 9]
            q = qkv[:, head * d:(head + 1) * d]
            k = qkv[:, width + head * d:width + (head + 1) * d]
            inside = (rows + dy >= 0) & (rows + dy < H) & (cols + dx >= 0) & (cols + dx < W)
            hits = ((q @ k.T).argmax(-1) == (rows + dy) * W + cols + dx)[inside].double().mean()
            assert hits > 0.9, (head, hits)


@pytest.mark.parametrize('rank', [0, 9])
def test_factor_rank_outside_one_to_dim_is_refused(rank):
    from linvit_mm.transfer.analytic import identity_plus_noise_factors
    with pytest.raises(ValueError, match=rf'^rank must be in \[1, 8\], got {rank}$'):
        identity_plus_noise_factors(8, rank, .5, .5, sign=1)


def test_full_rank_factors_give_the_target_itself():
    from linvit_mm.transfer.analytic import identity_plus_noise_factors
    torch.manual_seed(SEED)
    left, right = identity_plus_noise_factors(8, 8, .4, .3, sign=-1, num=2)
    torch.manual_seed(SEED)
    target = .4 * torch.randn(2, 8, 8) / 8 ** .5 - .3 * torch.eye(8)
    assert left.shape == (2, 8, 8) and right.shape == (2, 8, 8)
    torch.testing.assert_close(left @ right, target, atol=1e-5, rtol=0)


@pytest.mark.parametrize('head_type', ['VisionTransformerClsHead', 'LinearClsHead'])
@pytest.mark.parametrize('setting', ['mimetic', 'impulse'])
def test_analytic_settings_leave_a_module_without_blocks_alone(setting, head_type):
    """A classifier head has no attention (ViT's head has ``layers``, without ``attn``; a
    linear head not even that): nothing is written, and impulse does not look for a patch
    grid or a position embedding it does not have."""
    from mmpretrain.models import heads
    torch.manual_seed(SEED)
    head = getattr(heads, head_type)(num_classes=10, in_channels=C)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    report = transfer_softmax_weights(head, setting=setting, prefix='head.')
    assert report['analytic'] == [] and report['notes'] == []
    for name, value in head.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize('init', ['mimetic_init', 'impulse_init'])
def test_an_attention_of_another_shape_is_refused_before_any_write(init):
    """TTT's qkv carries extra rows: called directly, either init names the block and both
    shapes, and writes nothing."""
    from linvit_mm.transfer import analytic
    torch.manual_seed(SEED)
    model = LinearViT(arch=dict(embed_dims=32, num_layers=2, num_heads=2,
                                feedforward_channels=64), img_size=32, attn_type='ttt')
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = model.layers[0].attn.qkv.weight.shape[0]
    defaults = analytic.MIMETIC_DEFAULTS if init == 'mimetic_init' else analytic.IMPULSE_DEFAULTS
    with pytest.raises(ValueError) as info:
        getattr(analytic, init)(model, **defaults)
    assert str(info.value) == (
        f'layers.0.attn (ttt) is not a q/k/v + output projection of width 32 (qkv ({rows}, 32), '
        f'proj {tuple(model.layers[0].attn.proj.weight.shape)}); Mimetic and Impulse need that '
        f'parameterisation')
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_the_defaults_are_the_published_constants():
    # Trockman & Kolter (ICML 2023): alpha1 = beta1 = 0.7, alpha2 = beta2 = 0.4
    assert MIMETIC_DEFAULTS == dict(qk_alpha=0.7, qk_beta=0.7, vo_alpha=0.4, vo_beta=0.4)
    # Zheng et al. (NeurIPS 2025), the authors' timm post_weight_init='impulse'
    assert IMPULSE_DEFAULTS == dict(pos_scale=18., qk_gain=7., impulse_value=1000.,
                                    noise_std=0.6, noise_scale=3., vo_alpha=0.4, vo_beta=0.4)


def test_factors_of_rank_one_and_the_default_sign():
    from linvit_mm.transfer.analytic import identity_plus_noise_factors
    left, right = identity_plus_noise_factors(4, 1, alpha=0., beta=2.)
    assert left.shape == (1, 4, 1) and right.shape == (1, 1, 4)
    # without noise the target is +beta I (sign 1): its best rank-1 part has trace beta
    assert torch.trace((left @ right)[0]).item() == pytest.approx(2.)
    left, right = identity_plus_noise_factors(4, 4, alpha=0., beta=2.)
    torch.testing.assert_close(left @ right, 2. * torch.eye(4)[None], atol=1e-6, rtol=0)


def test_impulse_targets_hold_the_impulse_and_scaled_truncated_noise():
    from linvit_mm.transfer.analytic import impulse_attention_targets
    torch.manual_seed(SEED)
    targets = impulse_attention_targets([(0, 0), (0, 1)], (16, 16), impulse_value=1000.,
                                        noise_std=0.6, noise_scale=3.)
    assert targets.shape == (2, 256, 256)
    assert torch.equal(targets[0].diagonal(), torch.full((256,), 1000., dtype=torch.float64))
    # query (r, c) -> key (r, c + 1); the last column has no key to its right
    hits = targets[1] == 1000.
    assert hits.sum() == 16 * 15 and hits[0, 1] and not hits[15].any()
    noise = targets[targets != 1000.]
    assert abs(noise.std().item() - 0.6 * 3.) < 0.03
    assert noise.abs().max() <= 2. * 3.  # trunc_normal_ cuts at +-2, then the scale


def test_impulse_factors_have_the_gain_as_frobenius_norm_per_head():
    from linvit_mm.transfer.analytic import impulse_qk_factors
    torch.manual_seed(SEED)
    position_embed, targets = torch.randn(16, 12), torch.randn(3, 16, 16)
    left, right = impulse_qk_factors(position_embed, targets, rank=4, gain=7.)
    assert left.shape == (3, 12, 4) and right.shape == (3, 4, 12)
    for factor in (left, right):
        torch.testing.assert_close(factor.flatten(1).norm(dim=1),
                                   torch.full((3,), 7., dtype=torch.float64))


def test_an_attention_whose_output_projection_alone_differs_is_refused():
    from linvit_mm.transfer import analytic
    torch.manual_seed(SEED)
    model = LinearViT(arch=dict(embed_dims=32, num_layers=1, num_heads=2,
                                feedforward_channels=64), img_size=32, attn_type='softmax')
    model.layers[0].attn.proj = torch.nn.Linear(64, 32)
    with pytest.raises(ValueError, match=r'qkv \(96, 32\), proj \(32, 64\)\); Mimetic'):
        analytic.mimetic_init(model, **analytic.MIMETIC_DEFAULTS)
