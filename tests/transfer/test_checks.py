"""The checks before a copy: the head count, and components the checkpoint lacks or holds in
part (through transfer_softmax_weights, which runs them)."""
import logging
import re
from collections import OrderedDict

import pytest
import torch

from linvit_mm.transfer import COMPONENTS, load_softmax_checkpoint, transfer_softmax_weights

C = 192  # DeiT-Tiny width


def capturing_logger(name):
    """A plain logger that keeps every record (without becoming mmengine's current logger)."""
    logger = logging.getLogger(name)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    return logger, records


def without(sd, pattern):
    return OrderedDict((k, v) for k, v in sd.items() if not re.match(pattern, k))


# --------------------------------------------------------------- head count


@pytest.fixture(scope='module')
def mocov3_small_two_blocks():
    """A 384-wide ViT with 12 heads of 32 (MoCo v3's ViT-S) in MoCo v3's layout, two blocks."""
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=32, patch_size=16, embed_dim=384, depth=2, num_heads=12,
                            num_classes=0)
    state = OrderedDict(('module.base_encoder.' + k, v.detach().clone())
                        for k, v in vit.state_dict().items())
    return {'state_dict': state, 'arch': 'vit_small', 'epoch': 300}


def small_two_blocks(build, num_heads=6):
    return build('relu', arch=dict(embed_dims=384, num_layers=2, num_heads=num_heads,
                                   feedforward_channels=1536), img_size=32)


@pytest.mark.parametrize('setting', ['copy', 'fullcopy'])
def test_known_head_count_mismatch_refuses_copying_attention(setting, mocov3_small_two_blocks,
                                                             build, refuses):
    message = refuses(small_two_blocks(build), mocov3_small_two_blocks, setting=setting)
    assert message.startswith("the checkpoint has 12 attention heads (checkpoint['arch']="
                              "'vit_small'), the LinearViT's attention operators have 6 heads "
                              "(layers.0.attn, layers.1.attn)")
    assert 'num_heads=12' in message and "setting='mlpcopy'" in message
    assert 'Nothing was copied' in message

    matching = small_two_blocks(build, num_heads=12)
    report = transfer_softmax_weights(matching, mocov3_small_two_blocks, setting=setting)
    assert report['num_heads'] == {'checkpoint': 12, 'model': [12]}
    assert report['warnings'] == []


def test_head_count_mismatch_is_only_noted_when_attention_is_not_copied(
        mocov3_small_two_blocks, build):
    model = small_two_blocks(build)
    report = transfer_softmax_weights(model, mocov3_small_two_blocks, setting='mlpcopy')
    assert report['counts']['mlp']['copied'] == 12
    assert report['num_heads'] == {'checkpoint': 12, 'model': [6]}
    assert any(note.startswith('the checkpoint has 12 attention heads') and
               'only the attention depends on the head count' in note
               for note in report['notes'])


def test_unknown_head_count_warns_and_a_stated_one_is_checked(timm_sd, build, refuses):
    logger, records = capturing_logger('test_transfer_heads')
    report = transfer_softmax_weights(build('softmax'), timm_sd, setting='copy', logger=logger)
    assert report['num_heads'] == {'checkpoint': None, 'model': [3]}
    assert len(report['warnings']) == 1
    assert 'does not state its number of attention heads' in report['warnings'][0]
    assert 'num_heads=N' in report['warnings'][0]
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and report['warnings'][0] in warned[0]

    stated = transfer_softmax_weights(build('softmax'), timm_sd, setting='copy', num_heads=3)
    assert stated['warnings'] == [] and stated['num_heads']['checkpoint'] == 3
    refuses(build('softmax'), timm_sd, setting='copy', num_heads=4,
            match=r'the checkpoint has 4 attention heads \(given as num_heads=4\).* operators '
                  r'have 3 heads')
    # the MLP does not depend on the head count: nothing to warn about
    assert transfer_softmax_weights(build('softmax'), timm_sd, setting='mlpcopy')['warnings'] == []


