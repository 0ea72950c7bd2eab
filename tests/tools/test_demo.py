"""tools/demo.py: the console's view of the tools' logs, the validation-set rule, the recipes'
budgets and stage options (their configs build), the seeds, the mean +- std table, the reuse
of finished stages, and a short end-to-end run of the transfer stage (the full demo takes
minutes; tests/e2e runs the dense stages' configs)."""
import importlib.util
import json
import os
import statistics
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

REPO = Path(__file__).resolve().parents[2]
TRAIN_LINE = ('11/30 14:49:03 - mmengine - INFO - Iter(train) [ 50/1500]  base_lr: 5.0000e-04 '
              'lr: 5.0000e-04  eta: 0:03:12  time: 0.1276  data_time: 0.0031  memory: 0  '
              'grad_norm: 1.2300  loss: 1.7140\n')


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def demo():
    return load_module('linvit_demo', REPO / 'tools' / 'demo.py')


def test_progress_lines_keep_the_eta(demo):
    assert demo.shown_line(TRAIN_LINE) == ('Iter(train) [ 50/1500] lr: 5.0000e-04  eta: 0:03:12  '
                                           'time: 0.1276  memory: 0  loss: 1.7140')


@pytest.mark.parametrize('line', [
    '11/30 14:50:00 - mmengine - INFO - Epoch(val) [1][8/8]    accuracy/top1: 47.9167  '
    'data_time: 0.01  time: 0.02\n',
    '11/30 14:50:00 - mmengine - INFO - Iter(val) [400/400]    aAcc: 71.0  mIoU: 25.46\n',
], ids=['accuracy', 'miou'])
def test_metric_lines_are_shown(demo, line):
    shown = demo.shown_line(line)
    assert shown is not None and 'data_time' not in shown and ' - INFO - ' not in shown


def test_other_lines_are_not_shown(demo):
    assert demo.shown_line('11/30 14:50:00 - mmengine - INFO - Checkpoints will be saved to '
                           '/tmp/x.\n') is None


# ----------------------------------------------------------------------------- the data
def test_one_validation_image_is_at_most_half_a_point(demo):
    maker, params = demo.DEMO_SETS[demo.TRANSFER_SET]
    from linvit_mm.testing.mini_data import CLS_TASKS
    num_val = len(CLS_TASKS[params['task']]) * params['val_per_class']
    assert demo.check_validation_size(num_val) == num_val
    assert demo.points_per_image(num_val) <= 0.5
    assert demo.points_per_image(200) == 0.5
    # the training images stay the few of the default shape-groups set
    assert params['train_per_class'] == 8 and maker == 'make_mini_imagenet'


@pytest.mark.parametrize('num_val', [48, 199])
def test_small_validation_sets_are_refused(demo, num_val):
    with pytest.raises(ValueError, match=rf'{num_val} images .* at least 200 validation'):
        demo.check_validation_size(num_val)


# ----------------------------------------------------------------------------- recipes
@pytest.mark.parametrize('shares,total,expected', [
    ([1], 200, [200]),
    ([1, 3], 200, [50, 150]),
    ([1, 1, 2], 200, [50, 50, 100]),
    ([1, 1, 2], 10, [3, 2, 5]),
    ([1, 1, 2], 3, [1, 1, 1]),
    ([1, 100], 2, [1, 1]),
])
def test_split_budget(demo, shares, total, expected):
    assert demo.split_budget(shares, total) == expected


def test_split_budget_refuses_fewer_steps_than_stages(demo):
    with pytest.raises(ValueError, match='budget of 2 steps .* 3 stages'):
        demo.split_budget([1, 1, 2], 2)


@pytest.mark.parametrize('recipe', ['random', 'staged-1-3', 'staged-1-2-3', 'staged-1-2-3-lora'])
def test_every_recipe_spends_the_same_budget(demo, recipe):
    stages = demo.recipe_stages(recipe, 200)
    assert sum(steps for _, steps in stages) == 200
    assert [stage for stage, _ in stages] == [stage for stage, _ in demo.RECIPES[recipe]]


def test_unknown_recipe_is_named(demo):
    with pytest.raises(ValueError, match="unknown recipe 'staged-2'"):
        demo.recipe_stages('staged-2', 200)


def test_demo_recipes_are_recipes_with_configs(demo):
    assert set(demo.DEMO_RECIPES) <= set(demo.RECIPES)
    for stages in demo.RECIPES.values():
        for stage, _ in stages:
            assert (REPO / 'configs' / 'demo' / demo.CLS_CONFIG.format(stage=stage)).is_file()


def stage_configs(demo, recipe, previous_dir, attn_type='ttt', seed=3, iters=40):
    """Each stage's config of ``recipe`` with the demo's options merged in; a stage continues
    ``previous_dir/<previous stage>.pth``."""
    from mmengine.config import DictAction
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)
    configs, previous = [], None
    for stage, steps in demo.recipe_stages(recipe, iters):
        options = demo.stage_options(stage, steps, attn_type=attn_type, seed=seed,
                                     teacher='/t/teacher.pth', data_root='/d/groups',
                                     previous=previous)
        cfg = Config.fromfile(str(REPO / 'configs' / 'demo' /
                                  demo.CLS_CONFIG.format(stage=stage)))
        cfg.merge_from_dict(parser.parse_args(['--cfg-options', *options]).cfg_options)
        configs.append((stage, steps, cfg))
        previous = str(previous_dir / f'{stage}.pth')
    return configs


