"""The whole linvit_mm recipe at small scale, on CPU, from nothing.

    python tools/demo.py [--attn-type relu] [--source vit|dinov2] [--work-dir work_dirs/demo]
                         [--seeds 0 1 2]

1. writes the generated mini data sets (ImageNet / COCO / ADE20K layouts);
2. pre-trains a small Softmax ViT on a shapes set (the teacher);
3. transfers it into a linear ViT on a *different* task (the shapes grouped into
   round / cornered / spiky, from 8 training images a group, 70 a group for validation)
   with the paper's settings (Random, Copy, MLPCopy, MLPCopy + distillation, FullCopy +
   distillation) and the staged recipe (attention alignment, feature alignment,
   fine-tuning), all at one budget of optimiser steps (alignment steps counted), once per
   seed; prints each recipe's mean +- std over the seeds and draws a bar chart;
4. carries the best classifier into Mask R-CNN + ViT-Adapter (mini COCO, box and
   mask AP) and UperNet + ViT-Adapter (mini ADE20K, mIoU).

Every stage runs the same ``tools/train.py`` / ``tools/test.py`` and the configs in
``configs/demo/`` (thin overrides of the real ones). A stage already run with the same
options is reused; ``--force`` redoes everything. ``--source dinov2`` gives the teacher, and
so every ViT of the demo, DINOv2's shape (patch 14, registers, LayerScale) at the same small
sizes: the configs of ``configs/demo`` reshaped and written into ``<work-dir>/configs``.
"""
# Declared before linvit_mm is first imported (in parse_args, before torch loads): linvit_mm
# then chooses this process's CPU threading (see linvit_mm/cpu_threads.py).
LINVIT_MM_TOOL = True
import argparse
import collections
import functools
import json
import math
import os
import os.path as osp
import pprint
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO_CONFIGS = osp.join(REPO, 'configs', 'demo')
TEACHER_CONFIG = 'linvit-softmax-mini_random_1xb32_mini-shapes.py'
DET_CONFIG = 'mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py'
SEG_CONFIG = 'upernet_linvit-adapter-relu-mini_mini-ade.py'
MERGE_LORA = osp.join('tools', 'model_converters', 'merge_lora.py')

# The shape of the demo's teacher (and so of its students, the distillation and alignment
# teachers and the adapter's ViT): None keeps configs/demo as it is, a ViT like DeiT's (class
# token, position embedding, patch 8 on 64 px images); otherwise the LinearViT arch word
# whose architecture switches the demo's ViTs take at their own small sizes, and the image
# size the classification pipelines resize to. 'dinov2' has DINOv2's with registers: patch
# 14, 4 register tokens, LayerScale, position slots for the patches only; 112 px keeps the
# default's 8 x 8 grid of patches.
SOURCES = {
    'vit': None,
    'dinov2': dict(arch_word='dinov2-reg-small', img_size=112),
}

# The sets the demo writes under --data-root beside the default ones (make_mini_all), each a
# name (the folder), the generator of linvit_mm.testing.mini_data and its parameters. The
# transfer set's training images are those of the default shape-groups set (8 a group); its
# validation set is large enough for the recipes' differences to be more than a few images.
DEMO_SETS = {
    'imagenet_large': ('make_mini_imagenet',
                       dict(task='shapes', train_per_class=150, val_per_class=16)),
    'imagenet_groups_val210': ('make_mini_imagenet',
                               dict(task='shape-groups', train_per_class=8, val_per_class=70)),
    'coco_demo': ('make_mini_coco', dict(num_train=96, num_val=32)),
}
TEACHER_SET, TRANSFER_SET, DET_SET, SEG_SET = (
    'imagenet_large', 'imagenet_groups_val210', 'coco_demo', 'ade')
# One validation image may move a recipe's accuracy by at most this many points.
MAX_POINTS_PER_IMAGE = 0.5

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
# Where each stage's config holds the student LinearViT.
LORA_STAGES = ('staged-lora', )
# Lines of the tools' logs worth showing while a stage runs.
PROGRESS = re.compile(r'Iter\(train\)|Epoch\(train\)|accuracy/top1|bbox_mAP_copypaste|'
                      r'segm_mAP_copypaste|mIoU: |Error|error:')
