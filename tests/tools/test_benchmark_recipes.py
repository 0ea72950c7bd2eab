"""tools/analysis_tools/benchmark_recipes.py: its grid and defaults, the per-recipe summary,
table, CSVs and chart, and a --quick run end to end (the tools in this process)."""
import csv
import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from linvit_mm.staged import recipes as demo_recipes
from linvit_mm.staged.demo_stages import InProcessTools

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope='module')
def bench():
    spec = importlib.util.spec_from_file_location(
        'benchmark_recipes', REPO / 'tools' / 'analysis_tools' / 'benchmark_recipes.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipe_defaults_are_the_full_grid(bench):
    args = bench.parse_args([])
    assert args.attn_types == ['relu', 'ttt'] and args.seeds == [0, 1, 2]
    assert args.budgets == [20, 60] and not args.in_process
    assert args.recipes == ['mlpcopy', 'mlpcopy-distill', 'fullcopy', 'fullcopy-distill',
                            'staged-1-3', 'staged-1-2-3', 'staged-1-3-lora', 'staged-1-2-3-lora']
    assert set(args.recipes) <= set(demo_recipes.RECIPES)
    quick = bench.parse_args(['--quick', '--seeds', '4', '5', '6'])
    assert quick.budgets == [3, 6] and quick.teacher_iters == 2 and quick.seeds == [4, 5, 6]


def test_recipe_budgets_are_equal_with_alignment_counted(bench):
    """Every recipe at a budget takes the same optimiser steps and sees the same images; the
    staged recipes' alignment steps are part of them, not extra."""
    names = bench.parse_args([]).recipes
    for steps in (3, 20, 80, 101):
        spent = {recipe: bench.budget(recipe, steps) for recipe in names}
        assert {(b['steps'], b['images']) for b in spent.values()} == {(steps, 24 * steps)}
    assert bench.budget('staged-1-2-3', 80)['stages'] == (
        'align-attn:20 align-feat:20 staged-ft:40')
    assert bench.budget('staged-1-3-lora', 20)['stages'] == 'align-attn:5 staged-lora:15'
    assert bench.budget('mlpcopy-distill', 20)['stages'] == 'mlpcopy-distill:20'
    bench.check_equal_budgets(names, [20, 60])


def test_recipe_grid_with_unequal_budgets_is_refused(bench, monkeypatch, capsys):
    """A stage config with another batch size would let one recipe see more images: the
    grid is refused before anything trains, naming the recipes and what each would spend."""
    monkeypatch.setattr(bench, 'stage_batch_size',
                        lambda stage: 32 if stage == 'align-feat' else 24)
    with pytest.raises(ValueError, match=r'staged-1-2-3 20 steps / 520 images.*batch_size'):
        bench.check_equal_budgets(['fullcopy', 'staged-1-2-3'], [20])
    bench.check_equal_budgets(['fullcopy', 'staged-1-3'], [20])
    with pytest.raises(SystemExit):
        bench.parse_args(['--recipes', 'mlpcopy', 'staged-1-2-3-lora'])
    assert 'would not spend the same budget' in capsys.readouterr().err


@pytest.mark.parametrize('argv,message', [
    (['--budgets', '2'], '--budgets 2 cannot give each of the 3 stages'),
    (['--in-process', '--jobs', '2'], '--in-process runs one training at a time'),
    (['--threads', '0'], '--threads and --teacher-iters must be >= 1'),
    (['--seeds', '-1'], '--seeds must be non-negative'),
    (['--seeds', '1', '1'], '--seeds lists a value twice'),
    (['--recipes', 'copy', 'copy'], '--recipes lists a value twice'),
    (['--teacher', '/no/such/teacher.pth'], 'no such file'),
    (['--attn-types', 'relu', 'relu'], '--attn-types lists a value twice'),
])
def test_recipe_bad_arguments_are_refused(bench, argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


RUNS = [dict(attn_type='relu', steps=100, images=2400, recipe='mlpcopy', seed=s, top1=t,
             seconds=10.0 + s, stages='mlpcopy:100') for s, t in enumerate([40.0, 44.0, 48.0])
        ] + [dict(attn_type='relu', steps=100, images=2400, recipe='staged-1-3', seed=s, top1=t,
                  seconds=20.0, stages='align-attn:25 staged-ft:75')
             for s, t in enumerate([60.0, 61.0, 65.0])]


def test_recipe_summary_mean_and_sample_std(bench):
    summary = bench.summarise_runs(RUNS)
    assert [row['recipe'] for row in summary] == ['mlpcopy', 'staged-1-3']
    assert summary[0] == dict(attn_type='relu', steps=100, images=2400, recipe='mlpcopy',
                              mean=44.0, std=4.0, min=40.0, max=48.0, n=3, mean_seconds=11.0)
    assert summary[1]['std'] == pytest.approx(statistics.stdev([60.0, 61.0, 65.0]))
    table = bench.format_table(summary).splitlines()
    assert table[0] == 'relu, 100 steps (3 seeds): top-1 (%)'
    assert table[2].split() == ['staged-1-3', '62.00', '+-', '2.65', '60.00', '65.00', '20']
    assert table[3].split() == ['mlpcopy', '44.00', '+-', '4.00', '40.00', '48.00', '11']


def test_recipe_csvs_and_chart_are_written(bench, tmp_path):
    summary = bench.summarise_runs(RUNS)
    bench.write_csv(RUNS, bench.RUN_COLUMNS, tmp_path / 'runs.csv')
    bench.write_csv(summary, bench.SUMMARY_COLUMNS, tmp_path / 'summary.csv')
    with open(tmp_path / 'runs.csv') as f:
        assert next(csv.reader(f)) == ['attn_type', 'steps', 'images', 'recipe', 'seed', 'top1',
                                       'seconds', 'stages']
    with open(tmp_path / 'summary.csv') as f:
        assert next(csv.reader(f)) == ['attn_type', 'steps', 'images', 'recipe', 'n', 'mean',
                                       'std', 'min', 'max', 'mean_seconds']
    with open(tmp_path / 'runs.csv') as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 6 and runs[3]['stages'] == 'align-attn:25 staged-ft:75'
    with open(tmp_path / 'summary.csv') as f:
        rows = list(csv.DictReader(f))
    assert [float(row['mean']) for row in rows] == [44.0, pytest.approx(62.0)]
    bench.plot(summary, RUNS, tmp_path / 'chart.png', 'title')
    assert (tmp_path / 'chart.png').read_bytes()[:4] == b'\x89PNG'


@pytest.mark.slow  # five trainings in process and 210-image validations
def test_recipe_quick_grid_end_to_end(bench, monkeypatch, tmp_path):
    """--quick --in-process, a staged LoRA recipe over two seeds (kept to five trainings: the
    paper's recipes take the same path with one stage): every run of the grid trains through
    tools/train.py and is recorded; a second call reuses them all."""
    calls = []

    class CountingTools(InProcessTools):
        def __call__(self, args, *rest, **kwargs):
            calls.append(args[0])
            return super().__call__(args, *rest, **kwargs)

    monkeypatch.setattr(bench, 'InProcessTools', CountingTools)
    name = demo_recipes.TEACHER_SET
    maker, params = demo_recipes.DEMO_SETS[name]
    monkeypatch.setitem(demo_recipes.DEMO_SETS, name,
                        (maker, dict(params, train_per_class=4, val_per_class=2)))
    argv = ['--quick', '--in-process', '--recipes', 'staged-1-3-lora', '--budgets', '2',
            '--seeds', '0', '1', '--work-dir', str(tmp_path / 'work'),
            '--data-root', str(tmp_path / 'data')]
    result = bench.main(argv)
    # the teacher, then per seed the two stages (attention alignment, LoRA fine-tuning)
    assert calls == ['tools/train.py'] * (1 + 2 * 2)
    assert [(r['seed'], r['steps'], r['images'], r['stages']) for r in result['runs']] == [
        (0, 2, 48, 'align-attn:1 staged-lora:1'), (1, 2, 48, 'align-attn:1 staged-lora:1')]
    assert all(0.0 <= run['top1'] <= 100.0 for run in result['runs'])
    [row] = result['summary']
    assert (row['recipe'], row['n']) == ('staged-1-3-lora', 2)
    written = json.loads((tmp_path / 'work' / 'recipes.json').read_text())
    assert written['setup']['validation_images'] == 210 and len(written['runs']) == 2
    for name in ('recipes.csv', 'recipes_summary.csv', 'recipes.png'):
        assert (tmp_path / 'work' / name).is_file()
    calls.clear()
    again = bench.main(argv)
    assert calls == []
    assert [run['top1'] for run in again['runs']] == [run['top1'] for run in result['runs']]
