#!/usr/bin/env python
"""Which recipe turns one Softmax ViT into the best linear ViT, at an equal budget?

On the demo's generated data (``tools/demo.py``: a small Softmax ViT pre-trained on six shape
classes, transferred to the shapes grouped into round / cornered / spiky from 8 training
images a group, scored on 210 validation images, so one image is 0.48 points), every recipe
starts from the same teacher checkpoint and takes the same number of optimiser steps on
batches of 24 images, alignment steps counted, so every recipe sees the same images as often:

* the paper's: ``mlpcopy`` and ``fullcopy``, each alone and with the joint attention
  distillation (``-distill``), the task loss from the first step;
* the staged recipe: attention alignment (1), feature alignment (2), fine-tuning (3),
  dense or with LoRA: ``staged-1-3`` (budget shares 1 : 3), ``staged-1-2-3`` (1 : 1 : 2),
  ``staged-1-3-lora``, ``staged-1-2-3-lora``.

Each recipe runs per operator (``--attn-types``, relu and ttt by default), seed and budget
(``--budgets``: a short and a long one), through ``tools/train.py`` and the configs of
``configs/demo/`` (the demo's own code runs them: ``linvit_mm.staged.recipes.RECIPES`` and
``linvit_mm.staged.demo_stages.run_recipe``). A run's top-1 is the validation at its end. The
budget is equal in steps and images, not in compute: distillation and alignment also run the
teacher, which the ``seconds`` column shows.

Prints mean +- std over the seeds per operator, budget and recipe, and writes to
``--out-dir``: ``recipes.csv`` (one row per run), ``recipes_summary.csv`` (one per recipe),
``recipes.json`` (both, with the set-up and the machine's load) and ``recipes.png``. Runs
already finished with the same options are reused, so an interrupted grid continues.

On two cores a run of 20-60 steps is shorter than an interpreter start-up, so
``--in-process`` runs ``tools/train.py``'s ``main`` in this process, one run at a time; two
such processes on disjoint ``--attn-types`` fill two cores, and a last call with the whole grid
reuses their runs and writes the tables (docs/results/recipes.md has the commands).

Example::

    python tools/analysis_tools/benchmark_recipes.py                 # the full grid
    python tools/analysis_tools/benchmark_recipes.py --quick         # a few steps: a smoke test
"""
# Declared before the first import: linvit_mm, imported first, then chooses this process's
# CPU threading before torch loads (see linvit_mm/cpu_threads.py; the user's variables win).
LINVIT_MM_TOOL = True
import linvit_mm  # noqa: E402,F401  isort: skip
import argparse
import csv
import functools
import json
import os
import os.path as osp
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from linvit_mm.cpu_threads import usable_cores
from linvit_mm.staged import demo_sources, demo_stages, recipes
from linvit_mm.staged.demo_stages import InProcessTools

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
PAPER_RECIPES = ('mlpcopy', 'mlpcopy-distill', 'fullcopy', 'fullcopy-distill')
STAGED_RECIPES = ('staged-1-3', 'staged-1-2-3', 'staged-1-3-lora', 'staged-1-2-3-lora')
DEFAULTS = dict(attn_types=['relu', 'ttt'], budgets=[20, 60], seeds=[0, 1, 2],
                teacher_iters=1500)
# --quick: every code path of the grid in seconds a run (the numbers mean nothing).
QUICK = dict(attn_types=['relu'], budgets=[3, 6], seeds=[0, 1], teacher_iters=2)
RUN_COLUMNS = ['attn_type', 'steps', 'images', 'recipe', 'seed', 'top1', 'seconds', 'stages']
SUMMARY_COLUMNS = ['attn_type', 'steps', 'images', 'recipe', 'n', 'mean', 'std', 'min', 'max',
                   'mean_seconds']


@functools.lru_cache(maxsize=None)
def stage_batch_size(stage):
    """Images a step of ``stage`` (a stage of ``RECIPES``) trains on: its config's
    ``train_dataloader.batch_size``."""
    from mmengine.config import Config
    return Config.fromfile(osp.join(recipes.DEMO_CONFIGS, recipes.CLS_CONFIG.format(
        stage=stage))).train_dataloader.batch_size