def test_a_stated_head_count_reaches_a_read_checkpoint(timm_sd, build, refuses):
    ckpt = load_softmax_checkpoint({'model': timm_sd}, num_heads=3)
    refuses(build('softmax'), ckpt, setting='copy', num_heads=6,
            match='checkpoint states num_heads=3')
    report = transfer_softmax_weights(build('softmax'), ckpt, setting='copy', num_heads=3)
    assert report['num_heads']['checkpoint'] == 3


# --------------------------------------------------------------- nothing, or part, found


def test_a_prefix_that_selects_nothing_names_the_checkpoint_prefixes(ckpt_paths, build,
                                                                     refuses):
    message = refuses(build('softmax'), ckpt_paths['mmpretrain'], setting='fullcopy',
                      prefix='bakbone.')
    assert ("under prefix 'bakbone.' no tensor of the LinearViT is a Softmax ViT tensor (e.g. "
            "bakbone.cls_token), and the checkpoint holds its 152 tensors under 'backbone.' "
            "(150), 'head.' (2)") in message
    # a prefix that does not fit the module is refused whatever the setting
    refuses(build('softmax'), ckpt_paths['mmpretrain'], setting='copy', prefix='head.',
            match="under prefix 'head.' no tensor of the LinearViT is a Softmax ViT tensor")


def test_a_setting_that_selects_nothing_of_the_module_copies_nothing(timm_sd, state,
                                                                   assert_same_state):
    # A config switches backbone and head to one setting: 'copy' gives a classifier head
    # nothing, whether or not the checkpoint has a classifier.
    from mmpretrain.models.heads import VisionTransformerClsHead
    head = VisionTransformerClsHead(num_classes=1000, in_channels=C)
    head.init_weights()
    before = state(head)
    for checkpoint in (timm_sd, without(timm_sd, r'head\.')):
        report = transfer_softmax_weights(head, checkpoint, setting='copy', prefix='head.')
        assert report['copied'] == [] and report['copied in part'] == {}
        assert ("setting 'copy' copies nothing into the VisionTransformerClsHead: it has none of "
                "the selected components that a checkpoint fills (it has ['head'])"
                in report['notes'][-1])
        assert_same_state(state(head), before)


def test_a_block_copied_in_part_is_refused_unless_allowed(timm_sd, sources, build, state,
                                                          refuses):
    # block 3's fc1 is missing: its fc2 would be copied next to a random fc1
    sd = without(timm_sd, r'blocks\.3\.mlp\.fc1\.')
    model = build('relu')
    before = state(model)
    message = refuses(model, sd, setting='mlpcopy')
    assert 'holds mlp only in part' in message
    assert ('mlp of block 3: layers.3.ffn.layers.0.0.weight, layers.3.ffn.layers.0.0.bias'
            in message)
    assert 'allow_partial=True' in message and 'Nothing was copied' in message

    logger, records = capturing_logger('test_transfer_partial')
    report = transfer_softmax_weights(model, sd, setting='mlpcopy', allow_partial=True,
                                      logger=logger)
    assert report['copied in part'] == {
        'mlp': {3: ['layers.3.ffn.layers.0.0.weight', 'layers.3.ffn.layers.0.0.bias']}}
    assert report['absent in checkpoint'] == ['layers.3.ffn.layers.0.0.weight',
                                              'layers.3.ffn.layers.0.0.bias']
    assert torch.equal(model.layers[3].ffn.layers[1].weight,
                       sources['layers.3.ffn.layers.1.weight'])
    assert torch.equal(model.layers[3].ffn.layers[0][0].weight,
                       before['layers.3.ffn.layers.0.0.weight'])
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and 'copied in part (allow_partial=True)' in warned[0]
    assert 'mlp of block 3: layers.3.ffn.layers.0.0.weight' in warned[0]


