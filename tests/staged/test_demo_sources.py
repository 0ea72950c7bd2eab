"""linvit_mm.staged.demo_sources: the demo's ViTs in another source's shape (--source dinov2):
the configs written, read one thread at a time, and built."""
import copy
import os
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

from linvit_mm.staged import demo_sources
from linvit_mm.staged import recipes as demo_recipes

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- sources
MINI_SIZES = dict(embed_dims=96, num_layers=4, num_heads=3, feedforward_channels=384)


def test_dinov2_source_arch_is_the_dinov2_word_at_the_demo_sizes():
    from linvit_mm.models import LinearViT
    arch = demo_sources.source_arch(dict(MINI_SIZES), 'dinov2')
    assert arch == dict(LinearViT.arch_zoo['dinov2-reg-small'], **MINI_SIZES)
    assert (arch['patch_size'], arch['num_register_tokens'], arch['layer_scale_init_value'],
            arch['no_embed_class']) == (14, 4, 1e-5, True)


def test_vit_source_runs_configs_demo_as_they_are(tmp_path):
    configs = demo_sources.DemoConfigs('vit', str(tmp_path))
    assert configs.path(demo_recipes.TEACHER_CONFIG) == str(REPO / 'configs' / 'demo' /
                                                            demo_recipes.TEACHER_CONFIG)
    assert list(tmp_path.iterdir()) == []


def test_unknown_source_and_missing_config_dir_are_refused():
    with pytest.raises(ValueError, match="unknown source 'dinov3'; sources: vit, dinov2"):
        demo_sources.DemoConfigs('dinov3', '/c')
    with pytest.raises(ValueError, match="'dinov2' source writes its configs"):
        demo_sources.DemoConfigs('dinov2')


def test_a_config_without_a_vit_is_refused(tmp_path):
    path = tmp_path / 'resnet.py'
    path.write_text("model = dict(type='ImageClassifier', backbone=dict(type='ResNet'))\n")
    cfg = Config.fromfile(str(path))
    with pytest.raises(ValueError, match="resnet.py has no LinearViT .* 'dinov2' shape"):
        demo_sources.reshape_for_source(cfg, 'dinov2')


def vits_of(node, found=None):
    """Every dict of a config that is, or holds as ``vit``, a LinearViT's arguments."""
    found = [] if found is None else found
    if isinstance(node, dict):
        kind = str(node.get('type')).split('.')[-1]  # with or without a scope
        if kind == 'LinearViT':
            found.append(node)
        elif kind in ('LinearViTAdapter', 'LinearViTPlainPyramid'):
            found.append(node['vit'])
        for value in node.values():
            vits_of(value, found)
    elif isinstance(node, (list, tuple)):
        for value in node:
            vits_of(value, found)
    return found


def assert_dinov2_shaped(cfg):
    arch = dict(demo_sources.source_arch(dict(MINI_SIZES), 'dinov2'))
    vits = vits_of(cfg.to_dict()['model']) + vits_of(cfg.to_dict().get('custom_hooks', []))
    assert vits
    for vit in vits:
        assert vit['arch'] == arch and vit['img_size'] == 112 and 'patch_size' not in vit


@pytest.mark.parametrize('stage', ['teacher', 'fullcopy-distill', 'align-attn', 'align-feat',
                                   'staged-lora'])
def test_dinov2_configs_are_written_and_build(stage, tmp_path):
    """The written config reads back as the reshaped one, every ViT in it (student,
    distillation or alignment teacher, LoRA module) has the DINOv2 switches at the demo's
    sizes, the classification pipelines give 112 px images, and the model builds and runs on
    them: 8 x 8 patches of 14 pixels, 4 registers, LayerScale."""
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS
    name = (demo_recipes.TEACHER_CONFIG if stage == 'teacher' else
            demo_recipes.CLS_CONFIG.format(stage=stage))
    path = demo_sources.DemoConfigs('dinov2', str(tmp_path)).path(name)
    assert path == str(tmp_path / name)
    cfg = Config.fromfile(path)
    expected = Config.fromfile(str(REPO / 'configs' / 'demo' / name))
    demo_sources.reshape_for_source(expected, 'dinov2')
    assert cfg.to_dict() == expected.to_dict()
    assert_dinov2_shaped(cfg)
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


def test_configs_are_read_one_thread_at_a_time(monkeypatch, tmp_path):
    """The transfer runs' threads read configs (warm-ups, written sources) through mmengine's
    Config.fromfile, which fails under concurrent calls: every read holds the demo's lock."""
    from mmengine.config import Config as MMConfig
    original = MMConfig.fromfile
    reads = []

    def locked_fromfile(*args, **kwargs):
        reads.append(demo_recipes.CONFIG_LOCK.locked())
        return original(*args, **kwargs)

    monkeypatch.setattr(MMConfig, 'fromfile', staticmethod(locked_fromfile))
    demo_recipes.config_warmup.cache_clear()
    demo_recipes.config_warmup(demo_recipes.CLS_CONFIG.format(stage='copy'))
    demo_sources.DemoConfigs('dinov2', str(tmp_path)).path(
        demo_recipes.CLS_CONFIG.format(stage='copy'))
    assert reads == [True, True]


def test_dinov2_configs_are_rewritten_only_when_they_change(tmp_path):
    configs = demo_sources.DemoConfigs('dinov2', str(tmp_path))
    path = Path(configs.path(demo_recipes.TEACHER_CONFIG))
    os.utime(path, (0, 0))
    assert configs.path(demo_recipes.TEACHER_CONFIG) == str(path) and path.stat().st_mtime == 0
    path.write_text(path.read_text() + '# edited\n')
    configs.path(demo_recipes.TEACHER_CONFIG)
    assert '# edited' not in path.read_text() and path.stat().st_mtime > 0


