"""What both alignment stages inherit from BaseAligner: the configs they take, the teacher
that follows the model's dtype and mode without being one of its modules, the order of
initialisation, and when the teacher's recorded preprocessing is compared."""
import pytest
import torch
from mmpretrain.registry import MODELS

import linvit_mm.models  # noqa: F401
from linvit_mm.testing.staged import teacher_cfg, tiny_vit_cfg, write_softmax_teacher

ALIGNERS = ['AttentionAligner', 'FeatureAligner']
NORMALISE = dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], to_rgb=True)


@pytest.fixture(scope='module')
def teacher_path(tmp_path_factory):
    return write_softmax_teacher(tmp_path_factory.mktemp('base_aligner') / 'teacher.pth')


def build(aligner, teacher_path, **kwargs):
    kwargs.setdefault('data_preprocessor', dict(NORMALISE))
    return MODELS.build(dict(type=aligner, backbone=kwargs.pop('backbone', tiny_vit_cfg('relu')),
                             teacher=kwargs.pop('teacher', teacher_cfg(teacher_path)), **kwargs))


@pytest.mark.parametrize('aligner', ALIGNERS)
@pytest.mark.parametrize('role, field', [(r'backbone \(the student\)', 'backbone'),
                                         ('teacher', 'teacher')])
def test_a_vit_config_without_a_type_is_refused(aligner, role, field, teacher_path):
    cfg = tiny_vit_cfg('relu') if field == 'backbone' else teacher_cfg(teacher_path)
    cfg.pop('type')
    with pytest.raises(TypeError, match=rf'^{role} must be a LinearViT config dict with a type'):
        build(aligner, teacher_path, **{field: cfg})


@pytest.mark.parametrize('aligner', ALIGNERS)
def test_dtype_changes_reach_the_student_and_the_teacher(aligner, teacher_path):
    model = build(aligner, teacher_path).double()
    assert {p.dtype for p in model.backbone.parameters()} == {torch.float64}
    assert {p.dtype for p in model.teacher.parameters()} == {torch.float64}
    assert not any(p is q for p in model.parameters() for q in model.teacher.parameters())


@pytest.mark.parametrize('aligner', ALIGNERS)
def test_the_student_follows_the_mode_and_the_teacher_stays_in_eval(aligner, teacher_path):
    model = build(aligner, teacher_path)
    model.train()
    assert model.backbone.training and not model.teacher.training
    model.teacher.train()  # something else switched it
    model.train()
    assert model.backbone.training and not model.teacher.training
    model.eval()
    assert not model.backbone.training and not model.teacher.training


@pytest.mark.parametrize('aligner', ALIGNERS)
def test_init_weights_initialises_the_teacher_then_the_student(aligner, teacher_path,
                                                             monkeypatch):
    model = build(aligner, teacher_path)
    order = []
    for name, vit in (('teacher', model.teacher), ('student', model.backbone)):
        original = vit.init_weights
        monkeypatch.setattr(vit, 'init_weights',
                            lambda original=original, name=name: (order.append(name),
                                                                  original())[1])
    model.init_weights()
    assert order == ['teacher', 'student']


@pytest.mark.parametrize('aligner', ALIGNERS)
def test_without_preprocessing_of_its_own_nothing_is_compared_with_the_record(
        aligner, teacher_path, tmp_path):
    """No data_preprocessor given: the stage cannot say what it normalises with, so a
    teacher's record is not compared at build (training itself refuses later)."""
    from linvit_mm.engine.strict_load import describe_preprocessing
    from linvit_mm.staged import RECORD_KEY
    checkpoint = torch.load(teacher_path, map_location='cpu', weights_only=False)
    other = MODELS.build(dict(type='ClsDataPreprocessor', mean=[1, 2, 3], std=[4, 5, 6]))
    checkpoint['meta'] = {RECORD_KEY: dict(preprocessing=describe_preprocessing(other))}
    recorded = tmp_path / 'teacher.pth'
    torch.save(checkpoint, recorded)
    model = build(aligner, teacher_path, data_preprocessor=None,
                  teacher=teacher_cfg(recorded))
    model.init_weights()  # nothing to compare
    model = build(aligner, teacher_path, teacher=teacher_cfg(recorded))
    with pytest.raises(ValueError, match='differs from the one the teacher'):
        model.init_weights()


def test_feature_aligner_documented_defaults(teacher_path):
    model = build('FeatureAligner', teacher_path)
    assert (model.features, model.mse_weight, model.cos_weight) == ('final', 1., 0.)
