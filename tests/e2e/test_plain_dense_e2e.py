"""The paper's dense protocol end to end: each Base plain-ViT config (Mask R-CNN with windowed
Softmax, and relu / ttt global; UperNet for the three) trained by tools/train.py on the
generated mini sets from an ImageNet-stage checkpoint, then tested by tools/test.py.

The configs are taken as they are, with the smallest changes that keep the protocol: a
12-block ViT of width 64 (so the four levels still come from blocks 2, 5, 8, 11 and Softmax
still runs windows in the other eight), windows of 4 tokens instead of 14 (a mini image's
grid is 8 x 6: 14-token windows would be the whole grid, 4 leaves full and border windows),
and the heads, data, schedule and evaluators of the demo's mini configs."""
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

from linvit_mm.models import LinearViT, LinearViTPlainPyramid

# every test here runs whole tools or trainings (seconds each on 2 cores)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / 'configs' / 'demo'
ARCH = dict(embed_dims=64, num_layers=12, num_heads=2, feedforward_channels=128)
OPERATORS = ['softmax', 'relu', 'ttt']
MINI_WINDOW = 4


@pytest.fixture(scope='module')
def stage_checkpoints(tmp_path_factory):
    """Per operator, an ImageNet-stage checkpoint of the test's arch (``backbone.`` keys, the
    final norm and a head included, as tools/train.py writes them)."""
    root = tmp_path_factory.mktemp('plain_stage')
    paths = {}
    for index, attn_type in enumerate(OPERATORS):
        torch.manual_seed(index)
        vit = LinearViT(arch=ARCH, attn_type=attn_type, img_size=224)
        state = {f'backbone.{k}': v for k, v in vit.state_dict().items()}
        state['head.layers.head.weight'] = torch.zeros(10, ARCH['embed_dims'])
        paths[attn_type] = root / f'{attn_type}.pth'
        torch.save({'state_dict': state, 'meta': {}}, paths[attn_type])
    return paths


def shrink(cfg, demo, checkpoint):
    vit = cfg.model.backbone.vit
    vit.arch = dict(ARCH)
    if vit.get('window_size'):
        vit.window_size = MINI_WINDOW
    cfg.model.backbone.pretrained = str(checkpoint)
    for key in ('train_dataloader', 'val_dataloader', 'test_dataloader', 'val_evaluator',
                'test_evaluator', 'train_cfg', 'param_scheduler', 'default_hooks',
                'randomness'):
        cfg[key] = demo[key]


def backbone_of(cfg):
    kwargs = {k: v for k, v in cfg.model.backbone.items() if k not in ('type', 'pretrained')}
    return LinearViTPlainPyramid(**kwargs)


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_plain_mask_rcnn_on_mini_coco(attn_type, tools, mini_data_root, stage_checkpoints,
                                      tmp_path):
    cfg = Config.fromfile(
        str(REPO / f'configs/detection/mask-rcnn_linvit-{attn_type}-base_plain_fpn_1x_coco.py'))
    demo = Config.fromfile(str(DEMO / 'mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py'))
    windowed = cfg.model.backbone.vit.get('window_block_indexes')
    assert (windowed == [0, 1, 3, 4, 6, 7, 9, 10]) == (attn_type == 'softmax')
    shrink(cfg, demo, stage_checkpoints[attn_type])
    for key in ('rpn_head', 'roi_head', 'train_cfg', 'test_cfg'):
        cfg.model[key] = demo.model[key]
    cfg.model.neck = dict(demo.model.neck, in_channels=[ARCH['embed_dims']] * 4)
    if attn_type == 'softmax':
        sizes = [layer.window_size for layer in backbone_of(cfg).vit.layers]
        assert sizes == [None if i in (2, 5, 8, 11) else (4, 4) for i in range(12)]
    config = tmp_path / 'plain_mask_rcnn.py'
    cfg.dump(str(config))

    coco = f'{mini_data_root / "coco"}/'
    options = ['train_cfg.max_epochs=1', 'train_cfg.val_interval=1',
               'default_hooks.checkpoint.interval=1']
    options += [f'{loader}.dataset.data_root={coco}'
                for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    options += [f'{evaluator}.ann_file={coco}annotations/instances_val2017.json'
                for evaluator in ('val_evaluator', 'test_evaluator')]
    _, log = tools.train([config, '--work-dir', tmp_path, '--cfg-options', *options])
    assert 'LinearViTPlainPyramid: loaded' in log
    assert 'Epoch(train) [1][6/6]' in log and 'coco/segm_mAP' in log
    metrics, _ = tools.test([config, tmp_path / 'epoch_1.pth', '--work-dir', tmp_path / 'test',
                             '--cfg-options', *options])
    for key in ('coco/bbox_mAP', 'coco/segm_mAP'):
        assert 0.0 <= metrics[key] <= 1.0


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_plain_upernet_on_mini_ade(attn_type, tools, mini_data_root, stage_checkpoints,
                                   tmp_path):
    cfg = Config.fromfile(str(
        REPO / f'configs/segmentation/upernet_linvit-{attn_type}-base_plain_8xb2-160k_ade20k-'
        '512x512.py'))
    demo = Config.fromfile(str(DEMO / 'upernet_linvit-adapter-relu-mini_mini-ade.py'))
    assert not cfg.model.backbone.vit.get('window_size')
    shrink(cfg, demo, stage_checkpoints[attn_type])
    width = ARCH['embed_dims']
    cfg.model.data_preprocessor = demo.model.data_preprocessor
    cfg.model.decode_head = dict(demo.model.decode_head, in_channels=[width] * 4)
    cfg.model.auxiliary_head = dict(demo.model.auxiliary_head, in_channels=width)
    cfg.model.test_cfg = demo.model.test_cfg
    config = tmp_path / 'plain_upernet.py'
    cfg.dump(str(config))

    ade = mini_data_root / 'ade'
    options = ['train_cfg.max_iters=2', 'train_cfg.val_interval=2',
               'default_hooks.checkpoint.interval=2', 'param_scheduler.0.end=1',
               'param_scheduler.1.begin=1', 'param_scheduler.1.end=2',
               'default_hooks.logger.interval=1']
    options += [f'{loader}.dataset.data_root={ade}'
                for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    _, log = tools.train([config, '--work-dir', tmp_path, '--cfg-options', *options])
    assert 'LinearViTPlainPyramid: loaded' in log and 'Iter(train) [2/2]' in log
    assert 'mIoU' in log
    metrics, _ = tools.test([config, tmp_path / 'iter_2.pth', '--work-dir', tmp_path / 'test',
                             '--cfg-options', *options, f'visualizer.name=plain_{attn_type}'])
    assert 0.0 <= metrics['mIoU'] <= 100.0
