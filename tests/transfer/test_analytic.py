"""Mimetic and Impulse: the structure each analytic initialisation gives the attention."""
import pytest
import torch
import torch.nn.functional as F

from linvit_mm.models.backbones.linear_vit import LinearViT
from linvit_mm.transfer import transfer_softmax_weights

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
    transfer_softmax_weights(model, setting='impulse')
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
