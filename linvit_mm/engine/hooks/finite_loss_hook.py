"""Stop a training run at the first non-finite loss or state, before a checkpoint holds it."""
import os.path as osp
from collections import defaultdict

import torch
from mmengine.dist import all_reduce
from mmengine.hooks import CheckpointHook, Hook
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapper, OptimWrapperDict
from mmengine.registry import HOOKS
from mmengine.runner import EpochBasedTrainLoop

_MAX_NAMED = 8


def _named_state(model, optim_wrapper):
    """``(name, tensor)`` for every parameter of ``model`` and every tensor of the optimizer
    state (``'exp_avg_sq of backbone.x'``)."""
    names = {}
    for name, param in model.named_parameters():
        names.setdefault(id(param), name)
        yield name, param
    if isinstance(optim_wrapper, OptimWrapperDict):
        wrappers = list(optim_wrapper.values())
    elif isinstance(optim_wrapper, OptimWrapper):
        wrappers = [optim_wrapper]
    else:
        wrappers = []  # not built (validation or test only)
    for wrapper in wrappers:
        for param, entries in wrapper.optimizer.state.items():
            owner = names.get(id(param), f'a parameter of shape {tuple(param.shape)}')
            for key, value in entries.items():
                if torch.is_tensor(value):
                    yield f'optimizer {key} of {owner}', value


@torch.no_grad()
def non_finite_tensors(named_tensors):
    """The names of the floating-point tensors holding NaN or Inf.

    One fused max-abs reduction (``torch._foreach_norm`` of order inf) per device and dtype:
    a tensor's max-abs is finite exactly when all its values are, and unlike a sum or a
    2-norm it cannot overflow on large finite values.
    """
    groups = defaultdict(list)
    for name, tensor in named_tensors:
        if tensor.is_floating_point() and tensor.numel():
            groups[(tensor.device, tensor.dtype)].append((name, tensor.detach()))
    bad = []
    for members in groups.values():
        norms = torch.stack(torch._foreach_norm([t for _, t in members], float('inf')))
        flags = ~torch.isfinite(norms)
        if flags.any():
            bad += [members[i][0] for i in flags.nonzero().flatten().tolist()]
    return bad


