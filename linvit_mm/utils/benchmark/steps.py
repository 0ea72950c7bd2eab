"""What the training-step benchmarks (``benchmark_align.py``, ``benchmark_distill.py``) share:
the student classifier, its optimiser, a fixed random batch and a timed ``train_step``."""
import os
import time
import types

import torch

from .common import quiet_mmengine_logs, synchronise

IMAGENET_MEAN = [123.675, 116.28, 103.53]
IMAGENET_STD = [58.395, 57.12, 57.375]
# The options of add_training_step_args that define the step (not how it is timed).
STEP_OPTIONS = ('arch', 'attn_type', 'batch_size', 'img_size', 'patch_size', 'num_classes',
                'device', 'amp')


def step_options(args, *extra):
    """The step-defining options of ``args`` (and ``extra`` ones) as a namespace, which a
    fresh process can rebuild from its JSON."""
    return types.SimpleNamespace(**{name: getattr(args, name) for name in STEP_OPTIONS + extra})


def data_preprocessor(num_classes):
    return dict(type='ClsDataPreprocessor', num_classes=num_classes, mean=IMAGENET_MEAN,
                std=IMAGENET_STD, to_rgb=True)


def student_cfg(arch, attn_type, img_size, patch_size):
    return dict(type='LinearViT', arch=arch, attn_type=attn_type, img_size=img_size,
                patch_size=patch_size)


def write_random_teacher(arch, img_size, patch_size, folder):
    """A Softmax LinearViT of the student's arch with random weights, saved in ``folder``: the
    checkpoint a teacher's ``init_cfg`` loads (the aligner and the distillation hook refuse a
    teacher that would load none). The cost does not depend on the weights."""
    from linvit_mm.models import LinearViT
    path = os.path.join(folder, 'softmax_teacher.pth')
    torch.save(LinearViT(arch=arch, attn_type='softmax', img_size=img_size,
                         patch_size=patch_size).state_dict(), path)
    return path


def build_classifier(arch, attn_type, img_size, patch_size, num_classes, device):
    """An mmpretrain ``ImageClassifier``: the LinearViT student, a ``VisionTransformerClsHead``
    and a ``ClsDataPreprocessor``, initialised, in ``train()`` on ``device``."""
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS

    from linvit_mm.models import LinearViT  # importing registers it
    cfg = dict(
        type='ImageClassifier', backbone=student_cfg(arch, attn_type, img_size, patch_size),
        neck=None,
        head=dict(type='VisionTransformerClsHead', num_classes=num_classes,
                  in_channels=LinearViT.resolve_arch(arch)['embed_dims'],
                  loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original')),
        data_preprocessor=data_preprocessor(num_classes))
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        model = MODELS.build(cfg)
    with quiet_mmengine_logs():
        model.init_weights()
    return model.to(device).train()


def build_optim_wrapper(model, device, amp):
    """``OptimWrapper(AdamW)`` over the trainable parameters; with ``amp`` what
    ``tools/train.py --amp`` configures: mmengine's ``AmpOptimWrapper`` on CUDA (bf16, or fp16
    with dynamic loss scaling on a GPU without bf16), linvit_mm's ``CPUAmpOptimWrapper``
    (bf16) on a CPU."""
    from mmengine.optim import AmpOptimWrapper, OptimWrapper

    from linvit_mm.engine import CPUAmpOptimWrapper
    from linvit_mm.engine.launch import amp_dtype
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.05)
    if not amp:
        return OptimWrapper(optimizer)
    if torch.device(device).type == 'cuda':
        if amp_dtype() == torch.bfloat16:
            return AmpOptimWrapper(optimizer=optimizer, dtype='bfloat16')
        return AmpOptimWrapper(optimizer=optimizer, dtype='float16', loss_scale='dynamic')
    return CPUAmpOptimWrapper(optimizer=optimizer)


def random_batch(batch_size, img_size, num_classes, seed=0):
    """What a dataloader yields: uint8 images and data samples with labels."""
    from mmpretrain.structures import DataSample
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch_size, 3, img_size, img_size), dtype=torch.uint8,
                           generator=generator)
    labels = torch.randint(0, num_classes, (batch_size, ), generator=generator)
    return dict(inputs=list(images),
                data_samples=[DataSample().set_gt_label(int(label)) for label in labels])


def timed_step(model, data, optim_wrapper, device, hook=None, runner=None):
    """One ``model.train_step`` (the call mmengine's train loop makes): ``(seconds, outputs)``.

    With ``hook``, its ``before_train_iter`` and ``after_train_iter`` run inside the clock,
    as the Runner calls them. Timed by wall clock around the single call because the
    benchmarks alternate the two kinds of step in pairs (see :mod:`.common`)."""
    synchronise(device)
    start = time.perf_counter()
    if hook is not None:
        hook.before_train_iter(runner, runner.iter, data)
    outputs = model.train_step(data, optim_wrapper)
    if hook is not None:
        hook.after_train_iter(runner, runner.iter, data, outputs)
        runner.iter += 1
    synchronise(device)
    return time.perf_counter() - start, outputs


def detached_losses(outputs):
    return {k: float(torch.as_tensor(v).detach()) for k, v in outputs.items()}