# Fields of those lines left out of the console (the log file keeps them); mmengine's eta
# stays, it says how long the stage has left.
HIDDEN_FIELDS = re.compile(r'\s+(base_lr|data_time|grad_norm): \S+')
_print_lock = threading.Lock()
# Config.fromfile is not thread-safe (pkg_resources, which it asks whether a scope's package is
# installed, fails under concurrent calls); the transfer runs' threads read configs through it.
_config_lock = threading.Lock()


def log(message):
    with _print_lock:
        print(f'[demo {time.strftime("%H:%M:%S")}] {message}', flush=True)


def shown_line(line):
    """What the console shows of a line of a tool's log: a progress line without the
    logger's prefix and the ``HIDDEN_FIELDS``, or ``None`` for the other lines."""
    if not PROGRESS.search(line):
        return None
    return HIDDEN_FIELDS.sub('', line.rstrip().split(' - INFO - ')[-1])


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


# ----------------------------------------------------------------------------- sources
def source_arch(arch, source):
    """The arch dict of ``source``'s arch word at the sizes of ``arch`` (an arch dict or word
    of LinearViT): the four sizes kept, every architecture switch the source's."""
    from linvit_mm.models.backbones.linear_vit import ARCH_ESSENTIALS, LinearViT
    sizes = LinearViT.resolve_arch(arch)
    shaped = LinearViT.resolve_arch(SOURCES[source]['arch_word'])
    shaped.update({key: sizes[key] for key in ARCH_ESSENTIALS})
    return shaped


def _reshape_vit(vit, source):
    arch = source_arch(dict(vit['arch']) if isinstance(vit['arch'], dict) else vit['arch'],
                       source)
    # An explicit switch of the demo's own ViT (its patch size) gives way to the source's,
    # which LinearViT would otherwise refuse as contradicting the arch.
    for key in set(arch) & set(vit):
        vit.pop(key)
    vit['arch'] = arch
    vit['img_size'] = SOURCES[source]['img_size']


def _resize_classification_pipeline(pipeline, img_size):
    """Crop or resize a classification pipeline's images to ``img_size`` (the generated sets
    are 64 px)."""
    sized = False
    for step in pipeline:
        if step['type'] == 'RandomResizedCrop':
            step['scale'] = img_size
            sized = True
        elif 'Resize' in step['type'] or 'Crop' in step['type']:
            raise ValueError(f'a classification pipeline with {step["type"]} cannot be '
                             f'resized for another source; give it a RandomResizedCrop or '
                             f'no resize')
    if not sized:
        loads = [i for i, step in enumerate(pipeline) if step['type'] == 'LoadImageFromFile']
        if not loads:
            raise ValueError('a classification pipeline without LoadImageFromFile cannot be '
                             'resized for another source')
        pipeline.insert(loads[0] + 1, dict(type='Resize', scale=(img_size, img_size)))


def reshape_for_source(cfg, source):
    """Give every ViT of ``cfg`` (a loaded config of configs/demo) the shape of ``source``: each
    ``LinearViT`` (classifier backbone, distillation or alignment teacher, a LoRA module) and
    each ``LinearViTAdapter``'s ``vit`` take ``source_arch`` and the source's image size, and
    the classification pipelines (those ending in ``PackInputs``) resize to it. Returns the
    dotted paths of the ViTs reshaped; a config without one is refused."""
    reshaped = []

    def visit(node, path):
        if isinstance(node, dict):
            kind = node.get('type')
            if kind in ('LinearViT', 'mmpretrain.LinearViT'):
                _reshape_vit(node, source)
                reshaped.append(path)
            elif kind in ('LinearViTAdapter', 'mmpretrain.LinearViTAdapter') and 'vit' in node:
                _reshape_vit(node['vit'], source)
                reshaped.append(f'{path}.vit')
            pipeline = node.get('pipeline')
            if (isinstance(pipeline, list) and pipeline
                    and pipeline[-1].get('type') == 'PackInputs'):
                _resize_classification_pipeline(pipeline, SOURCES[source]['img_size'])
            for key, value in node.items():
                visit(value, f'{path}.{key}' if path else key)
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                visit(value, f'{path}[{index}]')

    visit(cfg._cfg_dict, '')
    if not reshaped:
        raise ValueError(f'{cfg.filename} has no LinearViT or LinearViTAdapter to give the '
                         f'{source!r} shape')
    return reshaped