def test_dinov2_student_copies_the_dinov2_teacher(tmp_path):
    """SoftmaxTransfer reads the demo's DINOv2-shaped teacher checkpoint into the student of
    the written config: registers, LayerScale, position embedding and MLPs copied."""
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS
    init_default_scope('mmpretrain')
    configs = demo_sources.DemoConfigs('dinov2', str(tmp_path))
    teacher = MODELS.build(Config.fromfile(configs.path(demo_recipes.TEACHER_CONFIG)).model)
    torch.manual_seed(0)
    for param in teacher.parameters():
        torch.nn.init.normal_(param)
    checkpoint = tmp_path / 'teacher.pth'
    torch.save(dict(state_dict=teacher.state_dict(), meta={}), str(checkpoint))
    cfg = Config.fromfile(configs.path(demo_recipes.CLS_CONFIG.format(stage='fullcopy-distill')))
    cfg.model.backbone.init_cfg.checkpoint = str(checkpoint)
    student = MODELS.build(cfg.model)
    student.init_weights()
    expected = teacher.backbone.state_dict()
    copied = student.backbone.state_dict()
    for key in ('register_tokens', 'pos_embed', 'layers.3.ffn.gamma2.weight',
                'layers.0.attn.gamma1.weight', 'layers.2.ffn.layers.0.0.weight'):
        assert torch.equal(copied[key], expected[key]), key
    assert copied['pos_embed'].shape[1] == 64  # the patches' slots only (no_embed_class)


@pytest.mark.parametrize('task,neck', [(task, neck) for task in demo_recipes.DENSE_TASKS
                                       for neck in demo_recipes.DENSE_NECKS])
def test_dinov2_dense_configs_build(task, neck, tmp_path):
    """The ViT of the written Mask R-CNN and UperNet configs, plain pyramid and adapter, has
    the DINOv2 shape and the backbone gives the four maps at strides 4 to 32 of the dense
    stage's 128 x 96 images."""
    from mmengine.registry import init_default_scope
    from mmdet.registry import MODELS as DET_MODELS
    from mmseg.registry import MODELS as SEG_MODELS
    name = demo_recipes.DENSE_TASKS[task]['configs'][neck]
    cfg = Config.fromfile(demo_sources.DemoConfigs('dinov2', str(tmp_path)).path(name))
    assert_dinov2_shaped(cfg)
    scope, registry = ('mmdet', DET_MODELS) if task == 'detection' else ('mmseg', SEG_MODELS)
    init_default_scope(scope)
    backbone_cfg = copy.deepcopy(cfg.model.backbone)
    backbone_cfg.pretrained = None
    backbone = registry.build(backbone_cfg)
    maps = backbone(torch.rand(1, 3, 96, 128))
    assert [tuple(m.shape[-2:]) for m in maps] == [(24, 32), (12, 16), (6, 8), (3, 4)]


# ------------------------------------------------------------- what a reshape touches

def _vit():
    return dict(type='LinearViT', arch=dict(MINI_SIZES), attn_type='relu')


def test_every_vit_is_reshaped_once_wherever_it_sits():
    cfg = Config(dict(
        model=dict(type='ImageClassifier', backbone=_vit()),
        teachers=[dict(type='Other'), _vit()],
        wrapper=dict(type='Wrapper', vit=_vit()),  # holds a ViT, is no adapter
        neck=dict(type='LinearViTAdapter', vit=dict(arch=dict(MINI_SIZES))),
        pyramid=dict(type='mmpretrain.LinearViTPlainPyramid', vit=dict(arch=dict(MINI_SIZES)))))
    assert demo_sources.reshape_for_source(cfg, 'dinov2') == [
        'model.backbone', 'teachers[1]', 'wrapper.vit', 'neck.vit', 'pyramid.vit']
    for vit in (cfg.model.backbone, cfg.teachers[1], cfg.wrapper.vit, cfg.neck.vit,
                cfg.pyramid.vit):
        assert vit.arch['patch_size'] == 14 and vit.img_size == 112


@pytest.mark.parametrize('pipeline,expected', [
    ([dict(type='LoadImageFromFile'), dict(type='RandomResizedCrop', scale=64),
      dict(type='PackInputs')],
     [dict(type='LoadImageFromFile'), dict(type='RandomResizedCrop', scale=112),
      dict(type='PackInputs')]),
    ([dict(type='Flip'), dict(type='LoadImageFromFile'), dict(type='PackInputs')],
     [dict(type='Flip'), dict(type='LoadImageFromFile'), dict(type='Resize', scale=(112, 112)),
      dict(type='PackInputs')]),
], ids=['random-resized-crop', 'no-resize'])
def test_a_classification_pipeline_is_sized_for_the_source(pipeline, expected):
    demo_sources._resize_classification_pipeline(pipeline, 112)
    assert pipeline == expected


@pytest.mark.parametrize('step', ['Resize', 'CenterCrop'])
def test_a_pipeline_that_sizes_its_images_otherwise_is_refused(step):
    pipeline = [dict(type='LoadImageFromFile'), dict(type=step), dict(type='PackInputs')]
    with pytest.raises(ValueError, match=f'a classification pipeline with {step} cannot be '
                                         'resized'):
        demo_sources._resize_classification_pipeline(pipeline, 112)


def test_the_config_dir_is_made_when_missing(tmp_path):
    configs = demo_sources.DemoConfigs('dinov2', str(tmp_path / 'not' / 'yet'))
    assert Path(configs.path(demo_recipes.TEACHER_CONFIG)).is_file()
