"""LoRA around a LinearViT with mmpretrain's LoRAModel: target checks and merging."""
import logging
import types

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


# ------------------------------------------------------- the record and the checked merge

def test_factor_names_and_the_digest_of_names_shapes_and_bytes():
    from linvit_mm.staged import lora_base_digest
    from linvit_mm.staged.lora import _is_factor
    assert _is_factor('lora_up.weight') and _is_factor('layers.0.attn.qkv.lora_down.weight')
    assert not _is_factor('weight') and not _is_factor('layers.0.attn.qkv.weight')

    def digest(**tensors):
        module = torch.nn.Module()
        for name, tensor in tensors.items():
            module.register_buffer(name, tensor)
        return lora_base_digest(types.SimpleNamespace(module=module))
    zeros = torch.zeros(2, 3)
    assert digest(a=zeros) == digest(a=zeros.clone())
    assert len({digest(a=zeros), digest(a=zeros.reshape(3, 2)), digest(b=zeros)}) == 3


def _recorded(model, **lora_changes):
    from linvit_mm.staged import RECORD_KEY, lora_record
    record = lora_record(model)
    (name, entry), = record.items()
    record[name] = dict(entry, **lora_changes)
    return {'state_dict': model.state_dict(),
            'meta': {RECORD_KEY: {'lora': record, 'trained_layers': [0]}}}


def test_the_record_names_each_lora_model_and_takes_a_digest_given():
    from linvit_mm.staged import lora_base_digest, lora_record
    model = lora_classifier()
    record = lora_record(model)
    assert list(record) == ['backbone']
    assert record['backbone'] == dict(alpha=16, rank=4, targets=list(LORA_TARGETS.values()),
                                      base_sha256=lora_base_digest(model.backbone))
    assert lora_record(model, base_digests={'backbone': 'given'})['backbone'][
        'base_sha256'] == 'given'
    assert lora_record(model, base_digests={'other': 'x'})['backbone']['base_sha256'] == \
        record['backbone']['base_sha256']


def test_a_checked_merge_folds_the_factors_and_records_the_merge():
    from linvit_mm.staged import RECORD_KEY, lora_record, merge_lora_checkpoint
    trained = lora_classifier()
    with torch.no_grad():  # what the run learnt: the config's model starts elsewhere
        trained.backbone.module.layers[1].attn.qkv.lora_up.weight.add_(0.5)
        trained.head.layers.head.weight.add_(0.5)
    config_model = lora_classifier()
    merged = merge_lora_checkpoint(config_model, _recorded(trained), 'run.pth')
    expected = merged_state_dict(trained)
    assert set(merged['state_dict']) == set(expected)
    for key, value in expected.items():
        assert torch.equal(merged['state_dict'][key], value), key
    record = merged['meta'][RECORD_KEY]
    assert record['stage'] == 'lora-merged' and record['trained_layers'] == [0]
    assert record['lora'] == lora_record(trained)
    assert record['merged_from'].endswith('run.pth') and list(record['backbones']) == [
        'backbone.']


@pytest.mark.parametrize('change,problem', [
    (dict(alpha=8), 'LoRAModel backbone: alpha differs: checkpoint 8, config 16'),
    (dict(base_sha256='0' * 64), 'LoRAModel backbone: its base weights are not those the '
                                 'factors were trained on'),
], ids=['alpha', 'base'])
def test_a_merge_with_another_config_is_refused_naming_the_difference(change, problem):
    from linvit_mm.staged import merge_lora_checkpoint
    with pytest.raises(ValueError) as info:
        merge_lora_checkpoint(lora_classifier(), _recorded(lora_classifier(), **change),
                              'run.pth')
    message = str(info.value)
    assert message.startswith('run.pth does not fit the LoRA model of the config, nothing was '
                              'merged:\n  - ') and problem in message
    assert message.count('\n  - ') == 1


