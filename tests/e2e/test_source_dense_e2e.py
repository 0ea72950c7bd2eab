"""The dense recipe from a foundation-model source, end to end at tiny sizes: a DINOv2-shaped
Softmax checkpoint (timm's layout: patch 14, LayerScale) is copied into a relu student that
is distilled from a teacher of the same shape (tools/train.py, the generated groups set), and
that checkpoint starts Mask R-CNN and UperNet around the ViT-Adapter (the generated COCO and
ADE20K sets), each trained a few iterations and evaluated.

The configs are the demo's, with the source's arch at the kept configs' switches:
``LinearViT.arch_zoo['dinov2-small']`` with tiny sizes (what tests/configs builds for the
kept ``*-dinov2-small`` configs, there without training)."""
from pathlib import Path

import pytest
import torch

from linvit_mm.models import LinearViT

# every test here runs whole tools or trainings (seconds each on 2 cores)
pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[2] / 'configs' / 'demo'
WORD = 'dinov2-small'
# Four blocks: one ViT-Adapter interaction each. Width 48 in 3 heads (the adapter's
# deformable heads divide it too).
SIZES = dict(embed_dims=48, num_layers=4, num_heads=3, feedforward_channels=96)
SOURCE_ARCH = dict(LinearViT.arch_zoo[WORD], **SIZES)


def write_config(path, base, text):
    path.write_text(f'_base_ = {str(base)!r}\n\nsource_arch = {SOURCE_ARCH!r}\n' + text)
    return path


@pytest.fixture(scope='module')
def source_checkpoint(tmp_path_factory):
    """A DINOv2-shaped Softmax ViT in timm's layout, as `checkpoints/` would hold it."""
    import timm
    torch.manual_seed(0)
    model = timm.create_model('vit_small_patch14_dinov2', pretrained=False, img_size=64,
                              num_classes=0, embed_dim=SIZES['embed_dims'],
                              depth=SIZES['num_layers'], num_heads=SIZES['num_heads'],
                              mlp_ratio=SIZES['feedforward_channels'] / SIZES['embed_dims'])
    path = tmp_path_factory.mktemp('source') / 'dinov2_tiny.pth'
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope='module')
def stage_checkpoint(tools, mini_data_root, source_checkpoint, tmp_path_factory):
    """Two iterations of the ImageNet-stage recipe (FullCopy + distillation) from the source."""
    work_dir = tmp_path_factory.mktemp('stage')
    config = write_config(work_dir / 'stage.py',
                          DEMO / 'linvit-relu-mini_fullcopy-distill_1xb24_mini-groups.py', f"""
checkpoint = {str(source_checkpoint)!r}
model = dict(backbone=dict(arch=dict(_delete_=True, **source_arch), patch_size=None,
                           init_cfg=dict(checkpoint=checkpoint)),
             head=dict(in_channels=source_arch['embed_dims']))
custom_hooks = [dict(
    type='AttentionDistillHook', loss_weight=50.0, target='output',
    teacher=dict(type='LinearViT', arch=source_arch, attn_type='softmax', img_size=64,
                 init_cfg=dict(type='SoftmaxTransfer', checkpoint=checkpoint,
                               setting='fullcopy')))]
""")
    root = mini_data_root / 'imagenet_groups'
    options = [f'{loader}.dataset.data_root={root}'
               for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    options += ['train_cfg.max_iters=2', 'train_cfg.val_interval=2',
                'default_hooks.checkpoint.interval=2', 'train_dataloader.batch_size=4',
                'default_hooks.logger.interval=1']
    _, log = tools.train([config, '--work-dir', work_dir, '--cfg-options', *options])
    # the student and the teacher both copied from the source (FullCopy; no classifier in it)
    assert log.count("Softmax weight transfer into LinearViT (prefix 'backbone.'): setting "
                     "'fullcopy', checkpoint layout: timm") == 2
    assert log.count('no linear classifier head in the checkpoint') == 2
    assert 'loss_distill' in log  # the teacher of the source's shape taught the student
    checkpoint = torch.load(work_dir / 'iter_2.pth', map_location='cpu', weights_only=False)
    assert checkpoint['state_dict']['backbone.patch_embed.projection.weight'].shape[-1] == 14
    return work_dir / 'iter_2.pth'


def adapter_override(stage_checkpoint):
    return f"""
model = dict(backbone=dict(
    pretrained={str(stage_checkpoint)!r},
    vit=dict(arch=dict(_delete_=True, **source_arch), patch_size=None),
    deform_num_heads=3))
"""


def assert_patch_14(path):
    state = torch.load(path, map_location='cpu', weights_only=False)['state_dict']
    assert state['backbone.vit.patch_embed.projection.weight'].shape[-2:] == (14, 14)


def test_mask_rcnn_from_the_source(tools, mini_data_root, stage_checkpoint, tmp_path):
    config = write_config(tmp_path / 'mask_rcnn.py',
                          DEMO / 'mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py',
                          adapter_override(stage_checkpoint) +
                          'model.update(neck=dict(in_channels=[48, 48, 48, 48]))\n')
    coco = f'{mini_data_root / "coco"}/'
    options = ['train_cfg.max_epochs=1', 'train_cfg.val_interval=1',
               'default_hooks.checkpoint.interval=1']
    options += [f'{loader}.dataset.data_root={coco}'
                for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    options += [f'{evaluator}.ann_file={coco}annotations/instances_val2017.json'
                for evaluator in ('val_evaluator', 'test_evaluator')]
    _, log = tools.train([config, '--work-dir', tmp_path, '--cfg-options', *options])
    assert 'LinearViTAdapter: loaded' in log and 'Epoch(train) [1][6/6]' in log
    assert 'coco/bbox_mAP' in log and 'coco/segm_mAP' in log
    assert_patch_14(tmp_path / 'epoch_1.pth')


def test_upernet_from_the_source(tools, mini_data_root, stage_checkpoint, tmp_path):
    config = write_config(tmp_path / 'upernet.py',
                          DEMO / 'upernet_linvit-adapter-relu-mini_mini-ade.py',
                          adapter_override(stage_checkpoint) +
                          'model.update(decode_head=dict(in_channels=[48, 48, 48, 48]),\n'
                          '             auxiliary_head=dict(in_channels=48))\n')
    ade = mini_data_root / 'ade'
    options = ['train_cfg.max_iters=2', 'train_cfg.val_interval=2',
               'default_hooks.checkpoint.interval=2', 'param_scheduler.0.end=1',
               'param_scheduler.1.begin=1', 'param_scheduler.1.end=2',
               'default_hooks.logger.interval=1']
    options += [f'{loader}.dataset.data_root={ade}'
                for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    _, log = tools.train([config, '--work-dir', tmp_path, '--cfg-options', *options])
    assert 'LinearViTAdapter: loaded' in log and 'Iter(train) [2/2]' in log
    assert 'mIoU' in log
    assert_patch_14(tmp_path / 'iter_2.pth')
