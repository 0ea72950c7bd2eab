"""Strict loading on the Runner's load paths (linvit_mm.engine.strict_load): tools/train.py
--resume and load_from, tools/test.py CHECKPOINT, on the tiny classifier config."""
import contextlib
import importlib.util
import io
import re
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

from linvit_mm.engine.strict_load import (CheckpointMismatchError, check_runner_checkpoint,
                                          pending_checkpoint)
from linvit_mm.staged import RECORD_KEY
from linvit_mm.utils.checkpoint import load_checkpoint_file

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
ITERS = 2


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f'strict_load_tool_{name}',
                                                  REPO / 'tools' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAIN, TEST = load_tool('train'), load_tool('test')


def run(tool, argv):
    """(result, log) of a tool's main in this process."""
    stream = io.StringIO()
    with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        result = tool.main([str(a) for a in argv])
    return result, stream.getvalue()


def data_options(mini_data_root):
    """The mini dataset, and a logger of this run's own: mmengine names a Runner's logger by
    config and second, so two runs in one second would share the first one's captured stream."""
    root = mini_data_root / 'imagenet'
    return [f'{loader}.dataset.data_root={root}'
            for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')] + [
                f'experiment_name=loadcheck_{uuid.uuid4().hex[:12]}']


def train(work_dir, mini_data_root, *extra, options=()):
    return run(TRAIN, [TINY_CONFIG, '--work-dir', work_dir, '--no-validate', *extra,
                       '--cfg-options', *data_options(mini_data_root), *options])


def evaluate(checkpoint, work_dir, mini_data_root, *extra, options=()):
    return run(TEST, [TINY_CONFIG, checkpoint, '--work-dir', work_dir, *extra,
                      '--cfg-options', *data_options(mini_data_root), *options])


@pytest.fixture(scope='module')
def relu_run(tmp_path_factory, mini_data_root):
    """A relu run of the tiny config: its work dir and last checkpoint."""
    work_dir = tmp_path_factory.mktemp('relu_run')
    train(work_dir, mini_data_root, options=[f'train_cfg.max_iters={ITERS}'])
    return work_dir, work_dir / f'iter_{ITERS}.pth'


@pytest.fixture
def loads(monkeypatch):
    """Every call of the Runner's own loaders (``load_checkpoint``, ``resume``), by name."""
    calls = []
    for name in ('load_checkpoint', 'resume'):
        original = getattr(Runner, name)

        def recorded(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Runner, name, recorded)
    return calls


def tiny_backbone(**overrides):
    from linvit_mm.models import LinearViT
    cfg = Config.fromfile(str(TINY_CONFIG)).model.backbone.to_dict()
    cfg.pop('type')
    cfg.update(overrides)
    return LinearViT(**cfg)


@pytest.fixture(scope='module')
def stage_checkpoint(tmp_path_factory):
    """A run checkpoint of attention alignment for the tiny config's ViT: the student under
    ``backbone.*`` (no head), its record with the stage, and the run's state."""
    from linvit_mm.staged import describe_linear_vit
    torch.manual_seed(1)
    vit = tiny_backbone()
    path = tmp_path_factory.mktemp('stage') / 'align_attn_iter_2.pth'
    record = dict(backbones={'backbone.': describe_linear_vit(vit)}, stage='align-attn',
                  trained_layers=[0, 1])
    torch.save(dict(state_dict={f'backbone.{k}': v for k, v in vit.state_dict().items()},
                    meta={RECORD_KEY: record, 'epoch': 0, 'iter': 2},
                    optimizer=dict(state={}, param_groups=[]),
                    message_hub=dict(log_scalars={}, runtime_info={}, resumed_keys={})),
               str(path))
    return path


def test_training_checkpoints_record_the_model(relu_run):
    _, checkpoint = relu_run
    record = torch.load(checkpoint, map_location='cpu', weights_only=False)['meta'][RECORD_KEY]
    described = record['backbones']['backbone.']
    assert described['attn_types'] == ['relu', 'relu'] and described['embed_dims'] == 32
    assert 'stage' not in record
    # the tiny config's ImageNet normalisation, which aligners with this teacher compare
    assert record['preprocessing'] == dict(mean=pytest.approx([123.675, 116.28, 103.53]),
                                           std=pytest.approx([58.395, 57.12, 57.375]),
                                           to_rgb=True)


def test_training_checkpoints_record_the_options_and_windows(relu_run):
    _, checkpoint = relu_run
    described = load_checkpoint_file(checkpoint)['meta'][
        RECORD_KEY]['backbones']['backbone.']
    assert described['attn_options'] == [dict(eps=1e-6, rope=None)] * 2
    assert described['window_sizes'] == [None, None]


