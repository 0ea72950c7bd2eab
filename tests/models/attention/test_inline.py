"""InLine attention: the fast form against the oracle written from the definition, its signed
map over every token, and its float32 state."""
import pytest
import torch

from linvit_mm.models.attention import InLineAttention
from linvit_mm.models.attention.inline import naive_inline_attention, naive_inline_residual
from linvit_mm.testing import assert_rel_close, rel_error

ROPES = {'eva': dict(type='eva', ref_grid=(4, 4)), 'dinov3': dict(type='dinov3')}
CONFIGS = {
    'plain': {},
    'rope_eva': {'rope': ROPES['eva']},
    'rope_dinov3': {'rope': ROPES['dinov3']},
    'no_qkv_bias_layer_scale': {'qkv_bias': False, 'layer_scale_init_value': .5},
    # as many heads as q, k, v parts (the default 3) hides a head split that swaps the two
    'four_heads': {'embed_dims': 32, 'num_heads': 4},
    'four_heads_rope_dinov3': {'embed_dims': 32, 'num_heads': 4, 'rope': ROPES['dinov3']},
}
GRIDS = {'7x9': (7, 9), '5x3': (5, 3)}


def channel_heads(module, x):
    """``q, k`` heads ``(B, heads, N, d)`` read from the ``qkv`` output's channels by hand."""
    qkv = module.qkv(x)
    C, d = module.embed_dims, module.head_dims
    return [torch.stack([qkv[..., p * C + h * d:p * C + (h + 1) * d]
                         for h in range(module.num_heads)], dim=1) for p in range(2)]


@pytest.mark.parametrize('hw', GRIDS.values(), ids=GRIDS)
@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('config', CONFIGS.values(), ids=CONFIGS)
def test_fast_form_matches_naive_reference(config, num_extra, hw, make_attention, tokens,
                                           assert_fast_matches_naive):
    """Output and the gradients of the input and of every parameter, in float64."""
    module = make_attention('inline', **config)
    assert_fast_matches_naive(module, tokens(hw, num_extra, dims=module.embed_dims), hw)


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_cls', 'cls'])
@pytest.mark.parametrize('config', ['plain', 'rope_eva', 'rope_dinov3', 'four_heads'])
def test_attention_map_matches_naive_map(config, num_extra, make_attention, tokens,
                                        assert_map_matches_naive):
    module = make_attention('inline', **CONFIGS[config])
    hw = (7, 9)
    assert_map_matches_naive(module, tokens(hw, num_extra, dims=module.embed_dims), hw)


@pytest.mark.parametrize('rotated', [False, True], ids=['no_rope', 'rotated'])
def test_naive_form_is_the_definition_token_by_token(rotated):
    """``out_i = sum_j (s/N q_i^T k_j + (1 - s q_i^T k_mean) / N) v_j`` per head, ``s = d^-1/2``,
    with ``q, k`` rotated by per-token matrices ``R`` first (any ``R``) and head ``h`` in
    channels ``h d .. (h+1) d`` of each of q, k, v and of the output."""
    generator = torch.Generator().manual_seed(0)
    heads, d, n = 2, 4, 5
    C, s = heads * d, 4**-0.5
    qkv = torch.randn(1, n, 3 * C, generator=generator, dtype=torch.float64)
    rotations = torch.linalg.qr(torch.randn(n, d, d, generator=generator,
                                            dtype=torch.float64))[0] if rotated else None
    out, attn = naive_inline_attention(qkv, heads, rotations)
    for h in range(heads):
        def part(p, i):
            t = qkv[0, i, p * C + h * d:p * C + (h + 1) * d]
            return t if rotations is None or p == 2 else rotations[i] @ t

        k_mean = sum(part(1, j) for j in range(n)) / n
        for i in range(n):
            weights = [s / n * (part(0, i) @ part(1, j)) + (1 - s * (part(0, i) @ k_mean)) / n
                       for j in range(n)]
            expected = sum(w * part(2, j) for j, w in enumerate(weights))
            assert_rel_close(attn[0, h, i], torch.stack(weights), 1e-12, f'map row {i}')
            assert_rel_close(out[0, i, h * d:(h + 1) * d], expected, 1e-12, f'output {i}')


