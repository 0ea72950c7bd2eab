"""FiniteLossHook: a non-finite loss stops the run before that iteration's checkpoint."""
import math
import re
import types
import uuid
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.logging import MMLogger
from mmengine.runner import Runner

from linvit_mm.engine import FiniteLossHook

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'


def stub_runner(iteration=4):
    return types.SimpleNamespace(iter=iteration, epoch=0, work_dir='/runs/here',
                                 logger=MMLogger.get_instance('test_finite_loss_hook'))


def test_finite_losses_pass():
    FiniteLossHook().after_train_iter(stub_runner(), 0, outputs=dict(
        loss=torch.tensor(2.5), loss_task=torch.tensor(1.5), loss_distill=1.0, accuracy=50.))


@pytest.mark.parametrize('outputs, named', [
    (dict(loss=torch.tensor(math.inf), loss_task=torch.tensor(1.5),
          loss_distill=torch.tensor(math.inf)), 'loss=inf, loss_task=1.5, loss_distill=inf'),
    (dict(loss=torch.tensor(math.nan), acc=torch.tensor(1.)), 'loss=nan'),
    # models with one optimizer per part log one total each and no plain 'loss'
    (dict(loss_gen=torch.tensor(0.3), loss_disc=float('nan')), 'loss_gen=0.3, loss_disc=nan'),
])
def test_non_finite_loss_raises_naming_every_term(outputs, named):
    with pytest.raises(FloatingPointError) as error:
        FiniteLossHook().after_train_iter(stub_runner(iteration=4), 0, outputs=outputs)
    message = str(error.value)
    assert message.startswith(f'non-finite training loss at iteration 5: {named}.')
    assert 'before this iteration is saved' in message and '/runs/here' in message
    assert 'learning rate' in message
    assert ('the teacher (its checkpoint)' in message) == ('loss_distill=inf' in named)


def test_outputs_without_a_loss_are_refused():
    with pytest.raises(ValueError, match=r"no loss entry to check \(outputs: \['acc'\]\)"):
        FiniteLossHook().after_train_iter(stub_runner(), 0, outputs=dict(acc=1.0))


# ---------------------------------------------------------------- with the real Runner
class PoisonLossWeight(Hook):
    """From iteration ``at`` (1-based) on, a NaN distillation weight: what the hook's own
    check refuses at construction, set behind its back, as a bug elsewhere could."""

    priority = 'HIGHEST'

    def __init__(self, at):
        self.at = at

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter + 1 == self.at:
            hook = next(h for h in runner.hooks if type(h).__name__ == 'AttentionDistillHook')
            hook.loss_weight = float('nan')


def distill_cfg(work_dir, mini_data_root, teacher_checkpoint, max_iters):
    cfg = Config.fromfile(str(TINY_CONFIG))
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.data_root = str(mini_data_root / 'imagenet')
    cfg.work_dir = str(work_dir)
    cfg.train_cfg.max_iters = max_iters
    cfg.train_cfg.val_interval = max_iters
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=1, by_epoch=False)
    cfg.default_hooks.check_loss = dict(type='FiniteLossHook')
    cfg.custom_hooks = [dict(
        type='AttentionDistillHook',
        teacher=dict(type='LinearViT', arch=dict(cfg.model.backbone.arch), attn_type='softmax',
                     img_size=32, patch_size=8,
                     init_cfg=dict(type='Pretrained', checkpoint=str(teacher_checkpoint))))]
    return cfg


@pytest.fixture(scope='module')
def nan_teacher_ckpt(teacher_ckpt, tmp_path_factory):
    state = torch.load(teacher_ckpt, map_location='cpu')
    state = {k: torch.full_like(v, math.nan) if k.endswith('attn.qkv.weight') else v
             for k, v in state.items()}
    path = tmp_path_factory.mktemp('nan_teacher') / 'nan_teacher.pth'
    torch.save(state, path)
    return path


def test_nan_teacher_stops_the_run_before_any_checkpoint(tmp_path, mini_data_root,
                                                         nan_teacher_ckpt):
    runner = Runner.from_cfg(distill_cfg(tmp_path, mini_data_root, nan_teacher_ckpt, 3))
    with pytest.raises(FloatingPointError,
                       match=r'at iteration 1: loss=nan, loss_task=[\d.]+, loss_distill=nan'):
        runner.train()
    assert not list(tmp_path.glob('*.pth')) and not (tmp_path / 'last_checkpoint').exists()


