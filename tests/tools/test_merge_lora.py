"""tools/model_converters/merge_lora.py: a LoRA run's factors folded into a plain checkpoint."""
import importlib.util
import logging
import math
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.staged import RECORD_KEY, load_linear_vit_checkpoint, lora_record
from linvit_mm.testing.staged import tiny_vit_cfg, write_recorded_checkpoint

# every test here runs whole tools or trainings (seconds each on 2 cores)
pytestmark = pytest.mark.slow

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


def write_config(path, stage2):
    lora = dict(type='LoRAModel', alpha=8, rank=2,
                module=tiny_vit_cfg('ttt', init_cfg=dict(type='LinearViTCheckpoint',
                                                         checkpoint=str(stage2))),
                targets=[dict(type='attn.qkv'), dict(type='ffn.layers.1')])
    Config(dict(default_scope='mmpretrain', model=classifier(lora),
                custom_imports=dict(imports=['linvit_mm.models', 'linvit_mm.engine']))
           ).dump(str(path))
    return path, lora


@pytest.fixture()
def lora_run(tmp_path):
    """A LoRA config around a ttt stage-2 checkpoint, and a checkpoint of its run with the
    record LoRATargetsHook writes."""
    torch.manual_seed(0)
    stage2 = write_recorded_checkpoint(tmp_path / 'stage2.pth',
                                       MODELS.build(tiny_vit_cfg('ttt')), stage='align-feat')
    config, lora = write_config(tmp_path / 'lora_config.py', stage2)
    init_default_scope('mmpretrain')
    model = MODELS.build(classifier(lora))
    with torch.no_grad():  # what training would have left: factors and head away from init
        for name, param in model.named_parameters():
            if '.lora_' in name or name.startswith('head.'):
                param.normal_(0, 0.1)
    checkpoint = tmp_path / 'iter_10.pth'
    torch.save(dict(state_dict=model.state_dict(),
                    meta={'iter': 10, RECORD_KEY: dict(lora=lora_record(model))}), checkpoint)
    return config, checkpoint, model.eval()


def edited(checkpoint, path, edit):
    """A copy of ``checkpoint`` at ``path`` after ``edit(loaded)``."""
    loaded = torch.load(checkpoint, map_location='cpu', weights_only=False)
    edit(loaded)
    torch.save(loaded, path)
    return path


def refused(args, capsys, out):
    assert tool.main([str(a) for a in args]) == 1
    assert not out.exists()
    return capsys.readouterr().err


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
    assert 'is one of the inputs' in capsys.readouterr().err


@pytest.mark.parametrize('option, named', [
    ('model.backbone.alpha=16', 'alpha differs: checkpoint 8, config 16'),
    ('model.backbone.targets.0.alpha=4',
     "targets differs: checkpoint [{'type': 'attn.qkv'}, {'type': 'ffn.layers.1'}], config "
     "[{'type': 'attn.qkv', 'alpha': 4}, {'type': 'ffn.layers.1'}]"),
    ('model.backbone.rank=4', 'rank differs: checkpoint 2, config 4'),
], ids=['alpha', 'target-alpha', 'rank'])
def test_merge_lora_refuses_other_settings_than_the_run_recorded(lora_run, tmp_path, capsys,
                                                                 option, named):
    config, checkpoint, _ = lora_run
    out = tmp_path / 'merged.pth'
    err = refused([config, checkpoint, out, '--cfg-options', option], capsys, out)
    assert f'LoRAModel backbone: {named}' in err and 'nothing was merged' in err


def test_merge_lora_refuses_another_base_than_the_run_trained_on(lora_run, tmp_path, capsys):
    config, checkpoint, _ = lora_run
    torch.manual_seed(5)  # another stage-2 checkpoint of the same model
    other = write_recorded_checkpoint(tmp_path / 'other_stage2.pth',
                                      MODELS.build(tiny_vit_cfg('ttt')), stage='align-feat')
    out = tmp_path / 'merged.pth'
    err = refused([config, checkpoint, out, '--cfg-options',
                   f'model.backbone.module.init_cfg.checkpoint={other}'], capsys, out)
    assert 'LoRAModel backbone: its base weights' in err and str(other) in err
    assert 'are not those the factors were trained on' in err


def test_merge_lora_needs_the_record_or_the_explicit_flag(lora_run, tmp_path, capsys, logged):
    config, checkpoint, lora_model = lora_run
    old = edited(checkpoint, tmp_path / 'old.pth', lambda c: c['meta'].pop(RECORD_KEY))
    out = tmp_path / 'merged.pth'
    err = refused([config, old, out], capsys, out)
    assert 'does not record the LoRA settings (alpha, rank, targets) and base weights' in err
    assert '--allow-unrecorded' in err
    with logged(level=logging.WARNING) as warnings:
        assert tool.main([str(config), str(old), str(out), '--allow-unrecorded']) == 0
    assert warnings[0] == (
        f'{old} records neither alpha, rank and targets nor the base weights its factors were '
        f"trained on: merging with the config's, unchecked")
    merged = torch.load(out, weights_only=True)
    assert merged['meta'][RECORD_KEY]['lora']['backbone']['alpha'] == 8