class DemoConfigs:
    """The demo's config files for one source: those of configs/demo for ``'vit'``; for
    another source each one reshaped (``reshape_for_source``) and written under
    ``config_dir`` with the same name, rewritten only when its text changes (so that a
    finished stage stays reusable)."""

    def __init__(self, source='vit', config_dir=None):
        if source not in SOURCES:
            raise ValueError(f'unknown source {source!r}; sources: {", ".join(SOURCES)}')
        if SOURCES[source] is not None and config_dir is None:
            raise ValueError(f'the {source!r} source writes its configs: give a config_dir')
        self.source, self.config_dir = source, config_dir

    def path(self, name):
        """The file to run for ``name``, a config of configs/demo."""
        original = osp.join(DEMO_CONFIGS, name)
        if SOURCES[self.source] is None:
            return original
        from mmengine.config import Config
        with _config_lock:
            cfg = Config.fromfile(original)
            reshape_for_source(cfg, self.source)
            target = osp.join(self.config_dir, name)
            # Config.pretty_text formats with yapf, seconds a config; the values here are
            # literals, which pprint writes as Python as they are.
            text = ''.join([f'# {name} of configs/demo with its ViTs in the shape of the '
                            f'{self.source!r} source (tools/demo.py --source {self.source})\n'] +
                           [f'{key} = {pprint.pformat(value, width=100, sort_dicts=False)}\n'
                            for key, value in cfg.to_dict().items()])
            if not osp.isfile(target) or open(target).read() != text:
                os.makedirs(self.config_dir, exist_ok=True)
                with open(target + '.tmp', 'w') as f:
                    f.write(text)
                os.replace(target + '.tmp', target)
            return target


# ----------------------------------------------------------------------------- recipes
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
    with _config_lock:
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


# ----------------------------------------------------------------------------- running
def run_tool(args, log_path, show=True, threads=None):
    """Run a tool with the current interpreter, tee its output into log_path."""
    command = [sys.executable] + args
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    lines = []
    with open(log_path, 'w') as log_file:
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log_file.write(line)
            lines.append(line)
            shown = shown_line(line) if show else None
            if shown is not None:
                with _print_lock:
                    print('    ' + shown, flush=True)
        proc.wait()
    if proc.returncode != 0:
        tail = ''.join(lines[-30:])
        raise SystemExit(f'demo: {" ".join(args[:2])} failed (exit {proc.returncode}); '
                         f'log: {log_path}\n{tail}')
    return ''.join(lines)


def last_checkpoint(work_dir):
    marker = osp.join(work_dir, 'last_checkpoint')
    if not osp.isfile(marker):
        return None
    path = open(marker).read().strip()
    return path if osp.isfile(path) else None


def metric(output, name):
    found = re.findall(rf'{re.escape(name)}: ([-\d.]+)', output)
    if not found:
        raise SystemExit(f'demo: the output has no {name}')
    return float(found[-1])


# A finished training: its last checkpoint, the metric of its final validation (None for a
# run without one), its wall time and whether it was reused from an earlier demo run.
Trained = collections.namedtuple('Trained', 'checkpoint metric seconds reused')


