"""Windowed attention, the block-level switch of LinearViT, for every registered operator:
a window as large as the grid is the global operator, a windowed call equals an explicit
loop over the windows (written here from the grid, not from the bands), nothing leaks
between windows, and the switch reaches the blocks it names."""
import pytest
import torch
from torch import nn

from linvit_mm.models import LinearViT
from linvit_mm.models.attention import attention_class, attention_types, build_attention
from linvit_mm.models.backbones.linear_vit import LinearViTLayer
from linvit_mm.models.backbones.windows import windowed_attention
from linvit_mm.models.utils.rope import GridRotation
from linvit_mm.testing import assert_rel_close

OPERATORS = attention_types()
ROPES = {'none': None, 'eva': dict(type='eva', ref_grid=(4, 4)), 'dinov3': dict(type='dinov3')}
EMBED_DIMS, NUM_HEADS = 16, 2


def make(attn_type, rope=None, seed=0):
    torch.manual_seed(seed)
    attn = build_attention(attn_type, embed_dims=EMBED_DIMS, num_heads=NUM_HEADS, rope=rope)
    attn = attn.double()
    # the learned parts every operator starts near zero or at a constant are drawn, so a
    # windowed form that drops one of them differs
    with torch.no_grad():
        for name, param in attn.named_parameters():
            if name not in ('qkv.weight', 'proj.weight'):
                param.add_(torch.randn_like(param) * .1)
    return attn


def tokens(hw, num_extra, batch=2, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_extra + hw[0] * hw[1], EMBED_DIMS, generator=generator,
                       dtype=torch.float64)


def rope_ids(attn_type):
    return ['none'] + (['eva', 'dinov3'] if attention_class(attn_type).supports_rope else [])


CASES = [(op, rope) for op in OPERATORS for rope in rope_ids(op)]


class GatheredRotation(nn.Module):
    """The global grid's rotation at the listed tokens (the test's own gathering)."""

    def __init__(self, rope, grid, index):
        super().__init__()
        self.rope, self.grid, self.index = rope, grid, index
        self.head_dims = rope.head_dims

    def forward(self, hw_shape, num_extra=0, like=None):
        whole = self.rope(self.grid, 0, like)
        sin, cos = whole.sin[self.index], whole.cos[self.index]
        sin = torch.cat([sin.new_zeros(num_extra, sin.shape[1]), sin])
        cos = torch.cat([cos.new_ones(num_extra, cos.shape[1]), cos])
        return GridRotation(sin, cos, whole.interleaved)