def test_reference_shares_no_helper_with_the_fast_form(make_attention, tokens,
                                                       fast_helpers_broken):
    module = make_attention('inline', rope=ROPES['eva'])
    hw = (4, 5)
    x = tokens(hw, 1)
    with torch.no_grad():
        expected = module.forward_reference(x, hw)
        with fast_helpers_broken((InLineAttention, '_linear'), (InLineAttention, '_map'),
                                 (module, 'scale')):
            assert torch.equal(module.forward_reference(x, hw), expected)


@pytest.mark.parametrize('rope', [None, 'eva'], ids=['no_rope', 'rope_eva'])
def test_map_is_float32_under_bf16_autocast(rope, make_attention, tokens):
    """The map (the distillation target) is formed in float32 from the bf16 projections (the
    rotation returns float32 and would upcast a rotated map anyway; an unrotated one shows it)."""
    module = make_attention('inline', dtype=torch.float32, rope=ROPES.get(rope))
    hw = (7, 9)
    x = tokens(hw, 1, dtype=torch.float32)
    with torch.no_grad():
        with torch.autocast('cpu', dtype=torch.bfloat16):
            attn = module.attention_map(x, hw)
            qkv = module.qkv(x)
        naive = naive_inline_attention(qkv.double(), module.num_heads,
                                       module.rotation_matrices(hw, 1, qkv.double()))[1]
    assert attn.dtype == torch.float32
    assert_rel_close(attn, naive, 1e-5, 'map from the bf16 projections')


def test_map_rows_sum_to_one_and_are_signed(make_attention, tokens):
    module = make_attention('inline')
    hw = (7, 9)
    with torch.no_grad():
        attn = module.attention_map(tokens(hw, 1), hw)
    assert attn.min() < 0, 'InLine maps are signed; this one has no negative entry'
    assert_rel_close(attn.sum(dim=-1), torch.ones(attn.shape[:-1], dtype=attn.dtype), 1e-12,
                     'row sums')


def test_inline_counts_the_class_token(make_attention, tokens):
    """N and the key/value means span every token, class token included (official DeiT model)."""
    module = make_attention('inline')
    hw = (4, 4)
    x = tokens(hw, 1)
    with torch.no_grad():
        attn = module.attention_map(x, hw)
        q, k = channel_heads(module, x)
        n, s = x.shape[1], module.head_dims**-0.5
        expected = (s / n) * (q @ k.transpose(-2, -1)) \
            + (1 - s * q @ k.mean(dim=2, keepdim=True).transpose(-2, -1)) / n
    assert_rel_close(attn, expected, 1e-12, 'InLine map')


def test_state_is_float32_under_fp16_autocast(make_attention, tokens, autocast_output):
    """``K^T V`` over 16k tokens of scale 10 (it grows like sqrt(N) |k||v|) overflows fp16
    (max 65504) while the true output fits it; the float32 state does not overflow."""
    module = make_attention('inline', dtype=torch.float32, embed_dims=64, num_heads=2)
    hw = (128, 128)
    x = tokens(hw, 0, batch=1, dims=64, dtype=torch.float32, scale=10.)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.float16):
        _, k, v = module.split_heads(module.qkv(x))
    assert k.dtype == torch.float16
    assert torch.isfinite(k).all() and not torch.isfinite(k.transpose(-2, -1) @ v).all()
    out, exact = autocast_output(module, x, hw, torch.float16)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert rel_error(out, exact) < 1e-2


def test_naive_form_ignores_autocast(assert_oracle_ignores_autocast):
    qkv = torch.randn(2, 13, 3 * 24, generator=torch.Generator().manual_seed(0))
    assert_oracle_ignores_autocast(naive_inline_attention, qkv, 3, tol=1e-6)


# ------------------------------------------------------------------ the local residual branch
def with_residual(make_attention, **kwargs):
    """An ``inline`` operator with the residual branch, its biases drawn away from zero."""
    module = make_attention('inline', residual=True, **kwargs)
    with torch.no_grad():
        for conv in (module.residual[0], module.residual[2]):
            conv.bias.uniform_(-.5, .5)
    return module


