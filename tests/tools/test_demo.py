"""tools/demo.py: the console's view of the tools' logs, the validation-set rule, the recipes'
budgets and stage options (their configs build), the seeds, the mean +- std table, the reuse
of finished stages, and a short end-to-end run of the transfer stage (the full demo takes
minutes; tests/e2e runs the dense stages' configs)."""
import copy
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
    config = tmp_path / 'configs' / demo.CLS_CONFIG.format(stage='mlpcopy')
    config.parent.mkdir()
    config.write_text((REPO / 'configs' / 'demo' / config.name).read_text())
    config = str(config)
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
    # the config itself changed (a source's config written again): run again
    os.utime(config, (os.stat(config).st_atime, os.stat(config).st_mtime + 10))
    assert demo.train(config, str(tmp_path), options, False).reused is False
    assert demo.train(config, str(tmp_path), options, False).reused is True
    assert fake.calls == 7


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


def test_source_defaults_and_work_dirs(demo):
    assert demo.parse_args([]).source == 'vit'
    assert demo.parse_args([]).work_dir == str(REPO / 'work_dirs' / 'demo')
    assert demo.parse_args(['--source', 'dinov2']).work_dir == str(
        REPO / 'work_dirs' / 'demo_dinov2')
    assert demo.parse_args(['--source', 'dinov2', '--work-dir', 'w']).work_dir == 'w'


# ----------------------------------------------------------------------------- sources
MINI_SIZES = dict(embed_dims=96, num_layers=4, num_heads=3, feedforward_channels=384)


def test_dinov2_source_arch_is_the_dinov2_word_at_the_demo_sizes(demo):
    from linvit_mm.models import LinearViT
    arch = demo.source_arch(dict(MINI_SIZES), 'dinov2')
    assert arch == dict(LinearViT.arch_zoo['dinov2-reg-small'], **MINI_SIZES)
    assert (arch['patch_size'], arch['num_register_tokens'], arch['layer_scale_init_value'],
            arch['no_embed_class']) == (14, 4, 1e-5, True)


def test_vit_source_runs_configs_demo_as_they_are(demo, tmp_path):
    configs = demo.DemoConfigs('vit', str(tmp_path))
    assert configs.path(demo.TEACHER_CONFIG) == str(REPO / 'configs' / 'demo' /
                                                    demo.TEACHER_CONFIG)
    assert list(tmp_path.iterdir()) == []


def test_unknown_source_and_missing_config_dir_are_refused(demo):
    with pytest.raises(ValueError, match="unknown source 'dinov3'; sources: vit, dinov2"):
        demo.DemoConfigs('dinov3', '/c')
    with pytest.raises(ValueError, match="'dinov2' source writes its configs"):
        demo.DemoConfigs('dinov2')


def test_a_config_without_a_vit_is_refused(demo, tmp_path):
    path = tmp_path / 'resnet.py'
    path.write_text("model = dict(type='ImageClassifier', backbone=dict(type='ResNet'))\n")
    cfg = Config.fromfile(str(path))
    with pytest.raises(ValueError, match="resnet.py has no LinearViT .* 'dinov2' shape"):
        demo.reshape_for_source(cfg, 'dinov2')


def vits_of(node, found=None):
    """Every dict of a config that is, or holds as ``vit``, a LinearViT's arguments."""
    found = [] if found is None else found
    if isinstance(node, dict):
        kind = str(node.get('type')).split('.')[-1]  # with or without a scope
        if kind == 'LinearViT':
            found.append(node)
        elif kind == 'LinearViTAdapter':
            found.append(node['vit'])
        for value in node.values():
            vits_of(value, found)
    elif isinstance(node, (list, tuple)):
        for value in node:
            vits_of(value, found)
    return found


def assert_dinov2_shaped(demo, cfg):
    arch = dict(demo.source_arch(dict(MINI_SIZES), 'dinov2'))
    vits = vits_of(cfg.to_dict()['model']) + vits_of(cfg.to_dict().get('custom_hooks', []))
    assert vits
    for vit in vits:
        assert vit['arch'] == arch and vit['img_size'] == 112 and 'patch_size' not in vit