def budget(recipe, steps):
    """What ``recipe`` spends at ``steps``: ``dict(steps, images, stages)``, alignment stages
    counted like any other (their optimiser steps, their batches of images)."""
    stages = recipes.recipe_stages(recipe, steps)
    return dict(steps=sum(n for _, n in stages),
                images=sum(n * stage_batch_size(stage) for stage, n in stages),
                stages=' '.join(f'{stage}:{n}' for stage, n in stages))


def check_equal_budgets(names, budgets):
    """Refuse a grid in which two recipes at one budget would take different numbers of
    optimiser steps or see different numbers of images (a stage config with another batch
    size, say): the comparison is only fair at an equal budget."""
    for steps in budgets:
        spent = {recipe: budget(recipe, steps) for recipe in names}
        kinds = {(b['steps'], b['images']) for b in spent.values()}
        if len(kinds) > 1:
            raise ValueError(f'at {steps} steps the recipes would not spend the same budget: ' +
                             ', '.join(f'{recipe} {b["steps"]} steps / {b["images"]} images'
                                       for recipe, b in spent.items()) +
                             '; give every stage config the same train_dataloader.batch_size')


def parse_args(argv=None):
    from linvit_mm.models.attention import attention_types
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--attn-types', nargs='+', choices=attention_types(),
                        help=f'student operators (default: {" ".join(DEFAULTS["attn_types"])})')
    parser.add_argument('--recipes', nargs='+', choices=list(recipes.RECIPES),
                        default=list(PAPER_RECIPES + STAGED_RECIPES),
                        help='recipes to compare (default: the four of the paper and the four '
                        'staged ones)')
    parser.add_argument('--budgets', type=int, nargs='+',
                        help='optimiser steps per run, alignment included (default: '
                        f'{" ".join(map(str, DEFAULTS["budgets"]))})')
    parser.add_argument('--seeds', type=int, nargs='+',
                        help=f'default: {" ".join(map(str, DEFAULTS["seeds"]))}')
    parser.add_argument('--teacher', help='a Softmax checkpoint of the demo\'s mini ViT (default: '
                        'train one, as the demo does, in WORK_DIR/teacher)')
    parser.add_argument('--teacher-iters', type=int,
                        help=f'default: {DEFAULTS["teacher_iters"]}')
    parser.add_argument('--quick', action='store_true',
                        help='defaults of a smoke test: relu, budgets 3 and 6 steps, seeds 0 1, '
                        'a 2-step teacher')
    parser.add_argument('--jobs', type=int,
                        help='runs at a time, each on cores / jobs threads')
    parser.add_argument('--threads', type=int,
                        help='torch threads of each run (default: cores / jobs)')
    parser.add_argument('--in-process', action='store_true',
                        help='run tools/train.py in this process, one run at a time (no '
                        'interpreter start-up per stage; --jobs must be 1)')
    parser.add_argument('--work-dir', default=osp.join(REPO, 'work_dirs', 'benchmark_recipes'))
    parser.add_argument('--data-root', default=osp.join(REPO, 'data', 'mini'))
    parser.add_argument('--out-dir', help='where the CSVs, JSON and PNG go (default: WORK_DIR)')
    parser.add_argument('--force', action='store_true', help='rerun finished runs')
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in ('attn_types', 'recipes', 'budgets', 'seeds'):
        values = getattr(args, name)
        if len(set(values)) != len(values):
            parser.error(f'--{name.replace("_", "-")} lists a value twice: {values}')
    if min(args.seeds) < 0:
        parser.error(f'--seeds must be non-negative, got {args.seeds}')
    if args.jobs is None:
        args.jobs = 1 if args.in_process else min(2, usable_cores())
    if args.in_process and args.jobs != 1:
        parser.error(f'--in-process runs one training at a time; got --jobs {args.jobs}')
    if args.threads is None:
        args.threads = max(1, usable_cores() // args.jobs)
    if min(args.jobs, args.threads, args.teacher_iters) < 1:
        parser.error(f'--jobs, --threads and --teacher-iters must be >= 1, got {args.jobs}, '
                     f'{args.threads} and {args.teacher_iters}')
    longest = max(len(recipes.RECIPES[recipe]) for recipe in args.recipes)
    if min(args.budgets) < longest:
        parser.error(f'--budgets {min(args.budgets)} cannot give each of the {longest} stages '
                     f'of a recipe a step')
    if args.teacher is not None and not osp.isfile(args.teacher):
        parser.error(f'--teacher {args.teacher}: no such file')
    try:
        check_equal_budgets(args.recipes, args.budgets)
    except ValueError as error:
        parser.error(str(error))
    args.out_dir = args.out_dir or args.work_dir
    return args


def summarise_runs(runs):
    """Rows of ``SUMMARY_COLUMNS``, one per operator, budget and recipe, in run order."""
    groups = {}
    for run in runs:
        groups.setdefault((run['attn_type'], run['steps'], run['recipe']), []).append(run)
    rows = []
    for (attn_type, steps, recipe), group in groups.items():
        stats = recipes.summarise({recipe: {run['seed']: run['top1'] for run in group}})[recipe]
        rows.append(dict(attn_type=attn_type, steps=steps, images=group[0].get('images'),
                         recipe=recipe, **stats,
                         mean_seconds=sum(run['seconds'] for run in group) / len(group)))
    return rows


def format_table(summary):
    """Per operator and budget, the recipes' mean +- std (best first) and seconds a run."""
    lines = []
    for attn_type, steps in dict.fromkeys((row['attn_type'], row['steps']) for row in summary):
        rows = sorted((row for row in summary
                       if (row['attn_type'], row['steps']) == (attn_type, steps)),
                      key=lambda row: -row['mean'])
        lines += ['', f'{attn_type}, {steps} steps ({rows[0]["n"]} seeds): top-1 (%)',
                  f'  {"recipe":<20}{"mean +- std":>16}{"min":>8}{"max":>8}{"s / run":>9}']
        lines += [f'  {row["recipe"]:<20}{recipes.format_mean_std(row, 2):>16}'
                  f'{row["min"]:>8.2f}{row["max"]:>8.2f}{row["mean_seconds"]:>9.0f}'
                  for row in rows]
    return '\n'.join(lines[1:])


def write_csv(rows, columns, path):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction='ignore')
        writer.writeheader()
        for row in rows:
            writer.writerow({key: '' if row.get(key) is None else row[key] for key in columns})


