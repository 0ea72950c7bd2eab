"""tools/model_converters/merge_lora.py: a LoRA run's factors folded into a plain checkpoint."""
import importlib.util
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.staged import RECORD_KEY, load_linear_vit_checkpoint
from linvit_mm.testing.staged import tiny_vit_cfg, write_recorded_checkpoint

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / 'tools' / 'model_converters' / 'merge_lora.py'


def load_tool():
    spec = importlib.util.spec_from_file_location('merge_lora', TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = load_tool()


def classifier(backbone):
    return dict(type='ImageClassifier', backbone=backbone,
                head=dict(type='VisionTransformerClsHead', num_classes=3, in_channels=32))


@pytest.fixture()
def lora_run(tmp_path):
    """A LoRA config around a ttt stage-2 checkpoint, and a checkpoint of its run."""
    torch.manual_seed(0)
    stage2 = write_recorded_checkpoint(tmp_path / 'stage2.pth',
                                       MODELS.build(tiny_vit_cfg('ttt')), stage='align-feat')
    lora = dict(type='LoRAModel', alpha=8, rank=2,
                module=tiny_vit_cfg('ttt', init_cfg=dict(type='LinearViTCheckpoint',
                                                         checkpoint=str(stage2))),
                targets=[dict(type='attn.qkv'), dict(type='ffn.layers.1')])
    config = tmp_path / 'lora_config.py'
    Config(dict(default_scope='mmpretrain', model=classifier(lora),
                custom_imports=dict(imports=['linvit_mm.models', 'linvit_mm.engine']))
           ).dump(str(config))
    init_default_scope('mmpretrain')
    model = MODELS.build(classifier(lora))
    with torch.no_grad():  # what training would have left: factors and head away from init
        for name, param in model.named_parameters():
            if '.lora_' in name or name.startswith('head.'):
                param.normal_(0, 0.1)
    checkpoint = tmp_path / 'iter_10.pth'
    torch.save(dict(state_dict=model.state_dict(), meta=dict(iter=10)), checkpoint)
    return config, checkpoint, model.eval()


def test_merge_lora_tool_gives_the_plain_model_of_the_run(lora_run, tmp_path, capsys):
    config, checkpoint, lora_model = lora_run
    out = tmp_path / 'merged.pth'
    assert tool.main([str(config), str(checkpoint), str(out)]) == 0
    assert 'merged the LoRA factors' in capsys.readouterr().out
    merged = torch.load(out, map_location='cpu', weights_only=True)
    assert merged['meta']['iter'] == 10
    record = merged['meta'][RECORD_KEY]
    assert record['stage'] == 'lora-merged' and list(record['backbones']) == ['backbone.']
    assert record['lora']['backbone']['targets'] == [dict(type='attn.qkv'),
                                                     dict(type='ffn.layers.1')]
    plain = MODELS.build(classifier(tiny_vit_cfg('ttt'))).eval()
    plain.load_state_dict(merged['state_dict'], strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), lora_model(x), rtol=1e-5, atol=1e-6)
    # the next stage's strict loader takes it, operators checked
    load_linear_vit_checkpoint(MODELS.build(tiny_vit_cfg('ttt')), str(out))


def test_merge_lora_tool_refuses_a_checkpoint_of_another_model(lora_run, tmp_path, capsys):
    config, checkpoint, _ = lora_run
    out = tmp_path / 'merged.pth'
    assert tool.main([str(config), str(checkpoint), str(out), '--cfg-options',
                      'model.backbone.rank=4']) == 1
    assert 'does not fit the LoRA model of the config' in capsys.readouterr().err
    assert tool.main([str(config), str(checkpoint), str(out), '--cfg-options',
                      "model.backbone.targets.1.type=attn.proj"]) == 1
    err = capsys.readouterr().err
    assert 'missing: backbone.module.layers.0.attn.proj.lora_down.weight' in err
    assert 'not in the model: backbone.module.layers.0.ffn.layers.1.lora_down.weight' in err
    assert not out.exists()
    assert tool.main([str(config), str(checkpoint), str(checkpoint)]) == 1
    assert 'is the checkpoint to merge' in capsys.readouterr().err