@pytest.mark.parametrize('stage', ['teacher', 'fullcopy-distill', 'align-attn', 'align-feat',
                                   'staged-lora'])
def test_dinov2_configs_are_written_and_build(demo, stage, tmp_path):
    """The written config reads back as the reshaped one, every ViT in it (student,
    distillation or alignment teacher, LoRA module) has the DINOv2 switches at the demo's
    sizes, the classification pipelines give 112 px images, and the model builds and runs on
    them: 8 x 8 patches of 14 pixels, 4 registers, LayerScale."""
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS
    name = demo.TEACHER_CONFIG if stage == 'teacher' else demo.CLS_CONFIG.format(stage=stage)
    path = demo.DemoConfigs('dinov2', str(tmp_path)).path(name)
    assert path == str(tmp_path / name)
    cfg = Config.fromfile(path)
    expected = Config.fromfile(str(REPO / 'configs' / 'demo' / name))
    demo.reshape_for_source(expected, 'dinov2')
    assert cfg.to_dict() == expected.to_dict()
    assert_dinov2_shaped(demo, cfg)
    train_steps = [step['type'] for step in cfg.train_dataloader.dataset.pipeline]
    assert cfg.train_dataloader.dataset.pipeline[train_steps.index('RandomResizedCrop')][
        'scale'] == 112
    if cfg.val_dataloader is not None:
        assert cfg.val_dataloader.dataset.pipeline[1] == dict(type='Resize', scale=(112, 112))
    init_default_scope('mmpretrain')
    model_cfg = cfg.model
    if stage == 'staged-lora':  # LoRAModel loads its module's checkpoint when built
        model_cfg = copy.deepcopy(cfg.model)
        model_cfg.backbone.module.init_cfg = None
    model = MODELS.build(model_cfg)
    vit = model.backbone.module if stage == 'staged-lora' else model.backbone
    assert (vit.patch_size, vit.num_register_tokens, vit.patch_resolution) == (14, 4, (8, 8))
    assert vit.layers[0].attn.gamma1.weight.shape == (96, )
    out = vit(torch.rand(2, 3, 112, 112))
    assert out[-1].shape[0] == 2


def test_configs_are_read_one_thread_at_a_time(demo, monkeypatch, tmp_path):
    """The transfer runs' threads read configs (warm-ups, written sources) through mmengine's
    Config.fromfile, which fails under concurrent calls: every read holds the demo's lock."""
    from mmengine.config import Config as MMConfig
    original = MMConfig.fromfile
    reads = []

    def locked_fromfile(*args, **kwargs):
        reads.append(demo._config_lock.locked())
        return original(*args, **kwargs)

    monkeypatch.setattr(MMConfig, 'fromfile', staticmethod(locked_fromfile))
    demo.config_warmup.cache_clear()
    demo.config_warmup(demo.CLS_CONFIG.format(stage='copy'))
    demo.DemoConfigs('dinov2', str(tmp_path)).path(demo.CLS_CONFIG.format(stage='copy'))
    assert reads == [True, True]


def test_dinov2_configs_are_rewritten_only_when_they_change(demo, tmp_path):
    configs = demo.DemoConfigs('dinov2', str(tmp_path))
    path = Path(configs.path(demo.TEACHER_CONFIG))
    os.utime(path, (0, 0))
    assert configs.path(demo.TEACHER_CONFIG) == str(path) and path.stat().st_mtime == 0
    path.write_text(path.read_text() + '# edited\n')
    configs.path(demo.TEACHER_CONFIG)
    assert '# edited' not in path.read_text() and path.stat().st_mtime > 0


