"""MHLA with the authors' switches against a transcription of the authors' module.

``OfficialMHLA`` below is written from reading ``MHLA_Normed_Torch`` and
``BlockDistanceConv`` (DAGroup-PKU/MHLA, ``mhla_image_classification/models/modules/
attention/mhla.py``) and the block rearrangement of their ``MHLA_ViT``: its input is the
token grid already cut into blocks, ``(B, num_pieces, window_size, C)``, and its tensors
carry the authors' names. The test moves its weights into our operator by the key map the
converter uses and compares outputs and gradients in float64.
"""
import math
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from torch import nn

from linvit_mm.models.attention import MultiHeadLinearAttention
from linvit_mm.models.attention.mhla import OFFICIAL_IMAGENET, distance_mixing_matrix
from linvit_mm.testing import assert_rel_close, rel_error

REPO = Path(__file__).resolve().parents[3]
PRESET = REPO / 'configs/_base_/models/linvit/mhla-official-small.py'
EMBED_DIMS, NUM_HEADS = 24, 3


# ---------------------------------------------------------------- the transcription

class OfficialBlockDistance(nn.Module):
    """The authors' mixing: a bias-free 1 x 1 convolution over the block axis whose
    ``(M, M)`` weight starts from block-centre distances, ``1 - d / d_max`` ('linear') or
    ``cos(pi/4 d / d_max)`` ('cos'), each column divided by its sum."""

    def __init__(self, num_patches_per_side, patch_group_size, transform):
        super().__init__()
        per_block = int(math.sqrt(patch_group_size))
        blocks_per_side = num_patches_per_side // per_block
        total = blocks_per_side**2
        centres = torch.tensor([[i + .5, j + .5] for i in range(blocks_per_side)
                                for j in range(blocks_per_side)])
        distance = torch.zeros(total, total)
        for i in range(total):
            for j in range(total):
                distance[i, j] = torch.norm(centres[i] - centres[j], p=2)
        if transform == 'linear':
            matrix = 1. - distance / distance.max()
        else:
            matrix = torch.cos(distance / distance.max() * math.pi / 4)
        matrix = matrix / matrix.sum(dim=0, keepdim=True)
        self.conv = nn.Conv2d(total, total, kernel_size=1, bias=False)
        with torch.no_grad():
            self.conv.weight.copy_(matrix[:, :, None, None])

    def forward(self, x):
        return self.conv(x)


