"""The whole linvit_mm recipe at small scale, on CPU, from nothing.

    python tools/demo.py [--attn-type relu] [--source vit|dinov2] [--work-dir work_dirs/demo]
                         [--seeds 0 1 2] [--dense-seeds 0 1 2]

1. writes the generated mini data sets (ImageNet / COCO / ADE20K layouts);
2. pre-trains a small Softmax ViT on a shapes set (the teacher);
3. transfers it into a linear ViT on a *different* task (the shapes grouped into
   round / cornered / spiky, from 8 training images a group, 70 a group for validation)
   with the paper's settings (Random, Copy, MLPCopy, MLPCopy + distillation, FullCopy +
   distillation) and the staged recipe (attention alignment, feature alignment,
   fine-tuning), all at one budget of optimiser steps (alignment steps counted), once per
   seed; prints each recipe's mean +- std over the seeds and draws a bar chart;
4. carries the best classifier into Mask R-CNN (mini COCO, box AP) and UperNet (mini
   ADE20K, mIoU), each on the plain-ViT pyramid and on ViT-Adapter, and trains the same
   runs from a randomly initialised ViT of the same shape, the control: three seeds each
   (``--dense-seeds``); prints each pair's mean +- std and whether the pre-trained runs all
   beat the random ones, and says so plainly when they do not.

Every stage is a ``tools/train.py`` run (its metric: the validation at its end) of a config
in ``configs/demo/`` (thin overrides of the real ones). A stage already run with the same
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
import collections
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

from linvit_mm.staged.demo_sources import SOURCES, DemoConfigs
from linvit_mm.staged.demo_stages import (log, plain_checkpoint, run_dense, run_recipe,
                                          train_teacher)
from linvit_mm.staged.recipes import (DEMO_RECIPES, DENSE_INITS, DENSE_NECKS, DENSE_TASKS,
                                      RECIPES, TRANSFER_SET, compare_inits, format_mean_std,
                                      points_per_image, recipe_stages, summarise,
                                      write_data_sets)

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


def dense_table(dense, comparisons):
    """The console table of the dense stage: per task and neck, each initialisation's mean +-
    std and runs, the difference of the means and the verdict of ``compare_inits``."""
    header = (f'  {"metric":<20}{"neck":<9}{"pre-trained ViT":>17}{"random ViT":>15}'
              f'{"difference":>12}  {"runs (pre-trained | random)":<34}verdict')
    lines = [header]
    for task, by_neck in dense.items():
        for neck, by_init in by_neck.items():
            comparison = comparisons[task][neck]
            runs = ' | '.join(' '.join(f'{value:.1f}' for value in by_init[init].values())
                              for init in DENSE_INITS)
            lines.append(
                f'  {DENSE_TASKS[task]["label"]:<20}{neck:<9}'
                + ''.join(f'{format_mean_std(comparison["rows"][init]):>{width}}'
                          for init, width in zip(DENSE_INITS, (17, 15)))
                + f'{comparison["difference"]:>+12.1f}  {runs:<34}{comparison["verdict"]}')
    return '\n'.join(lines)


def dense_verdicts(comparisons):
    """What the comparisons support: one sentence a task and neck, then one on the whole
    table, which holds several comparisons and so several chances of a separation by
    chance."""
    lines, ahead, chances = [], 0, []
    for task, by_neck in comparisons.items():
        for neck, comparison in by_neck.items():
            rows = comparison['rows']
            subject = f'{DENSE_TASKS[task]["label"]}, {neck} neck'
            chance = comparison['p_separated']
            chances.append(chance)
            values = [rows[init][key] for init in DENSE_INITS for key in ('min', 'max')]
            if min(values) == max(values):
                lines.append(f'{subject}: every run ended at {values[0]:.1f}, so nothing was '
                             f'learned that could tell the two starts apart.')
            elif comparison['verdict'] == 'overlap':
                lines.append(f'{subject}: the pre-trained and random runs overlap, so these '
                             f'{rows["pre-trained"]["n"]} seeds show no effect of the '
                             f'pre-training.')
            else:
                ahead += comparison['verdict'] == 'pre-trained ahead'
                winner, loser = (('pre-trained', 'random')
                                 if comparison['verdict'] == 'pre-trained ahead'
                                 else ('random', 'pre-trained'))
                lines.append(f'{subject}: every {winner} run beats every {loser} one (a chance '
                             f'of {chance:.2f} if the start made no difference).')
    if not ahead:
        lines.append("So at this budget the dense stage shows that the classifier's ViT "
                     'carries into Mask R-CNN and UperNet and trains there, not that its '
                     'pre-training helps them.')
    else:
        by_luck = 1 - math.prod(1 - chance for chance in chances)
        lines.append(f'{ahead} of {len(chances)} comparisons put the pre-trained ViT ahead; '
                     f'if the start made no difference, at least one of {len(chances)} would '
                     f'do so by chance {by_luck:.0%} of the time, so read a single one as a '
                     f'hint to be repeated with other seeds, not as evidence.'
                     if ahead == 1 else
                     f'{ahead} of {len(chances)} comparisons put the pre-trained ViT ahead, '
                     f'each with a chance of at most {max(chances):.2f} if the start made no '
                     f'difference.')
    return lines


def dense_summary(dense, comparisons, budgets, sets):
    """The dense stage's part of summary.json."""
    return {task: dict(
        metric=DENSE_TASKS[task]['label'], budget=budgets[task],
        budget_unit=DENSE_TASKS[task]['budget_unit'], images=sets[task],
        necks={neck: dict(runs=by_init, difference=comparisons[task][neck]['difference'],
                          verdict=comparisons[task][neck]['verdict'],
                          p_separated=comparisons[task][neck]['p_separated'],
                          **{init: comparisons[task][neck]['rows'][init]
                             for init in DENSE_INITS})
               for neck, by_init in by_neck.items()})
        for task, by_neck in dense.items()}