def test_loss_turning_nan_mid_run_keeps_only_the_checkpoints_from_before(
        tmp_path, mini_data_root, teacher_ckpt):
    runner = Runner.from_cfg(distill_cfg(tmp_path, mini_data_root, teacher_ckpt, 5))
    runner.register_hook(PoisonLossWeight(at=3))
    with pytest.raises(FloatingPointError, match='at iteration 3: .*loss_distill=nan'):
        runner.train()
    assert sorted(p.name for p in tmp_path.glob('*.pth')) == ['iter_1.pth', 'iter_2.pth']
    assert (tmp_path / 'last_checkpoint').read_text().endswith('iter_2.pth')
    state = torch.load(tmp_path / 'iter_2.pth', map_location='cpu', weights_only=False)
    assert all(torch.isfinite(v).all() for v in state['state_dict'].values())
    log = next(tmp_path.glob('*/*.log')).read_text()
    assert re.search(r'ERROR - .*non-finite training loss at iteration 3: ', log)


# ------------------------------------------------- parameters and optimizer state at a save
class PoisonState(Hook):
    """After the update of iteration ``at`` (1-based), one Inf where a diverging AdamW step
    puts it (``exp_avg_sq``) or one NaN weight: a state the loss of that iteration, computed
    before the update, cannot show."""

    priority = 'HIGHEST'

    def __init__(self, at, where):
        self.at, self.where = at, where

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        if runner.iter + 1 != self.at:
            return
        param = runner.model.backbone.layers[0].attn.qkv.weight
        with torch.no_grad():
            if self.where == 'exp_avg_sq':
                runner.optim_wrapper.optimizer.state[param]['exp_avg_sq'][0, 0] = math.inf
            else:
                param[0, 0] = math.nan


def diverging_cfg(work_dir, mini_data_root, max_iters, lr=1e6, **checkpoint):
    """The tiny classifier at ``lr`` (1e6: diverging) without clipping, by default a checkpoint
    every iteration."""
    cfg = Config.fromfile(str(TINY_CONFIG))
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.data_root = str(mini_data_root / 'imagenet')
    cfg.work_dir = str(work_dir)
    cfg.optim_wrapper = dict(optimizer=dict(type='AdamW', lr=lr, weight_decay=0.05))
    cfg.train_cfg.max_iters = max_iters
    cfg.train_cfg.val_interval = max_iters
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', by_epoch=False,
                                        **(checkpoint or dict(interval=1)))
    cfg.default_hooks.check_loss = dict(type='FiniteLossHook')
    # a run's message hub is named by config and second: two runs of one second would share
    # it, the second reading the first one's 'last_ckpt'
    cfg.experiment_name = f'diverging_{uuid.uuid4().hex[:12]}'
    return cfg


def finite_checkpoint(path):
    checkpoint = torch.load(path, map_location='cpu', weights_only=False)
    tensors = list(checkpoint['state_dict'].values()) + [
        value for state in checkpoint['optimizer']['state'].values()
        for value in state.values() if torch.is_tensor(value)]
    return all(torch.isfinite(t).all() for t in tensors)


@pytest.mark.parametrize('where', ['exp_avg_sq', 'weight'])
def test_non_finite_state_with_a_finite_loss_is_not_saved(tmp_path, mini_data_root, where):
    runner = Runner.from_cfg(diverging_cfg(tmp_path, mini_data_root, 4))
    runner.register_hook(PoisonState(at=2, where=where))
    with pytest.raises(FloatingPointError) as error:
        runner.train()
    message = str(error.value)
    named = ('optimizer exp_avg_sq of backbone.layers.0.attn.qkv.weight' if where == 'exp_avg_sq'
             else 'backbone.layers.0.attn.qkv.weight')
    assert f'non-finite parameters or optimizer state after iteration 2 (1 tensors: {named})' \
        in message
    assert 'the checkpoint of iteration 2 was not written' in message
    first = str(tmp_path / 'iter_1.pth')
    assert f'the last finite checkpoint of this run is {first}' in message
    assert f'--resume {first}' in message
    assert sorted(p.name for p in tmp_path.glob('*.pth')) == ['iter_1.pth']
    assert (tmp_path / 'last_checkpoint').read_text() == first
    assert finite_checkpoint(first)


