"""linvit_mm.utils.benchmark.steps and .distill: the timed training step with and without the
distillation hook."""
import torch

from linvit_mm.utils.benchmark import distill, steps

TINY_ARCH = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)


def test_hook_is_detached_after_the_run():
    """Steps without the hook really run no teacher, and nothing stays attached."""
    model = steps.build_classifier(TINY_ARCH, 'relu', 32, 8, 10, 'cpu')
    before = len(model.backbone._forward_pre_hooks) + len(model._forward_hooks)
    hook, runner = distill.setup_hook(model, TINY_ARCH, 32, 8, 50.)
    assert len(model.backbone._forward_pre_hooks) + len(model._forward_hooks) == before + 2
    optim_wrapper = steps.build_optim_wrapper(model, 'cpu', amp=False)
    data = steps.random_batch(2, 32, 10)
    _, outputs = steps.timed_step(model, data, optim_wrapper, 'cpu')
    assert 'loss_distill' not in outputs
    _, outputs = steps.timed_step(model, data, optim_wrapper, 'cpu', hook, runner)
    assert torch.isfinite(outputs['loss_distill'])
    hook.after_train(runner)
    assert len(model.backbone._forward_pre_hooks) + len(model._forward_hooks) == before
