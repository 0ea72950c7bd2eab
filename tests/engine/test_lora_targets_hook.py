"""LoRATargetsHook: LoRA targets that adapt no layer stop the run before it starts."""
from pathlib import Path

import pytest
from mmengine.config import Config
from mmengine.runner import Runner

import linvit_mm.engine  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'


def make_cfg(work_dir, mini_data_root, targets):
    cfg = Config.fromfile(str(TINY_CONFIG))
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.data_root = str(mini_data_root / 'imagenet')
    cfg.work_dir = str(work_dir)
    vit = cfg.model.backbone
    cfg.model.backbone = dict(type='LoRAModel', module=vit, alpha=4, rank=2, targets=targets)
    cfg.custom_hooks = [dict(type='LoRATargetsHook')]
    return cfg


def test_lora_targets_hook_names_targets_that_adapt_nothing(tmp_path, mini_data_root):
    cfg = make_cfg(tmp_path, mini_data_root,
                   [dict(type='attn.qkv'), dict(type='ffn.fc1'), dict(type='attn.proj')])
    runner = Runner.from_cfg(cfg)
    with pytest.raises(ValueError) as info:
        runner.train()
    message = str(info.value)
    assert "LoRAModel backbone: targets [{'type': 'ffn.fc1'}] adapt no layer" in message
    assert 'layers.*.ffn.layers.0.0' in message
    assert runner.iter == 0


def test_lora_targets_hook_lets_matching_targets_train(tmp_path, mini_data_root):
    cfg = make_cfg(tmp_path, mini_data_root, [dict(type='attn.qkv'), dict(type='ffn.layers.1')])
    runner = Runner.from_cfg(cfg)
    runner.train()
    assert runner.iter == 2


def test_lora_targets_none_matching_refused_when_built(tmp_path, mini_data_root):
    # LoRAModel itself refuses a set of targets of which none matched, when it is built
    cfg = make_cfg(tmp_path, mini_data_root, [dict(type='ffn.fc1')])
    with pytest.raises(ValueError, match='No lora layer is replaced'):
        Runner.from_cfg(cfg)


def test_lora_targets_hook_refuses_a_model_without_lora(tmp_path, mini_data_root):
    cfg = Config.fromfile(str(TINY_CONFIG))
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.data_root = str(mini_data_root / 'imagenet')
    cfg.work_dir = str(tmp_path)
    cfg.custom_hooks = [dict(type='LoRATargetsHook')]
    with pytest.raises(ValueError, match='holds no LoRAModel'):
        Runner.from_cfg(cfg).train()


def test_lora_run_checkpoints_record_what_a_merge_needs(tmp_path, mini_data_root):
    import torch

    from linvit_mm.staged import RECORD_KEY, lora_base_digest
    cfg = make_cfg(tmp_path, mini_data_root, [dict(type='attn.qkv'), dict(type='attn.proj')])
    # the order of the LoRA configs: StagedRecordHook writes the record LoRATargetsHook adds to
    cfg.custom_hooks = [dict(type='LoRATargetsHook'), dict(type='StagedRecordHook')]
    runner = Runner.from_cfg(cfg)
    runner.train()
    checkpoint = torch.load(tmp_path / 'iter_2.pth', map_location='cpu', weights_only=False)
    record = checkpoint['meta'][RECORD_KEY]
    assert list(record['backbones']) == ['backbone.module.']
    assert record['lora'] == {'backbone': dict(
        alpha=4, rank=2, targets=[dict(type='attn.qkv'), dict(type='attn.proj')],
        base_sha256=lora_base_digest(runner.model.backbone))}
