"""linvit_mm.analysis.student_teacher: the config, the distillation hook entry, the student
(strictly loaded, with the config's preprocessor) and the teacher (from the hook, another
config or a checkpoint of any accepted layout)."""
import pytest
import torch

from linvit_mm.analysis import (backbone_of, backbone_state_from, build_teacher,
                                find_distill_hook, load_config, load_student,
                                load_teacher_weights)


def test_load_config_merges_options_and_imports(make_student, teacher_ckpt):
    config, _ = make_student('relu', teacher_ckpt)
    cfg = load_config(str(config), {'model.backbone.attn_type': 'elu'})
    assert cfg.model.backbone.attn_type == 'elu'


@pytest.mark.parametrize('hook_type', ['AttentionDistillHook', 'linvit_mm.AttentionDistillHook',
                                       'class'])
def test_find_distill_hook(hook_type):
    from mmengine.config import Config

    from linvit_mm.engine.hooks import AttentionDistillHook
    entry = dict(type=AttentionDistillHook if hook_type == 'class' else hook_type, teacher={})
    cfg = Config(dict(custom_hooks=[dict(type='EMAHook'), entry]))
    assert find_distill_hook(cfg)['type'] is entry['type']
    assert find_distill_hook(Config(dict(custom_hooks=[dict(type='EMAHook')]))) is None
    assert find_distill_hook(Config(dict())) is None


def test_backbone_of(make_student, teacher_ckpt, tiny_vit):
    config, checkpoint = make_student('relu', teacher_ckpt)
    model = load_student(load_config(str(config)), str(checkpoint), 'cpu')
    assert backbone_of(model) is model.backbone
    backbone = tiny_vit()
    assert backbone_of(backbone) is backbone
    with pytest.raises(ValueError, match=r"ImageClassifier has no module 'neck.x'"):
        backbone_of(model, 'neck.x')
    with pytest.raises(ValueError, match=r"'data_preprocessor' \(ClsDataPreprocessor\) has no "
                                         r'ViT blocks'):
        backbone_of(model, 'data_preprocessor')


def test_student_gets_the_config_data_preprocessor(make_student, teacher_ckpt):
    """Images are normalised as in training: the top-level data_preprocessor is used."""
    config, checkpoint = make_student('relu', teacher_ckpt)
    model = load_student(load_config(str(config)), str(checkpoint), 'cpu')
    preprocessor = model.data_preprocessor
    assert preprocessor.mean.flatten().tolist() == pytest.approx([123.675, 116.28, 103.53])
    assert preprocessor.std.flatten().tolist() == pytest.approx([58.395, 57.12, 57.375])
    assert not model.training
    saved = torch.load(checkpoint, weights_only=True)['state_dict']
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_student_checkpoint_must_fit(make_student, teacher_ckpt):
    config, _ = make_student('mhla', teacher_ckpt, name='mhla')
    _, relu_checkpoint = make_student('relu', teacher_ckpt, name='relu')
    with pytest.raises(ValueError, match=r'relu\.pth does not fit the model of the config'):
        load_student(load_config(str(config)), str(relu_checkpoint), 'cpu')


@pytest.mark.parametrize('layout', ['bare', 'run-checkpoint'])
def test_teacher_state_from_own_layouts(tiny_vit, layout):
    source, backbone = tiny_vit(seed=1), tiny_vit(seed=2)
    state = source.state_dict()
    raw = state if layout == 'bare' else dict(
        state_dict={**{f'backbone.{k}': v for k, v in state.items()},
                    'head.layers.head.weight': torch.zeros(6, 32)}, meta={})
    picked = backbone_state_from(raw, backbone, 'file.pth')
    assert set(picked) == set(backbone.state_dict())
    assert all(torch.equal(picked[k], v) for k, v in state.items())


def test_teacher_state_missing_tensors_is_refused(tiny_vit):
    backbone = tiny_vit()
    state = {f'backbone.{k}': v for k, v in backbone.state_dict().items()
             if not k.startswith('layers.1.')}
    with pytest.raises(ValueError, match=r"teacher\.pth: no weights for the teacher's "
                                         r'layers\.1\..* \.\.\. \(12 of 30 tensors missing\)'):
        backbone_state_from(dict(state_dict=state), backbone, 'teacher.pth')


def test_teacher_weights_load_strictly(tiny_vit, tmp_path):
    backbone = tiny_vit(seed=2)
    path = tmp_path / 'teacher.pth'
    torch.save(tiny_vit(seed=1).state_dict(), path)
    load_teacher_weights(backbone, str(path))
    assert torch.equal(backbone.cls_token, tiny_vit(seed=1).cls_token)


def test_teacher_from_the_hook_is_initialised_by_its_init_cfg(make_student, teacher_ckpt):
    config, _ = make_student('relu', teacher_ckpt)
    teacher, source = build_teacher(load_config(str(config)))
    assert source.startswith('AttentionDistillHook teacher of the config, initialised by')
    expected = torch.load(teacher_ckpt, weights_only=True)
    assert all(torch.equal(v, expected[k]) for k, v in teacher.state_dict().items())
    assert not teacher.training


def test_teacher_from_another_config_and_a_run_checkpoint(make_student, teacher_ckpt):
    config, _ = make_student('relu', teacher_ckpt, with_hook=False, name='plain')
    cfg = load_config(str(config))
    with pytest.raises(ValueError, match='no AttentionDistillHook in custom_hooks'):
        build_teacher(cfg)
    teacher_config, teacher_run = make_student('softmax', teacher_ckpt, name='copy')
    teacher, source = build_teacher(cfg, str(teacher_config), str(teacher_run))
    assert source == f'model of {teacher_config}, weights from {teacher_run}'
    assert teacher.attn_type == 'softmax'
    saved = torch.load(teacher_run, weights_only=True)['state_dict']
    key = 'layers.0.attn.qkv.weight'
    assert torch.equal(teacher.state_dict()[key], saved[f'backbone.{key}'])


def test_teacher_checkpoint_in_timm_layout(make_student, teacher_ckpt, tmp_path):
    """A DeiT/timm-layout file is mapped to LinearViT names: the teacher is that timm model."""
    timm = pytest.importorskip('timm')
    torch.manual_seed(1)
    reference = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.,
        num_classes=6).eval()
    path = tmp_path / 'deit_like.pth'
    torch.save({'model': reference.state_dict()}, path)
    config, _ = make_student('relu', teacher_ckpt)
    teacher, source = build_teacher(load_config(str(config)), teacher_checkpoint=str(path))
    assert str(path) in source
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = reference.forward_features(images)[:, 0]
        assert torch.allclose(teacher(images)[0], expected, atol=1e-5)