def train(config, work_dir, options, force, metric_name=None, show=True, threads=None):
    """Train ``config`` (a config file's path) into ``work_dir``; return ``Trained``.

    A finished run of the same config and options, from the same versions of the config and
    of the files the options name (checkpoints of earlier stages: their modification times),
    is reused (its ``demo_run.json``); any other content of ``work_dir`` is trained over.
    """
    record_path = osp.join(work_dir, 'demo_run.json')
    values = [config] + [option.split('=', 1)[-1] for option in options]
    request = dict(config=config, options=list(options),
                   inputs={path: osp.getmtime(path) for path in values if osp.isfile(path)})
    if not force and osp.isfile(record_path):
        with open(record_path) as f:
            record = json.load(f)
        if ({k: record.get(k) for k in request} == request
                and osp.isfile(record['checkpoint'])):
            return Trained(record['checkpoint'], record['metric'], record['seconds'], True)
    os.makedirs(work_dir, exist_ok=True)
    if osp.exists(record_path):
        os.remove(record_path)
    started = time.time()
    output = run_tool(['tools/train.py', config, '--work-dir', work_dir,
                       '--cfg-options', *options], osp.join(work_dir, 'train.log'), show=show,
                      threads=threads)
    run = Trained(last_checkpoint(work_dir), metric(output, metric_name) if metric_name else None,
                  time.time() - started, False)
    with open(record_path, 'w') as f:
        json.dump(dict(request, **run._asdict()), f, indent=1)
    return run


def test(config, checkpoint, work_dir, options, extra=()):
    return run_tool(['tools/test.py', config, checkpoint, '--work-dir',
                     work_dir, *extra, '--cfg-options', *options],
                    osp.join(work_dir, 'test.log'), show=False)


def train_teacher(work_dir, data_root, iters, force, configs):
    """The Softmax teacher on ``TEACHER_SET`` (``configs``: ``DemoConfigs``): ``Trained`` with
    its top-1."""
    options = data_options(osp.join(data_root, TEACHER_SET)) + schedule_options(
        TEACHER_CONFIG, iters)
    return train(configs.path(TEACHER_CONFIG), work_dir, options, force,
                 metric_name='accuracy/top1')


def run_recipe(recipe, seed, *, steps, attn_type, teacher, data_root, configs, work_dir, force,
               threads=None):
    """Train every stage of ``recipe`` for one seed into ``work_dir/<stage>`` (``configs``:
    ``DemoConfigs``); return ``Trained``: the last stage's checkpoint and top-1, the stages'
    seconds summed, reused when every stage was."""
    stages = []
    for stage, iters in recipe_stages(recipe, steps):
        options = stage_options(stage, iters, attn_type=attn_type, seed=seed, teacher=teacher,
                                data_root=data_root,
                                previous=stages[-1].checkpoint if stages else None)
        stages.append(train(configs.path(CLS_CONFIG.format(stage=stage)),
                            osp.join(work_dir, stage), options, force,
                            metric_name=None if stage in ALIGN_STAGES else 'accuracy/top1',
                            show=False, threads=threads))
    return Trained(stages[-1].checkpoint, stages[-1].metric, sum(s.seconds for s in stages),
                   all(s.reused for s in stages))


def plain_checkpoint(recipe, seed, checkpoint, *, steps, attn_type, teacher, data_root, configs,
                     work_dir):
    """The classifier checkpoint of a finished run as a plain LinearViT classifier: a LoRA
    fine-tuning checkpoint has its factors merged in (tools/model_converters/merge_lora.py);
    the others are plain already."""
    stage, _ = recipe_stages(recipe, steps)[-1]
    if stage not in LORA_STAGES:
        return checkpoint
    stages = recipe_stages(recipe, steps)
    previous = last_checkpoint(osp.join(work_dir, stages[-2][0]))
    options = stage_options(stage, stages[-1][1], attn_type=attn_type, seed=seed,
                            teacher=teacher, data_root=data_root, previous=previous)
    merged = osp.join(work_dir, stage, 'merged.pth')
    run_tool([MERGE_LORA, configs.path(CLS_CONFIG.format(stage=stage)), checkpoint,
              merged, '--cfg-options', *options], osp.join(work_dir, stage, 'merge.log'),
             show=False)
    return merged


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


def transfer_table(top1, summary):
    """The console table: one row per recipe, mean +- std and every seed's top-1."""
    seeds = sorted({seed for by_seed in top1.values() for seed in by_seed})
    header = f'  {"recipe":<20}{"mean +- std":>14}' + ''.join(
        f'{f"seed {seed}":>9}' for seed in seeds)
    lines = [header]
    for recipe, row in summary.items():
        lines.append(f'  {recipe:<20}{format_mean_std(row, 2):>14}' + ''.join(
            f'{top1[recipe][seed]:>9.2f}' if seed in top1[recipe] else f'{"":>9}'
            for seed in seeds))
    return '\n'.join(lines)


