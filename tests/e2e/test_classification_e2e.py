"""End-to-end tools/train.py on the mini classification set for every operator with
MLPCopy + distillation from a Softmax checkpoint written here; tools/test.py reloads it."""
import re
from pathlib import Path

import pytest
import torch

# every test here runs whole tools or trainings (seconds each on 2 cores)
pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[2] / 'configs' / 'demo'
CONFIG = DEMO / 'linvit-relu-mini_mlpcopy-distill_1xb24_mini-groups.py'
MINI_ARCH = dict(embed_dims=96, num_layers=4, num_heads=3, feedforward_channels=384)


@pytest.fixture(scope='module')
def softmax_checkpoint(tmp_path_factory):
    """A Softmax classifier in mmpretrain's layout, as the demo's teacher stage writes it."""
    from linvit_mm.models import LinearViT
    torch.manual_seed(0)
    vit = LinearViT(arch=MINI_ARCH, attn_type='softmax', img_size=64, patch_size=8)
    vit.init_weights()
    state = {f'backbone.{k}': v for k, v in vit.state_dict().items()}
    state['head.layers.head.weight'] = torch.randn(6, 96) * 0.02
    state['head.layers.head.bias'] = torch.zeros(6)
    path = tmp_path_factory.mktemp('teacher') / 'softmax_mini.pth'
    torch.save({'state_dict': state, 'meta': {}}, path)
    return path


@pytest.mark.parametrize('attn_type', ['softmax', 'elu', 'relu', 'inline', 'mhla', 'ttt'])
def test_mlpcopy_distill_train_then_test(attn_type, tools, mini_data_root, softmax_checkpoint,
                                         tmp_path):
    root = mini_data_root / 'imagenet_groups'
    options = [f'{loader}.dataset.data_root={root}'
               for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    options += [f'model.backbone.attn_type={attn_type}',
                f'model.backbone.init_cfg.checkpoint={softmax_checkpoint}',
                f'custom_hooks.0.teacher.init_cfg.checkpoint={softmax_checkpoint}',
                'train_cfg.max_iters=3', 'train_cfg.val_interval=3',
                'default_hooks.checkpoint.interval=3', 'default_hooks.logger.interval=1',
                'train_dataloader.batch_size=8']
    _, log = tools.train([CONFIG, '--work-dir', tmp_path, '--cfg-options', *options])
    distill = [float(x) for x in re.findall(r'loss_distill: ([\d.]+)', log)]
    tasks = [float(x) for x in re.findall(r'loss_task: ([\d.]+)', log)]
    assert len(distill) == 3 and len(tasks) == 3, log[-3000:]
    assert all(torch.isfinite(torch.tensor(distill + tasks)))
    assert "setting 'mlpcopy'" in log
    train_top1 = float(re.findall(r'accuracy/top1: ([\d.]+)', log)[-1])
    ckpt = tmp_path / 'iter_3.pth'
    assert ckpt.is_file()

    metrics, _ = tools.test([CONFIG, ckpt, '--work-dir', tmp_path / 'test', '--cfg-options',
                             *options])
    assert metrics['accuracy/top1'] == pytest.approx(train_top1, abs=1e-3)
