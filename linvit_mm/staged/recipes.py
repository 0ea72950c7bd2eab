"""The staged recipes of the demo and of ``benchmark_recipes.py``: which stages a recipe runs
at which share of a budget of optimiser steps, the ``--cfg-options`` of each stage in the
configs of ``configs/demo``, the mini data sets they train on, and the mean +- std over seeds.

Everything here is pure configuration and arithmetic; :mod:`.demo_stages` runs the stages.
"""
import functools
import math
import os.path as osp
import statistics
import threading

from linvit_mm.utils.compat import package_root

# configs/demo and tools/ live in the checkout beside the package.
REPO = osp.dirname(package_root())
DEMO_CONFIGS = osp.join(REPO, 'configs', 'demo')
TEACHER_CONFIG = 'linvit-softmax-mini_random_1xb32_mini-shapes.py'
# Config.fromfile is not thread-safe (pkg_resources, which it asks whether a scope's package is
# installed, fails under concurrent calls); the transfer runs' threads read configs through it.
CONFIG_LOCK = threading.Lock()

# The sets the demo writes under --data-root beside the default ones (make_mini_all), each a
# name (the folder), the generator of linvit_mm.testing.mini_data and its parameters. The
# transfer set's training images are those of the default shape-groups set (8 a group); its
# validation set is large enough for the recipes' differences to be more than a few images.
DEMO_SETS = {
    'imagenet_large': ('make_mini_imagenet',
                       dict(task='shapes', train_per_class=150, val_per_class=16)),
    'imagenet_groups_val210': ('make_mini_imagenet',
                               dict(task='shape-groups', train_per_class=8, val_per_class=70)),
    # The dense sets: 64 x 64 scenes of one or two shapes, the size of the images the demo's
    # ViTs are pre-trained on (an 8 x 8 grid of patches, shapes of a similar scale), and
    # cheap enough for the dense stage's twelve runs a task.
    'coco_demo': ('make_mini_coco', dict(num_train=48, num_val=48, img_size=64,
                                         max_instances=2)),
    'ade_demo': ('make_mini_ade', dict(num_train=48, num_val=48, img_size=64,
                                       max_instances=2)),
}
TEACHER_SET, TRANSFER_SET, DET_SET, SEG_SET = (
    'imagenet_large', 'imagenet_groups_val210', 'coco_demo', 'ade_demo')
# One validation image may move a recipe's accuracy by at most this many points.
MAX_POINTS_PER_IMAGE = 0.5

# The dense stage: per task, its config of configs/demo for each neck (the same heads, data
# and schedule on the plain-ViT pyramid and on ViT-Adapter), its set, the metric its final
# validation reports (printed times ``scale``) and the unit of its budget.
DENSE_NECKS = ('plain', 'adapter')
DENSE_TASKS = {
    'detection': dict(
        configs=dict(plain='mask-rcnn_linvit-plain-relu-mini_fpn_mini-coco.py',
                     adapter='mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py'),
        data_set=DET_SET, metric='coco/bbox_mAP', scale=100, label='Mask R-CNN box AP',
        budget_unit='epochs'),
    'segmentation': dict(
        configs=dict(plain='upernet_linvit-plain-relu-mini_mini-ade.py',
                     adapter='upernet_linvit-adapter-relu-mini_mini-ade.py'),
        data_set=SEG_SET, metric='mIoU', scale=1, label='UperNet mIoU',
        budget_unit='iterations'),
}
# The ViT a dense run starts from: the demo's best classifier, or one of the same shape
# initialised at random, the control that says what the classification stages are worth.
DENSE_INITS = ('pre-trained', 'random')

# A recipe is its stages in order: (stage, share of the budget). A stage is the part of a
# configs/demo name between the operator and the batch size. The paper's settings are one
# stage each; the staged recipes split the same budget between attention alignment (1),
# feature alignment (2) and fine-tuning (3), dense or with LoRA.
CLS_CONFIG = 'linvit-relu-mini_{stage}_1xb24_mini-groups.py'
RECIPES = {
    'random': (('random', 1), ),
    'copy': (('copy', 1), ),
    'mlpcopy': (('mlpcopy', 1), ),
    'mlpcopy-distill': (('mlpcopy-distill', 1), ),
    'fullcopy': (('fullcopy', 1), ),
    'fullcopy-distill': (('fullcopy-distill', 1), ),
    'staged-1-3': (('align-attn', 1), ('staged-ft', 3)),
    'staged-1-2-3': (('align-attn', 1), ('align-feat', 1), ('staged-ft', 2)),
    'staged-1-3-lora': (('align-attn', 1), ('staged-lora', 3)),
    'staged-1-2-3-lora': (('align-attn', 1), ('align-feat', 1), ('staged-lora', 2)),
}
DEMO_RECIPES = ('random', 'copy', 'mlpcopy', 'mlpcopy-distill', 'fullcopy-distill',
                'staged-1-2-3')
