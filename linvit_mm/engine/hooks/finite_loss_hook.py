"""Stop a training run at the first non-finite loss, before its checkpoint is written."""
import torch
from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from mmengine.runner import EpochBasedTrainLoop


@HOOKS.register_module()
class FiniteLossHook(Hook):
    """Raises ``FloatingPointError`` when a loss of a training iteration is NaN or infinite.

    Without it a run whose loss turns NaN (a NaN teacher, a diverging learning rate, a
    broken loss weight) trains on, saves NaN weights and ends with exit code 0. The
    check runs after every iteration, on every process, at ``NORMAL`` priority, so
    before ``CheckpointHook`` (``VERY_LOW``) saves that iteration: the last checkpoint
    in the work dir is one from before the loss went bad, ready for ``--resume`` once
    the cause is fixed. The error names every loss term with its value.

    It checks every entry of the train step's outputs whose name contains ``loss``
    (mmengine's ``parse_losses`` sums exactly those into ``loss``), so models that log
    several totals (one per optimizer) are covered too.

    mmengine itself has no such hook; mmdet's ``CheckInvalidLossHook`` checks with an
    ``assert`` (skipped under ``python -O``, no message in the error), every 50
    iterations by default, and lives in mmdet's registry, out of reach of mmpretrain
    and mmseg configs.
    """

    priority = 'NORMAL'

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        losses = {name: value for name, value in (outputs or {}).items() if 'loss' in name}
        if not losses:
            raise ValueError(
                f'FiniteLossHook: the train step returned no loss entry to check (outputs: '
                f'{sorted(outputs or {})}); remove the hook (default_hooks.check_loss=None) '
                f'for a model that reports no loss')
        finite = {name: bool(torch.isfinite(torch.as_tensor(value)).all())
                  for name, value in losses.items()}
        if all(finite.values()):
            return
        terms = ', '.join(f'{name}={self._describe(value)}' for name, value in losses.items())
        causes = 'the learning rate (lower it, clip gradients), the loss weights or the data'
        if any('distill' in name and not ok for name, ok in finite.items()):
            causes = ('the teacher (its checkpoint) or the distillation loss_weight, else '
                      + causes)
        epoch = (f' (epoch {runner.epoch + 1})'
                 if isinstance(getattr(runner, 'train_loop', None), EpochBasedTrainLoop) else '')
        message = (
            f'non-finite training loss at iteration {runner.iter + 1}{epoch}: {terms}. '
            f'The run stops before this iteration is saved; '
            f'checkpoints already in {runner.work_dir} are from before. Look at {causes}; '
            f'then resume from the last checkpoint (--resume).')
        runner.logger.error(message)
        raise FloatingPointError(message)

    @staticmethod
    def _describe(value):
        value = torch.as_tensor(value).detach()
        return f'{value.item():.6g}' if value.numel() == 1 else str(value.cpu().tolist())
