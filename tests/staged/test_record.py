"""The staged-recipe record: what a checkpoint says about its LinearViT."""
import pytest
import torch
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.staged import describe_linear_vit, find_linear_vits, model_record
from linvit_mm.staged.record import block_ranges, record_differences
from linvit_mm.testing.staged import tiny_vit_cfg


def test_staged_record_describes_operator_and_heads_per_block():
    vit = MODELS.build(tiny_vit_cfg('relu', layer_cfgs=[{}, dict(attn_type='elu'), {}]))
    described = describe_linear_vit(vit)
    assert described == dict(attn_types=['relu', 'elu', 'relu'], num_heads=[2, 2, 2],
                             attn_options=[dict(eps=1e-6, rope=None)] * 3,
                             window_sizes=[None] * 3,
                             embed_dims=32, num_layers=3, patch_size=[8, 8],
                             with_cls_token=True, num_register_tokens=0)


# An option of each operator that changes what the same weights compute, and another value.
OTHER_OPTIONS = {
    'mhla': ('normaliser', 'consistent', 'official'),
    'hedgehog': ('feature_map', 'softmax', 'exp'),
    'ttt': ('inner_scale', 1 / 3, 0.5),
    'inline': ('residual', False, True),
    'elu': ('eps', 1e-6, 0.1),
    'mhla-floor': ('feature_floor', 1e-6, 0.5),
    'hedgehog-untied': ('tie_qk', True, False),
}


@pytest.mark.parametrize('case', list(OTHER_OPTIONS))
def test_the_record_names_each_option_that_changes_the_function(case):
    attn_type = case.split('-')[0]
    option, recorded, other = OTHER_OPTIONS[case]
    torch.manual_seed(0)
    first = MODELS.build(tiny_vit_cfg(attn_type)).eval()
    with torch.no_grad():  # trained weights, not an init where two options may coincide
        for param in first.parameters():
            param.add_(torch.randn_like(param) * .3)
    second = MODELS.build(tiny_vit_cfg(attn_type, attn_cfg={option: other})).eval()
    missing, unexpected = second.load_state_dict(first.state_dict(), strict=False)
    assert not unexpected
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (first(images)[-1] - second(images)[-1]).abs().max() > 1e-4
    problems = record_differences(describe_linear_vit(first), describe_linear_vit(second))
    assert problems == [f'attn_cfg.{option} of blocks 0-2: checkpoint {recorded!r}, model '
                        f'{other!r}']


def test_staged_record_differences_name_blocks_and_fields():
    relu = describe_linear_vit(MODELS.build(tiny_vit_cfg('relu')))
    ttt = describe_linear_vit(MODELS.build(tiny_vit_cfg('ttt')))
    problems = record_differences(relu, ttt)
    assert "operator of blocks 0-2: checkpoint 'relu', model 'ttt'" in problems
    assert 'with_cls_token: checkpoint True, model False' in problems
    assert record_differences(relu, relu) == []
    assert record_differences({}, relu)[:2] == ['the record lacks attn_types',
                                                'the record lacks num_heads']
    assert block_ranges([5, 0, 1, 2, 7, 8]) == '0-2, 5, 7-8'


def test_staged_record_of_a_model_finds_nested_vits_and_stage():
    classifier = MODELS.build(dict(
        type='ImageClassifier', backbone=tiny_vit_cfg('relu'),
        head=dict(type='VisionTransformerClsHead', num_classes=3, in_channels=32)))
    assert list(find_linear_vits(classifier)) == ['backbone.']
    assert list(model_record(classifier)) == ['backbones']

    class Staged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = classifier.backbone

        def staged_record(self):
            return dict(stage='x')

    assert model_record(Staged())['stage'] == 'x'