def bar_chart(top1, summary, attn_type, teacher_acc, num_val, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    names = list(summary)
    means = [summary[n]['mean'] for n in names]
    stds = [summary[n]['std'] or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    colours = ['#9e9e9e', '#64b5f6', '#1e88e5', '#e53935', '#8e24aa', '#43a047', '#fb8c00',
               '#6d4c41', '#00897b', '#5e35b1']
    ax.bar(names, means, yerr=stds, capsize=4, color=colours[:len(names)], alpha=0.85,
           label='mean +- std over seeds')
    for i, name in enumerate(names):
        values = list(top1[name].values())
        ax.plot([i] * len(values), values, 'k.', ms=4,
                label='one seed' if i == 0 else None)
        ax.text(i, summary[name]['max'] + 1.5, f'{means[i]:.1f}', ha='center', fontsize=8)
    ax.axhline(100 / 3, color='k', ls=':', lw=1, label='chance')
    ax.set_ylabel(f'top-1 accuracy (%), {num_val} val images')
    ax.set_ylim(0, 105)
    ax.tick_params(axis='x', labelsize=7, rotation=20)
    ax.set_title(f'Softmax teacher ({teacher_acc:.1f}% on shapes) -> {attn_type} ViT '
                 f'on shape groups, {len(next(iter(top1.values())))} seeds', fontsize=9)
    ax.legend(loc='upper left', fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    from linvit_mm.cpu_threads import usable_cores
    from linvit_mm.models.attention import attention_types
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--attn-type', default='relu', choices=attention_types(),
                        help='operator of the linear student (default relu)')
    parser.add_argument('--source', default='vit', choices=list(SOURCES),
                        help="the teacher's shape: vit (default; class token, position "
                        'embedding, patch 8) or dinov2 (patch 14, registers, LayerScale, '
                        '112 px images)')
    parser.add_argument('--work-dir', help='default work_dirs/demo, work_dirs/demo_<source> '
                        'for another source')
    parser.add_argument('--data-root', default=osp.join(REPO, 'data', 'mini'))
    parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2],
                        help='one transfer run per recipe and seed (default 0 1 2)')
    parser.add_argument('--recipes', nargs='+', default=list(DEMO_RECIPES),
                        choices=list(RECIPES), help='transfer recipes to compare')
    parser.add_argument('--teacher-iters', type=int, default=1500)
    parser.add_argument('--transfer-iters', type=int, default=200,
                        help="every recipe's optimiser steps, alignment steps included")
    parser.add_argument('--det-epochs', type=int, default=12)
    parser.add_argument('--seg-iters', type=int, default=400)
    parser.add_argument('--jobs', type=int, default=min(2, usable_cores()),
                        help='transfer runs at a time, each on cores / jobs threads '
                        '(default: 2 where there are 2 cores or more)')
    parser.add_argument('--skip-dense', action='store_true', help='stop after classification')
    parser.add_argument('--force', action='store_true', help='redo stages already done')
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        parser.error(f'--seeds must be distinct non-negative integers, got {args.seeds}')
    if len(set(args.recipes)) != len(args.recipes):
        parser.error(f'--recipes names a recipe twice: {args.recipes}')
    for name in ('teacher_iters', 'transfer_iters', 'det_epochs', 'seg_iters', 'jobs'):
        if getattr(args, name) < 1:
            parser.error(f'--{name.replace("_", "-")} must be >= 1, got {getattr(args, name)}')
    if args.work_dir is None:
        args.work_dir = osp.join(REPO, 'work_dirs', 'demo' if SOURCES[args.source] is None
                                 else f'demo_{args.source}')
    longest = max(len(RECIPES[recipe]) for recipe in args.recipes)
    if args.transfer_iters < longest:
        parser.error(f'--transfer-iters {args.transfer_iters} cannot give each of the '
                     f'{longest} stages of a recipe a step')
    return args


