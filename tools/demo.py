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
# Declared before linvit_mm is first imported: linvit_mm then chooses this process's CPU
# threading before torch loads (see linvit_mm/cpu_threads.py).
LINVIT_MM_TOOL = True
import os.path as osp  # noqa: E402  isort: skip
import sys  # noqa: E402  isort: skip

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
sys.path.insert(0, REPO)  # the checkout's linvit_mm, as the tools run from it
import linvit_mm  # noqa: E402,F401  isort: skip
import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

from linvit_mm.staged import demo_stages
from linvit_mm.staged.demo_sources import SOURCES, DemoConfigs
from linvit_mm.staged.demo_stages import (log, plain_checkpoint, run_recipe, run_test, train,
                                          train_teacher)
from linvit_mm.staged.recipes import (DEMO_RECIPES, DET_CONFIG, DET_SET, RECIPES, SEG_CONFIG,
                                      SEG_SET, TRANSFER_SET, data_options, points_per_image,
                                      recipe_stages, summarise, write_data_sets,
                                      format_mean_std)

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
        det_out = run_test(det_config, det_ckpt, det_dir, det_options,
                           extra=['--show-dir', osp.join(det_dir, 'vis')])
        box_ap, mask_ap = (demo_stages.metric(det_out, 'coco/bbox_mAP'),
                           demo_stages.metric(det_out, 'coco/segm_mAP'))

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
        seg_out = run_test(seg_config, seg_ckpt, seg_dir, seg_options,
                           extra=['--show-dir', osp.join(seg_dir, 'vis')])
        miou = demo_stages.metric(seg_out, 'mIoU')
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