# Each of these models computes another function on the relu run's weights.
@pytest.mark.parametrize('options, difference', [
    (['model.backbone.attn_cfg.eps=0.001'],
     "attn_cfg.eps of blocks 0-1 (backbone.): checkpoint 1e-06, config 0.001"),
    (['model.backbone.window_size=2', 'model.backbone.window_block_indexes=[1]'],
     "window_size of blocks 1 (backbone.): checkpoint None, config [2, 2]"),
], ids=['eps', 'windows'])
def test_resuming_or_testing_with_other_operator_options_is_refused(
        relu_run, mini_data_root, tmp_path, loads, options, difference):
    _, checkpoint = relu_run
    with pytest.raises(CheckpointMismatchError) as error:
        train(tmp_path, mini_data_root, '--resume', checkpoint,
              options=[*options, f'train_cfg.max_iters={ITERS + 1}'])
    assert difference in str(error.value)
    with pytest.raises(CheckpointMismatchError, match=re.escape(difference)):
        evaluate(checkpoint, tmp_path, mini_data_root, options=options)
    assert loads == []
    # the opt-out tests the other model on these weights, saying what differs
    metrics, log = evaluate(checkpoint, tmp_path, mini_data_root, '--no-strict-load',
                            options=options)
    assert 'accuracy/top1' in metrics and difference in log


@pytest.mark.parametrize('resume', ['path', 'auto'])
def test_resuming_an_elu_run_from_a_relu_checkpoint_is_refused(relu_run, mini_data_root,
                                                               tmp_path, loads, resume):
    work_dir, checkpoint = relu_run
    if resume == 'path':
        target, args = tmp_path, ['--resume', checkpoint]
    else:
        target, args = work_dir, ['--resume']
    with pytest.raises(CheckpointMismatchError) as error:
        train(target, mini_data_root, *args, options=[
            'model.backbone.attn_type=elu', f'train_cfg.max_iters={ITERS + 1}'])
    message = str(error.value)
    assert message.startswith(f'{checkpoint} does not fit the model of this config '
                              f'(ImageClassifier), so the run does not resume from it')
    assert "attn_type of blocks 0-1 (backbone.): checkpoint 'relu', config 'elu'" in message
    assert loads == []
    assert not (target / f'iter_{ITERS + 1}.pth').exists()


def test_resuming_the_same_model_still_works(relu_run, mini_data_root, tmp_path, loads):
    _, checkpoint = relu_run
    _, log = train(tmp_path, mini_data_root, '--resume', checkpoint,
                   options=[f'train_cfg.max_iters={ITERS + 1}'])
    assert loads == ['resume', 'load_checkpoint']
    assert (tmp_path / f'iter_{ITERS + 1}.pth').is_file()
    assert 'strict_load' not in log and 'records no operators' not in log


def test_load_from_with_another_head_is_refused_naming_the_keys(relu_run, mini_data_root,
                                                                tmp_path, loads):
    _, checkpoint = relu_run
    with pytest.raises(CheckpointMismatchError) as error:
        train(tmp_path, mini_data_root, options=[f'load_from={checkpoint}',
                                                 'model.head.num_classes=3'])
    message = str(error.value)
    assert f'{checkpoint} does not fit' in message and 'does not load it' in message
    assert ('size-mismatched keys: head.layers.head.bias: checkpoint (6,), config (3,); '
            'head.layers.head.weight: checkpoint (6, 32), config (3, 32)') in message
    assert '--no-strict-load' in message and 'strict_load = False' in message
    assert loads == []


def test_testing_a_stage_checkpoint_is_refused_before_evaluation(stage_checkpoint,
                                                                 mini_data_root, tmp_path,
                                                                 loads):
    with pytest.raises(CheckpointMismatchError) as error:
        evaluate(stage_checkpoint, tmp_path, mini_data_root)
    message = str(error.value)
    assert message.startswith(f'{stage_checkpoint} does not fit')
    assert "stage: checkpoint 'align-attn', config None (the config builds ImageClassifier)" \
        in message
    assert ('missing keys (the model has them, the checkpoint not): head.layers.head.bias, '
            'head.layers.head.weight') in message
    assert loads == []


@pytest.mark.parametrize('strict', ['strict', 'no-strict-load'])
def test_resuming_a_classification_run_from_a_stage_checkpoint_is_refused(
        stage_checkpoint, mini_data_root, tmp_path, loads, strict):
    # Even without strict loading: the optimizer state belongs to tensors the file lacks.
    extra = ['--no-strict-load'] if strict == 'no-strict-load' else []
    with pytest.raises(CheckpointMismatchError) as error:
        train(tmp_path, mini_data_root, '--resume', stage_checkpoint, *extra)
    message = str(error.value)
    assert message.startswith(f'{stage_checkpoint} does not fit the model of this config '
                              f'(ImageClassifier), so the run does not resume from it; '
                              f'nothing was loaded')
    assert 'head.layers.head.weight' in message and 'use load_from' in message
    assert ("stage: checkpoint 'align-attn'" in message) == (strict == 'strict')
    assert loads == []


