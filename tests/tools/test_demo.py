"""tools/demo.py: its options, the mean +- std table and the chart, and short end-to-end runs of
the transfer stage (the full demo takes minutes; tests/e2e runs the dense stages' configs).

The demo's logic is tested in tests/staged/ (test_recipes, test_demo_sources,
test_demo_stages)."""
import importlib.util
import json
import statistics
from pathlib import Path

import pytest
import torch

from linvit_mm.staged import demo_stages
from linvit_mm.staged import recipes as demo_recipes

REPO = Path(__file__).resolve().parents[2]


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def demo():
    return load_module('linvit_demo', REPO / 'tools' / 'demo.py')


def test_table_shows_mean_std_and_each_seed(demo):
    top1 = {'random': {0: 40.0, 1: 50.0}, 'staged-1-2-3': {0: 61.25, 1: 62.75}}
    table = demo.transfer_table(top1, demo_recipes.summarise(top1)).splitlines()
    assert table[0].split() == ['recipe', 'mean', '+-', 'std', 'seed', '0', 'seed', '1']
    assert table[1].split() == ['random', '45.00', '+-', '7.07', '40.00', '50.00']
    assert table[2].split() == ['staged-1-2-3', '62.00', '+-', '1.06', '61.25', '62.75']


def test_bar_chart_is_written(demo, tmp_path):
    top1 = {'random': {0: 40.0, 1: 50.0}, 'copy': {0: 45.0, 1: 47.0}}
    path = tmp_path / 'chart.png'
    demo.bar_chart(top1, demo_recipes.summarise(top1), 'relu', 70.0, 210, str(path))
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.parametrize('argv,message', [
    (['--seeds', '0', '0'], 'distinct'),
    (['--seeds', '-1'], 'non-negative'),
    (['--recipes', 'copy', 'copy'], 'twice'),
    (['--transfer-iters', '2', '--recipes', 'staged-1-2-3'], 'each of the 3 stages'),
    (['--jobs', '0'], '--jobs must be >= 1'),
])
def test_bad_arguments_are_refused(demo, argv, message, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(argv)
    assert message in capsys.readouterr().err


def test_source_defaults_and_work_dirs(demo):
    assert demo.parse_args([]).source == 'vit'
    assert demo.parse_args([]).work_dir == str(REPO / 'work_dirs' / 'demo')
    assert demo.parse_args(['--source', 'dinov2']).work_dir == str(
        REPO / 'work_dirs' / 'demo_dinov2')
    assert demo.parse_args(['--source', 'dinov2', '--work-dir', 'w']).work_dir == 'w'


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_transfer_stage_end_to_end(demo, monkeypatch, tmp_path, in_process_run_tool):
    """A staged recipe (alignment, then fine-tuning on its checkpoint) x two seeds, a few steps
    each: per-seed results, their summary, table and chart, and seeds that train different
    weights."""
    from linvit_mm.utils.checkpoint import load_checkpoint_file
    monkeypatch.setattr(demo_stages, 'run_tool', in_process_run_tool)
    name = demo_recipes.TEACHER_SET
    maker, params = demo_recipes.DEMO_SETS[name]
    monkeypatch.setitem(demo_recipes.DEMO_SETS, name,
                        (maker, dict(params, train_per_class=4, val_per_class=2)))
    summary = demo.main(['--recipes', 'staged-1-3', '--seeds', '0', '1', '--teacher-iters', '2',
                         '--transfer-iters', '4', '--jobs', '1', '--skip-dense', '--work-dir',
                         str(tmp_path / 'work'), '--data-root', str(tmp_path / 'data')])
    assert summary['transfer_val_images'] == 210
    result = summary['transfer_top1']['staged-1-3']
    values = [result['seeds'][0], result['seeds'][1]]
    assert result['n'] == 2 and result['mean'] == pytest.approx(statistics.mean(values))
    assert result['std'] == pytest.approx(statistics.stdev(values))
    assert result['stages'] == [('align-attn', 1), ('staged-ft', 3)]
    work = tmp_path / 'work'
    written = json.loads((work / 'summary.json').read_text())
    assert written['transfer_top1']['staged-1-3']['seeds'] == {'0': values[0], '1': values[1]}
    assert (work / 'transfer_accuracy.png').is_file()
    heads = [load_checkpoint_file(str(work / 'relu' / 'staged-1-3' / f'seed{seed}' / 'staged-ft' /
                                      'iter_3.pth'))['state_dict']['head.layers.head.weight']
             for seed in (0, 1)]
    assert not torch.equal(*heads)


@pytest.mark.slow
def test_dinov2_transfer_end_to_end(demo, monkeypatch, tmp_path, in_process_run_tool):
    """--source dinov2 through the classification stages: the teacher and a distilled student
    trained from the configs it writes, both with DINOv2's registers and 14-pixel patches."""
    from linvit_mm.utils.checkpoint import load_checkpoint_file
    monkeypatch.setattr(demo_stages, 'run_tool', in_process_run_tool)
    name = demo_recipes.TEACHER_SET
    maker, params = demo_recipes.DEMO_SETS[name]
    monkeypatch.setitem(demo_recipes.DEMO_SETS, name,
                        (maker, dict(params, train_per_class=4, val_per_class=2)))
    work = tmp_path / 'work'
    summary = demo.main(['--source', 'dinov2', '--recipes', 'fullcopy-distill', '--seeds', '0',
                         '--teacher-iters', '2', '--transfer-iters', '2', '--jobs', '1',
                         '--skip-dense', '--work-dir', str(work), '--data-root',
                         str(tmp_path / 'data')])
    assert summary['source'] == 'dinov2'
    assert summary['transfer_top1']['fullcopy-distill']['n'] == 1
    assert (work / 'configs' / demo_recipes.TEACHER_CONFIG).is_file()
    for checkpoint in (work / 'teacher' / 'iter_2.pth',
                       work / 'relu' / 'fullcopy-distill' / 'seed0' / 'fullcopy-distill' /
                       'iter_2.pth'):
        state = load_checkpoint_file(str(checkpoint))['state_dict']
        assert state['backbone.register_tokens'].shape == (1, 4, 96)
        assert state['backbone.patch_embed.projection.weight'].shape[-2:] == (14, 14)
        assert state['backbone.pos_embed'].shape == (1, 64, 96)