def test_diverging_run_names_the_last_finite_checkpoint(tmp_path, mini_data_root):
    # lr 1e6: the weights reach ~5e10 after two updates, all finite; the third loss is NaN
    runner = Runner.from_cfg(diverging_cfg(tmp_path, mini_data_root, 4))
    with pytest.raises(FloatingPointError, match='non-finite training loss at iteration 3') \
            as error:
        runner.train()
    last = str(tmp_path / 'iter_2.pth')
    assert f'the last finite checkpoint of this run is {last}' in str(error.value)
    assert all(finite_checkpoint(p) for p in tmp_path.glob('*.pth'))


def test_the_last_checkpoint_of_a_non_finite_state_is_refused_before_old_ones_go(
        tmp_path, mini_data_root):
    # keep one checkpoint: CheckpointHook removes iter_2.pth before it writes iter_3.pth, so
    # the state must be refused before it acts
    runner = Runner.from_cfg(diverging_cfg(tmp_path, mini_data_root, 3, lr=1e-3, interval=2,
                                           max_keep_ckpts=1))
    runner.register_hook(PoisonState(at=3, where='exp_avg_sq'))
    with pytest.raises(FloatingPointError) as error:
        runner.train()
    kept = str(tmp_path / 'iter_2.pth')
    assert 'the checkpoint of iteration 3 was not written' in str(error.value)
    assert f'the last finite checkpoint of this run is {kept}' in str(error.value)
    assert sorted(p.name for p in tmp_path.glob('*.pth')) == ['iter_2.pth']


def test_the_best_checkpoint_of_a_non_finite_state_is_not_written(tmp_path, mini_data_root):
    runner = Runner.from_cfg(diverging_cfg(tmp_path, mini_data_root, 2, lr=1e-3, interval=100,
                                           save_last=False, save_best='accuracy/top1'))
    runner.register_hook(PoisonState(at=2, where='exp_avg_sq'))
    with pytest.raises(FloatingPointError, match='optimizer exp_avg_sq of backbone') as error:
        runner.train()
    assert 'the best checkpoint at iteration 2 was not written' in str(error.value)
    assert 'no finite checkpoint of this run was written' in str(error.value)
    assert not list(tmp_path.glob('*.pth'))


class SaveDirectly(Hook):
    """Saves through ``runner.save_checkpoint`` itself, ahead of the checks of the hook."""

    priority = 'HIGH'

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        runner.save_checkpoint(runner.work_dir, 'direct.pth')


def test_a_save_by_another_path_is_refused_too(tmp_path, mini_data_root):
    runner = Runner.from_cfg(diverging_cfg(tmp_path, mini_data_root, 2, lr=1e-3, interval=100))
    runner.register_hook(PoisonState(at=1, where='weight'))
    runner.register_hook(SaveDirectly())
    with pytest.raises(FloatingPointError, match='the checkpoint being saved was not written'):
        runner.train()
    assert not list(tmp_path.glob('*.pth'))


def test_resuming_a_non_finite_checkpoint_is_refused_at_once(tmp_path, mini_data_root):
    runner = Runner.from_cfg(diverging_cfg(tmp_path / 'run', mini_data_root, 1))
    runner.train()
    checkpoint = torch.load(tmp_path / 'run' / 'iter_1.pth', map_location='cpu',
                            weights_only=False)
    next(iter(checkpoint['optimizer']['state'].values()))['exp_avg_sq'].fill_(math.inf)
    poisoned = tmp_path / 'poisoned.pth'
    torch.save(checkpoint, poisoned)
    cfg = diverging_cfg(tmp_path / 'resumed', mini_data_root, 3)
    cfg.resume, cfg.load_from = True, str(poisoned)
    runner = Runner.from_cfg(cfg)
    with pytest.raises(FloatingPointError,
                       match=r'starts from non-finite parameters or optimizer state \(1 '
                             r'tensors: optimizer exp_avg_sq of backbone\.'):
        runner.train()
    assert runner.iter == 1 and not list((tmp_path / 'resumed').glob('*.pth'))