def main(argv=None):
    sys.path.insert(0, REPO)
    args = parse_args(argv)
    started = time.time()
    from linvit_mm.cpu_threads import shared_machine_note, usable_cores
    note = shared_machine_note()
    if note is not None:
        log(note)
    work = osp.abspath(args.work_dir)
    data_root = osp.abspath(args.data_root)
    os.makedirs(work, exist_ok=True)
    configs = DemoConfigs(args.source, osp.join(work, 'configs'))
    timings = {}

    log(f'1/4 mini data sets -> {data_root}')
    summaries = write_data_sets(data_root)
    for name, summary in summaries.items():
        log(f'    {name}: {summary["num_files"]} files in {summary["root"]}')
    groups = osp.join(data_root, TRANSFER_SET)
    num_val = summaries[TRANSFER_SET]['splits']['val']

    shape = '' if SOURCES[args.source] is None else (
        f' in {args.source} shape ({SOURCES[args.source]["arch_word"]}\'s switches, '
        f'{SOURCES[args.source]["img_size"]} px images; configs in {configs.config_dir})')
    log(f'2/4 pre-train the Softmax teacher{shape} on shapes ({args.teacher_iters} iterations)')
    teacher_run = train_teacher(osp.join(work, 'teacher'), data_root, args.teacher_iters,
                                args.force, configs)
    teacher, teacher_acc, timings['teacher'] = teacher_run[:3]
    log(f'    teacher: {teacher_acc:.2f}% top-1 on shapes (chance 16.7%)')

    threads = max(1, usable_cores() // args.jobs)
    log(f'3/4 transfer into a {args.attn_type} ViT on shape groups (8 training images a group, '
        f'{num_val} for validation: one image is {points_per_image(num_val):.2f} points): '
        f'{len(args.recipes)} recipes x {len(args.seeds)} seeds, {args.transfer_iters} '
        f'optimiser steps each, {args.jobs} at a time')
    common = dict(steps=args.transfer_iters, attn_type=args.attn_type, teacher=teacher,
                  data_root=groups, configs=configs)
    runs = [(recipe, seed) for recipe in args.recipes for seed in args.seeds]

    def one_run(recipe_seed):
        recipe, seed = recipe_seed
        run_dir = osp.join(work, args.attn_type, recipe, f'seed{seed}')
        run = run_recipe(recipe, seed, work_dir=run_dir, force=args.force, threads=threads,
                         **common)
        log(f'    {recipe:<20} seed {seed}: {run.metric:6.2f}% ({run.seconds:.0f} s'
            f'{", reused" if run.reused else ""})')
        return recipe_seed, run

    transfer_started = time.time()
    top1 = {recipe: {} for recipe in args.recipes}
    checkpoints, run_seconds = {}, {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for (recipe, seed), run in pool.map(one_run, runs):
            top1[recipe][seed] = run.metric
            checkpoints[recipe, seed] = run.checkpoint
            run_seconds.setdefault(recipe, []).append(round(run.seconds, 1))
    timings['transfer'] = time.time() - transfer_started
    summary_rows = summarise(top1)

    print()
    print(f'  {args.attn_type} ViT on shape groups, top-1 (%) on {num_val} validation images, '
          f'{args.transfer_iters} optimiser steps per recipe, initialised from a Softmax ViT '
          f'pre-trained on shapes ({teacher_acc:.1f}%):')
    print(transfer_table(top1, summary_rows))
    print()
    chart = osp.join(work, 'transfer_accuracy.png')
    bar_chart(top1, summary_rows, args.attn_type, teacher_acc, num_val, chart)
    log(f'    bar chart: {chart}')
    summary = dict(
        source=args.source, attn_type=args.attn_type, teacher_top1=teacher_acc, seeds=args.seeds,
        transfer_steps=args.transfer_iters, transfer_val_images=num_val,
        transfer_top1={recipe: dict(summary_rows[recipe], seeds=top1[recipe],
                                    stages=recipe_stages(recipe, args.transfer_iters),
                                    seconds=run_seconds[recipe])
                       for recipe in args.recipes})

    if not args.skip_dense:
        best = max(args.recipes, key=lambda r: (summary_rows[r]['mean'],
                                                -args.recipes.index(r)))
        best_seed = max(args.seeds, key=lambda s: (top1[best][s], -args.seeds.index(s)))
        run_dir = osp.join(work, args.attn_type, best, f'seed{best_seed}')
        classifier = plain_checkpoint(best, best_seed, checkpoints[best, best_seed],
                                      work_dir=run_dir, **common)
        log(f'4/4 dense prediction from the best recipe\'s best classifier ({best}, seed '
            f'{best_seed}: {top1[best][best_seed]:.2f}%)')
        backbone = [f'model.backbone.vit.attn_type={args.attn_type}',
                    f'model.backbone.pretrained={classifier}']
        coco = osp.join(data_root, DET_SET) + '/'
        det_options = backbone + [
            f'train_dataloader.dataset.data_root={coco}',
            f'val_dataloader.dataset.data_root={coco}',
            f'test_dataloader.dataset.data_root={coco}',
            f'val_evaluator.ann_file={coco}annotations/instances_val2017.json',
            f'test_evaluator.ann_file={coco}annotations/instances_val2017.json',
            f'train_cfg.max_epochs={args.det_epochs}',
            f'train_cfg.val_interval={args.det_epochs}',
            f'default_hooks.checkpoint.interval={args.det_epochs}']
        det_dir = osp.join(work, f'mask-rcnn_{args.attn_type}')
        coco_summary = summaries[DET_SET]
        log(f'    Mask R-CNN + adapter on mini COCO ({coco_summary["splits"]["train"]} training '
            f'images, {args.det_epochs} epochs)')
        det_config = configs.path(DET_CONFIG)
        det_ckpt, _, timings['detection'], _ = train(det_config, det_dir, det_options,
                                                     args.force)
        det_out = test(det_config, det_ckpt, det_dir, det_options,
                       extra=['--show-dir', osp.join(det_dir, 'vis')])
        box_ap, mask_ap = metric(det_out, 'coco/bbox_mAP'), metric(det_out, 'coco/segm_mAP')

        ade = osp.join(data_root, SEG_SET)
        seg_options = backbone + data_options(ade) + [
            f'train_cfg.max_iters={args.seg_iters}', f'train_cfg.val_interval={args.seg_iters}',
            f'default_hooks.checkpoint.interval={args.seg_iters}',
            f'param_scheduler.1.end={args.seg_iters}']  # warm-up: the first 20 iterations
        seg_dir = osp.join(work, f'upernet_{args.attn_type}')
        log(f'    UperNet + adapter on mini ADE20K ({args.seg_iters} iterations)')
        seg_config = configs.path(SEG_CONFIG)
        seg_ckpt, _, timings['segmentation'], _ = train(seg_config, seg_dir, seg_options,
                                                        args.force)
        seg_out = test(seg_config, seg_ckpt, seg_dir, seg_options,
                       extra=['--show-dir', osp.join(seg_dir, 'vis')])
        miou = metric(seg_out, 'mIoU')
        print()
        print(f'  from the {best} classifier of seed {best_seed} ({args.attn_type}):')
        print(f'  Mask R-CNN (mini COCO val, {coco_summary["splits"]["val"]} images): box mAP '
              f'{box_ap:.3f} ({100 * box_ap:.1f} AP), mask mAP {mask_ap:.3f} '
              f'({100 * mask_ap:.1f} AP)')
        print(f'  UperNet (mini ADE20K val):  mIoU {miou:.2f}')
        print()
        summary.update(best_recipe=best, best_seed=best_seed, coco_bbox_mAP=box_ap,
                       coco_segm_mAP=mask_ap, ade_mIoU=miou)

    timings['total'] = time.time() - started
    summary['seconds'] = {name: round(value, 1) for name, value in timings.items()}
    with open(osp.join(work, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=2)
    log(f'done in {timings["total"]:.0f} s; results in {work}/summary.json')
    return summary


if __name__ == '__main__':
    main()
