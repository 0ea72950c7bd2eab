"""The alignment models preprocess as the teacher did, or refuse: a stage config that replaces
the model (``_delete_=True``) of a base that keeps the data_preprocessor inside ``model``."""
import textwrap

import pytest
from mmengine.config import Config
from mmengine.runner import Runner
from mmpretrain.registry import MODELS

import linvit_mm.engine  # noqa: F401  (StagedRecordHook)
from linvit_mm.testing.staged import teacher_cfg, tiny_vit_cfg, write_softmax_teacher

NORMALISE = dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], to_rgb=True)
ALIGNERS = ['AttentionAligner', 'FeatureAligner']


@pytest.fixture(scope='module')
def teacher_path(tmp_path_factory):
    return write_softmax_teacher(tmp_path_factory.mktemp('preproc_teacher') / 'teacher.pth')


def write_configs(folder, data_root, teacher, aligner, top_level):
    """A classifier base with its preprocessor inside ``model`` (as mmpretrain's are) and a
    stage config over it; ``top_level`` adds the preprocessor at the stage's top level."""
    (folder / 'base.py').write_text(textwrap.dedent(f"""\
        _base_ = ['mmpretrain::_base_/default_runtime.py']
        model = dict(
            type='ImageClassifier',
            data_preprocessor=dict(num_classes=6, **{NORMALISE!r}),
            backbone={tiny_vit_cfg('relu')!r},
            neck=None,
            head=dict(type='VisionTransformerClsHead', num_classes=6, in_channels=32))
        train_dataloader = dict(
            batch_size=2, num_workers=0, sampler=dict(type='InfiniteSampler', shuffle=False),
            dataset=dict(type='CustomDataset', data_root={str(data_root)!r},
                         ann_file='meta/train.txt', data_prefix='train',
                         pipeline=[dict(type='LoadImageFromFile'),
                                   dict(type='RandomResizedCrop', scale=32),
                                   dict(type='PackInputs')]))
        optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3))
        train_cfg = dict(type='IterBasedTrainLoop', max_iters=1)
        default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1,
                                             by_epoch=False))
        log_processor = dict(by_epoch=False)
        """))
    stage = textwrap.dedent(f"""\
        _base_ = ['./base.py']
        model = dict(_delete_=True, type={aligner!r}, backbone={tiny_vit_cfg('relu')!r},
                     teacher={teacher_cfg(teacher)!r})
        custom_hooks = [dict(type='StagedRecordHook')]
        """)
    if top_level:
        stage += f'data_preprocessor = dict(num_classes=6, **{NORMALISE!r})\n'
    (folder / 'stage.py').write_text(stage)
    return folder / 'stage.py'


@pytest.mark.parametrize('aligner', ALIGNERS)
def test_a_stage_that_dropped_the_bases_preprocessor_is_refused_before_training(
        aligner, teacher_path, mini_data_root, tmp_path):
    config = write_configs(tmp_path, mini_data_root / 'imagenet', teacher_path, aligner,
                           top_level=False)
    cfg = Config.fromfile(str(config))
    assert 'data_preprocessor' not in cfg.model  # what _delete_=True did
    cfg.work_dir = str(tmp_path / 'work')
    runner = Runner.from_cfg(cfg)
    with pytest.raises(ValueError, match=rf'{aligner} was built without a data_preprocessor, '
                       r'so it would align on raw 0-255 pixels.*_delete_=True'):
        runner.train()
    assert not list((tmp_path / 'work').glob('*.pth'))


@pytest.mark.parametrize('aligner', ALIGNERS)
def test_the_same_stage_with_the_teachers_preprocessing_trains(aligner, teacher_path,
                                                               mini_data_root, tmp_path):
    config = write_configs(tmp_path, mini_data_root / 'imagenet', teacher_path, aligner,
                           top_level=True)
    cfg = Config.fromfile(str(config))
    cfg.work_dir = str(tmp_path / 'work')
    runner = Runner.from_cfg(cfg)
    runner.train()
    assert runner.model.data_preprocessor._enable_normalize
    assert runner.model.data_preprocessor.mean.flatten().tolist() == pytest.approx(
        NORMALISE['mean'])
    assert (tmp_path / 'work' / 'iter_1.pth').is_file()


@pytest.mark.parametrize('aligner', ALIGNERS)
def test_a_preprocessor_that_normalises_nothing_is_refused_at_build(aligner, teacher_path):
    with pytest.raises(ValueError, match='normalises nothing.*mean=\\[0, 0, 0\\]'):
        MODELS.build(dict(type=aligner, backbone=tiny_vit_cfg('relu'),
                          teacher=teacher_cfg(teacher_path),
                          data_preprocessor=dict(num_classes=6)))
    # raw pixels on purpose
    model = MODELS.build(dict(type=aligner, backbone=tiny_vit_cfg('relu'),
                              teacher=teacher_cfg(teacher_path),
                              data_preprocessor=dict(mean=[0, 0, 0], std=[1, 1, 1])))
    assert model.preprocessing_given


@pytest.fixture(scope='module')
def recorded_teacher(teacher_path, tmp_path_factory):
    """The teacher with the preprocessing record a tools/train.py run writes."""
    import torch

    from linvit_mm.engine.strict_load import describe_preprocessing
    from linvit_mm.staged import RECORD_KEY
    checkpoint = torch.load(teacher_path, map_location='cpu', weights_only=False)
    preprocessor = MODELS.build(dict(type='ClsDataPreprocessor', **NORMALISE))
    checkpoint['meta'] = {RECORD_KEY: dict(preprocessing=describe_preprocessing(preprocessor))}
    path = tmp_path_factory.mktemp('recorded_teacher') / 'teacher.pth'
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize('aligner', ALIGNERS)
@pytest.mark.parametrize('field, value', [
    ('mean', [122.77, 116.75, 104.09]),  # CLIP's
    ('to_rgb', False),
], ids=['mean', 'to_rgb'])
def test_preprocessing_other_than_the_teachers_recorded_one_is_refused(
        aligner, field, value, recorded_teacher):
    model = MODELS.build(dict(type=aligner, backbone=tiny_vit_cfg('relu'),
                              teacher=teacher_cfg(recorded_teacher),
                              data_preprocessor={**NORMALISE, field: value}))
    with pytest.raises(ValueError, match=rf"differs from the one the teacher's checkpoint "
                       rf'{recorded_teacher} was trained with \({field}: teacher'):
        model.init_weights()


@pytest.mark.parametrize('aligner', ALIGNERS)
def test_the_teachers_recorded_preprocessing_is_accepted(aligner, recorded_teacher):
    model = MODELS.build(dict(type=aligner, backbone=tiny_vit_cfg('relu'),
                              teacher=teacher_cfg(recorded_teacher),
                              data_preprocessor=dict(NORMALISE)))
    model.init_weights()
