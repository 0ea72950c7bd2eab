"""LoRA around a LinearViT with mmpretrain's LoRAModel: target checks and merging."""
import pytest
import torch
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.staged import (LORA_TARGETS, linear_layer_names, merged_state_dict,
                              unmatched_lora_targets)
from linvit_mm.testing.staged import tiny_vit_cfg


def classifier(backbone):
    return dict(type='ImageClassifier', backbone=backbone,
                head=dict(type='VisionTransformerClsHead', num_classes=3, in_channels=32))


def lora_classifier(attn_type='relu', targets=None, **lora):
    torch.manual_seed(0)
    model = MODELS.build(classifier(dict(
        type='LoRAModel', module=tiny_vit_cfg(attn_type), alpha=16, rank=4,
        targets=targets or list(LORA_TARGETS.values()), **lora)))
    with torch.no_grad():  # LoRA starts as a no-op (up = 0); give the factors values
        for name, param in model.named_parameters():
            if '.lora_' in name:
                param.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize('attn_type', ['relu', 'ttt', 'mhla'])
def test_lora_merged_state_gives_the_outputs_of_the_lora_model(attn_type):
    model = lora_classifier(attn_type)
    merged = merged_state_dict(model)
    plain = MODELS.build(classifier(tiny_vit_cfg(attn_type))).eval()
    plain.load_state_dict(merged, strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model(x), rtol=1e-5, atol=1e-6)
    assert not any('lora' in key or 'original_layer' in key for key in merged)


def test_lora_targets_that_adapt_nothing_are_found():
    model = lora_classifier(targets=[dict(type='attn.qkv'), dict(type='ffn.fc1'),
                                     dict(type='.*qkv'), dict(type='ffn')])
    lora_model = model.backbone
    # 'ffn.fc1' names no layer, '.*qkv' only layers 'attn.qkv' took, 'ffn' an FFN (no Linear)
    assert unmatched_lora_targets(lora_model) == [dict(type='ffn.fc1'), dict(type='.*qkv'),
                                                  dict(type='ffn')]
    assert linear_layer_names(lora_model.module) == [
        'layers.*.attn.qkv', 'layers.*.attn.proj', 'layers.*.ffn.layers.0.0',
        'layers.*.ffn.layers.1']
    assert unmatched_lora_targets(lora_classifier().backbone) == []


def test_lora_merge_needs_a_lora_model():
    with pytest.raises(ValueError, match='holds no LoRAModel'):
        merged_state_dict(MODELS.build(classifier(tiny_vit_cfg('relu'))))


def test_lora_base_digest_tells_the_frozen_weights_apart_not_the_factors():
    from linvit_mm.staged import lora_base_digest
    model = lora_classifier('relu')
    digest = lora_base_digest(model.backbone)
    with torch.no_grad():
        model.backbone.module.layers[0].attn.qkv.lora_up.weight.add_(1.0)
    assert lora_base_digest(model.backbone) == digest
    again = lora_classifier('relu')  # same seed, same base
    assert lora_base_digest(again.backbone) == digest
    with torch.no_grad():
        again.backbone.module.layers[2].ln1.bias[5] += 1e-6
    assert lora_base_digest(again.backbone) != digest