# Stages that learn from the teacher alone: no labels, no validation.
ALIGN_STAGES = ('align-attn', 'align-feat')
# Stages whose config wraps the student LinearViT in mmpretrain's LoRAModel.
LORA_STAGES = ('staged-lora', )


# ----------------------------------------------------------------------------- data
def points_per_image(num_images):
    """Accuracy points (%) that one image of a validation set of ``num_images`` is worth."""
    return 100.0 / num_images


def check_validation_size(num_images, max_points=MAX_POINTS_PER_IMAGE):
    """Refuse a validation set on which one image moves the accuracy by more than
    ``max_points``: the recipes' differences would then be a handful of images."""
    if points_per_image(num_images) > max_points:
        raise ValueError(
            f'a validation set of {num_images} images makes one image '
            f'{points_per_image(num_images):.2f} accuracy points, more than {max_points}; '
            f'use at least {math.ceil(100.0 / max_points)} validation images')
    return num_images


def write_demo_set(data_root, name):
    """Write the set ``name`` of ``DEMO_SETS`` under ``data_root``; return its summary."""
    from linvit_mm.testing import mini_data
    maker, params = DEMO_SETS[name]
    summary = getattr(mini_data, maker)(osp.join(data_root, name), **params)
    if name == TRANSFER_SET:
        check_validation_size(summary['splits']['val'])
    return summary


def write_data_sets(data_root):
    """The default mini sets and the demo's own (``DEMO_SETS``); ``{name: summary}``."""
    from linvit_mm.testing.mini_data import make_mini_all
    summaries = make_mini_all(data_root)
    for name in DEMO_SETS:
        summaries[name] = write_demo_set(data_root, name)
    return summaries


# ----------------------------------------------------------------------------- stages
def split_budget(shares, total):
    """Integer steps per stage in proportion to ``shares``, summing to ``total``, each >= 1
    (largest remainders get the steps left over)."""
    if total < len(shares):
        raise ValueError(f'a budget of {total} steps cannot give each of {len(shares)} stages '
                         f'a step; use at least {len(shares)}')
    weight = sum(shares)
    exact = [total * share / weight for share in shares]
    steps = [max(1, math.floor(x)) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: exact[i] - math.floor(exact[i]),
                   reverse=True)
    for i in order[:max(0, total - sum(steps))]:
        steps[i] += 1
    while sum(steps) > total:  # a stage lifted to 1 step takes it from the largest
        steps[steps.index(max(steps))] -= 1
    return steps


def recipe_stages(recipe, total_steps):
    """``[(stage, steps), ...]`` of ``recipe`` (a key of ``RECIPES``) at ``total_steps``."""
    if recipe not in RECIPES:
        raise ValueError(f'unknown recipe {recipe!r}; recipes: {", ".join(RECIPES)}')
    stages = [stage for stage, _ in RECIPES[recipe]]
    return list(zip(stages, split_budget([share for _, share in RECIPES[recipe]],
                                         total_steps)))


@functools.lru_cache(maxsize=None)
def config_warmup(config):
    """Iterations of the linear warm-up that ``config`` (a file of configs/demo) starts with."""
    from mmengine.config import Config
    with CONFIG_LOCK:
        return Config.fromfile(osp.join(DEMO_CONFIGS, config)).param_scheduler[0]['end']


