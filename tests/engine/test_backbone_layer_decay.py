"""Layer-wise lr decay for models whose depths come from ``model.backbone``."""
import pytest
from torch import nn

import linvit_mm.engine  # noqa: F401
from linvit_mm.engine import BackboneLayerDecayOptimWrapperConstructor
from linvit_mm.models import LinearViT


class Segmentor(nn.Module):
    """Stands in for an mmseg EncoderDecoder: a backbone and a head, no get_layer_depth."""

    def __init__(self):
        super().__init__()
        self.backbone = LinearViT(
            arch=dict(embed_dims=32, num_layers=3, num_heads=2, feedforward_channels=64),
            attn_type='relu', img_size=32)
        self.decode_head = nn.Linear(32, 4)


def test_lr_follows_backbone_depth():
    model = Segmentor()
    constructor = BackboneLayerDecayOptimWrapperConstructor(
        dict(type='OptimWrapper', optimizer=dict(type='AdamW', lr=1.0, weight_decay=0.05)),
        paramwise_cfg=dict(layer_decay_rate=0.5, flat_decay_mult=0.0))
    optim_wrapper = constructor(model)
    lr_of = {}
    for group in optim_wrapper.optimizer.param_groups:
        for param in group['params']:
            lr_of[param] = group['lr']
    # 3 blocks -> depths 0 (stem) .. 4 (after the blocks): scale 0.5 ** (4 - depth)
    assert lr_of[model.backbone.pos_embed] == pytest.approx(0.5**4)
    assert lr_of[model.backbone.layers[0].attn.qkv.weight] == pytest.approx(0.5**3)
    assert lr_of[model.backbone.layers[2].ffn.layers[1].weight] == pytest.approx(0.5)
    assert lr_of[model.backbone.ln1.weight] == pytest.approx(1.0)
    assert lr_of[model.decode_head.weight] == pytest.approx(1.0)
    weight_decay = {p: g['weight_decay'] for g in optim_wrapper.optimizer.param_groups
                    for p in g['params']}
    assert weight_decay[model.decode_head.bias] == 0.0
    assert weight_decay[model.decode_head.weight] == pytest.approx(0.05)


def test_model_without_backbone_depths_is_refused():
    constructor = BackboneLayerDecayOptimWrapperConstructor(
        dict(type='OptimWrapper', optimizer=dict(type='AdamW', lr=1.0)),
        paramwise_cfg=dict(layer_decay_rate=0.5))
    with pytest.raises(TypeError, match='backbone.get_layer_depth'):
        constructor(nn.Sequential(nn.Linear(2, 2)))