@HOOKS.register_module()
class FiniteLossHook(Hook):
    """Raises ``FloatingPointError`` when a loss of a training iteration is NaN or infinite,
    or when a checkpoint would hold NaN or Inf parameters or optimizer state.

    Without it a run whose loss turns NaN (a NaN teacher, a diverging learning rate, a
    broken loss weight) trains on, saves NaN weights and ends with exit code 0. The
    loss check runs after every iteration, on every process, at ``NORMAL`` priority, so
    before ``CheckpointHook`` (``VERY_LOW``) saves that iteration. The error names every
    loss term with its value.

    It checks every entry of the train step's outputs whose name contains ``loss``
    (mmengine's ``parse_losses`` sums exactly those into ``loss``), so models that log
    several totals (one per optimizer) are covered too.

    The loss is computed before the iteration's update: a diverging step (a huge learning
    rate, no clipping) can leave Inf in the optimizer state (AdamW's ``exp_avg_sq``) or the
    weights while its loss was finite. So whenever a ``CheckpointHook`` is about to save
    (its interval, last and best checkpoints, before it removes old ones), and when
    training starts (a resumed checkpoint), the parameters and optimizer state are checked
    too, with one fused reduction per dtype; ``before_save_checkpoint`` checks again for a
    save by any other path. A non-finite state is refused before the file is written, and
    the error names the tensors and the last checkpoint of the run that is finite, the one
    to ``--resume`` from once the cause is fixed.

    mmengine itself has no such hook; mmdet's ``CheckInvalidLossHook`` checks with an
    ``assert`` (skipped under ``python -O``, no message in the error), every 50
    iterations by default, and lives in mmdet's registry, out of reach of mmpretrain
    and mmseg configs.
    """

    priority = 'NORMAL'

    def __init__(self):
        self._last_finite = None
        # whether the state was checked since the last update (before_train_iter clears it)
        self._checked = False
        self._training = False

    # ------------------------------------------------------------------ loss
    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self._checked = False

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self._note_saved(runner)
        losses = {name: value for name, value in (outputs or {}).items() if 'loss' in name}
        if not losses:
            raise ValueError(
                f'FiniteLossHook: the train step returned no loss entry to check (outputs: '
                f'{sorted(outputs or {})}); remove the hook (default_hooks.check_loss=None) '
                f'for a model that reports no loss')
        finite = {name: bool(torch.isfinite(torch.as_tensor(value)).all())
                  for name, value in losses.items()}
        if not all(finite.values()):
            terms = ', '.join(f'{name}={self._describe(value)}'
                              for name, value in losses.items())
            causes = 'the learning rate (lower it, clip gradients), the loss weights or the data'
            if any('distill' in name and not ok for name, ok in finite.items()):
                causes = ('the teacher (its checkpoint) or the distillation loss_weight, else '
                          + causes)
            message = (
                f'non-finite training loss at iteration {runner.iter + 1}{self._epoch(runner)}: '
                f'{terms}. The run stops before this iteration is saved; '
                f'{self._resume_advice(runner)} Look at {causes}.')
            runner.logger.error(message)
            raise FloatingPointError(message)
        if self._save_due(runner, by_epoch=False):
            self._check_state(runner, runner.iter + 1, f'the checkpoint of iteration '
                              f'{runner.iter + 1}', reduce=True)

    # ------------------------------------------------------------------ state
    def before_train(self, runner):
        self._training = True
        self._note_saved(runner)
        bad = self._bad_state(runner, reduce=True)
        self._checked = True
        if bad:
            self._last_finite = None
            message = (f'the run starts from non-finite parameters or optimizer state '
                       f'({self._listed(bad)}): the checkpoint it resumed or loaded is from '
                       f'after the divergence. Resume from an earlier checkpoint, or start '
                       f'again.')
            runner.logger.error(message)
            raise FloatingPointError(message)

    def after_train(self, runner):
        self._training = False

    def after_train_epoch(self, runner):
        self._note_saved(runner)
        if self._save_due(runner, by_epoch=True):
            self._check_state(runner, runner.iter,
                              f'the checkpoint of epoch {runner.epoch + 1}', reduce=True)

    def after_val_epoch(self, runner, metrics=None):
        self._note_saved(runner)
        if self._training and any(isinstance(hook, CheckpointHook) and hook.save_best
                                  for hook in runner.hooks):
            self._check_state(runner, runner.iter,
                              f'the best checkpoint at iteration {runner.iter}', reduce=True)

    def before_save_checkpoint(self, runner, checkpoint):
        # runner.save_checkpoint runs on the main process only: no collective here
        if self._training and not self._checked:
            # saved from within another hook: which iteration is done is not known here
            self._check_state(runner, None, 'the checkpoint being saved', reduce=False)

    def _check_state(self, runner, iteration, what, reduce):
        # ``iteration``: how many iterations are done, the last one's update being checked
        bad = self._bad_state(runner, reduce)
        self._checked = True
        if not bad:
            return
        message = (
            f'non-finite parameters or optimizer state'
            + (f' after iteration {iteration}' if iteration is not None else '')
            + f'{self._epoch(runner)} ({self._listed(bad)}), although the loss was finite (it is '
            f'computed before the update); {what} was not written. '
            f'{self._resume_advice(runner)} Look at the learning rate (lower it, clip '
            f'gradients: optim_wrapper.clip_grad) or the loss weights.')
        runner.logger.error(message)
        raise FloatingPointError(message)

    @staticmethod
    def _bad_state(runner, reduce):
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        bad = non_finite_tensors(_named_state(model, getattr(runner, 'optim_wrapper', None)))
        if reduce:
            # every process stops, or none: a sharded optimizer holds different state per rank
            count = torch.tensor(float(len(bad)))
            all_reduce(count)
            if count.item() and not bad:
                bad = ['state held by another process']
        return bad

    @staticmethod
    def _listed(bad):
        more = f' and {len(bad) - _MAX_NAMED} more' if len(bad) > _MAX_NAMED else ''
        return f'{len(bad)} tensors: ' + ', '.join(bad[:_MAX_NAMED]) + more

    # ------------------------------------------------------------------ checkpoints
    def _note_saved(self, runner):
        # Called before CheckpointHook acts in the same stage: every save recorded so far
        # completed, and each passed the state check (or is the resumed checkpoint, checked
        # when training started).
        hub = getattr(runner, 'message_hub', None)
        path = hub.get_info('last_ckpt') if hub is not None else None
        if path and osp.isfile(str(path)):
            self._last_finite = str(path)

    def _resume_advice(self, runner):
        if self._last_finite:
            return (f'the last finite checkpoint of this run is {self._last_finite}: once the '
                    f'cause is fixed, resume from it (--resume {self._last_finite}); a resume '
                    f'restores the learning rate that diverged, whatever the config says, so '
                    f'add --resume-lr-scale 0.5 (tools/train.py) to go on at half of it.')
        return (f'no finite checkpoint of this run was written (none in {runner.work_dir}); '
                f'once the cause is fixed, start again.')

    @staticmethod
    def _save_due(runner, by_epoch):
        """Whether a CheckpointHook saves at this point (its own rule, asked of it)."""
        for hook in getattr(runner, 'hooks', ()):
            if not isinstance(hook, CheckpointHook) or bool(hook.by_epoch) != by_epoch:
                continue
            start = getattr(hook, 'save_begin', 0)
            if by_epoch:
                due = hook.every_n_epochs(runner, hook.interval, start) or (
                    hook.save_last and hook.is_last_train_epoch(runner))
            else:
                due = hook.every_n_train_iters(runner, hook.interval, start) or (
                    hook.save_last and hook.is_last_train_iter(runner))
            if due:
                return True
        return False

    @staticmethod
    def _epoch(runner):
        return (f' (epoch {runner.epoch + 1})'
                if isinstance(getattr(runner, 'train_loop', None), EpochBasedTrainLoop) else '')

    @staticmethod
    def _describe(value):
        value = torch.as_tensor(value).detach()
        return f'{value.item():.6g}' if value.numel() == 1 else str(value.cpu().tolist())
