"""Continue a resumed run at a scaled learning rate."""
import math

from mmengine.hooks import Hook
from mmengine.optim import OptimWrapperDict
from mmengine.registry import HOOKS


@HOOKS.register_module()
class ResumeLRScaleHook(Hook):
    """Multiplies the learning rate a run resumed with by ``scale``.

    A resume restores the optimizer's state, its learning rate included, and the schedules'
    state, so a learning rate set in the config does not reach a resumed run: the run that
    diverged resumes at the rate that made it diverge. Before the first resumed iteration
    (``before_train``, which comes after the Runner has resumed) this hook scales, in every
    parameter group, the learning rate and its ``initial_lr``, and the base values of the
    learning-rate schedules; the schedules then go on from there (mmengine's schedules update
    the current value step by step, so the rest of the schedule is scaled alike).
    ``tools/train.py --resume [CKPT] --resume-lr-scale S`` adds it.

    Args:
        scale (float): the factor, > 0 and finite.
    """

    priority = 'VERY_HIGH'

    def __init__(self, scale):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
                math.isfinite(scale) and scale > 0):
            raise ValueError(f'ResumeLRScaleHook: scale must be a finite number > 0, got '
                             f'{scale!r}')
        self.scale = float(scale)

    def before_train(self, runner):
        if not getattr(runner, '_resume', False):
            raise ValueError('ResumeLRScaleHook scales the learning rate of a resumed run; '
                             'this run does not resume (use --resume, or set the learning '
                             'rate in the config)')
        wrapper = runner.optim_wrapper
        wrappers = wrapper.values() if isinstance(wrapper, OptimWrapperDict) else [wrapper]
        before = []
        for optim_wrapper in wrappers:
            for group in optim_wrapper.optimizer.param_groups:
                before.append(group['lr'])
                group['lr'] *= self.scale
                if 'initial_lr' in group:
                    group['initial_lr'] *= self.scale
        schedulers = runner.param_schedulers or []
        if isinstance(schedulers, dict):
            schedulers = [s for group in schedulers.values() for s in group]
        for scheduler in schedulers:
            if getattr(scheduler, 'param_name', None) == 'lr':
                scheduler.base_values = [v * self.scale for v in scheduler.base_values]
        runner.logger.info(
            f'ResumeLRScaleHook: resumed learning rate {min(before):.4g}'
            + (f'-{max(before):.4g}' if max(before) != min(before) else '')
            + f' scaled by {self.scale:g}')
