"""SoftmaxTransfer, the settings as an mmengine weight initialiser in model configs."""
from collections import OrderedDict

import pytest
import torch
from mmengine.registry import WEIGHT_INITIALIZERS

from linvit_mm.models.backbones.linear_vit import LinearViT
from linvit_mm.testing import assert_rel_close
from linvit_mm.transfer import transfer_softmax_weights

SEED = 7
C = 192


def test_fullcopy_through_init_cfg_reproduces_timm_deit_logits(ckpt_paths, timm_deit):
    from mmpretrain.registry import MODELS
    path = str(ckpt_paths['deit-official'])
    classifier = MODELS.build(dict(
        type='ImageClassifier',
        backbone=dict(type='LinearViT', arch='tiny', attn_type='softmax',
                      init_cfg=dict(type='SoftmaxTransfer', checkpoint=path, setting='fullcopy')),
        head=dict(type='VisionTransformerClsHead', num_classes=1000, in_channels=C,
                  init_cfg=[dict(type='Constant', layer='Linear', val=0),
                            dict(type='SoftmaxTransfer', checkpoint=path, setting='fullcopy',
                                 prefix='head.')])))
    classifier.init_weights()
    classifier.eval()
    assert classifier.head.transfer_report['copied'] == ['layers.head.weight', 'layers.head.bias']
    assert len(classifier.backbone.transfer_report['copied']) == 150
    torch.manual_seed(3)
    images = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected = timm_deit(images)
        logits = classifier(images, mode='tensor')
    assert_rel_close(logits, expected, 1e-5, 'logits')


def test_head_with_other_classes_keeps_its_init(ckpt_paths):
    from mmpretrain.models.heads import VisionTransformerClsHead
    head = VisionTransformerClsHead(num_classes=10, in_channels=C, init_cfg=[
        dict(type='Constant', layer='Linear', val=0),
        dict(type='SoftmaxTransfer', checkpoint=str(ckpt_paths['timm']), setting='fullcopy',
             prefix='head.')])
    head.init_weights()
    report = head.transfer_report
    assert report['copied'] == []
    assert report['kept own init'] == {
        name: 'shape differs: the checkpoint has 1000 classes, the model 10'
        for name in ('layers.head.weight', 'layers.head.bias')}
    assert report['counts']['head']['kept own init'] == 2
    assert not head.layers.head.weight.any() and not head.layers.head.bias.any()


def test_analytic_settings_through_init_cfg_need_no_checkpoint(build, state, assert_same_state):
    torch.manual_seed(SEED)
    via_cfg = LinearViT(arch='tiny', attn_type='relu',
                        init_cfg=dict(type='SoftmaxTransfer', setting='mimetic'))
    via_cfg.init_weights()
    assert len(via_cfg.transfer_report['analytic']) == 24
    direct = build('relu')
    transfer_softmax_weights(direct, setting='mimetic')
    assert_same_state(state(via_cfg), state(direct))


def test_bad_initialiser_configs_fail_when_built():
    with pytest.raises(ValueError, match='checkpoint may be None only for random, mimetic'):
        WEIGHT_INITIALIZERS.build(dict(type='SoftmaxTransfer', setting='mlpcopy'))
    with pytest.raises(ValueError, match='unknown transfer setting'):
        WEIGHT_INITIALIZERS.build(dict(type='SoftmaxTransfer', setting='fulcopy',
                                       checkpoint='x.pth'))
    with pytest.raises(ValueError, match='num_heads must be a positive integer'):
        WEIGHT_INITIALIZERS.build(dict(type='SoftmaxTransfer', setting='copy',
                                       checkpoint='x.pth', num_heads=0))


def test_num_heads_and_allow_partial_reach_the_transfer(timm_sd, tmp_path):
    sd = OrderedDict((k, v) for k, v in timm_sd.items() if not k.startswith('blocks.4.mlp.fc2.'))
    path = str(tmp_path / 'no_fc2_in_block_4.pth')
    torch.save({'model': sd}, path)

    def init(**options):
        torch.manual_seed(SEED)
        model = LinearViT(arch='tiny', attn_type='relu', init_cfg=dict(
            type='SoftmaxTransfer', checkpoint=path, setting='fullcopy', **options))
        model.init_weights()
        return model

    with pytest.raises(ValueError, match='mlp of block 4: layers.4.ffn.layers.1.weight'):
        init()
    with pytest.raises(ValueError, match=r'the checkpoint has 6 attention heads \(given as '
                                         r'num_heads=6\)'):
        init(allow_partial=True, num_heads=6)
    report = init(allow_partial=True, num_heads=3).transfer_report
    assert report['copied in part'] == {'mlp': {4: ['layers.4.ffn.layers.1.weight',
                                                    'layers.4.ffn.layers.1.bias']}}
    assert report['num_heads'] == {'checkpoint': 3, 'model': [3]}
    assert report['warnings'] and 'copied in part' in report['warnings'][0]


@pytest.mark.parametrize('setting,num_copied', [('copy', 48), ('mlpcopy', 72)])
def test_a_block_init_cfg_does_not_overwrite_the_copies(setting, num_copied, ckpt_paths,
                                                        sources):
    # mmengine applies a module's init_cfg before its children's init_weights: a block with
    # an init_cfg of its own (through layer_cfgs) would overwrite what was copied.
    torch.manual_seed(SEED)
    model = LinearViT(
        arch='tiny', attn_type='relu',
        layer_cfgs=dict(init_cfg=dict(type='Constant', val=0, layer='Linear')),
        init_cfg=dict(type='SoftmaxTransfer', checkpoint=str(ckpt_paths['timm']),
                      setting=setting, num_heads=3))
    model.init_weights()
    copied = model.transfer_report['copied']
    assert len(copied) == num_copied
    for name, value in model.state_dict().items():
        if name in copied:
            assert torch.equal(value, sources[name]), name
    # the blocks' own init_cfg did run on everything the setting does not copy
    untouched = model.layers[5].ffn.layers[0][0] if setting == 'copy' else model.layers[5].attn.qkv
    assert not untouched.weight.any() and not untouched.bias.any()