def test_residual_is_off_by_default(make_attention):
    module = make_attention('inline')
    assert module.residual is None
    assert set(module.state_dict()) == set(make_attention('softmax').state_dict())
    assert 'residual=False' in repr(module)
    shapes = {name: tuple(t.shape) for name, t in
              make_attention('inline', residual=True).state_dict().items()
              if name.startswith('residual.')}
    C, d = 24, 8
    assert shapes == {'residual.0.weight': (C, d, 1), 'residual.0.bias': (C, ),
                      'residual.2.weight': (9 * C, d, 1), 'residual.2.bias': (9 * C, )}


@pytest.mark.parametrize('hw', GRIDS.values(), ids=GRIDS)
@pytest.mark.parametrize('num_extra', [0, 1, 2], ids=['no_cls', 'cls', 'cls_register'])
@pytest.mark.parametrize('config', ['plain', 'four_heads', 'rope_eva'])
def test_residual_fast_form_matches_naive_reference(config, num_extra, hw, make_attention,
                                                    tokens, assert_fast_matches_naive):
    """With the branch on: output and the gradients of the input and of every parameter (the
    branch's convs included), in float64, against the oracle."""
    module = with_residual(make_attention, **CONFIGS[config])
    assert_fast_matches_naive(module, tokens(hw, num_extra, dims=module.embed_dims), hw)


def test_residual_is_the_definition_pixel_by_pixel(make_attention, tokens):
    """The branch written out for one image, channel and pixel: kernel entries ``9c .. 9c+8``
    of ``W2 gelu(W1 mean(x) + b1) + b2`` (grouped: head ``g``'s outputs read head ``g``'s
    inputs) laid out row by row, times the in-grid neighbours of the patch value."""
    module = with_residual(make_attention, embed_dims=32, num_heads=4)
    hw, num_extra = (3, 4), 1
    H, W = hw
    x = tokens(hw, num_extra, dims=32)
    C, d, heads = 32, 8, 4
    with torch.no_grad():
        branch = module.forward_reference(x, hw) - make_plain(module)(x, hw)
        values = module.qkv(x)[..., 2 * C:]
        w1, b1 = module.residual[0].weight[..., 0], module.residual[0].bias
        w2, b2 = module.residual[2].weight[..., 0], module.residual[2].bias
        for b in range(2):
            mean = x[b].mean(dim=0)
            hidden = torch.cat([w1[g * d:(g + 1) * d] @ mean[g * d:(g + 1) * d]
                                for g in range(heads)]) + b1
            hidden = torch.nn.functional.gelu(hidden)
            entries = torch.cat([w2[g * 9 * d:(g + 1) * 9 * d] @ hidden[g * d:(g + 1) * d]
                                 for g in range(heads)]) + b2
            expected = torch.zeros(H * W, C, dtype=x.dtype)
            for c in range(C):
                kernel = entries[9 * c:9 * c + 9].reshape(3, 3)
                for i in range(H):
                    for j in range(W):
                        expected[i * W + j, c] = sum(
                            kernel[a + 1, e + 1] * values[b, num_extra + (i + a) * W + j + e, c]
                            for a in (-1, 0, 1) for e in (-1, 0, 1)
                            if 0 <= i + a < H and 0 <= j + e < W)
            # before proj: undo it (proj is linear) by comparing proj(expected) - proj(0)
            projected = module.proj(expected) - module.proj.bias
            assert_rel_close(branch[b, num_extra:], projected, 1e-12, f'image {b} patches')
            assert branch[b, :num_extra].abs().max() < 1e-12


def make_plain(module):
    """The same operator without the branch (its qkv and proj)."""
    plain = InLineAttention(module.embed_dims, module.num_heads).to(module.qkv.weight.dtype)
    plain.load_state_dict({k: v for k, v in module.state_dict().items()
                           if not k.startswith('residual.')})
    return plain