def plot(summary, runs, path, title):
    """One panel per operator: each recipe's bars (one per budget) at mean +- std, with
    every seed's top-1 as a dot."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    operators = list(dict.fromkeys(row['attn_type'] for row in summary))
    budgets = list(dict.fromkeys(row['steps'] for row in summary))
    recipes = list(dict.fromkeys(row['recipe'] for row in summary))
    fig, axes = plt.subplots(len(operators), 1, figsize=(1.1 * len(recipes) + 2.5,
                                                         3.2 * len(operators)), squeeze=False)
    width = 0.8 / len(budgets)
    for ax, attn_type in zip(axes[:, 0], operators):
        for b, steps in enumerate(budgets):
            rows = {row['recipe']: row for row in summary
                    if row['attn_type'] == attn_type and row['steps'] == steps}
            xs = [i + (b - (len(budgets) - 1) / 2) * width for i in range(len(recipes))]
            ax.bar(xs, [rows[r]['mean'] if r in rows else 0 for r in recipes], width,
                   yerr=[(rows[r]['std'] or 0) if r in rows else 0 for r in recipes],
                   capsize=3, label=f'{steps} steps', alpha=0.85)
            for x, recipe in zip(xs, recipes):
                seeds = [run['top1'] for run in runs if (run['attn_type'], run['steps'],
                                                         run['recipe']) == (attn_type, steps,
                                                                            recipe)]
                ax.plot([x] * len(seeds), seeds, 'k.', ms=3)
        ax.axhline(100 / 3, color='k', ls=':', lw=1, label='chance')
        ax.set_xticks(range(len(recipes)))
        ax.set_xticklabels(recipes, fontsize=7, rotation=20)
        ax.set_ylim(0, 105)
        ax.set_ylabel(f'{attn_type}: top-1 (%)')
        ax.legend(fontsize=7, loc='upper left', ncol=len(budgets) + 1)
    axes[0, 0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def git_commit():
    try:
        return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None):
    args = parse_args(argv)
    started = time.time()
    load_before = os.getloadavg()
    work = osp.abspath(args.work_dir)
    data_root = osp.abspath(args.data_root)
    groups = osp.join(data_root, recipes.TRANSFER_SET)
    num_val = recipes.write_demo_set(data_root, recipes.TRANSFER_SET)['splits']['val']
    threads = args.threads
    runner = InProcessTools(threads, 'benchmark_recipes') if args.in_process else None
    configs = demo_sources.DemoConfigs()  # configs/demo as they are
    teacher_top1 = None
    if args.teacher is None:
        recipes.write_demo_set(data_root, recipes.TEACHER_SET)
        demo_stages.log(f'Softmax teacher on shapes ({args.teacher_iters} iterations)')
        teacher_run = demo_stages.train_teacher(osp.join(work, 'teacher'), data_root,
                                                args.teacher_iters, args.force, configs,
                                                runner=runner)
        args.teacher, teacher_top1 = teacher_run.checkpoint, teacher_run.metric
        demo_stages.log(f'    teacher: {teacher_top1:.2f}% top-1 on shapes')
    grid = [(attn_type, steps, recipe, seed) for attn_type in args.attn_types
            for steps in args.budgets for recipe in args.recipes for seed in args.seeds]
    demo_stages.log(f'{len(grid)} runs ({len(args.attn_types)} operators x '
                    f'{len(args.budgets)} budgets '
             f'x {len(args.recipes)} recipes x {len(args.seeds)} seeds), {args.jobs} at a time '
             f'on {threads} threads each; validation: {num_val} images')

    def one_run(key):
        attn_type, steps, recipe, seed = key
        run = demo_stages.run_recipe(recipe, seed, steps=steps, attn_type=attn_type,
                                     teacher=args.teacher, data_root=groups, force=args.force,
                                     threads=threads, configs=configs, runner=runner,
                                     work_dir=osp.join(work, attn_type, f'{steps}steps',
                                                       recipe, f'seed{seed}'))
        demo_stages.log(f'    {attn_type} {steps:>4} steps {recipe:<18} seed {seed}: '
                 f'{run.metric:6.2f}% ({run.seconds:.0f} s{", reused" if run.reused else ""})')
        spent = budget(recipe, steps)
        return dict(attn_type=attn_type, steps=spent['steps'], images=spent['images'],
                    recipe=recipe, seed=seed, top1=run.metric, seconds=round(run.seconds, 1),
                    stages=spent['stages'])

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(one_run, grid))
    summary = summarise_runs(runs)
    print()
    print(format_table(summary))
    print()

    os.makedirs(args.out_dir, exist_ok=True)
    paths = {name: osp.join(args.out_dir, name) for name in (
        'recipes.csv', 'recipes_summary.csv', 'recipes.json', 'recipes.png')}
    write_csv(runs, RUN_COLUMNS, paths['recipes.csv'])
    write_csv(summary, SUMMARY_COLUMNS, paths['recipes_summary.csv'])
    setup = dict(date=datetime.now(timezone.utc).isoformat(timespec='seconds'),
                 commit=git_commit(), teacher=args.teacher, teacher_top1=teacher_top1,
                 validation_images=num_val, jobs=args.jobs, threads=threads,
                 seconds=round(time.time() - started), load_before=load_before,
                 load_after=os.getloadavg())
    with open(paths['recipes.json'], 'w') as f:
        json.dump(dict(setup=setup, summary=summary, runs=runs), f, indent=1)
    plot(summary, runs, paths['recipes.png'],
         f'Softmax -> linear ViT on shape groups, equal steps per recipe, mean +- std over '
         f'{len(args.seeds)} seeds ({num_val} validation images)')
    demo_stages.log(f'wrote {", ".join(paths.values())} in {setup["seconds"]} s (load average '
             f'{load_before[0]:.1f} before, {setup["load_after"][0]:.1f} after)')
    return dict(setup=setup, summary=summary, runs=runs)


if __name__ == '__main__':
    main()