def test_a_whole_block_missing_from_one_component_is_in_part(timm_sd, build, refuses):
    # block 5 keeps its attention (so the depth matches) but has no MLP at all
    sd = without(timm_sd, r'blocks\.5\.(mlp|norm2)\.')
    refuses(build('relu'), sd, setting='mlpcopy',
            match=r'mlp of block 5: layers\.5\.ln2\.weight, layers\.5\.ln2\.bias, '
                  r'layers\.5\.ffn\.layers\.0\.0\.weight, layers\.5\.ffn\.layers\.0\.0\.bias, '
                  r'\.\.\. \(6 in all\)')
    report = transfer_softmax_weights(build('relu'), sd, setting='copy')
    assert report['counts']['attention']['copied'] == 48


def test_components_outside_the_blocks_are_judged_whole(timm_sd, timm_sd_fc_norm, build,
                                                         refuses):
    # a pooled fc_norm instead of the final norm: the blocks' norms copy, the final one not
    refuses(build('softmax'), {'model': timm_sd_fc_norm}, setting='fullcopy',
            match=r"norms outside the blocks: ln1\.weight, ln1\.bias(.|\n)*fc_norm_target='ln1'")
    ckpt = load_softmax_checkpoint({'model': timm_sd_fc_norm}, fc_norm_target='ln1')
    report = transfer_softmax_weights(build('softmax'), ckpt, setting='fullcopy')
    assert report['copied in part'] == {} and 'ln1.weight' in report['copied']

    no_bias = without(timm_sd, r'patch_embed\.proj\.bias')
    refuses(build('softmax'), no_bias, setting='fullcopy',
            match=r'holds patch_embed only in part(.|\n)*  patch_embed: '
                  r'patch_embed\.projection\.bias')


def test_fullcopy_refuses_a_component_the_checkpoint_lacks(timm_sd, build, refuses):
    # The distillation teacher is a Softmax LinearViT built with fullcopy: every component
    # it has must come from the checkpoint.
    message = refuses(build('softmax'), without(timm_sd, r'cls_token'), setting='fullcopy')
    assert ("has no tensor of the component(s) ['cls_token'] that the LinearViT has (cls_token "
            "under prefix 'backbone.')") in message
    assert ("components=['attention', 'mlp', 'norms', 'patch_embed', 'pos_embed', 'registers', "
            "'head']" in message)
    refuses(build('softmax'), without(timm_sd, r'pos_embed'), components=list(COMPONENTS),
            match=r"component\(s\) \['pos_embed'\]")
    # the Table G form without the class token is complete
    table_g = [name for name in COMPONENTS if name != 'cls_token']
    report = transfer_softmax_weights(build('softmax'), without(timm_sd, r'cls_token'),
                                      components=table_g)
    assert report['copied in part'] == {}


def test_fullcopy_into_a_head_needs_a_classifier(timm_sd, refuses):
    from mmpretrain.models.heads import VisionTransformerClsHead
    head = VisionTransformerClsHead(num_classes=1000, in_channels=C)
    head.init_weights()
    refuses(head, without(timm_sd, r'head\.'), setting='fullcopy', prefix='head.',
            match=r"component\(s\) \['head'\] that the VisionTransformerClsHead has(.|\n)*no "
                  r'linear classifier head in the checkpoint')


def test_components_the_model_lacks_do_not_count(timm_sd, build):
    # MHLA and TTT models have no class token or learned position embedding, and a backbone
    # has no classifier.
    for attn_type in ('mhla', 'ttt'):
        report = transfer_softmax_weights(build(attn_type), without(timm_sd, r'head\.'),
                                          setting='fullcopy')
        assert report['not in model'] == ['cls_token', 'pos_embed']
        assert report['copied in part'] == {}