# ----------------------------------------------------------------------------- main
MAX_SEED = 2**31 - 1


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
    parser.add_argument('--det-epochs', type=int, default=4,
                        help='epochs of each Mask R-CNN run of the dense stage')
    parser.add_argument('--seg-iters', type=int, default=120,
                        help='iterations of each UperNet run of the dense stage')
    parser.add_argument('--dense-seeds', type=int, nargs='+', default=[0, 1, 2],
                        help='one dense run per task, neck, initialisation and seed '
                        '(default 0 1 2)')
    parser.add_argument('--jobs', type=int, default=min(2, usable_cores()),
                        help='transfer and dense runs at a time, each on cores / jobs threads '
                        '(default: 2 where there are 2 cores or more)')
    parser.add_argument('--skip-dense', action='store_true', help='stop after classification')
    parser.add_argument('--force', action='store_true', help='redo stages already done')
    args = parser.parse_args(argv)
    for name in ('seeds', 'dense_seeds'):
        seeds = getattr(args, name)
        # numpy takes seeds below 2**32, and the data loader workers add their rank and index
        if len(set(seeds)) != len(seeds) or min(seeds) < 0 or max(seeds) > MAX_SEED:
            parser.error(f'--{name.replace("_", "-")} must be distinct integers from 0 to '
                         f'{MAX_SEED}, got {seeds}')
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
        budgets = dict(detection=args.det_epochs, segmentation=args.seg_iters)
        sets = {task: summaries[spec['data_set']]['splits']
                for task, spec in DENSE_TASKS.items()}
        log(f'4/4 dense prediction: the {best} classifier of seed {best_seed} '
            f'({top1[best][best_seed]:.2f}%) against a randomly initialised ViT of its shape, '
            f'each under the plain-ViT pyramid and under ViT-Adapter: Mask R-CNN on mini COCO '
            f'({sets["detection"]["train"]} training images, {args.det_epochs} epochs), '
            f'UperNet on mini ADE20K ({sets["segmentation"]["train"]} training images, '
            f'{args.seg_iters} iterations); seeds {" ".join(map(str, args.dense_seeds))}, '
            f'{args.jobs} at a time')
        dense_runs = [(task, neck, init, seed) for task in DENSE_TASKS for neck in DENSE_NECKS
                      for init in DENSE_INITS for seed in args.dense_seeds]

        def one_dense_run(key):
            task, neck, init, seed = key
            run = run_dense(task, neck, init, seed, classifier=classifier,
                            attn_type=args.attn_type, data_root=data_root,
                            budget=budgets[task], configs=configs, force=args.force,
                            work_dir=osp.join(work, args.attn_type, 'dense', f'{task}_{neck}',
                                              init, f'seed{seed}'), threads=threads)
            value = run.metric * DENSE_TASKS[task]['scale']
            log(f'    {task:<12} {neck:<7} {init:<11} seed {seed}: {value:6.2f} '
                f'({run.seconds:.0f} s{", reused" if run.reused else ""})')
            return key, value, run.seconds

        dense_started = time.time()
        dense = {task: {neck: {init: {} for init in DENSE_INITS} for neck in DENSE_NECKS}
                 for task in DENSE_TASKS}
        dense_seconds = collections.defaultdict(float)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for (task, neck, init, seed), value, seconds in pool.map(one_dense_run, dense_runs):
                dense[task][neck][init][seed] = value
                dense_seconds[task] += seconds
        timings['dense'] = time.time() - dense_started
        comparisons = {task: {neck: compare_inits(by_init) for neck, by_init in by_neck.items()}
                       for task, by_neck in dense.items()}
        print()
        print(f'  dense prediction, the {best} classifier of seed {best_seed} ({args.attn_type}) '
              f'against a random ViT of its shape, mean +- std over seeds '
              f'{" ".join(map(str, args.dense_seeds))} (validation: {sets["detection"]["val"]} '
              f'mini COCO, {sets["segmentation"]["val"]} mini ADE20K images):')
        print(dense_table(dense, comparisons))
        print()
        for line in dense_verdicts(comparisons):
            print(f'  {line}')
        print()
        summary.update(best_recipe=best, best_seed=best_seed, dense_seeds=args.dense_seeds,
                       dense=dense_summary(dense, comparisons, budgets, sets),
                       dense_train_seconds={task: round(value, 1)
                                            for task, value in dense_seconds.items()})

    timings['total'] = time.time() - started
    summary['seconds'] = {name: round(value, 1) for name, value in timings.items()}
    with open(osp.join(work, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=2)
    log(f'done in {timings["total"]:.0f} s; results in {work}/summary.json')
    return summary


if __name__ == '__main__':
    main()
