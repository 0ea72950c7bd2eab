"""tools/analysis_tools/select_hybrid_blocks.py: the DtR greedy pass against brute force, end
to end on the generated mini ImageNet set with a 4-block model, and its refusals."""
import csv
import importlib.util
from itertools import combinations
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import load_checkpoint

import linvit_mm.engine  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
ARCH = dict(embed_dims=32, num_layers=4, num_heads=2, feedforward_channels=64)
NUM_IMAGES = 24  # of the 48 of the mini validation set, 4 of each class


def load_tool():
    path = REPO / 'tools' / 'analysis_tools' / 'select_hybrid_blocks.py'
    spec = importlib.util.spec_from_file_location('select_hybrid_blocks', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


select = load_tool()


# ------------------------------------------------------------------ the greedy pass alone
def additive(weights):
    """Scores whose loss is the sum of the weights of the blocks made linear: removing a
    block costs its weight whatever else was removed, so the greedy pass (lightest block
    first) is provably optimal for every budget."""
    return lambda softmax: dict(loss=sum(w for i, w in enumerate(weights) if i not in softmax))


@pytest.mark.parametrize('weights', [(3., 1., 4., 1.5), (0.2, 5., 0.1, 2.), (1., 1., 1., 1.)],
                         ids=['a', 'b', 'ties'])
def test_greedy_pass_equals_brute_force_where_greedy_is_optimal(weights):
    evaluate, cost = additive(weights), select.cost_key('loss')
    steps = select.greedy_replace(range(4), evaluate, cost, budget=0)
    assert [len(step['softmax']) for step in steps] == [4, 3, 2, 1, 0]
    for step in steps:
        size = len(step['softmax'])
        best_cost, best = select.best_subsets(range(4), evaluate, cost, size)[0]
        assert cost(step['score']) == best_cost
        if len(set(weights)) == len(weights):  # a unique optimum: the same blocks
            assert tuple(step['softmax']) == best
    # ties go to the lower block index
    if weights == (1., 1., 1., 1.):
        assert [step['replaced'] for step in steps[1:]] == [0, 1, 2, 3]


def test_greedy_pass_stops_at_the_budget_and_refuses_impossible_ones():
    steps = select.greedy_replace(range(4), additive((3., 1., 4., 1.5)),
                                  select.cost_key('loss'), budget=2)
    assert steps[-1]['softmax'] == [0, 2] and len(steps) == 3
    with pytest.raises(ValueError, match='budget 5 is outside 0..4'):
        select.greedy_replace(range(4), additive((1, 1, 1, 1)), select.cost_key('loss'), 5)


def test_criteria():
    score = dict(loss=.5, accuracy=80., relmse=.01)
    assert select.cost_key('loss')(score) == (.5, )
    assert select.cost_key('accuracy')(score) == (-80., .5)
    assert select.cost_key('fidelity')(score) == (.01, )
    with pytest.raises(ValueError, match="unknown criterion 'speed'"):
        select.cost_key('speed')


# ------------------------------------------------------------------ the tool
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
    batches, count = select.validation_batches(cfg, student, NUM_IMAGES, 16, 'cpu')
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


def test_every_step_keeps_the_replacement_that_hurts_least(students, mini_data_root):
    """The greedy invariant, checked at each step with fresh evaluations of every candidate
    (the real model and scores: greedy is not provably optimal here)."""
    config, checkpoint = students['relu']
    cfg = Config.fromfile(str(config))
    model = select.fidelity.load_student(cfg, str(checkpoint), 'cpu')
    teacher, _ = select.fidelity.build_teacher(cfg)
    batches, _ = select.validation_batches(cfg, model, NUM_IMAGES, 16, 'cpu')
    swap = select.AttentionSwap(model.backbone, teacher)
    cost = select.cost_key('loss')
    steps = select.greedy_replace(range(4), select.Evaluator(model, swap, batches), cost)
    for before, after in zip(steps, steps[1:]):
        fresh = select.Evaluator(model, swap, batches)
        candidates = {block: cost(fresh(set(before['softmax']) - {block}))
                      for block in before['softmax']}
        assert after['replaced'] == min(candidates, key=lambda b: (candidates[b], b))
        assert set(after['softmax']) == set(before['softmax']) - {after['replaced']}
    # all-Softmax is the teacher with the student's stem, MLPs and head: no fidelity loss
    assert steps[0]['score']['relmse'] == 0 and steps[0]['score']['cos'] == pytest.approx(1)
    assert [layer.attn.attn_type for layer in model.backbone.layers] == ['relu'] * 4


def test_a_teacher_of_another_depth_is_refused(students, tmp_path, mini_data_root,
                                               teacher_ckpt, monkeypatch):
    config, checkpoint = students['relu']
    teacher_config = tmp_path / 'teacher2.py'
    teacher_config.write_text(
        "model = dict(type='LinearViT', arch=dict(embed_dims=32, num_layers=2, num_heads=2, "
        "feedforward_channels=64), attn_type='softmax', img_size=32, patch_size=8)\n")
    monkeypatch.setattr(select, 'validation_batches',
                        lambda *args: pytest.fail('the validation set was read'))
    with pytest.raises(ValueError, match=r"the teacher has 2 blocks, the student 4: blocks are "
                                         r"swapped one for one"):
        select.main([str(config), str(checkpoint), '--teacher-config', str(teacher_config),
                     '--out-dir', str(tmp_path)])


def test_pairs_that_cannot_be_swapped_are_refused_naming_each_problem():
    from linvit_mm.models import LinearViT
    wide = dict(ARCH, embed_dims=64)
    student = LinearViT(arch=ARCH, attn_type=dict(default='relu', softmax=[2]), img_size=32,
                        patch_size=8)
    teacher = LinearViT(arch=wide, attn_type='elu', img_size=32, patch_size=16)
    with pytest.raises(ValueError) as info:
        select.check_pair(student, teacher)
    message = str(info.value)
    for part in ("the teacher's attention is ['elu'], not Softmax",
                 'the student already has Softmax attention in blocks [2]',
                 'embed_dims differs (student vs teacher: block 0: 32 vs 64',
                 'the student cuts 8-pixel patches, the teacher 16'):
        assert part in message


@pytest.mark.parametrize('budget', ['0', '4'])
def test_a_budget_outside_the_blocks_is_refused(students, tmp_path, budget):
    config, checkpoint = students['relu']
    with pytest.raises(ValueError, match=f'--budget {budget}: a hybrid of the 4 blocks keeps '
                                         f'1 to 3 Softmax blocks'):
        select.main([str(config), str(checkpoint), '--budget', budget, '--out-dir',
                     str(tmp_path)])


def test_brute_force_lists_every_subset():
    ranked = select.best_subsets(range(4), additive((3., 1., 4., 1.5)),
                                 select.cost_key('loss'), 2)
    assert len(ranked) == len(list(combinations(range(4), 2)))
    assert ranked[0][1] == (0, 2)