def official_inline_attention(module, x):
    """The official InLine-DeiT attention (LeapLabTHU/InLine ``models/inline_deit.py``,
    ``InLineAttention.forward``), written here from reading it: one class token, a square
    grid ``h = w = int(n ** 0.5)``, the state scaled by ``(scale / n) ** 0.5`` on each side."""
    b, n, c = x.shape
    heads = module.num_heads
    d = c // heads
    scale = d**-0.5
    side = int(n**0.5)
    qkv = module.qkv(x).reshape(b, n, 3, c).permute(2, 0, 1, 3)
    q, k, v = (t.reshape(b, n, heads, d).permute(0, 2, 1, 3) for t in qkv)
    kernels = module.residual(x.mean(dim=1).unsqueeze(dim=-1)).reshape(b * c, 1, 3, 3)
    kv = (k.transpose(-2, -1) * (scale / n)**0.5) @ (v * (scale / n)**0.5)
    out = q @ kv + (1 - q @ k.mean(dim=2, keepdim=True).transpose(-2, -1) * scale) \
        * v.mean(dim=2, keepdim=True)
    out = out.transpose(1, 2).reshape(b, n, c)
    grid = v[:, :, 1:, :].transpose(1, 2).reshape(b, side, side, c).permute(0, 3, 1, 2)
    local = torch.nn.functional.conv2d(grid.reshape(1, b * c, side, side), kernels, None,
                                       padding=(1, 1), groups=b * c)
    out = out.clone()
    out[:, 1:, :] = out[:, 1:, :] + local.reshape(b, c, n - 1).permute(0, 2, 1)
    return module.proj(out)


@pytest.mark.parametrize('side', [4, 7])
def test_residual_equals_the_official_attention(side, make_attention, tokens):
    """``residual=True`` is the official module (square grid, one class token), 1e-6 in
    float64; without the branch the two differ."""
    module = with_residual(make_attention, embed_dims=48, num_heads=6)
    hw = (side, side)
    x = tokens(hw, 1, dims=48)
    with torch.no_grad():
        official = official_inline_attention(module, x)
        assert_rel_close(module(x, hw), official, 1e-6, 'output vs the official attention')
        assert rel_error(make_plain(module)(x, hw), official) > 1e-3


def test_residual_core_macs(make_attention):
    plain, module = make_attention('inline'), make_attention('inline', residual=True)
    C, d, n, hw = 24, 8, 13, (3, 4)
    assert module.core_macs(n, hw) - plain.core_macs(n, hw) == n * C + 10 * C * d + 9 * 12 * C


def test_softmax_transfer_keeps_the_residual_at_its_init():
    """qkv and proj copy; the four branch tensors per block are operator-specific, reported,
    and untouched."""
    from linvit_mm.models import LinearViT
    from linvit_mm.transfer import transfer_softmax_weights
    arch = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)
    teacher = LinearViT(arch=arch, attn_type='softmax', img_size=32, patch_size=8)
    student = LinearViT(arch=arch, attn_type='inline', attn_cfg=dict(residual=True),
                        img_size=32, patch_size=8)
    before = {k: v.clone() for k, v in student.state_dict().items() if '.residual.' in k}
    report = transfer_softmax_weights(
        student, {f'backbone.{k}': v for k, v in teacher.state_dict().items()}, setting='copy')
    assert len(before) == 8
    for name, value in before.items():
        assert report['kept own init'][name] == 'operator-specific'
        assert torch.equal(student.state_dict()[name], value)
    assert torch.equal(student.layers[1].attn.qkv.weight, teacher.layers[1].attn.qkv.weight)


def test_residual_oracle_ignores_autocast(make_attention, tokens, assert_oracle_ignores_autocast):
    module = with_residual(make_attention, embed_dims=24, num_heads=3)
    hw = (3, 4)
    x = tokens(hw, 1, dims=24)
    qkv = module.qkv(x).detach()
    residual = module.residual.float()

    def oracle(qkv, num_heads):
        return naive_inline_residual(x.to(qkv.dtype), qkv, residual.to(qkv.dtype), num_heads, hw)

    assert_oracle_ignores_autocast(oracle, qkv, 3, tol=1e-6)


def test_residual_convolution_is_float32_under_bf16_autocast(make_attention, tokens):
    """Under bf16 autocast the branch's two 1x1 convolutions run in bf16 (they make the
    kernels), but the per-image 3x3 convolution runs outside autocast on float32 patches, so
    the branch comes back in float32, as the linear part's state does."""
    module = with_residual(make_attention, dtype=torch.float32, embed_dims=32, num_heads=4)
    hw = (6, 5)
    x = tokens(hw, 1, dims=32, dtype=torch.float32)
    with torch.no_grad():
        v = module.split_heads(module.qkv(x))[2]
        exact = module.double().local_residual(x.double(), v.double(), hw)
        module.float()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            got = module.local_residual(x, v, hw)
    assert got.dtype == torch.float32
    assert rel_error(got, exact) < 1e-2