def test_the_opt_out_loads_what_fits_and_says_so_at_warning(stage_checkpoint, mini_data_root,
                                                            tmp_path, loads):
    metrics, log = evaluate(stage_checkpoint, tmp_path, mini_data_root, '--no-strict-load')
    assert loads == ['load_checkpoint']
    assert 'accuracy/top1' in metrics
    warning = re.search(r'WARNING - strict_load=False: (\S+) does not fit the model '
                        r'\(ImageClassifier\); it is loaded partially', log)
    assert warning and warning.group(1) == str(stage_checkpoint)
    assert "stage: checkpoint 'align-attn', config None" in log
    assert 'missing keys (the model has them, the checkpoint not): head.layers.head.bias' in log


def runner_for(cfg_options, work_dir, mini_data_root):
    cfg = Config.fromfile(str(TINY_CONFIG))
    cfg.merge_from_dict(dict(work_dir=str(work_dir), **cfg_options))
    for option in data_options(mini_data_root):
        key, value = option.split('=')
        cfg.merge_from_dict({key: value})
    return Runner.from_cfg(cfg)


def test_a_partial_load_really_loads_the_tensors_that_fit(stage_checkpoint, mini_data_root,
                                                          tmp_path):
    runner = runner_for(dict(load_from=str(stage_checkpoint), strict_load=False), tmp_path,
                        mini_data_root)
    notes = check_runner_checkpoint(runner)
    assert len(notes) == 1 and 'head.layers.head.weight' in notes[0]
    runner.load_or_resume()
    saved = torch.load(stage_checkpoint, map_location='cpu', weights_only=False)['state_dict']
    for key, value in runner.model.state_dict().items():
        if key.startswith('backbone.'):
            assert torch.equal(value, saved[key]), key


def test_a_checkpoint_without_record_is_checked_by_tensors_and_warned(relu_run, mini_data_root,
                                                                      tmp_path):
    _, checkpoint = relu_run
    state = torch.load(checkpoint, map_location='cpu', weights_only=False)['state_dict']
    plain = tmp_path / 'plain.pth'
    torch.save(state, plain)  # a bare state dict, as converted releases are
    runner = runner_for(dict(load_from=str(plain)), tmp_path, mini_data_root)
    notes = check_runner_checkpoint(runner)
    assert notes == [f'{plain} records no operators of its LinearViT blocks (checkpoints of '
                     f"tools/train.py runs carry them in meta['linvit_mm']): names and shapes "
                     f'were checked, attn_type and num_heads could not be']
    torch.save({k: v for k, v in state.items() if k != 'backbone.ln1.bias'}, plain)
    with pytest.raises(CheckpointMismatchError, match=r'missing keys .*: backbone\.ln1\.bias'):
        check_runner_checkpoint(runner)


def test_a_model_without_a_linear_vit_loads_as_mmengine_loads_it(tmp_path):
    # Nothing is read: the file does not even exist.
    from mmpretrain.models import ImageClassifier
    model = ImageClassifier(backbone=dict(type='ResNet', depth=18),
                            head=dict(type='LinearClsHead', num_classes=3, in_channels=512))
    runner = SimpleNamespace(model=model, _has_loaded=False, _resume=False,
                             _load_from=str(tmp_path / 'absent.pth'), cfg=Config(),
                             work_dir=str(tmp_path))
    assert check_runner_checkpoint(runner) == []


def test_a_test_time_augmentation_model_is_checked_as_mmengine_loads_it(tmp_path):
    # tools/test.py --tta wraps the classifier: the checkpoint's keys name the inner model
    from mmpretrain.models import AverageClsScoreTTA, ImageClassifier
    classifier = ImageClassifier(backbone=tiny_backbone(),
                                 head=dict(type='LinearClsHead', num_classes=3, in_channels=32))
    ckpt = tmp_path / 'classifier.pth'
    torch.save(dict(state_dict=classifier.state_dict()), ckpt)
    from mmengine.logging import MMLogger
    runner = SimpleNamespace(model=AverageClsScoreTTA(module=classifier), _has_loaded=False,
                             _resume=False, _load_from=str(ckpt), cfg=Config(),
                             work_dir=str(tmp_path), logger=MMLogger.get_instance('tta'))
    # fits: the tensors of the classifier inside (only the missing record is noted)
    assert not any('missing keys' in note for note in check_runner_checkpoint(runner))
    torch.save(dict(state_dict={k: v for k, v in classifier.state_dict().items()
                                if not k.startswith('head.')}), ckpt)
    with pytest.raises(CheckpointMismatchError, match='missing keys.*head.fc.weight'):
        check_runner_checkpoint(runner)