class OfficialMHLA(nn.Module):
    """``MHLA_Normed_Torch``: LayerNorm, bias-free qkv (``qkv_bias`` kwarg), optional
    RMSNorm of q and k over all channels, ``relu + eps`` features, per-block ``K^T V``
    mixed by the distance conv, the normaliser ``conv(q . k_sum) + eps`` (each block's
    queries dotted with its own key sum, then mixed), a 5 x 5 depthwise 'lepe' of the
    values in image layout added before ``to_out``."""

    def __init__(self, dim, heads, qk_norm, embed_len, window_size, transform='linear',
                 qkv_bias=False, eps=1e-6):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.RMSNorm(dim) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(dim) if qk_norm else nn.Identity()
        self.lepe = nn.Conv2d(dim, dim, 5, 1, 2, groups=dim)
        self.window_len = int(window_size**.5)
        self.pieces_len = int((embed_len // window_size)**.5)
        self.piece_attn = OfficialBlockDistance(int(embed_len**.5), window_size, transform)
        self.eps = eps
        self.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(0.))

    def _blocks_to_image(self, t):
        """``b (h w) (p1 p2) d -> b d (h p1) (w p2)``."""
        B, _, _, C = t.shape
        n, p = self.pieces_len, self.window_len
        return t.reshape(B, n, n, p, p, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, n * p, n * p)

    def _image_to_blocks(self, t):
        """``b d (h p1) (w p2) -> b (h w) (p1 p2) d``."""
        B, C = t.shape[:2]
        n, p = self.pieces_len, self.window_len
        return t.reshape(B, C, n, p, n, p).permute(0, 2, 4, 3, 5, 1).reshape(B, n * n, p * p, C)

    def forward(self, x):
        x = self.norm(x)
        B, N, W, C = x.shape
        H, D = self.num_heads, self.head_dim
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        lepe = self._image_to_blocks(self.lepe(self._blocks_to_image(v)))
        q, k = self.q_norm(q), self.k_norm(k)
        k = torch.relu(k) + self.eps
        q = torch.relu(q) + self.eps
        # b n w (h d) -> (b h) n w d
        q, k, v = (t.reshape(B, N, W, H, D).permute(0, 3, 1, 2, 4).reshape(B * H, N, W, D)
                   for t in (q, k, v))
        k = k.transpose(-2, -1)
        kv = self.piece_attn(k @ v)
        k_sum = k.sum(dim=-1, keepdim=True)
        normalizer = self.piece_attn(q @ k_sum) + self.eps
        out = (q @ kv) / normalizer
        out = out.reshape(B, H, N, W, D).permute(0, 2, 3, 1, 4).reshape(B, N, W, H * D)
        return self.to_out(out + lepe)


def official_blocks(x, side, piece):
    """The authors' ViT rearrangement ``b (hb p1 wb p2) c -> b (hb wb) (p1 p2) c`` of a
    row-major ``side x side`` token grid, and back."""
    B, _, C = x.shape
    n = side // piece
    return x.reshape(B, n, piece, n, piece, C).transpose(2, 3).reshape(B, n * n, piece**2, C)


def official_tokens(blocks, side, piece):
    B, _, _, C = blocks.shape
    n = side // piece
    return blocks.reshape(B, n, n, piece, piece, C).transpose(2, 3).reshape(B, side * side, C)


# The converter's key map: the authors' name -> ours (the mixing weight drops its 1 x 1).
OFFICIAL_KEYS = {'norm.weight': 'norm.weight', 'norm.bias': 'norm.bias',
                 'to_qkv.weight': 'qkv.weight', 'to_qkv.bias': 'qkv.bias',
                 'q_norm.weight': 'q_norm.weight', 'k_norm.weight': 'k_norm.weight',
                 'lepe.weight': 'value_conv.weight', 'lepe.bias': 'value_conv.bias',
                 'piece_attn.conv.weight': 'block_mixing',
                 'to_out.0.weight': 'proj.weight', 'to_out.0.bias': 'proj.bias'}


def to_ours(official_state):
    state = {OFFICIAL_KEYS[key]: value for key, value in official_state.items()}
    state['block_mixing'] = state['block_mixing'][:, :, 0, 0]
    return state


def randomised(module, seed=0):
    """Every parameter drawn away from its init (norm weights around 1, mixing positive)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.rand(param.shape, generator=generator, dtype=param.dtype)
            if name.endswith('norm.weight'):
                param.copy_(.5 + noise)
            elif 'piece_attn' in name:
                param.copy_(.1 + noise)
            else:
                param.copy_(noise - .5)
    return module


def official_and_ours(side, piece, qk_norm=True, qkv_bias=False, transform='linear', **ours):
    official = OfficialMHLA(EMBED_DIMS, NUM_HEADS, qk_norm, side * side, piece * piece,
                            transform, qkv_bias).double()
    randomised(official)
    blocks = side // piece
    module = MultiHeadLinearAttention(
        EMBED_DIMS, NUM_HEADS, **dict(OFFICIAL_IMAGENET, num_blocks=(blocks, blocks),
                                      mixing_init=transform, qk_norm=qk_norm,
                                      qkv_bias=qkv_bias, **ours)).double()
    module.load_state_dict(to_ours(official.state_dict()), strict=True)
    return official, module


def outputs_and_grads(official, module, x, side, piece):
    """Both modules' outputs in token order and the gradients of the input and of every
    parameter (ours under the authors' names), for one fixed upstream gradient."""
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(3),
                           dtype=x.dtype)
    results = []
    for run, named in ((lambda t: official_tokens(official(official_blocks(t, side, piece)),
                                                  side, piece), official),
                       (lambda t: module(t, (side, side)), module)):
        named.zero_grad(set_to_none=True)
        t = x.clone().requires_grad_(True)
        out = run(t)
        out.backward(upstream)
        grads = {'x': t.grad, **{name: p.grad for name, p in named.named_parameters()}}
        results.append((out.detach(), grads))
    (out_official, grads_official), (out, grads) = results
    grads = {'x': grads['x'], **{key: grads[ours] for key, ours in OFFICIAL_KEYS.items()
                                 if ours in grads}}
    grads['piece_attn.conv.weight'] = grads['piece_attn.conv.weight'][:, :, None, None]
    return out_official, grads_official, out, grads


def tokens(side, batch=2, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, side * side, EMBED_DIMS, generator=generator, dtype=torch.float64)


# ---------------------------------------------------------------- ours == the authors'

CASES = {
    # the authors' ImageNet layout: 16 blocks of 4 x 4 on a 16 x 16 grid
    'imagenet_16x16_4x4': dict(side=16, piece=4),
    'grid_8x8_blocks_2x2': dict(side=8, piece=2),
    'no_qk_norm': dict(side=8, piece=4, qk_norm=False),
    'qkv_bias': dict(side=8, piece=4, qkv_bias=True),
    'cos_mixing': dict(side=12, piece=3, transform='cos'),
    'fixed_block_size': dict(side=8, piece=4, block_size=(4, 4)),
}


@pytest.mark.parametrize('case', list(CASES))
def test_official_switches_match_the_authors_module(case):
    """Output and the gradients of the input and of every parameter, float64."""
    kwargs = dict(CASES[case])
    side, piece = kwargs.pop('side'), kwargs.pop('piece')
    official, module = official_and_ours(side, piece, **kwargs)
    out_official, grads_official, out, grads = outputs_and_grads(
        official, module, tokens(side), side, piece)
    assert_rel_close(out, out_official, 1e-6, 'output')
    assert set(grads) == set(grads_official)
    for name, grad in grads_official.items():
        assert grad is not None and grad.abs().max() > 0, name
        assert_rel_close(grads[name], grad, 1e-6, f'grad of {name}')


@pytest.mark.parametrize('switch,value', [('normaliser', 'consistent'), ('attn_norm', False),
                                          ('qk_norm', False)],
                         ids=['consistent_normaliser', 'no_attn_norm', 'no_qk_norm'])
def test_each_official_switch_is_needed(switch, value):
    """Turning any one switch back makes the output differ from the authors' module, so the
    match above depends on every switch."""
    side, piece = 8, 4
    official, module = official_and_ours(side, piece)
    changed = MultiHeadLinearAttention(
        EMBED_DIMS, NUM_HEADS,
        **dict(OFFICIAL_IMAGENET, num_blocks=(2, 2), qkv_bias=False, **{switch: value}))
    changed.double().load_state_dict(module.state_dict(), strict=False)
    x = tokens(side)
    with torch.no_grad():
        expected = official_tokens(official(official_blocks(x, side, piece)), side, piece)
        assert rel_error(module(x, (side, side)), expected) < 1e-12
        assert rel_error(changed(x, (side, side)), expected) > 1e-3


@pytest.mark.parametrize('transform', ['linear', 'cos'])
@pytest.mark.parametrize('side,piece', [(16, 4), (8, 2), (12, 3)], ids=['16x16_4x4', '8x8_2x2',
                                                                       '12x12_3x3'])
def test_mixing_init_equals_the_authors_distance_conv(side, piece, transform):
    blocks = side // piece
    official = OfficialBlockDistance(side, piece * piece, transform)
    ours = distance_mixing_matrix((blocks, blocks), transform, dtype=torch.float32)
    assert_rel_close(ours, official.conv.weight[:, :, 0, 0], 1e-6, 'mixing init')


def test_official_normaliser_rows_do_not_sum_to_one():
    """Equal values in: the consistent normaliser returns that value exactly (a weighted
    mean), the authors' does not; and it is what the authors' module computes."""
    side, piece = 8, 4
    official, module = official_and_ours(side, piece, qk_norm=False)
    value = torch.linspace(-1., 2., EMBED_DIMS, dtype=torch.float64)
    for target in (official, module):
        linear = target.to_qkv if target is official else target.qkv
        conv = target.lepe if target is official else target.value_conv
        out = target.to_out[0] if target is official else target.proj
        with torch.no_grad():
            linear.weight[2 * EMBED_DIMS:].zero_()
            conv.weight.zero_()
            conv.bias.zero_()
            out.weight.copy_(torch.eye(EMBED_DIMS))
            out.bias.zero_()
    with torch.no_grad():
        module.qkv.bias = nn.Parameter(torch.cat([torch.zeros(2 * EMBED_DIMS,
                                                              dtype=torch.float64), value]))
        official.to_qkv.bias = nn.Parameter(module.qkv.bias.clone())
        x = tokens(side)
        ours = module(x, (side, side))
        expected = official_tokens(official(official_blocks(x, side, piece)), side, piece)
        assert_rel_close(ours, expected, 1e-12, 'official normaliser')
        assert rel_error(ours, value.expand_as(ours)) > 1e-2
        module.normaliser = 'consistent'
        assert_rel_close(module(x, (side, side)), value.expand_as(ours), 1e-5, 'consistent')


# ---------------------------------------------------------------- the preset

def preset_backbone(**arch):
    cfg = Config.fromfile(str(PRESET))
    backbone = dict(cfg.model.backbone)
    backbone['arch'] = {**backbone['arch'].to_dict(), **arch}
    backbone.pop('type')
    from linvit_mm.models.backbones.linear_vit import LinearViT
    return LinearViT(**backbone)


def test_preset_builds_the_authors_operator_in_every_block():
    """The preset's blocks hold the authors' operator: its attention, moved into the
    official module by the key map, computes the same on the 16 x 16 grid of 256 px."""
    backbone = preset_backbone(num_layers=2).double()
    assert backbone.patch_resolution == (16, 16)
    assert backbone.out_type == 'avg_featmap' and not backbone.with_cls_token
    for layer in backbone.layers:
        attn = layer.attn
        assert (attn.normaliser, attn.num_blocks, attn.mixing_init) == ('official', (4, 4),
                                                                         'linear')
        assert attn.qkv.bias is None
        assert isinstance(attn.norm, nn.LayerNorm) and isinstance(attn.q_norm, nn.RMSNorm)
    attn = randomised(backbone.layers[1].attn)
    official = OfficialMHLA(384, 6, True, 256, 16).double()
    reverse = {ours: key for key, ours in OFFICIAL_KEYS.items()}
    state = {reverse[key]: value for key, value in attn.state_dict().items()}
    state['piece_attn.conv.weight'] = state['piece_attn.conv.weight'][:, :, None, None]
    official.load_state_dict(state, strict=True)
    x = torch.randn(1, 256, 384, dtype=torch.float64)
    with torch.no_grad():
        expected = official_tokens(official(official_blocks(x, 16, 4)), 16, 4)
        assert_rel_close(attn(x, (16, 16)), expected, 1e-6, 'preset operator')
        out = backbone(torch.randn(1, 3, 256, 256, dtype=torch.float64))
    assert out[-1].shape == (1, 384)


def test_linear_vit_passes_and_checks_the_switches():
    from linvit_mm.models.backbones.linear_vit import LinearViT
    arch = dict(embed_dims=EMBED_DIMS, num_layers=1, num_heads=NUM_HEADS,
                feedforward_channels=48)
    model = LinearViT(arch=arch, attn_type='mhla', img_size=64,
                      attn_cfg=dict(normaliser='official', attn_norm=True, block_size=4))
    attn = model.layers[0].attn
    assert (attn.normaliser, attn.block_size) == ('official', (4, 4))
    assert isinstance(attn.norm, nn.LayerNorm)
    with pytest.raises(ValueError, match='normalizer'):
        LinearViT(arch=arch, attn_type='mhla', img_size=64, attn_cfg=dict(normalizer='official'))


def test_softmax_transfer_leaves_the_new_norms_at_the_identity_affine():
    """A Softmax checkpoint fills qkv / proj; the operator's own norms keep weight 1, bias 0
    and are reported as operator-specific."""
    from linvit_mm.models.backbones.linear_vit import LinearViT
    from linvit_mm.transfer import transfer_softmax_weights
    arch = dict(embed_dims=EMBED_DIMS, num_layers=2, num_heads=NUM_HEADS,
                feedforward_channels=48)
    torch.manual_seed(0)
    softmax = LinearViT(arch=dict(arch, qkv_bias=False), attn_type='softmax', img_size=64)
    checkpoint = {f'backbone.{key}': value for key, value in softmax.state_dict().items()}
    model = LinearViT(arch=dict(arch, qkv_bias=False), attn_type='mhla', img_size=64,
                      attn_cfg=dict(normaliser='official', attn_norm=True, qk_norm=True))
    report = transfer_softmax_weights(model, checkpoint, setting='fullcopy')
    for index, layer in enumerate(model.layers):
        attn = layer.attn
        assert torch.equal(attn.qkv.weight, softmax.layers[index].attn.qkv.weight)
        for norm in (attn.norm, attn.q_norm, attn.k_norm):
            assert torch.equal(norm.weight, torch.ones_like(norm.weight))
        assert torch.equal(attn.norm.bias, torch.zeros_like(attn.norm.bias))
        for name in ('norm.weight', 'norm.bias', 'q_norm.weight', 'k_norm.weight'):
            assert report['kept own init'][f'layers.{index}.attn.{name}'] == 'operator-specific'


def test_official_module_refuses_what_it_cannot_hold():
    module = MultiHeadLinearAttention(EMBED_DIMS, NUM_HEADS, num_blocks=(2, 2), block_size=(4, 4))
    x = torch.randn(1, 81, EMBED_DIMS)
    for form in (module, module.forward_reference):
        with pytest.raises(ValueError, match='does not fit the fixed layout'):
            form(x, (9, 9))
    with pytest.raises(ValueError, match='normaliser'):
        MultiHeadLinearAttention(EMBED_DIMS, NUM_HEADS, normaliser='shifted')
    with pytest.raises(ValueError, match='block_size'):
        MultiHeadLinearAttention(EMBED_DIMS, NUM_HEADS, block_size=(4, 0))


def test_benchmark_measures_the_official_forms_by_name():
    """The backbone benchmark's MHLA forms build the switches they are named for, their
    rows carry mhla's bound target, and they pass ``--operators`` as they are."""
    import importlib.util

    from linvit_mm.utils.benchmark import BOUND_FRACTION_TARGETS
    from linvit_mm.utils.benchmark.backbone import build_backbone
    from linvit_mm.utils.benchmark.targets import bound_fractions
    arch = dict(embed_dims=EMBED_DIMS, num_layers=1, num_heads=NUM_HEADS,
                feedforward_channels=48)
    official = build_backbone('mhla-official', arch, 64, init=False).layers[0].attn
    assert (official.normaliser, official.num_blocks, official.qkv.bias) == ('official', (4, 4),
                                                                              None)
    assert isinstance(official.norm, nn.LayerNorm) and isinstance(official.k_norm, nn.RMSNorm)
    offnorm = build_backbone('mhla-offnorm', arch, 64, init=False).layers[0].attn
    assert (offnorm.normaliser, offnorm.num_blocks) == ('official', (2, 2))
    assert isinstance(offnorm.norm, nn.Identity) and offnorm.qkv.bias is not None
    fractions = bound_fractions(['mhla', 'mhla-official'])
    assert fractions['mhla-official'] == fractions['mhla'] == BOUND_FRACTION_TARGETS['mhla']
    # the command line: the forms are accepted by name
    path = REPO / 'tools' / 'analysis_tools' / 'benchmark_backbone.py'
    spec = importlib.util.spec_from_file_location('benchmark_backbone', path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(['--operators', 'softmax', 'mhla-official', '--no-memory'])
    assert args.operators == ['softmax', 'mhla-official']
