"""linvit_mm.staged.recipes: the validation-set rule, the recipes' budgets and stage options
(their configs build), the seeds and the mean +- std over them."""
import re
import statistics
from pathlib import Path

import pytest
from mmengine.config import Config

from linvit_mm.staged import recipes as demo_recipes

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the data
def test_one_validation_image_is_at_most_half_a_point():
    maker, params = demo_recipes.DEMO_SETS[demo_recipes.TRANSFER_SET]
    from linvit_mm.testing.mini_data import CLS_TASKS
    num_val = len(CLS_TASKS[params['task']]) * params['val_per_class']
    assert demo_recipes.check_validation_size(num_val) == num_val
    assert demo_recipes.points_per_image(num_val) <= 0.5
    assert demo_recipes.points_per_image(200) == 0.5
    assert demo_recipes.check_validation_size(200) == 200  # half a point is allowed
    # the training images stay the few of the default shape-groups set
    assert params['train_per_class'] == 8 and maker == 'make_mini_imagenet'


@pytest.mark.parametrize('num_val', [48, 199])
def test_small_validation_sets_are_refused(num_val):
    with pytest.raises(ValueError, match=rf'{num_val} images .* at least 200 validation'):
        demo_recipes.check_validation_size(num_val)


# ----------------------------------------------------------------------------- recipes
@pytest.mark.parametrize('shares,total,expected', [
    ([1], 200, [200]),
    ([1, 3], 200, [50, 150]),
    ([1, 1, 2], 200, [50, 50, 100]),
    ([1, 1, 2], 10, [3, 2, 5]),
    ([1, 1, 2], 3, [1, 1, 1]),
    ([1, 100], 2, [1, 1]),
])
def test_split_budget(shares, total, expected):
    assert demo_recipes.split_budget(shares, total) == expected


def test_split_budget_refuses_fewer_steps_than_stages():
    with pytest.raises(ValueError, match='budget of 2 steps .* 3 stages'):
        demo_recipes.split_budget([1, 1, 2], 2)


@pytest.mark.parametrize('recipe', ['random', 'staged-1-3', 'staged-1-2-3', 'staged-1-2-3-lora'])
def test_every_recipe_spends_the_same_budget(recipe):
    stages = demo_recipes.recipe_stages(recipe, 200)
    assert sum(steps for _, steps in stages) == 200
    assert [stage for stage, _ in stages] == [stage for stage, _ in demo_recipes.RECIPES[recipe]]


def test_unknown_recipe_is_named():
    with pytest.raises(ValueError, match="unknown recipe 'staged-2'"):
        demo_recipes.recipe_stages('staged-2', 200)


def test_demo_recipes_are_recipes_with_configs():
    assert set(demo_recipes.DEMO_RECIPES) <= set(demo_recipes.RECIPES)
    for stages in demo_recipes.RECIPES.values():
        for stage, _ in stages:
            config = demo_recipes.CLS_CONFIG.format(stage=stage)
            assert (REPO / 'configs' / 'demo' / config).is_file()


def stage_configs(recipe, previous_dir, attn_type='ttt', seed=3, iters=40):
    """Each stage's config of ``recipe`` with the demo's options merged in; a stage continues
    ``previous_dir/<previous stage>.pth``."""
    from mmengine.config import DictAction
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)
    configs, previous = [], None
    for stage, steps in demo_recipes.recipe_stages(recipe, iters):
        options = demo_recipes.stage_options(stage, steps, attn_type=attn_type, seed=seed,
                                             teacher='/t/teacher.pth', data_root='/d/groups',
                                             previous=previous)
        cfg = Config.fromfile(str(REPO / 'configs' / 'demo' /
                                  demo_recipes.CLS_CONFIG.format(stage=stage)))
        cfg.merge_from_dict(parser.parse_args(['--cfg-options', *options]).cfg_options)
        configs.append((stage, steps, cfg))
        previous = str(previous_dir / f'{stage}.pth')
    return configs


