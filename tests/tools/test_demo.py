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
    (['--seeds', '-1'], 'integers from 0 to 2147483647'),
    (['--seeds', '0', '4294967296'], 'integers from 0 to 2147483647, got [0, 4294967296]'),
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


@pytest.mark.slow
def test_dense_stage_end_to_end(demo, monkeypatch, tmp_path, in_process_run_tool):
    """The dense stage from a two-step classifier: Mask R-CNN and UperNet, each on the plain
    pyramid and on the adapter, from the classifier's ViT and from a random one, two seeds:
    every run trained, the table's rows and the summary's verdicts from those runs."""
    monkeypatch.setattr(demo_stages, 'run_tool', in_process_run_tool)
    for name, smaller in ((demo_recipes.TEACHER_SET, dict(train_per_class=4, val_per_class=2)),
                          (demo_recipes.DET_SET, dict(num_train=4, num_val=4))):
        maker, params = demo_recipes.DEMO_SETS[name]
        monkeypatch.setitem(demo_recipes.DEMO_SETS, name, (maker, dict(params, **smaller)))
    work = tmp_path / 'work'
    summary = demo.main(['--recipes', 'fullcopy-distill', '--seeds', '0', '--teacher-iters', '2',
                         '--transfer-iters', '2', '--det-epochs', '1', '--seg-iters', '2',
                         '--dense-seeds', '0', '1', '--jobs', '1', '--work-dir', str(work),
                         '--data-root', str(tmp_path / 'data')])
    assert summary['dense_seeds'] == [0, 1]
    for task, unit in (('detection', 'epochs'), ('segmentation', 'iterations')):
        result = summary['dense'][task]
        assert result['budget_unit'] == unit and set(result['necks']) == {'plain', 'adapter'}
        for neck, row in result['necks'].items():
            runs = row['runs']
            assert set(runs) == {'pre-trained', 'random'}
            assert all(set(by_seed) == {0, 1} for by_seed in runs.values())
            assert row['verdict'] == demo_recipes.compare_inits(runs)['verdict']
            trained = work / 'relu' / 'dense' / f'{task}_{neck}'
            for init in ('pre-trained', 'random'):
                log = (trained / init / 'seed1' / 'train.log').read_text()
                assert ('ViT tensors from' in log) == (init == 'pre-trained'), (task, neck, init)
    written = json.loads((work / 'summary.json').read_text())
    assert written['dense']['segmentation']['necks']['plain']['verdict'] == (
        summary['dense']['segmentation']['necks']['plain']['verdict'])


def _comparisons(verdicts):
    """``compare_inits`` of runs that give each task and neck the verdict asked for."""
    runs = {'pre-trained ahead': ({0: 30., 1: 32., 2: 31.}, {0: 20., 1: 25., 2: 22.}),
            'random ahead': ({0: 20., 1: 21., 2: 22.}, {0: 30., 1: 25., 2: 28.}),
            'overlap': ({0: 10., 1: 30., 2: 20.}, {0: 15., 1: 25., 2: 20.5})}
    comparisons, dense = {}, {}
    for (task, neck), verdict in verdicts.items():
        pre, rand = runs[verdict]
        dense.setdefault(task, {})[neck] = {'pre-trained': pre, 'random': rand}
        comparisons.setdefault(task, {})[neck] = demo_recipes.compare_inits(
            dense[task][neck])
    return dense, comparisons


def test_dense_table_shows_both_inits_their_runs_and_the_verdict(demo):
    dense, comparisons = _comparisons({('detection', 'plain'): 'pre-trained ahead',
                                       ('segmentation', 'adapter'): 'overlap'})
    header, detection, segmentation = demo.dense_table(dense, comparisons).splitlines()
    assert header.split()[:4] == ['metric', 'neck', 'pre-trained', 'ViT']
    assert detection.split() == ['Mask', 'R-CNN', 'box', 'AP', 'plain', '31.0', '+-', '1.0',
                                 '22.3', '+-', '2.5', '+8.7', '30.0', '32.0', '31.0', '|',
                                 '20.0', '25.0', '22.0', 'pre-trained', 'ahead']
    assert segmentation.split()[:3] == ['UperNet', 'mIoU', 'adapter']
    assert segmentation.split()[-1] == 'overlap' and '-0.2' in segmentation.split()