def test_a_record_of_other_lora_models_is_refused():
    from linvit_mm.staged import RECORD_KEY, merge_lora_checkpoint
    checkpoint = _recorded(lora_classifier())
    lora = checkpoint['meta'][RECORD_KEY]['lora']
    lora['neck'] = lora.pop('backbone')
    with pytest.raises(ValueError) as info:
        merge_lora_checkpoint(lora_classifier(), checkpoint, 'run.pth')
    assert ("LoRAModel backbone: the checkpoint records no LoRA settings for it (it records "
            "['neck'])") in str(info.value)
    assert ("the checkpoint records LoRAModels the config does not have: ['neck']"
            in str(info.value))


def test_tensors_that_do_not_fit_are_named():
    from linvit_mm.staged import merge_lora_checkpoint
    checkpoint = _recorded(lora_classifier())
    state = checkpoint['state_dict']
    del state['head.layers.head.bias']
    state['extra.weight'] = torch.zeros(1)
    state['head.layers.head.weight'] = torch.zeros(4, 32)
    with pytest.raises(ValueError) as info:
        merge_lora_checkpoint(lora_classifier(), checkpoint, 'run.pth')
    message = str(info.value)
    assert '  - missing: head.layers.head.bias' in message
    assert '  - not in the model: extra.weight' in message
    assert ('  - shapes that differ: head.layers.head.weight: checkpoint (4, 32), model '
            '(3, 32)') in message


def test_an_unrecorded_run_merges_only_when_allowed(logged):
    from linvit_mm.staged import merge_lora_checkpoint
    trained = lora_classifier()
    unrecorded = {'state_dict': trained.state_dict()}
    with pytest.raises(ValueError, match='does not record the LoRA settings'):
        merge_lora_checkpoint(lora_classifier(), unrecorded, 'run.pth')
    with logged('test_lora_unrecorded', logging.WARNING) as warnings:
        merged = merge_lora_checkpoint(lora_classifier(), unrecorded, 'run.pth',
                                       allow_unrecorded=True, logger='test_lora_unrecorded')
    assert set(merged['state_dict']) == set(merged_state_dict(trained))
    assert warnings == ["run.pth records neither alpha, rank and targets nor the base weights "
                        "its factors were trained on: merging with the config's, unchecked"]


def test_a_merge_needs_a_lora_model_and_a_state_dict():
    from linvit_mm.staged import merge_lora_checkpoint
    with pytest.raises(ValueError, match=r'the model of the config \(ImageClassifier\) holds '
                                         'no LoRAModel'):
        merge_lora_checkpoint(MODELS.build(classifier(tiny_vit_cfg('relu'))), {}, 'run.pth')
    with pytest.raises(ValueError, match='run.pth holds no state dict'):
        merge_lora_checkpoint(lora_classifier(), [], 'run.pth')


@pytest.mark.parametrize('where', ['checkpoint', 'base', 'merged'])
def test_non_finite_weights_stop_the_merge(where):
    from linvit_mm.staged import merge_lora_checkpoint
    trained, config_model = lora_classifier(), lora_classifier()
    checkpoint = _recorded(trained)
    state = checkpoint['state_dict']
    if where == 'checkpoint':
        state['head.layers.head.bias'] = torch.full((3, ), float('nan'))
        match = r'run\.pth: 1 tensor\(s\) hold non-finite values'
    elif where == 'base':  # the frozen weights come from the config, not the checkpoint
        with torch.no_grad():
            config_model.backbone.module.layers[0].ln1.weight[0] = float('inf')
        checkpoint = _recorded(config_model)  # a run on those very weights
        match = 'the base weights the config loads: 1 tensor'
    else:  # each factor finite, their product beyond float32
        for key in state:
            if '.lora_' in key:
                state[key] = torch.full_like(state[key], 1e20)
        match = 'run.pth: folding the factors overflows, nothing was written'
    with pytest.raises(ValueError, match=match):
        merge_lora_checkpoint(config_model, checkpoint, 'run.pth')