@pytest.mark.parametrize('state, expected', [
    (dict(_resume=False, _load_from=None), None),
    (dict(_resume=False, _load_from='a.pth'), ('a.pth', False)),
    (dict(_resume=True, _load_from='a.pth'), ('a.pth', True)),
    (dict(_resume='b.pth', _load_from='a.pth'), ('b.pth', True)),  # FlexibleRunner
    (dict(_resume=True, _load_from=None), None),  # an empty work dir: nothing to resume
    (dict(_resume=False, _load_from='a.pth', _has_loaded=True), None),
], ids=['nothing', 'load-from', 'resume-path', 'flexible-resume-path', 'auto-empty',
        'already-loaded'])
def test_pending_checkpoint_follows_the_runner(state, expected, tmp_path):
    runner = SimpleNamespace(**{'_has_loaded': False, 'work_dir': str(tmp_path), **state})
    assert pending_checkpoint(runner) == expected


def test_a_resume_file_that_mmengine_would_run_is_refused(relu_run, mini_data_root, tmp_path):
    _, checkpoint = relu_run
    loaded = torch.load(checkpoint, map_location='cpu', weights_only=False)
    loaded['meta']['config'] = "import os\nos.system('touch pwned')"
    crafted = tmp_path / 'crafted.pth'
    torch.save(loaded, crafted)
    runner = runner_for(dict(load_from=str(crafted), resume=True), tmp_path, mini_data_root)
    with pytest.raises(CheckpointMismatchError, match="its meta holds a 'config' text"):
        check_runner_checkpoint(runner, strict=False)


def resnet_runner(work_dir, mini_data_root, **cfg_options):
    """A Runner of the tiny config with a ResNet-18 in place of its LinearViT."""
    cfg = Config.fromfile(str(TINY_CONFIG))
    cfg.model.backbone = dict(type='ResNet', depth=18)
    cfg.model.neck = dict(type='GlobalAveragePooling')
    cfg.model.head.in_channels = 512
    cfg.merge_from_dict(dict(work_dir=str(work_dir), **cfg_options))
    for option in data_options(mini_data_root):
        key, value = option.split('=')
        cfg.merge_from_dict({key: value})
    return Runner.from_cfg(cfg)


@pytest.mark.parametrize('resume', [True, False], ids=['resume', 'load-from'])
def test_a_resume_file_with_code_is_refused_for_a_model_without_linear_vit(
        resume, mini_data_root, tmp_path):
    runner = resnet_runner(tmp_path, mini_data_root)
    marker = tmp_path / 'pwned'
    crafted = tmp_path / 'crafted.pth'
    torch.save(dict(state_dict=runner.model.state_dict(), optimizer={}, message_hub={},
                    meta=dict(epoch=1, iter=1,
                              config=f"import pathlib\npathlib.Path('{marker}').touch()")),
               crafted)
    runner = resnet_runner(tmp_path, mini_data_root, load_from=str(crafted), resume=resume)
    if resume:
        with pytest.raises(CheckpointMismatchError, match="its meta holds a 'config' text"):
            check_runner_checkpoint(runner)
    else:  # loading weights does not parse the text: nothing to refuse
        assert check_runner_checkpoint(runner) == []
    assert not marker.exists()


def test_the_record_hook_adds_to_the_record_and_skips_other_models():
    from mmpretrain.models import ImageClassifier

    from linvit_mm.engine.strict_load import ModelRecordHook
    hook = ModelRecordHook()
    vit_model = SimpleNamespace(model=torch.nn.ModuleDict(dict(backbone=tiny_backbone())))
    checkpoint = dict(meta={RECORD_KEY: dict(lora=dict(alpha=16))})
    hook.before_save_checkpoint(vit_model, checkpoint)
    record = checkpoint['meta'][RECORD_KEY]
    assert record['lora'] == dict(alpha=16)
    assert record['backbones']['backbone.']['attn_types'] == ['relu', 'relu']
    resnet = ImageClassifier(backbone=dict(type='ResNet', depth=18),
                             head=dict(type='LinearClsHead', num_classes=3, in_channels=512))
    checkpoint = dict(meta={})
    hook.before_save_checkpoint(SimpleNamespace(model=resnet), checkpoint)
    assert checkpoint == dict(meta={})