def test_dense_verdicts_say_plainly_when_no_comparison_separates(demo):
    _, comparisons = _comparisons({('detection', 'plain'): 'random ahead',
                                   ('segmentation', 'plain'): 'overlap'})
    lines = demo.dense_verdicts(comparisons)
    assert lines == [
        'Mask R-CNN box AP, plain neck: every random run beats every pre-trained one (a '
        'chance of 0.05 if the start made no difference).',
        'UperNet mIoU, plain neck: the pre-trained and random runs overlap, so these 3 seeds '
        'show no effect of the pre-training.',
        "So at this budget the dense stage shows that the classifier's ViT carries into Mask "
        'R-CNN and UperNet and trains there, not that its pre-training helps them.']


def test_runs_that_all_end_alike_learned_nothing_to_compare(demo):
    floor = {0: 15.07, 1: 15.07, 2: 15.07}
    comparisons = {'segmentation': {'adapter': demo_recipes.compare_inits(
        {'pre-trained': floor, 'random': dict(floor)})}}
    assert demo.dense_verdicts(comparisons)[0] == (
        'UperNet mIoU, adapter neck: every run ended at 15.1, so nothing was learned that '
        'could tell the two starts apart.')


def test_one_separation_among_several_comparisons_is_called_a_hint(demo):
    """Four comparisons of three seeds: one separation in the pre-trained ViT's favour comes
    by chance 1 - 0.95^4 = 19 % of the time; the table says so. Two are reported with each
    one's chance."""
    keys = [(task, neck) for task in ('detection', 'segmentation')
            for neck in ('plain', 'adapter')]
    _, comparisons = _comparisons(dict(zip(keys, ['pre-trained ahead'] + ['overlap'] * 3)))
    lines = demo.dense_verdicts(comparisons)
    assert lines[0] == ('Mask R-CNN box AP, plain neck: every pre-trained run beats every '
                        'random one (a chance of 0.05 if the start made no difference).')
    assert lines[-1] == ('1 of 4 comparisons put the pre-trained ViT ahead; if the start made '
                         'no difference, at least one of 4 would do so by chance 19% of the '
                         'time, so read a single one as a hint to be repeated with other '
                         'seeds, not as evidence.')
    _, comparisons = _comparisons(dict(zip(keys, ['pre-trained ahead'] * 2 + ['overlap'] * 2)))
    assert demo.dense_verdicts(comparisons)[-1] == (
        '2 of 4 comparisons put the pre-trained ViT ahead, each with a chance of at most 0.05 '
        'if the start made no difference.')


def test_the_dense_summary_holds_each_pairs_runs_rows_and_verdict(demo):
    dense, comparisons = _comparisons({('detection', 'adapter'): 'pre-trained ahead',
                                       ('segmentation', 'plain'): 'random ahead'})
    sets = dict(detection=dict(train=48, val=48), segmentation=dict(train=24, val=8))
    summary = demo.dense_summary(dense, comparisons, dict(detection=4, segmentation=120), sets)
    detection, segmentation = summary['detection'], summary['segmentation']
    assert {key: detection[key] for key in ('metric', 'budget', 'budget_unit', 'images')} == dict(
        metric='Mask R-CNN box AP', budget=4, budget_unit='epochs', images=sets['detection'])
    assert (segmentation['budget'], segmentation['budget_unit']) == (120, 'iterations')
    adapter = detection['necks']['adapter']
    assert adapter['runs'] == dense['detection']['adapter']
    assert adapter['verdict'] == 'pre-trained ahead' and adapter['p_separated'] == 0.05
    assert adapter['difference'] == pytest.approx(31. - 67 / 3)
    assert adapter['pre-trained'] == comparisons['detection']['adapter']['rows']['pre-trained']
    assert adapter['random'] == comparisons['detection']['adapter']['rows']['random']
    assert segmentation['necks']['plain']['verdict'] == 'random ahead'


@pytest.mark.parametrize('argv,message', [
    (['--dense-seeds', '1', '1'], '--dense-seeds must be distinct'),
    (['--dense-seeds', '-2'], '--dense-seeds must be distinct integers from 0'),
    (['--dense-seeds', '2147483648'], '--dense-seeds must be distinct integers from 0'),
])
def test_bad_dense_seeds_are_refused(demo, argv, message, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(argv)
    assert message in capsys.readouterr().err