def test_report_absent_tensors_when_partial_copies_are_allowed(timm_sd, build, refuses):
    backbone_only = without(timm_sd, r'head\.|blocks\.2\.attn\.qkv\.bias')
    model = build('softmax')
    refuses(model, backbone_only, setting='copy',
            match='attention of block 2: layers.2.attn.qkv.bias')
    report = transfer_softmax_weights(model, backbone_only, setting='copy', allow_partial=True)
    assert report['absent in checkpoint'] == ['layers.2.attn.qkv.bias']
    assert report['counts']['attention']['absent in checkpoint'] == 1
    assert report['copied in part'] == {'attention': {2: ['layers.2.attn.qkv.bias']}}


def test_a_refusal_lists_five_parts_and_counts_the_rest(timm_sd, build, refuses):
    sd = without(timm_sd, r'blocks\.[0-6]\.mlp\.fc1\.bias')
    message = refuses(build('relu'), sd, setting='mlpcopy')
    lines = message.splitlines()
    start = lines.index("setting 'mlpcopy': the checkpoint (timm layout) holds mlp only in "
                        'part; absent in it:')
    assert lines[start + 1:start + 8] == [
        f'  mlp of block {block}: layers.{block}.ffn.layers.0.0.bias' for block in range(5)] + [
        '  ... (7 parts in all)',
        "Copied next to tensors that keep their own init, the rest would compute neither the "
        "checkpoint's function nor a fresh one. Nothing was copied. Use a complete checkpoint, "
        'copy without the component, or pass allow_partial=True to copy what there is (the '
        'report then lists what was left out).']


# --------------------------------------------------------------- architecture


def test_a_checkpoint_without_patch_embedding_leaves_its_patch_size_unchecked(timm_sd, sources,
                                                                             build):
    """Backbone-only weights without the patch embedding: its patch size is unknown, so the
    position embedding (which depends on it) copies unchecked instead of being refused."""
    model = build('relu')
    report = transfer_softmax_weights(model, without(timm_sd, r'patch_embed\.'),
                                      components=['pos_embed'])
    assert report['copied'] == ['pos_embed'] and report['warnings'] == []
    assert torch.equal(model.pos_embed.detach(), sources['pos_embed'])
    assert ('checkpoint: no patch embedding (backbone.patch_embed.projection) mapped; '
            'patch_size unknown') in report['notes']


def test_four_names_are_listed_in_full_and_five_as_four_and_a_count():
    from linvit_mm.transfer.checks import _names_text
    names = [f'n{i}' for i in range(5)]
    assert _names_text(names[:4]) == 'n0, n1, n2, n3'
    assert _names_text(names) == 'n0, n1, n2, n3, ... (5 in all)'


def test_a_checkpoint_of_unknown_family_is_still_checked_field_by_field(timm_sd, build):
    import dataclasses
    ckpt = load_softmax_checkpoint(timm_sd)
    unknown = dataclasses.replace(ckpt, family=None, family_from=None, layer_scale=True)
    with pytest.raises(ValueError, match=r'layer_scale: checkpoint True, model False'):
        transfer_softmax_weights(build('elu'), unknown, setting='fullcopy')


def test_the_refusal_names_the_arch_word_of_a_family_without_registers(refuses):
    import timm

    from linvit_mm.models import LinearViT
    torch.manual_seed(0)
    source = timm.create_model('deit3_small_patch16_224', pretrained=False, img_size=64)
    model = LinearViT(arch=dict(LinearViT.arch_zoo['deit3-small'], layer_scale_init_value=0.),
                      img_size=64)
    text = refuses(model, source.state_dict(), setting='fullcopy')
    assert 'layer_scale: checkpoint True, model False' in text
    assert "Build the model with arch='deit3-small'" in text


def test_the_activation_warning_reads_a_one_block_model(timm_source, arch_of):
    from linvit_mm.models import LinearViT
    logger, records = capturing_logger('test_activation_one_block')
    source = timm_source('clip-base', img_size=32, depth=1)
    model = LinearViT(arch=arch_of('clip-base', source), attn_type='relu', img_size=32)
    transfer_softmax_weights(model, source.state_dict(), setting='mlpcopy', num_heads=4,
                             logger=logger)
    assert any('The model uses QuickGELU;' in r.getMessage() for r in records)
