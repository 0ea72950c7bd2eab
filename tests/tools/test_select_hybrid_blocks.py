"""The command line of tools/analysis_tools/select_hybrid_blocks.py end to end on the generated
mini ImageNet set with a 4-block model, and its refusals (its logic:
tests/analysis/test_hybrid_selection.py)."""
import csv
import importlib.util
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import load_checkpoint

import linvit_mm.engine  # noqa: F401
from linvit_mm.analysis import validation_batches

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
ARCH = dict(embed_dims=32, num_layers=4, num_heads=2, feedforward_channels=64)
NUM_IMAGES = 24  # of the 48 of the mini validation set, 4 of each class


def load_tool():
    # the tool is a script: its main is run as the command line runs it
    path = REPO / 'tools' / 'analysis_tools' / 'select_hybrid_blocks.py'
    spec = importlib.util.spec_from_file_location('select_hybrid_blocks', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


select = load_tool()


def write_config(path, mini_data_root, teacher_ckpt, attn_type):
    root = mini_data_root / 'imagenet'
    teacher = dict(type='LinearViT', arch=ARCH, attn_type='softmax', img_size=32, patch_size=8,
                   init_cfg=dict(type='Pretrained', checkpoint=str(teacher_ckpt)))
    lines = [
        f"_base_ = ['{TINY_CONFIG}']",
        f'model = dict(backbone=dict(arch={ARCH!r}, attn_type={attn_type!r}))',
        "custom_imports = dict(imports=['linvit_mm.models', 'linvit_mm.engine'])",
        f"train_dataloader = dict(dataset=dict(data_root='{root}'))",
        f"val_dataloader = dict(dataset=dict(data_root='{root}'))",
        f"test_dataloader = dict(dataset=dict(data_root='{root}'))",
        f"custom_hooks = [dict(type='AttentionDistillHook', teacher={teacher!r})]",
    ]
    path.write_text('\n'.join(lines) + '\n')
    return path


def build(cfg):
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS
    model_cfg = cfg.model.copy()
    model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        return MODELS.build(model_cfg)


@pytest.fixture(scope='module')
def teacher4(tmp_path_factory):
    """A 4-block Softmax backbone (the teacher of every student here)."""
    from linvit_mm.models import LinearViT
    torch.manual_seed(0)
    teacher = LinearViT(arch=ARCH, attn_type='softmax', img_size=32, patch_size=8)
    teacher.init_weights()
    path = tmp_path_factory.mktemp('teacher4') / 'teacher.pth'
    torch.save(teacher.state_dict(), path)
    return path


@pytest.fixture(scope='module')
def students(tmp_path_factory, mini_data_root, teacher4):
    """config and checkpoint of a relu and an mhla student: the teacher's blocks with the
    student's operator (FullCopy), a random head."""
    made = {}
    for attn_type in ('relu', 'mhla'):
        base = tmp_path_factory.mktemp(attn_type)
        config = write_config(base / f'{attn_type}.py', mini_data_root, teacher4, attn_type)
        torch.manual_seed(1)
        model = build(Config.fromfile(str(config)))
        model.init_weights()
        teacher = torch.load(teacher4, weights_only=True)
        own = model.backbone.state_dict()
        model.backbone.load_state_dict({k: v for k, v in teacher.items() if k in own
                                        and v.shape == own[k].shape}, strict=False)
        checkpoint = base / 'student.pth'
        torch.save(dict(state_dict=model.state_dict(), meta={}), checkpoint)
        made[attn_type] = config, checkpoint
    return made


@pytest.mark.parametrize('attn_type', ['relu', 'mhla'])
def test_end_to_end_on_the_mini_set(attn_type, students, tmp_path, capsys):
    config, checkpoint = students[attn_type]
    result = select.main([str(config), str(checkpoint), '--budget', '2', '--batch-size', '16',
                          '--num-images', str(NUM_IMAGES), '--out-dir', str(tmp_path)])
    printed = capsys.readouterr().out
    steps, chosen = result['steps'], result['chosen']
    assert [len(step['softmax']) for step in steps] == [4, 3, 2, 1, 0]
    assert len(chosen['softmax']) == 2 and chosen is steps[2]
    assert result['evaluator'].calls == 1 + 4 + 3 + 2 + 1  # start, then every candidate once
    assert 'Greedy pass (DtR)' in printed and f'Softmax in blocks {chosen["softmax"]}' in printed

    with open(tmp_path / 'blocks.csv', newline='') as f:
        blocks = list(csv.DictReader(f))
    assert sorted(int(row['block']) for row in blocks) == [0, 1, 2, 3]
    assert {row['operator'] for row in blocks} == {attn_type}
    assert blocks[0]['greedy_step'] == '1'  # the cheapest single replacement goes first
    with open(tmp_path / 'greedy.csv', newline='') as f:
        greedy = list(csv.DictReader(f))
    assert [row['softmax_blocks'] for row in greedy][0] == '0 1 2 3'
    assert greedy[-1]['softmax_blocks'] == '' and float(greedy[0]['relmse']) == 0
    assert (tmp_path / 'selection.png').stat().st_size > 0

    # the all-linear end of the pass is the student as it is
    cfg = Config.fromfile(str(config))
    student = build(cfg)
    load_checkpoint(student, str(checkpoint), strict=True, logger='silent')
    student.eval()
    batches, count = validation_batches(cfg, student, NUM_IMAGES, 16, 'cpu')
    assert count == NUM_IMAGES
    with torch.no_grad():
        logits = torch.cat([student(inputs, mode='tensor') for inputs, _ in batches])
    labels = torch.cat([labels for _, labels in batches])
    assert torch.bincount(labels).tolist() == [4] * 6  # spread evenly over the set
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert steps[-1]['score']['loss'] == pytest.approx(loss, rel=1e-5)

    # the written config and checkpoint are the selected hybrid and score as the pass said
    written = Path(result['config'])
    assert written.parent == tmp_path
    assert written.name == f'{attn_type}_softmax-{"-".join(map(str, chosen["softmax"]))}.py'
    hybrid_cfg = Config.fromfile(str(written))
    assert hybrid_cfg.load_from == str(tmp_path / 'hybrid.pth')
    hybrid = build(hybrid_cfg)
    assert hybrid.backbone.attn_types == [
        'softmax' if i in chosen['softmax'] else attn_type for i in range(4)]
    assert hybrid.backbone.with_cls_token == (attn_type == 'relu')
    load_checkpoint(hybrid, hybrid_cfg.load_from, strict=True, logger='silent')
    hybrid.eval()
    with torch.no_grad():
        logits = torch.cat([hybrid(inputs, mode='tensor') for inputs, _ in batches])
    assert torch.nn.functional.cross_entropy(logits, labels).item() == pytest.approx(
        chosen['score']['loss'], rel=1e-5)
    teacher = torch.load(cfg.custom_hooks[0].teacher.init_cfg.checkpoint, weights_only=True)
    block = chosen['softmax'][0]
    assert torch.equal(hybrid.backbone.layers[block].attn.qkv.weight,
                       teacher[f'layers.{block}.attn.qkv.weight'])


def test_a_teacher_of_another_depth_is_refused(students, tmp_path, mini_data_root,
                                               teacher_ckpt, monkeypatch):
    config, checkpoint = students['relu']
    teacher_config = tmp_path / 'teacher2.py'
    teacher_config.write_text(
        "model = dict(type='LinearViT', arch=dict(embed_dims=32, num_layers=2, num_heads=2, "
        "feedforward_channels=64), attn_type='softmax', img_size=32, patch_size=8)\n")
    monkeypatch.setattr(select, 'validation_batches',
                        lambda *args: pytest.fail('the validation set was read'))
    with pytest.raises(ValueError, match=r'the teacher does not fit the student:\n  - the '
                                         r'student has 4 blocks, the teacher 2'):
        select.main([str(config), str(checkpoint), '--teacher-config', str(teacher_config),
                     '--out-dir', str(tmp_path)])


@pytest.mark.parametrize('budget', ['0', '4'])
def test_a_budget_outside_the_blocks_is_refused(students, tmp_path, budget):
    config, checkpoint = students['relu']
    with pytest.raises(ValueError, match=f'--budget {budget}: a hybrid of the 4 blocks keeps '
                                         f'1 to 3 Softmax blocks'):
        select.main([str(config), str(checkpoint), '--budget', budget, '--out-dir',
                     str(tmp_path)])