def schedule_options(config, iters):
    """Train ``config`` for ``iters`` iterations, validate and save at the end: its linear
    warm-up (at most a tenth of a run shorter than the config's), then its cosine to the end
    (a one-step run stays in the warm-up: mmengine needs a scheduler to span a step)."""
    warmup = max(1, min(config_warmup(config), iters // 10))
    return [f'train_cfg.max_iters={iters}', f'train_cfg.val_interval={iters}',
            f'default_hooks.checkpoint.interval={iters}', f'param_scheduler.0.end={warmup}',
            f'param_scheduler.1.begin={warmup}',
            f'param_scheduler.1.end={max(iters, warmup + 1)}']


def data_options(root, labelled=True):
    loaders = ('train_dataloader', 'val_dataloader', 'test_dataloader') if labelled else (
        'train_dataloader', )
    return [f'{loader}.dataset.data_root={root}' for loader in loaders]


def stage_options(stage, iters, *, attn_type, seed, teacher, data_root, previous=None):
    """``--cfg-options`` of one stage of a recipe in ``configs/demo``.

    Args:
        stage: a stage of ``RECIPES`` (the config ``CLS_CONFIG.format(stage=stage)``).
        iters: its optimiser steps.
        attn_type: the student's operator.
        seed: mmengine's ``randomness.seed`` (initialisation, data order, augmentation).
        teacher: the Softmax teacher checkpoint (the transfer's source and the
            distillation's or alignment's teacher).
        data_root: the transfer set.
        previous: the checkpoint of the recipe's previous stage, for the stages that
            continue one (feature alignment, fine-tuning).
    """
    continues = stage in ('align-feat', 'staged-ft') + LORA_STAGES
    if continues != (previous is not None):
        raise ValueError(f'stage {stage!r} ' + (
            'continues the previous stage: pass its checkpoint as previous' if continues else
            f'starts from the teacher and takes no previous checkpoint (got {previous!r})'))
    options = data_options(data_root, labelled=stage not in ALIGN_STAGES)
    options += schedule_options(CLS_CONFIG.format(stage=stage), iters) + [
        f'randomness.seed={seed}']
    student = 'model.backbone.module' if stage in LORA_STAGES else 'model.backbone'
    options.append(f'{student}.attn_type={attn_type}')
    if stage in ALIGN_STAGES:
        options.append(f'model.teacher.init_cfg.checkpoint={teacher}')
    if continues:
        options.append(f'{student}.init_cfg.checkpoint={previous}')
    else:
        if stage not in ALIGN_STAGES:  # align-attn copies from its teacher itself
            options.append(f'model.backbone.init_cfg.checkpoint={teacher}')
        if stage.endswith('-distill'):
            options.append(f'custom_hooks.0.teacher.init_cfg.checkpoint={teacher}')
    return options


def dense_options(task, neck, data_root, budget, *, attn_type, checkpoint, seed):
    """``--cfg-options`` of one dense run of ``task`` (a key of ``DENSE_TASKS``) in its config
    for ``neck``: its set under ``data_root``; ``budget`` epochs (detection) or iterations
    (segmentation: ``schedule_options``) with one validation and one checkpoint at the end;
    the ViT's operator, its weights (``checkpoint``, a classifier's; ``None``: random) and the
    seed."""
    spec = DENSE_TASKS[task]
    root = osp.join(data_root, spec['data_set'])
    options = [f'model.backbone.vit.attn_type={attn_type}',
               f'model.backbone.pretrained={checkpoint}', f'randomness.seed={seed}']
    if task == 'detection':
        root += '/'  # mmdet joins data_root and the prefixes as strings
        options += data_options(root) + [
            f'{evaluator}.ann_file={root}annotations/instances_val2017.json'
            for evaluator in ('val_evaluator', 'test_evaluator')]
        return options + [f'train_cfg.max_epochs={budget}', f'train_cfg.val_interval={budget}',
                          f'default_hooks.checkpoint.interval={budget}']
    return options + data_options(root) + schedule_options(spec['configs'][neck], budget)


# ----------------------------------------------------------------------------- results
def summarise(top1):
    """``{recipe: {seed: top-1}}`` -> ``{recipe: dict(mean, std, min, max, n)}``.

    ``std`` is the sample standard deviation over the seeds (n - 1 in the denominator), the
    spread a new seed is expected to show; ``None`` with a single seed.
    """
    summary = {}
    for recipe, by_seed in top1.items():
        values = list(by_seed.values())
        if not values:
            raise ValueError(f'recipe {recipe!r} has no results')
        summary[recipe] = dict(mean=statistics.mean(values),
                               std=statistics.stdev(values) if len(values) > 1 else None,
                               min=min(values), max=max(values), n=len(values))
    return summary


def format_mean_std(row, digits=1):
    std = '-' if row['std'] is None else f'{row["std"]:.{digits}f}'
    return f'{row["mean"]:.{digits}f} +- {std}'


def compare_inits(by_init):
    """``{'pre-trained': {seed: value}, 'random': {seed: value}}`` (one neck of one task) ->
    dict(rows=``summarise`` of both, difference=the means' (pre-trained minus random),
    verdict=``'pre-trained ahead'`` when every pre-trained run is above every random one,
    ``'random ahead'`` for the reverse, ``'overlap'`` otherwise).

    Separation is the test: with n runs a side and no difference between the
    initialisations, every ordering of the 2n results is equally likely, so one side's runs
    all lie above the other's with probability ``p_separated(n, n)`` (1 / 20 for three seeds).
    """
    missing = [init for init in DENSE_INITS if not by_init.get(init)]
    if missing:
        raise ValueError(f'compare_inits needs runs of both initialisations; '
                         f'none of: {", ".join(missing)}')
    rows = summarise({init: by_init[init] for init in DENSE_INITS})
    pre, rand = (rows[init] for init in DENSE_INITS)
    verdict = ('pre-trained ahead' if pre['min'] > rand['max'] else
               'random ahead' if rand['min'] > pre['max'] else 'overlap')
    return dict(rows=rows, difference=pre['mean'] - rand['mean'], verdict=verdict,
                p_separated=p_separated(pre['n'], rand['n']))


def p_separated(n_first, n_second):
    """The chance that ``n_first`` results all lie above ``n_second`` others when all
    ``n_first + n_second`` come from one distribution (no ties): ``1 / C(n1 + n2, n1)``."""
    return 1.0 / math.comb(n_first + n_second, n_first)
