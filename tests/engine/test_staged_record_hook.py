"""StagedRecordHook: every checkpoint of a run records its LinearViT (staged recipe)."""
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

import linvit_mm.engine  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'


def make_cfg(work_dir, mini_data_root):
    cfg = Config.fromfile(str(TINY_CONFIG))
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.data_root = str(mini_data_root / 'imagenet')
    cfg.work_dir = str(work_dir)
    cfg.custom_hooks = [dict(type='StagedRecordHook')]
    return cfg


def test_staged_record_hook_writes_the_record_into_checkpoints(tmp_path, mini_data_root):
    cfg = make_cfg(tmp_path, mini_data_root)
    cfg.model.backbone.layer_cfgs = [dict(), dict(attn_type='elu')]
    Runner.from_cfg(cfg).train()
    for name in ('iter_1.pth', 'iter_2.pth'):
        meta = torch.load(tmp_path / name, map_location='cpu', weights_only=False)['meta']
        backbone = meta['linvit_mm']['backbones']['backbone.']
        assert backbone['attn_types'] == ['relu', 'elu'] and backbone['num_heads'] == [2, 2]
        assert 'stage' not in meta['linvit_mm']  # a classifier states no stage


def test_staged_record_hook_refuses_a_model_without_linear_vit(tmp_path, mini_data_root):
    cfg = make_cfg(tmp_path, mini_data_root)
    cfg.model.backbone = dict(type='ResNet', depth=18)
    cfg.model.head = dict(type='LinearClsHead', num_classes=6, in_channels=512)
    cfg.model.neck = dict(type='GlobalAveragePooling')
    with pytest.raises(ValueError, match=r'StagedRecordHook: the model \(ImageClassifier\) '
                                         r'holds no LinearViT'):
        Runner.from_cfg(cfg).train()