def test_dinov2_student_copies_the_dinov2_teacher(demo, tmp_path):
    """SoftmaxTransfer reads the demo's DINOv2-shaped teacher checkpoint into the student of
    the written config: registers, LayerScale, position embedding and MLPs copied."""
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS
    init_default_scope('mmpretrain')
    configs = demo.DemoConfigs('dinov2', str(tmp_path))
    teacher = MODELS.build(Config.fromfile(configs.path(demo.TEACHER_CONFIG)).model)
    torch.manual_seed(0)
    for param in teacher.parameters():
        torch.nn.init.normal_(param)
    checkpoint = tmp_path / 'teacher.pth'
    torch.save(dict(state_dict=teacher.state_dict(), meta={}), str(checkpoint))
    cfg = Config.fromfile(configs.path(demo.CLS_CONFIG.format(stage='fullcopy-distill')))
    cfg.model.backbone.init_cfg.checkpoint = str(checkpoint)
    student = MODELS.build(cfg.model)
    student.init_weights()
    expected = teacher.backbone.state_dict()
    copied = student.backbone.state_dict()
    for key in ('register_tokens', 'pos_embed', 'layers.3.ffn.gamma2.weight',
                'layers.0.attn.gamma1.weight', 'layers.2.ffn.layers.0.0.weight'):
        assert torch.equal(copied[key], expected[key]), key
    assert copied['pos_embed'].shape[1] == 64  # the patches' slots only (no_embed_class)


@pytest.mark.parametrize('config', ['DET_CONFIG', 'SEG_CONFIG'])
def test_dinov2_dense_configs_build(demo, config, tmp_path):
    """The adapter's ViT in the written Mask R-CNN and UperNet configs has the DINOv2 shape
    and the backbone gives the four maps at strides 4 to 32 of the dense stage's 128 x 96
    images."""
    from mmengine.registry import init_default_scope
    from mmdet.registry import MODELS as DET_MODELS
    from mmseg.registry import MODELS as SEG_MODELS
    name = getattr(demo, config)
    cfg = Config.fromfile(demo.DemoConfigs('dinov2', str(tmp_path)).path(name))
    assert_dinov2_shaped(demo, cfg)
    scope, registry = ('mmdet', DET_MODELS) if config == 'DET_CONFIG' else ('mmseg', SEG_MODELS)
    init_default_scope(scope)
    backbone_cfg = copy.deepcopy(cfg.model.backbone)
    backbone_cfg.pretrained = None
    backbone = registry.build(backbone_cfg)
    maps = backbone(torch.rand(1, 3, 96, 128))
    assert [tuple(m.shape[-2:]) for m in maps] == [(24, 32), (12, 16), (6, 8), (3, 4)]


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


def test_dinov2_transfer_end_to_end(demo, monkeypatch, tmp_path, in_process_run_tool):
    """--source dinov2 through the classification stages: the teacher and a distilled student
    trained from the configs it writes, both with DINOv2's registers and 14-pixel patches."""
    from linvit_mm.utils.checkpoint import load_checkpoint_file
    monkeypatch.setattr(demo, 'run_tool', in_process_run_tool)
    name, (maker, params) = demo.TEACHER_SET, demo.DEMO_SETS[demo.TEACHER_SET]
    monkeypatch.setitem(demo.DEMO_SETS, name, (maker, dict(params, train_per_class=4,
                                                           val_per_class=2)))
    work = tmp_path / 'work'
    summary = demo.main(['--source', 'dinov2', '--recipes', 'fullcopy-distill', '--seeds', '0',
                         '--teacher-iters', '2', '--transfer-iters', '2', '--jobs', '1',
                         '--skip-dense', '--work-dir', str(work), '--data-root',
                         str(tmp_path / 'data')])
    assert summary['source'] == 'dinov2'
    assert summary['transfer_top1']['fullcopy-distill']['n'] == 1
    assert (work / 'configs' / demo.TEACHER_CONFIG).is_file()
    for checkpoint in (work / 'teacher' / 'iter_2.pth',
                       work / 'relu' / 'fullcopy-distill' / 'seed0' / 'fullcopy-distill' /
                       'iter_2.pth'):
        state = load_checkpoint_file(str(checkpoint))['state_dict']
        assert state['backbone.register_tokens'].shape == (1, 4, 96)
        assert state['backbone.patch_embed.projection.weight'].shape[-2:] == (14, 14)
        assert state['backbone.pos_embed'].shape == (1, 64, 96)