def window_loop(attn, x, hw, window):
    """Each window run alone: its tokens found by ``(i // wh, j // ww)``, the extra tokens
    in front, its output written back token by token; each extra token's output the mean of
    its window outputs weighted by the windows' patch counts."""
    H, W = hw
    num_extra = x.shape[1] - H * W
    members = {}
    for i in range(H):
        for j in range(W):
            members.setdefault((i // window[0], j // window[1]), []).append((i, j))
    out = torch.zeros_like(x)
    rope = attn.rope
    for cells in members.values():
        rows = sorted({i for i, _ in cells})
        cols = sorted({j for _, j in cells})
        index = [num_extra + i * W + j for i, j in cells]
        part = torch.cat([x[:, :num_extra], x[:, index]], dim=1)
        if rope is not None:
            attn.rope = GatheredRotation(rope, hw, [t - num_extra for t in index])
        try:
            y = attn(part, (len(rows), len(cols)))
        finally:
            attn.rope = rope
        out[:, index] = y[:, num_extra:]
        out[:, :num_extra] += y[:, :num_extra] * len(cells) / (H * W)
    return out


def case_id(case):
    return '-'.join(case)


@pytest.mark.parametrize('num_extra', [0, 2], ids=['no_extra', 'cls_and_register'])
@pytest.mark.parametrize('case', CASES, ids=case_id)
def test_window_of_the_grid_is_the_global_operator(case, num_extra):
    attn_type, rope = case
    attn = make(attn_type, ROPES[rope])
    hw = (5, 6)
    x = tokens(hw, num_extra)
    expected = attn(x, hw)
    for window in [(5, 6), (8, 9)]:
        assert_rel_close(windowed_attention(attn, x, hw, window), expected, 1e-12,
                         f'window {window}')


@pytest.mark.parametrize('num_extra', [0, 2], ids=['no_extra', 'cls_and_register'])
@pytest.mark.parametrize('case', CASES, ids=case_id)
def test_windows_match_an_explicit_loop(case, num_extra):
    """A 7 x 5 grid under 3 x 2 windows has all four window shapes (3x2, 3x1, 1x2, 1x1);
    outputs and input gradients."""
    attn_type, rope = case
    attn = make(attn_type, ROPES[rope])
    hw, window = (7, 5), (3, 2)
    x = tokens(hw, num_extra)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(3),
                           dtype=x.dtype)
    results = []
    for run in (lambda t: windowed_attention(attn, t, hw, window),
                lambda t: window_loop(attn, t, hw, window)):
        t = x.clone().requires_grad_(True)
        out = run(t)
        out.backward(upstream)
        results.append((out.detach(), t.grad))
    assert_rel_close(results[0][0], results[1][0], 1e-11, 'output')
    assert_rel_close(results[0][1], results[1][1], 1e-10, 'input gradient')
    # the windows matter: the global operator computes something else
    assert not torch.allclose(results[0][0], attn(x, hw).detach(), atol=1e-6)


@pytest.mark.parametrize('num_extra', [0, 1], ids=['no_extra', 'cls'])
@pytest.mark.parametrize('attn_type', OPERATORS)
def test_nothing_leaks_between_windows(attn_type, num_extra):
    """Changing the tokens of the 1 x 1 corner window (the border of both sides, where a
    padded partition would put its padding) changes no other patch's output, and changing
    everything outside a window changes none of its patches' outputs."""
    attn = make(attn_type)
    hw, window = (7, 5), (3, 2)
    x = tokens(hw, num_extra)
    grid = torch.arange(hw[0] * hw[1]).reshape(hw) + num_extra
    corner = grid[6:, 4:].flatten()
    changed = x.clone()
    changed[:, corner] = torch.randn_like(changed[:, corner]) * 5
    base = windowed_attention(attn, x, hw, window)
    moved = windowed_attention(attn, changed, hw, window)
    others = torch.ones(x.shape[1], dtype=torch.bool)
    others[corner] = False
    others[:num_extra] = False
    assert torch.equal(base[:, others], moved[:, others])
    assert not torch.allclose(base[:, corner], moved[:, corner])

    inside = grid[3:6, 2:4].flatten()
    outside = x.clone()
    keep = torch.zeros(x.shape[1], dtype=torch.bool)
    keep[inside] = True
    keep[:num_extra] = True
    outside[:, ~keep] = torch.randn_like(outside[:, ~keep])
    assert torch.equal(windowed_attention(attn, outside, hw, window)[:, inside],
                       base[:, inside])


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_windowed_block_is_the_block_around_the_window_loop(attn_type):
    """The block windows its operator only: ``encode_position`` (TTT's conv) runs on the
    whole grid, the FFN on every token."""
    torch.manual_seed(0)
    layer = LinearViTLayer(EMBED_DIMS, NUM_HEADS, 32, attn_type=attn_type,
                           window_size=(3, 2)).double()
    with torch.no_grad():
        for param in layer.attn.parameters():
            param.add_(torch.randn_like(param) * .1)
    hw = (7, 5)
    x = tokens(hw, 1)
    y = layer.attn.encode_position(x, hw)
    y = y + window_loop(layer.attn, layer.ln1(y), hw, (3, 2))
    y = y + layer.ffn(layer.ln2(y))
    assert_rel_close(layer(x, hw), y, 1e-12, 'block')


def test_backbone_windows_the_blocks_it_names():
    kwargs = dict(arch=dict(embed_dims=16, num_layers=4, num_heads=2, feedforward_channels=32),
                  img_size=(112, 80), attn_type='relu', out_type='featmap')
    vit = LinearViT(window_size=3, window_block_indexes=[0, -1], **kwargs)
    assert [layer.window_size for layer in vit.layers] == [(3, 3), None, None, (3, 3)]
    every = LinearViT(window_size=(2, 4), **kwargs)
    assert all(layer.window_size == (2, 4) for layer in every.layers)
    # windows as large as the 7 x 5 grid: the global model
    globe = LinearViT(**kwargs)
    whole = LinearViT(window_size=(7, 5), **kwargs)
    whole.load_state_dict(globe.state_dict())
    image = torch.randn(1, 3, 112, 80)
    assert_rel_close(whole(image)[0], globe(image)[0], 1e-5, 'featmap')
    every.load_state_dict(globe.state_dict())
    assert not torch.allclose(every(image)[0], globe(image)[0], atol=1e-4)


@pytest.mark.parametrize('kwargs, message', [
    (dict(window_size=0, window_block_indexes=[1]), 'needs a window_size'),
    (dict(window_size=3, window_block_indexes=[4]), r'\[4\] are outside the 4 blocks'),
    (dict(window_size=3, window_block_indexes=[]), 'selects no block'),
    (dict(window_size=-2), 'window_size must be'),
    (dict(window_size=(3, 0)), 'window_size must be'),
], ids=['indexes_without_size', 'index_out_of_range', 'empty_indexes', 'negative_size',
        'zero_side'])
def test_bad_window_settings_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        LinearViT(arch=dict(embed_dims=16, num_layers=4, num_heads=2, feedforward_channels=32),
                  **kwargs)


def test_hooks_on_a_windowed_operator_are_refused():
    attn = make('softmax')
    attn.register_forward_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match='forward hooks'):
        windowed_attention(attn, tokens((4, 4), 1), (4, 4), (2, 2))