def test_initialisers_of_the_backbone_itself_keep_their_order(ckpt_paths, sources):
    # SoftmaxTransfer only moves the children's own initialisation before it; the
    # initialisers listed before it in the backbone's init_cfg still run first, so the
    # copies land on top of them.
    torch.manual_seed(SEED)
    model = LinearViT(arch='tiny', attn_type='relu', init_cfg=[
        dict(type='Constant', val=0, layer='Linear'),
        dict(type='SoftmaxTransfer', checkpoint=str(ckpt_paths['timm']), setting='mlpcopy',
             num_heads=3)])
    model.init_weights()
    assert torch.equal(model.layers[0].ffn.layers[1].weight,
                       sources['layers.0.ffn.layers.1.weight'])
    assert not model.layers[0].attn.qkv.weight.any()
    assert model.is_init and all(layer.is_init for layer in model.layers)


def test_a_transfer_from_a_parent_module_is_not_overwritten_either(ckpt_paths, sources):
    from mmpretrain.registry import MODELS
    path = str(ckpt_paths['mmpretrain'])
    classifier = MODELS.build(dict(
        type='ImageClassifier',
        backbone=dict(type='LinearViT', arch='tiny', attn_type='softmax',
                      layer_cfgs=dict(init_cfg=dict(type='Constant', val=0, layer='Linear'))),
        head=dict(type='VisionTransformerClsHead', num_classes=1000, in_channels=C),
        init_cfg=dict(type='SoftmaxTransfer', checkpoint=path, setting='fullcopy', prefix='',
                      num_heads=3)))
    classifier.init_weights()
    assert len(classifier.transfer_report['copied']) == 152
    assert torch.equal(classifier.backbone.layers[7].attn.qkv.weight,
                       sources['layers.7.attn.qkv.weight'])


def test_the_initialiser_called_on_its_own(ckpt_paths, sources, build):
    """Outside ``init_weights`` (no init-info bookkeeping): it copies and attaches the report."""
    from linvit_mm.transfer.initializer import SoftmaxTransferInit
    model = build('relu')
    SoftmaxTransferInit(checkpoint=str(ckpt_paths['timm']), setting='mlpcopy')(model)
    assert len(model.transfer_report['copied']) == 72
    for name in model.transfer_report['copied']:
        assert torch.equal(model.state_dict()[name], sources[name]), name


def test_a_wrapped_child_is_initialised_before_the_transfer():
    """A child inside a model wrapper (DataParallel has no init_weights of its own) gets its
    init_cfg run first, and mmengine does not run it again."""
    from mmengine.model import BaseModule
    from linvit_mm.transfer.initializer import SoftmaxTransferInit

    class Child(BaseModule):

        def __init__(self):
            super().__init__(init_cfg=dict(type='Constant', layer='Linear', val=0.5))
            self.fc = torch.nn.Linear(2, 2)

    parent = torch.nn.Module()
    parent.wrapped = torch.nn.DataParallel(Child())
    SoftmaxTransferInit(setting='random')(parent)
    child = parent.wrapped.module
    assert child.is_init
    assert torch.equal(child.fc.weight, torch.full((2, 2), 0.5))
    assert parent.transfer_report['setting'] == 'random'


def test_the_copied_tensors_are_logged_as_the_transfers(ckpt_paths, init_info):
    from mmpretrain.registry import MODELS
    path = str(ckpt_paths['timm'])
    model = MODELS.build(dict(
        type='LinearViT', arch='tiny', attn_type='relu',
        init_cfg=dict(type='SoftmaxTransfer', checkpoint=path, setting='mlpcopy')))
    model.init_weights()
    assert init_info['layers.0.ffn.layers.0.0.weight'] == (
        f'SoftmaxTransferInit: mlpcopy from {path}')


def test_what_a_child_initialises_itself_is_logged_as_its_own(init_info):
    """A child whose ``init_weights`` changes a tensor after mmengine's part (as
    mmpretrain's ViT does with its position embedding) is logged as that child's."""
    from mmengine.model import BaseModule

    class Child(BaseModule):

        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.zeros(3))

        def init_weights(self):
            super().init_weights()
            torch.nn.init.constant_(self.scale, 2.)

    class Parent(BaseModule):

        def __init__(self):
            super().__init__(init_cfg=dict(type='SoftmaxTransfer', setting='random'))
            self.child = Child()

    parent = Parent()
    parent.init_weights()
    assert init_info['child.scale'] == 'Initialized by user-defined `init_weights` in Child '


def test_a_plain_child_with_init_weights_is_initialised_before_the_transfer_too():
    """Without ``is_init`` (not a BaseModule) its ``init_weights`` has not run, and mmengine
    would run it after the transfer, over the copies."""
    from linvit_mm.transfer.initializer import init_children_first

    class PlainChild(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(3))

        def init_weights(self):
            torch.nn.init.constant_(self.bias, 3.)

    parent = torch.nn.Module()
    parent.plain = PlainChild()
    init_children_first(parent)
    assert torch.equal(parent.plain.bias, torch.full((3,), 3.))
