"""The override patterns of configs/classification/staged/README.md build and run.

The configs themselves are built and run by test_configs.py (every config under configs/);
the helpers and checkpoints here are that module's.
"""
import importlib.util
from pathlib import Path

import pytest
from mmengine.config import Config

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location('staged_config_helpers', HERE / 'test_configs.py')
_configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_configs)
# pytest finds fixtures by name in the module: the tiny DeiT and staged checkpoints
softmax_checkpoint = _configs.softmax_checkpoint
classification_checkpoints = _configs.classification_checkpoints
staged_checkpoints = _configs.staged_checkpoints

STAGED = _configs.CONFIG_ROOT / 'classification' / 'staged'
README = (STAGED / 'README.md').read_text()
# pattern: (config, options as typed after --cfg-options; PATH stands for a file)
OVERRIDES = {
    'operator': ('linvit-relu-small_align-attn_8xb128_in1k.py',
                 'model.backbone.attn_type=hedgehog'),
    'operator, staged-ft': ('linvit-ttt-tiny_staged-ft_32xb128_in1k.py',
                            'model.backbone.attn_type=mhla'),
    'operator, staged-lora': ('linvit-ttt-base_staged-lora_8xb128_in1k.py',
                              'model.backbone.module.attn_type=mhla'),
    'blocks per job': ('linvit-relu-tiny_align-attn_8xb128_in1k.py', 'model.layers=[1]'),
    'stage-1 checkpoint': ('linvit-ttt-small_align-feat_8xb128_in1k.py',
                           'model.backbone.init_cfg.checkpoint=PATH'),
    'stage-2 checkpoint': ('linvit-relu-base_staged-ft_32xb128_in1k.py',
                           'model.backbone.init_cfg.checkpoint=PATH'),
    'stage-2 checkpoint, LoRA': ('linvit-relu-small_staged-lora_8xb128_in1k.py',
                                 'model.backbone.module.init_cfg.checkpoint=PATH'),
    'cosine loss': ('linvit-relu-tiny_align-feat_8xb128_in1k.py', 'model.cos_weight=1.0'),
    'DeiT checkpoint': ('linvit-ttt-tiny_align-attn_8xb128_in1k.py',
                        'model.teacher.init_cfg.checkpoint=PATH'),
    'no distillation': ('linvit-relu-small_staged-ft-distill_32xb128_in1k.py',
                        'custom_hooks=[]'),
}


@pytest.mark.parametrize('pattern', OVERRIDES)
def test_staged_readme_documents_the_override(pattern):
    documented = OVERRIDES[pattern][1]
    if pattern.startswith('operator'):  # documented with OP for the operator
        documented = documented.split('=')[0] + '=OP'
    elif pattern == 'blocks per job':  # documented for a 12-block ViT
        documented = 'model.layers=[0,1,2,3]'
    assert documented in README


@pytest.mark.parametrize('pattern', OVERRIDES)
def test_staged_override_builds_and_runs(pattern, softmax_checkpoint,
                                         classification_checkpoints, staged_checkpoints):
    config, options = OVERRIDES[pattern]
    path = softmax_checkpoint if 'DeiT' in pattern else staged_checkpoints('relu')
    cfg = _configs.apply_cli_options(Config.fromfile(str(STAGED / config)),
                                     options.replace('PATH', path))
    if 'checkpoint' in pattern:
        model_cfg = cfg.model.backbone.get('module', cfg.model.backbone)
        vit = cfg.model.teacher if 'DeiT' in pattern else model_cfg
        assert vit.init_cfg.checkpoint == path
    model = _configs.build_and_run(cfg, softmax_checkpoint, classification_checkpoints,
                                   staged_checkpoints)
    vit = getattr(model.backbone, 'module', model.backbone)
    operators = {layer.attn.attn_type for layer in vit.layers}
    if pattern.startswith('operator'):
        assert operators == {options.split('=')[1]}
    elif pattern == 'blocks per job':
        assert model.layer_ids == [1]
    elif pattern == 'cosine loss':
        assert model.cos_weight == 1.0
    elif pattern == 'no distillation':
        assert cfg.custom_hooks == []