def test_merge_lora_refuses_non_finite_factors_and_results(lora_run, tmp_path, capsys):
    config, checkpoint, _ = lora_run
    out = tmp_path / 'merged.pth'
    factor = 'backbone.module.layers.1.attn.qkv.lora_up.weight'

    def poison(c):
        c['state_dict'][factor][3, 1] = math.nan
    nan = edited(checkpoint, tmp_path / 'nan.pth', poison)
    err = refused([config, nan, out], capsys, out)
    assert f'{nan}: 1 tensor(s) hold non-finite values' in err
    assert f'{factor}: 1 NaN of 288' in err

    def overflow(c):  # finite factors whose product overflows float32
        for name in ('lora_up', 'lora_down'):
            c['state_dict'][f'backbone.module.layers.0.attn.qkv.{name}.weight'].fill_(1e20)
    huge = edited(checkpoint, tmp_path / 'huge.pth', overflow)
    err = refused([config, huge, out], capsys, out)
    assert 'folding the factors overflows' in err
    assert 'the merged weights: 1 tensor(s) hold non-finite values' in err
    assert 'backbone.layers.0.attn.qkv.weight: 4608 Inf of 4608' in err


def test_merge_lora_refuses_a_non_finite_base(lora_run, tmp_path, capsys):
    config, checkpoint, _ = lora_run
    stage2 = tmp_path / 'stage2.pth'

    def poison(c):
        c['state_dict']['backbone.layers.2.ffn.layers.1.weight'][0, 0] = math.inf
    edited(stage2, stage2, poison)
    out = tmp_path / 'merged.pth'
    err = refused([config, checkpoint, out], capsys, out)
    assert f'{stage2}: 1 tensor(s) hold non-finite values' in err
    assert 'backbone.layers.2.ffn.layers.1.weight: 1 Inf' in err


def truncate(path, to):
    data = Path(path).read_bytes()
    cut = Path(to)
    cut.write_bytes(data[:len(data) // 2])
    return cut


def test_merge_lora_names_a_truncated_file_and_an_unwritable_out(lora_run, tmp_path, capsys):
    config, checkpoint, _ = lora_run
    out = tmp_path / 'merged.pth'
    cut = truncate(checkpoint, tmp_path / 'cut.pth')
    err = refused([config, cut, out], capsys, out)
    assert f'LoRA checkpoint {cut} cannot be read, it is truncated or damaged' in err
    truncate(tmp_path / 'stage2.pth', tmp_path / 'stage2.pth')
    err = refused([config, checkpoint, out], capsys, out)
    assert f'checkpoint {tmp_path / "stage2.pth"} cannot be read' in err
    blocker = tmp_path / 'a_file'
    blocker.write_text('')
    err = refused([config, checkpoint, blocker / 'merged.pth'], capsys, blocker / 'merged.pth')
    assert f'cannot be created: {blocker} is a file, not a directory' in err


def test_a_lora_run_records_what_its_merge_checks(tmp_path, mini_data_root, capsys):
    """A LoRA run of the tiny classifier with the LoRA configs' hooks, then the merge of its
    checkpoint: as trained, with another alpha, and onto another stage-2 checkpoint."""
    from mmengine.runner import Runner
    tiny = Config.fromfile(str(REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'))
    vit_cfg = tiny.model.backbone.to_dict()
    stages = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        stages[seed] = write_recorded_checkpoint(tmp_path / f'stage2_{seed}.pth',
                                                 MODELS.build(vit_cfg), stage='align-feat')
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        tiny[loader].dataset.data_root = str(mini_data_root / 'imagenet')
    tiny.model.backbone = dict(
        type='LoRAModel', alpha=4, rank=2, targets=[dict(type='attn.qkv')],
        module=dict(vit_cfg, init_cfg=dict(type='LinearViTCheckpoint',
                                           checkpoint=str(stages[0]))))
    tiny.custom_imports = dict(imports=['linvit_mm.models', 'linvit_mm.engine'])
    tiny.custom_hooks = [dict(type='LoRATargetsHook'), dict(type='StagedRecordHook')]
    tiny.train_cfg.max_iters = 1
    tiny.work_dir = str(tmp_path / 'run')
    Runner.from_cfg(tiny.copy()).train()
    config = tmp_path / 'run_config.py'
    tiny.dump(str(config))
    checkpoint = tmp_path / 'run' / 'iter_1.pth'
    out = tmp_path / 'merged.pth'
    assert tool.main([str(config), str(checkpoint), str(out)]) == 0
    assert torch.load(out, weights_only=True)['meta'][RECORD_KEY]['stage'] == 'lora-merged'
    out.unlink()
    capsys.readouterr()
    err = refused([config, checkpoint, out, '--cfg-options', 'model.backbone.alpha=8'],
                  capsys, out)
    assert 'alpha differs: checkpoint 4, config 8' in err
    err = refused([config, checkpoint, out, '--cfg-options',
                   f'model.backbone.module.init_cfg.checkpoint={stages[1]}'], capsys, out)
    assert 'are not those the factors were trained on' in err
