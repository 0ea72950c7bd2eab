"""tools/train.py + tools/test.py on the mini COCO set (CocoMetric bbox + segm) and the
mini ADE20K set (IoUMetric), starting from a classification checkpoint that the project's own
classification pipeline wrote; --show-dir writes the visualised predictions."""
from pathlib import Path

import pytest

# every test here runs whole tools or trainings (seconds each on 2 cores)
pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[2] / 'configs' / 'demo'
# one operator with a class token and one without (MHLA: fixed block count, padded grids)
OPERATORS = ['relu', 'mhla']


@pytest.fixture(scope='module')
def classification_checkpoints(tools, mini_data_root, tmp_path_factory):
    """Two iterations of the demo's classification config per operator."""
    paths = {}
    root = mini_data_root / 'imagenet_groups'
    for attn_type in OPERATORS:
        work_dir = tmp_path_factory.mktemp(f'cls_{attn_type}')
        options = [f'{loader}.dataset.data_root={root}'
                   for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
        options += [f'model.backbone.attn_type={attn_type}', 'train_cfg.max_iters=2',
                    'train_cfg.val_interval=2', 'default_hooks.checkpoint.interval=2',
                    'train_dataloader.batch_size=4']
        tools.train([DEMO / 'linvit-relu-mini_random_1xb24_mini-groups.py', '--work-dir',
                     work_dir, '--cfg-options', *options])
        paths[attn_type] = work_dir / 'iter_2.pth'
        assert paths[attn_type].is_file()
    return paths


def images_under(path):
    return [p for p in Path(path).rglob('*') if p.suffix in ('.jpg', '.png')]


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_mask_rcnn_on_mini_coco(attn_type, tools, mini_data_root, classification_checkpoints,
                                tmp_path):
    config = DEMO / 'mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py'
    coco = f'{mini_data_root / "coco"}/'
    options = [f'model.backbone.vit.attn_type={attn_type}',
               f'model.backbone.pretrained={classification_checkpoints[attn_type]}',
               'train_cfg.max_epochs=1', 'train_cfg.val_interval=1',
               'default_hooks.checkpoint.interval=1']
    options += [f'{loader}.dataset.data_root={coco}'
                for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    options += [f'{evaluator}.ann_file={coco}annotations/instances_val2017.json'
                for evaluator in ('val_evaluator', 'test_evaluator')]
    _, log = tools.train([config, '--work-dir', tmp_path, '--cfg-options', *options])
    assert 'Epoch(train) [1][6/6]' in log
    assert 'coco/segm_mAP' in log  # validation after the epoch
    metrics, _ = tools.test([config, tmp_path / 'epoch_1.pth', '--work-dir', tmp_path / 'test',
                             '--show-dir', tmp_path / 'vis', '--cfg-options', *options])
    for key in ('coco/bbox_mAP', 'coco/segm_mAP'):
        assert 0.0 <= metrics[key] <= 1.0
    assert len(images_under(tmp_path / 'vis')) == 8  # every val image, boxes and masks drawn


@pytest.mark.parametrize('attn_type', OPERATORS)
def test_upernet_on_mini_ade(attn_type, tools, mini_data_root, classification_checkpoints,
                             tmp_path):
    config = DEMO / 'upernet_linvit-adapter-relu-mini_mini-ade.py'
    ade = mini_data_root / 'ade'
    options = [f'model.backbone.vit.attn_type={attn_type}',
               f'model.backbone.pretrained={classification_checkpoints[attn_type]}',
               'train_cfg.max_iters=4', 'train_cfg.val_interval=4',
               'default_hooks.checkpoint.interval=4', 'param_scheduler.0.end=2',
               'param_scheduler.1.begin=2', 'param_scheduler.1.end=4',
               'default_hooks.logger.interval=1']
    options += [f'{loader}.dataset.data_root={ade}'
                for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    _, log = tools.train([config, '--work-dir', tmp_path, '--cfg-options', *options])
    assert 'Iter(train) [4/4]' in log and 'mIoU' in log
    # mmseg's visualizer is a named singleton: in this one process, give the test run its own
    # (a separate tools/test.py process gets a fresh one anyway).
    metrics, _ = tools.test([config, tmp_path / 'iter_4.pth', '--work-dir', tmp_path / 'test',
                             '--show-dir', tmp_path / 'vis', '--cfg-options', *options,
                             f'visualizer.name=test_{attn_type}'])
    assert 0.0 <= metrics['mIoU'] <= 100.0
    assert len(images_under(tmp_path / 'vis')) == 8