@pytest.mark.parametrize('recipe', ['mlpcopy-distill', 'fullcopy', 'staged-1-2-3',
                                    'staged-1-3-lora'])
def test_stage_options_build_each_stage_of_the_recipe(demo, recipe, tmp_path):
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS

    from linvit_mm.testing.staged import write_recorded_checkpoint
    init_default_scope('mmpretrain')
    for index, (stage, steps, cfg) in enumerate(stage_configs(demo, recipe, tmp_path)):
        student = cfg.model.backbone.module if stage in demo.LORA_STAGES else cfg.model.backbone
        assert student.attn_type == 'ttt' and cfg.randomness.seed == 3
        assert cfg.train_cfg.max_iters == steps == cfg.param_scheduler[1].end
        assert cfg.param_scheduler[0].end == cfg.param_scheduler[1].begin == max(1, steps // 10)
        assert cfg.train_dataloader.dataset.data_root == '/d/groups'
        if stage in demo.ALIGN_STAGES:
            assert cfg.val_dataloader is None and cfg.model.teacher.init_cfg.checkpoint == (
                '/t/teacher.pth')
        else:
            assert cfg.val_dataloader.dataset.data_root == '/d/groups'
        if index == 0 and stage not in demo.ALIGN_STAGES:
            assert student.init_cfg.checkpoint == '/t/teacher.pth'
        elif index > 0:  # continues the previous stage's checkpoint
            previous = tmp_path / f'{stages_of(demo, recipe)[index - 1]}.pth'
            assert student.init_cfg.checkpoint == str(previous)
        if stage.endswith('-distill'):
            assert cfg.custom_hooks[0].teacher.init_cfg.checkpoint == '/t/teacher.pth'
        if stage in demo.LORA_STAGES:  # LoRAModel loads its module's weights when built
            write_recorded_checkpoint(previous, MODELS.build(student))
        MODELS.build(cfg.model)


def stages_of(demo, recipe):
    return [stage for stage, _ in demo.RECIPES[recipe]]


def test_seeds_differ_only_in_the_seed(demo):
    options = [demo.stage_options('staged-ft', 100, attn_type='relu', seed=seed, teacher='t',
                                  data_root='d', previous='p') for seed in (0, 1)]
    assert set(options[0]) ^ set(options[1]) == {'randomness.seed=0', 'randomness.seed=1'}


def test_stage_options_refuse_a_missing_or_stray_previous_checkpoint(demo):
    with pytest.raises(ValueError, match="'staged-ft' continues the previous stage"):
        demo.stage_options('staged-ft', 10, attn_type='relu', seed=0, teacher='t',
                           data_root='d')
    with pytest.raises(ValueError, match="'mlpcopy' starts from the teacher .* 'p'"):
        demo.stage_options('mlpcopy', 10, attn_type='relu', seed=0, teacher='t', data_root='d',
                           previous='p')


# ----------------------------------------------------------------------------- results
def test_summary_is_mean_and_sample_std_over_seeds(demo):
    top1 = {'a': {0: 40.0, 1: 50.0, 2: 60.0}, 'b': {0: 33.0, 1: 35.0, 2: 34.0}, 'c': {7: 70.0}}
    summary = demo.summarise(top1)
    assert summary['a'] == dict(mean=50.0, std=10.0, min=40.0, max=60.0, n=3)
    assert summary['b']['mean'] == pytest.approx(34.0)
    assert summary['b']['std'] == pytest.approx(statistics.stdev([33.0, 35.0, 34.0])) == 1.0
    assert summary['c'] == dict(mean=70.0, std=None, min=70.0, max=70.0, n=1)
    assert demo.format_mean_std(summary['a']) == '50.0 +- 10.0'
    assert demo.format_mean_std(summary['c']) == '70.0 +- -'
    with pytest.raises(ValueError, match="'d' has no results"):
        demo.summarise({'d': {}})


def test_table_shows_mean_std_and_each_seed(demo):
    top1 = {'random': {0: 40.0, 1: 50.0}, 'staged-1-2-3': {0: 61.25, 1: 62.75}}
    table = demo.transfer_table(top1, demo.summarise(top1)).splitlines()
    assert table[0].split() == ['recipe', 'mean', '+-', 'std', 'seed', '0', 'seed', '1']
    assert table[1].split() == ['random', '45.00', '+-', '7.07', '40.00', '50.00']
    assert table[2].split() == ['staged-1-2-3', '62.00', '+-', '1.06', '61.25', '62.75']


def test_bar_chart_is_written(demo, tmp_path):
    top1 = {'random': {0: 40.0, 1: 50.0}, 'copy': {0: 45.0, 1: 47.0}}
    path = tmp_path / 'chart.png'
    demo.bar_chart(top1, demo.summarise(top1), 'relu', 70.0, 210, str(path))
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


# ----------------------------------------------------------------------------- reuse
class FakeTrain:
    """Stands in for ``tools/train.py``: writes the checkpoint and prints a validation."""

    def __init__(self):
        self.calls = 0

    def __call__(self, args, log_path, show=True, threads=None):
        self.calls += 1
        work_dir = Path(args[args.index('--work-dir') + 1])
        checkpoint = work_dir / 'iter_1.pth'
        checkpoint.write_bytes(b'weights')
        (work_dir / 'last_checkpoint').write_text(str(checkpoint))
        return f'Epoch(val) [1][4/4]    accuracy/top1: {40.0 + self.calls}\n'


def test_finished_stage_is_reused_only_with_the_same_options(demo, monkeypatch, tmp_path):
    fake = FakeTrain()
    monkeypatch.setattr(demo, 'run_tool', fake)
    config = demo.CLS_CONFIG.format(stage='mlpcopy')
    first = demo.train(config, str(tmp_path), ['a=1'], False, metric_name='accuracy/top1')
    assert first[:2] == (str(tmp_path / 'iter_1.pth'), 41.0) and fake.calls == 1
    assert not first.reused
    assert demo.train(config, str(tmp_path), ['a=1'], False,
                      metric_name='accuracy/top1') == first._replace(reused=True)
    assert fake.calls == 1
    assert demo.train(config, str(tmp_path), ['a=2'], False,
                      metric_name='accuracy/top1')[1] == 42.0
    assert demo.train(config, str(tmp_path), ['a=2'], True,
                      metric_name='accuracy/top1')[1] == 43.0
    (tmp_path / 'iter_1.pth').unlink()  # a record without its checkpoint is run again
    assert demo.train(config, str(tmp_path), ['a=2'], False,
                      metric_name='accuracy/top1')[1] == 44.0
    # an earlier stage's checkpoint written again (same path, new weights): run again
    previous = tmp_path / 'previous.pth'
    previous.write_bytes(b'old')
    options = [f'model.backbone.init_cfg.checkpoint={previous}']
    assert demo.train(config, str(tmp_path), options, False).reused is False
    assert demo.train(config, str(tmp_path), options, False).reused is True
    os.utime(previous, (previous.stat().st_atime, previous.stat().st_mtime + 10))
    assert demo.train(config, str(tmp_path), options, False).reused is False
    assert fake.calls == 6


@pytest.mark.parametrize('argv,message', [
    (['--seeds', '0', '0'], 'distinct'),
    (['--seeds', '-1'], 'non-negative'),
    (['--recipes', 'copy', 'copy'], 'twice'),
    (['--transfer-iters', '2', '--recipes', 'staged-1-2-3'], 'each of the 3 stages'),
    (['--jobs', '0'], '--jobs must be >= 1'),
])
def test_bad_arguments_are_refused(demo, argv, message, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(argv)
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- end to end
def test_transfer_stage_end_to_end(demo, monkeypatch, tmp_path, in_process_run_tool):
    """A staged recipe (alignment, then fine-tuning on its checkpoint) x two seeds, a few steps
    each: per-seed results, their summary, table and chart, and seeds that train different
    weights."""
    from linvit_mm.utils.checkpoint import load_checkpoint_file
    monkeypatch.setattr(demo, 'run_tool', in_process_run_tool)
    name, (maker, params) = demo.TEACHER_SET, demo.DEMO_SETS[demo.TEACHER_SET]
    monkeypatch.setitem(demo.DEMO_SETS, name, (maker, dict(params, train_per_class=4,
                                                           val_per_class=2)))
    summary = demo.main(['--recipes', 'staged-1-3', '--seeds', '0', '1', '--teacher-iters', '2',
                         '--transfer-iters', '4', '--jobs', '1', '--skip-dense', '--work-dir',
                         str(tmp_path / 'work'), '--data-root', str(tmp_path / 'data')])
    assert summary['transfer_val_images'] == 210
    result = summary['transfer_top1']['staged-1-3']
    values = [result['seeds'][0], result['seeds'][1]]
    assert result['n'] == 2 and result['mean'] == pytest.approx(statistics.mean(values))
    assert result['std'] == pytest.approx(statistics.stdev(values))
    assert result['stages'] == [('align-attn', 1), ('staged-ft', 3)]
    work = tmp_path / 'work'
    written = json.loads((work / 'summary.json').read_text())
    assert written['transfer_top1']['staged-1-3']['seeds'] == {'0': values[0], '1': values[1]}
    assert (work / 'transfer_accuracy.png').is_file()
    heads = [load_checkpoint_file(str(work / 'relu' / 'staged-1-3' / f'seed{seed}' / 'staged-ft' /
                                      'iter_3.pth'))['state_dict']['head.layers.head.weight']
             for seed in (0, 1)]
    assert not torch.equal(*heads)