@pytest.mark.parametrize('recipe', ['mlpcopy-distill', 'fullcopy', 'staged-1-2-3',
                                    'staged-1-3-lora'])
def test_stage_options_build_each_stage_of_the_recipe(recipe, tmp_path):
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS

    from linvit_mm.testing.staged import write_recorded_checkpoint
    init_default_scope('mmpretrain')
    for index, (stage, steps, cfg) in enumerate(stage_configs(recipe, tmp_path)):
        student = (cfg.model.backbone.module if stage in demo_recipes.LORA_STAGES else
                   cfg.model.backbone)
        assert student.attn_type == 'ttt' and cfg.randomness.seed == 3
        assert cfg.train_cfg.max_iters == steps == cfg.param_scheduler[1].end
        assert cfg.param_scheduler[0].end == cfg.param_scheduler[1].begin == max(1, steps // 10)
        assert cfg.train_dataloader.dataset.data_root == '/d/groups'
        if stage in demo_recipes.ALIGN_STAGES:
            assert cfg.val_dataloader is None and cfg.model.teacher.init_cfg.checkpoint == (
                '/t/teacher.pth')
        else:
            assert cfg.val_dataloader.dataset.data_root == '/d/groups'
        if index == 0 and stage not in demo_recipes.ALIGN_STAGES:
            assert student.init_cfg.checkpoint == '/t/teacher.pth'
        elif index > 0:  # continues the previous stage's checkpoint
            previous = tmp_path / f'{stages_of(recipe)[index - 1]}.pth'
            assert student.init_cfg.checkpoint == str(previous)
        if stage.endswith('-distill'):
            assert cfg.custom_hooks[0].teacher.init_cfg.checkpoint == '/t/teacher.pth'
        if stage in demo_recipes.LORA_STAGES:  # LoRAModel loads its module's weights when built
            write_recorded_checkpoint(previous, MODELS.build(student))
        MODELS.build(cfg.model)


def stages_of(recipe):
    return [stage for stage, _ in demo_recipes.RECIPES[recipe]]


def test_seeds_differ_only_in_the_seed():
    options = [demo_recipes.stage_options('staged-ft', 100, attn_type='relu', seed=seed,
                                          teacher='t', data_root='d', previous='p')
               for seed in (0, 1)]
    assert set(options[0]) ^ set(options[1]) == {'randomness.seed=0', 'randomness.seed=1'}


def test_stage_options_refuse_a_missing_or_stray_previous_checkpoint():
    with pytest.raises(ValueError, match="'staged-ft' continues the previous stage"):
        demo_recipes.stage_options('staged-ft', 10, attn_type='relu', seed=0, teacher='t',
                                   data_root='d')
    with pytest.raises(ValueError, match="'mlpcopy' starts from the teacher .* 'p'"):
        demo_recipes.stage_options('mlpcopy', 10, attn_type='relu', seed=0, teacher='t',
                                   data_root='d', previous='p')


# ----------------------------------------------------------------------------- results
def test_summary_is_mean_and_sample_std_over_seeds():
    top1 = {'a': {0: 40.0, 1: 50.0, 2: 60.0}, 'b': {0: 33.0, 1: 35.0, 2: 34.0}, 'c': {7: 70.0}}
    summary = demo_recipes.summarise(top1)
    assert summary['a'] == dict(mean=50.0, std=10.0, min=40.0, max=60.0, n=3)
    assert summary['b']['mean'] == pytest.approx(34.0)
    assert summary['b']['std'] == pytest.approx(statistics.stdev([33.0, 35.0, 34.0])) == 1.0
    assert summary['c'] == dict(mean=70.0, std=None, min=70.0, max=70.0, n=1)
    assert demo_recipes.format_mean_std(summary['a']) == '50.0 +- 10.0'
    assert demo_recipes.format_mean_std(summary['c']) == '70.0 +- -'
    with pytest.raises(ValueError, match="'d' has no results"):
        demo_recipes.summarise({'d': {}})


def test_the_recipes_split_their_budget_as_the_results_page_says():
    """docs/results/recipes.md gives each recipe's stages at 20 and 60 steps."""
    rows = re.findall(r'^\| `([\w-]+)` \| [^|]* \| ([\d +]+) \| ([\d +]+) \|$',
                      (REPO / 'docs' / 'results' / 'recipes.md').read_text(), re.M)
    assert {recipe for recipe, _, _ in rows} >= {
        recipe for recipe, stages in demo_recipes.RECIPES.items() if len(stages) > 1}
    for recipe, at_20, at_60 in rows:
        for budget, text in ((20, at_20), (60, at_60)):
            steps = [steps for _, steps in demo_recipes.recipe_stages(recipe, budget)]
            assert steps == [int(part) for part in text.split('+')], (recipe, budget)


@pytest.mark.parametrize('shares,total,expected', [
    ([1, 1, 10], 3, [1, 1, 1]), ([1, 10], 2, [1, 1])], ids=['three-stages', 'two-stages'])
def test_a_stage_lifted_to_one_step_takes_it_from_the_largest(shares, total, expected):
    assert demo_recipes.split_budget(shares, total) == expected


def test_the_warm_up_is_the_configs_at_most_a_tenth_and_one_step_at_least():
    config = demo_recipes.TEACHER_CONFIG
    warmup = Config.fromfile(str(REPO / 'configs' / 'demo' / config)).param_scheduler[0]['end']
    long_run = demo_recipes.schedule_options(config, 1000 * warmup)
    assert f'param_scheduler.0.end={warmup}' in long_run
    assert demo_recipes.schedule_options(config, 1) == [
        'train_cfg.max_iters=1', 'train_cfg.val_interval=1', 'default_hooks.checkpoint.interval=1',
        'param_scheduler.0.end=1', 'param_scheduler.1.begin=1', 'param_scheduler.1.end=2']


def test_only_the_transfer_set_must_be_large_enough(monkeypatch, tmp_path):
    tiny = ('make_mini_imagenet', dict(task='shape-groups', train_per_class=1, val_per_class=2))
    monkeypatch.setitem(demo_recipes.DEMO_SETS, demo_recipes.TRANSFER_SET, tiny)
    monkeypatch.setitem(demo_recipes.DEMO_SETS, demo_recipes.TEACHER_SET, tiny)
    summary = demo_recipes.write_demo_set(str(tmp_path), demo_recipes.TEACHER_SET)
    assert summary['splits']['val'] == 6
    with pytest.raises(ValueError, match='a validation set of 6 images'):
        demo_recipes.write_demo_set(str(tmp_path), demo_recipes.TRANSFER_SET)


# ----------------------------------------------------------------------------- dense stage
@pytest.mark.parametrize('pre,rand,verdict', [
    ({0: 30.0, 1: 31.0, 2: 29.5}, {0: 20.0, 1: 29.4, 2: 25.0}, 'pre-trained ahead'),
    ({0: 20.0, 1: 21.0}, {0: 21.5, 1: 30.0}, 'random ahead'),
    # one pair out of order is an overlap, and so is a tie at the edge
    ({0: 30.0, 1: 31.0, 2: 24.0}, {0: 20.0, 1: 29.4, 2: 25.0}, 'overlap'),
    ({0: 30.0, 1: 29.4}, {0: 20.0, 1: 29.4}, 'overlap'),
    ({0: 20.0, 1: 29.4}, {0: 35.0, 1: 29.4}, 'overlap'),
], ids=['pre-trained-ahead', 'random-ahead', 'one-pair-reversed', 'tie', 'tie-the-other-way'])
def test_the_inits_are_compared_by_separation(pre, rand, verdict):
    comparison = demo_recipes.compare_inits({'pre-trained': pre, 'random': rand})
    assert comparison['verdict'] == verdict
    assert comparison['difference'] == pytest.approx(
        statistics.mean(pre.values()) - statistics.mean(rand.values()))
    assert comparison['rows'] == demo_recipes.summarise({'pre-trained': pre, 'random': rand})
    assert comparison['p_separated'] == demo_recipes.p_separated(len(pre), len(rand))


def test_separation_by_chance_is_one_in_the_orderings():
    assert demo_recipes.p_separated(3, 3) == pytest.approx(1 / 20)
    assert demo_recipes.p_separated(2, 3) == pytest.approx(1 / 10)
    assert demo_recipes.p_separated(1, 1) == 0.5


@pytest.mark.parametrize('missing', ['pre-trained', 'random'])
def test_a_comparison_needs_both_inits(missing):
    by_init = {'pre-trained': {0: 1.0}, 'random': {0: 2.0}, missing: {}}
    with pytest.raises(ValueError, match=f'none of: {missing}$'):
        demo_recipes.compare_inits(by_init)


def test_dense_options_of_a_detection_run():
    options = demo_recipes.dense_options('detection', 'adapter', '/d', 5, attn_type='mhla',
                                         checkpoint='/c.pth', seed=2)
    root = f'/d/{demo_recipes.DET_SET}/'
    assert options == [
        'model.backbone.vit.attn_type=mhla', 'model.backbone.pretrained=/c.pth',
        'randomness.seed=2', f'train_dataloader.dataset.data_root={root}',
        f'val_dataloader.dataset.data_root={root}', f'test_dataloader.dataset.data_root={root}',
        f'val_evaluator.ann_file={root}annotations/instances_val2017.json',
        f'test_evaluator.ann_file={root}annotations/instances_val2017.json',
        'train_cfg.max_epochs=5', 'train_cfg.val_interval=5',
        'default_hooks.checkpoint.interval=5']


def test_dense_options_of_a_random_segmentation_run():
    options = demo_recipes.dense_options('segmentation', 'plain', '/d', 40, attn_type='relu',
                                         checkpoint=None, seed=0)
    root = f'/d/{demo_recipes.SEG_SET}'
    # the configs' 20-iteration warm-up, cut to a tenth of a short run, then the poly decay
    assert options == [
        'model.backbone.vit.attn_type=relu', 'model.backbone.pretrained=None',
        'randomness.seed=0', f'train_dataloader.dataset.data_root={root}',
        f'val_dataloader.dataset.data_root={root}', f'test_dataloader.dataset.data_root={root}',
        'train_cfg.max_iters=40', 'train_cfg.val_interval=40',
        'default_hooks.checkpoint.interval=40', 'param_scheduler.0.end=4',
        'param_scheduler.1.begin=4', 'param_scheduler.1.end=40']
    assert demo_recipes.dense_options('segmentation', 'adapter', '/d', 400, attn_type='relu',
                                      checkpoint=None, seed=0)[-3:] == [
        'param_scheduler.0.end=20', 'param_scheduler.1.begin=20', 'param_scheduler.1.end=400']


@pytest.mark.parametrize('task', sorted(demo_recipes.DENSE_TASKS))
def test_each_dense_task_has_a_config_per_neck(task):
    """The plain and adapter configs of a task differ in the backbone only: the same heads,
    data, schedule and ViT."""
    configs = demo_recipes.DENSE_TASKS[task]['configs']
    assert sorted(configs) == sorted(demo_recipes.DENSE_NECKS)
    loaded = {neck: Config.fromfile(str(REPO / 'configs' / 'demo' / name)).to_dict()
              for neck, name in configs.items()}
    plain, adapter = loaded['plain'], loaded['adapter']
    assert plain['model']['backbone']['type'] == 'mmpretrain.LinearViTPlainPyramid'
    assert adapter['model']['backbone']['type'] == 'mmpretrain.LinearViTAdapter'
    assert plain['model']['backbone']['vit'] == adapter['model']['backbone']['vit']
    plain.pop('mini_plain')  # the plain backbone's base variable
    for cfg in (plain, adapter):
        cfg['model'].pop('backbone')
    assert plain == adapter
