"""linvit_mm.staged.demo_stages: the console's view of the tools' logs and the reuse of finished
stages."""
import os
import re
from pathlib import Path

import pytest

from linvit_mm.staged import demo_sources, demo_stages
from linvit_mm.staged import recipes as demo_recipes

REPO = Path(__file__).resolve().parents[2]
TRAIN_LINE = ('11/30 14:49:03 - mmengine - INFO - Iter(train) [ 50/1500]  base_lr: 5.0000e-04 '
              'lr: 5.0000e-04  eta: 0:03:12  time: 0.1276  data_time: 0.0031  memory: 0  '
              'grad_norm: 1.2300  loss: 1.7140\n')


def test_progress_lines_keep_the_eta():
    assert demo_stages.shown_line(TRAIN_LINE) == (
        'Iter(train) [ 50/1500] lr: 5.0000e-04  eta: 0:03:12  time: 0.1276  memory: 0  '
        'loss: 1.7140')


@pytest.mark.parametrize('line', [
    '11/30 14:50:00 - mmengine - INFO - Epoch(val) [1][8/8]    accuracy/top1: 47.9167  '
    'data_time: 0.01  time: 0.02\n',
    '11/30 14:50:00 - mmengine - INFO - Iter(val) [400/400]    aAcc: 71.0  mIoU: 25.46\n',
], ids=['accuracy', 'miou'])
def test_metric_lines_are_shown(line):
    shown = demo_stages.shown_line(line)
    assert shown is not None and 'data_time' not in shown and ' - INFO - ' not in shown


def test_other_lines_are_not_shown():
    assert demo_stages.shown_line('11/30 14:50:00 - mmengine - INFO - Checkpoints will be saved to '
                           '/tmp/x.\n') is None


# ----------------------------------------------------------------------------- reuse
class FakeTrain:
    """Stands in for ``tools/train.py``: writes the checkpoint and prints a validation."""

    def __init__(self):
        self.calls = 0

    def __call__(self, args, log_path, show=True, threads=None):
        self.calls += 1
        work_dir = Path(args[args.index('--work-dir') + 1])
        checkpoint = work_dir / 'iter_1.pth'
        checkpoint.write_bytes(b'weights')
        (work_dir / 'last_checkpoint').write_text(str(checkpoint))
        return f'Epoch(val) [1][4/4]    accuracy/top1: {40.0 + self.calls}\n'


def test_finished_stage_is_reused_only_with_the_same_options(monkeypatch, tmp_path):
    fake = FakeTrain()
    monkeypatch.setattr(demo_stages, 'run_tool', fake)
    config = tmp_path / 'configs' / demo_recipes.CLS_CONFIG.format(stage='mlpcopy')
    config.parent.mkdir()
    config.write_text((REPO / 'configs' / 'demo' / config.name).read_text())
    config = str(config)
    first = demo_stages.train(config, str(tmp_path), ['a=1'], False, metric_name='accuracy/top1')
    assert first[:2] == (str(tmp_path / 'iter_1.pth'), 41.0) and fake.calls == 1
    assert not first.reused
    assert demo_stages.train(config, str(tmp_path), ['a=1'], False,
                             metric_name='accuracy/top1') == first._replace(reused=True)
    assert fake.calls == 1
    assert demo_stages.train(config, str(tmp_path), ['a=2'], False,
                             metric_name='accuracy/top1')[1] == 42.0
    assert demo_stages.train(config, str(tmp_path), ['a=2'], True,
                             metric_name='accuracy/top1')[1] == 43.0
    (tmp_path / 'iter_1.pth').unlink()  # a record without its checkpoint is run again
    assert demo_stages.train(config, str(tmp_path), ['a=2'], False,
                             metric_name='accuracy/top1')[1] == 44.0
    # an earlier stage's checkpoint written again (same path, new weights): run again
    previous = tmp_path / 'previous.pth'
    previous.write_bytes(b'old')
    options = [f'model.backbone.init_cfg.checkpoint={previous}']
    assert demo_stages.train(config, str(tmp_path), options, False).reused is False
    assert demo_stages.train(config, str(tmp_path), options, False).reused is True
    os.utime(previous, (previous.stat().st_atime, previous.stat().st_mtime + 10))
    assert demo_stages.train(config, str(tmp_path), options, False).reused is False
    assert fake.calls == 6
    # the config itself changed (a source's config written again): run again
    os.utime(config, (os.stat(config).st_atime, os.stat(config).st_mtime + 10))
    assert demo_stages.train(config, str(tmp_path), options, False).reused is False
    assert demo_stages.train(config, str(tmp_path), options, False).reused is True
    assert fake.calls == 7


def test_a_given_runner_runs_the_stage_instead_of_a_subprocess(monkeypatch, tmp_path):
    """benchmark_recipes --in-process passes its runner; the module's run_tool stays unused."""
    def refuse(*args, **kwargs):
        raise AssertionError('run_tool ran although a runner was given')

    monkeypatch.setattr(demo_stages, 'run_tool', refuse)
    fake = FakeTrain()
    config = tmp_path / 'c.py'
    config.write_text('x = 1\n')
    run = demo_stages.train(str(config), str(tmp_path / 'w'), ['a=1'], False,
                            metric_name='accuracy/top1', runner=fake)
    assert run.metric == 41.0 and fake.calls == 1


# ------------------------------------------------------------------- the two runners

TOOL = '''import os, sys
def main(argv):
    print('Iter(train) [1/2]  base_lr: 2  lr: 1')
    print('env', os.environ.get('OMP_NUM_THREADS'), os.environ.get('PYTHONUNBUFFERED'))
    for i in range(40):
        print(f'line {i}')
    print('argv', argv)
    if argv and argv[0] == 'fail':
        raise RuntimeError('asked to fail')
if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except RuntimeError:
        sys.exit(2)
'''


@pytest.fixture
def tool(tmp_path):
    path = tmp_path / 'train.py'
    path.write_text(TOOL)
    return str(path)


def test_a_subprocess_run_is_logged_and_shows_its_progress(tool, tmp_path, capsys):
    log_path = tmp_path / 'run.log'
    output = demo_stages.run_tool([tool, 'ok'], str(log_path), threads=3)
    assert log_path.read_text() == output
    assert 'env 3 1\n' in output and "argv ['ok']\n" in output
    shown = capsys.readouterr().out
    assert shown == '    Iter(train) [1/2]  lr: 1\n'  # base_lr hidden
    demo_stages.run_tool([tool], str(log_path), show=False)
    assert capsys.readouterr().out == ''


def test_a_failed_subprocess_run_names_its_log_and_shows_its_last_lines(tool, tmp_path):
    log_path = tmp_path / 'run.log'
    with pytest.raises(SystemExit) as info:
        demo_stages.run_tool([tool, 'fail'], str(log_path), show=False)
    message = str(info.value)
    assert message.startswith(f'demo: {tool} fail failed (exit 2); log: {log_path}\n')
    assert 'line 39\n' in message and 'line 11\n' in message and 'line 10\n' not in message


def test_an_in_process_run_calls_main_once_loaded(tool, tmp_path):
    import torch
    threads = torch.get_num_threads()
    runner = demo_stages.InProcessTools(threads=1, label='here')
    try:
        torch.set_num_threads(2)
        output = runner([tool, 'ok'], str(tmp_path / 'a.log'))
        assert torch.get_num_threads() == 1  # the runner's own
        runner([tool, 'again'], str(tmp_path / 'b.log'), threads=2)
        assert torch.get_num_threads() == 2  # the call's
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / 'a.log').read_text() == output
    # a train.py run is named apart from any other run of the same config in this second,
    # and draws with a visualizer of its own
    names = re.search(r"argv \['ok', 'experiment_name=(here_[0-9a-f]{12})', "
                      r"'visualizer.name=(here_[0-9a-f]{12})'\]", output)
    assert names and names[1] == names[2]
    assert names[1] not in (tmp_path / 'b.log').read_text()
    assert list(runner.modules) == [tool]
    with pytest.raises(SystemExit, match=rf"here: {re.escape(tool)} fail failed "
                                         rf"\(RuntimeError\('asked to fail'\)\); log: "):
        runner([tool, 'fail'], str(tmp_path / 'c.log'))
    assert 'line 39' in (tmp_path / 'c.log').read_text()


# ------------------------------------------------------------------ the stages' wiring

class RecordingRunner(FakeTrain):
    """``FakeTrain`` that records each call and prints two validations (the last counts)."""

    def __init__(self):
        super().__init__()
        self.runs = []

    def __call__(self, args, log_path, show=True, threads=None):
        self.runs.append(dict(args=list(args), log=log_path, show=show, threads=threads))
        if args[0] != 'tools/train.py':
            return ''
        super().__call__(args, log_path)
        return 'Epoch(val) [1][4/4]    accuracy/top1: 10.0\n' \
               'Epoch(val) [2][4/4]    accuracy/top1: 20.0\n'


def _without_seed(run):
    return {key: value for key, value in run.items() if key != 'seed'}


@pytest.fixture
def recipe_run(tmp_path):
    teacher = tmp_path / 'teacher.pth'
    teacher.write_bytes(b'weights')
    return dict(seed=3, steps=8, attn_type='relu', teacher=str(teacher),
                data_root=str(tmp_path / 'data'), configs=demo_sources.DemoConfigs('vit'),
                work_dir=str(tmp_path / 'run'))


def test_a_recipe_runs_its_stages_in_order_each_from_the_last(recipe_run):
    runner = RecordingRunner()
    run = demo_stages.run_recipe('staged-1-3-lora', force=False, threads=2, runner=runner,
                                 **recipe_run)
    work_dir = recipe_run['work_dir']
    _, lora = runner.runs
    assert [r['args'][1] for r in runner.runs] == [
        recipe_run['configs'].path(demo_recipes.CLS_CONFIG.format(stage=stage))
        for stage in ('align-attn', 'staged-lora')]
    assert [r['args'][3] for r in runner.runs] == [f'{work_dir}/align-attn',
                                                   f'{work_dir}/staged-lora']
    assert all(r['show'] is False and r['threads'] == 2 for r in runner.runs)
    assert (f'model.backbone.module.init_cfg.checkpoint={work_dir}/align-attn/iter_1.pth'
            in lora['args'])
    assert run.checkpoint == f'{work_dir}/staged-lora/iter_1.pth' and run.metric == 20.0
    assert 0 <= run.seconds < 60 and not run.reused
    assert demo_stages.run_recipe('staged-1-3-lora', force=False, runner=runner,
                                  **recipe_run).reused
    assert len(runner.runs) == 2


def test_a_lora_run_is_merged_into_a_plain_checkpoint(recipe_run):
    runner = RecordingRunner()
    run = demo_stages.run_recipe('staged-1-3-lora', force=False, runner=runner, **recipe_run)
    work_dir = recipe_run['work_dir']
    merged = demo_stages.plain_checkpoint('staged-1-3-lora', 3, run.checkpoint, runner=runner,
                                          **_without_seed(recipe_run))
    assert merged == f'{work_dir}/staged-lora/merged.pth'
    merge = runner.runs[-1]
    options = demo_recipes.stage_options(
        'staged-lora', 6, attn_type='relu', seed=3, teacher=recipe_run['teacher'],
        data_root=recipe_run['data_root'], previous=f'{work_dir}/align-attn/iter_1.pth')
    assert merge['args'] == [demo_stages.MERGE_LORA, recipe_run['configs'].path(
        demo_recipes.CLS_CONFIG.format(stage='staged-lora')), run.checkpoint, merged,
        '--cfg-options', *options]
    assert merge['show'] is False and merge['log'] == f'{work_dir}/staged-lora/merge.log'
    calls = len(runner.runs)
    assert demo_stages.plain_checkpoint('staged-1-2-3', 3, 'x.pth', runner=runner,
                                        **_without_seed(recipe_run)) == 'x.pth'
    assert len(runner.runs) == calls


def test_the_teacher_takes_its_own_options(recipe_run, tmp_path):
    runner = RecordingRunner()
    data_root = recipe_run['data_root']
    run = demo_stages.train_teacher(str(tmp_path / 'teacher'), data_root, 5, False,
                                    recipe_run['configs'], runner=runner)
    assert run.metric == 20.0
    config = recipe_run['configs'].path(demo_recipes.TEACHER_CONFIG)
    assert runner.runs[0]['args'] == [
        'tools/train.py', config, '--work-dir', str(tmp_path / 'teacher'), '--cfg-options',
        *demo_recipes.data_options(os.path.join(data_root, demo_recipes.TEACHER_SET)),
        *demo_recipes.schedule_options(demo_recipes.TEACHER_CONFIG, 5)]


def test_a_run_that_fails_leaves_no_record_of_the_earlier_one(tmp_path):
    config = tmp_path / 'c.py'
    config.write_text('x = 1\n')
    demo_stages.train(str(config), str(tmp_path / 'w'), ['a=1'], False, runner=FakeTrain())

    def fail(*args, **kwargs):
        raise SystemExit('failed')

    with pytest.raises(SystemExit):
        demo_stages.train(str(config), str(tmp_path / 'w'), ['a=2'], False, runner=fail)
    assert not (tmp_path / 'w' / 'demo_run.json').exists()


def test_the_last_value_of_a_metric_is_read():
    assert demo_stages.metric('mIoU: 1.5\nmIoU: -2.25\n', 'mIoU') == -2.25
    with pytest.raises(SystemExit, match='demo: the output has no mIoU'):
        demo_stages.metric('aAcc: 3\n', 'mIoU')


def test_a_three_stage_recipe_continues_each_stage_from_the_one_before(recipe_run):
    runner = RecordingRunner()
    demo_stages.run_recipe('staged-1-2-3', force=False, runner=runner, **recipe_run)
    work_dir = recipe_run['work_dir']
    assert (f'model.backbone.init_cfg.checkpoint={work_dir}/align-feat/iter_1.pth'
            in runner.runs[2]['args'])


def test_a_stage_is_shown_unless_asked_otherwise_and_the_log_lines_are_stamped(tmp_path,
                                                                              capsys):
    config = tmp_path / 'c.py'
    config.write_text('x = 1\n')
    runner = RecordingRunner()
    demo_stages.train(str(config), str(tmp_path / 'w'), [], False, runner=runner)
    assert runner.runs[-1]['show'] is True
    demo_stages.log('a message')
    assert re.fullmatch(r'\[demo \d\d:\d\d:\d\d\] a message\n', capsys.readouterr().out)


class DenseRunner(RecordingRunner):
    """A dense run's tools/train.py: the checkpoint and a final validation of each metric."""

    def __call__(self, args, log_path, show=True, threads=None):
        super().__call__(args, log_path, show, threads)
        return ('Epoch(val) [4][8/8]    coco/bbox_mAP: 0.0100  coco/segm_mAP: 0.0200\n'
                'Epoch(val) [5][8/8]    coco/bbox_mAP: 0.3120  coco/bbox_mAP_50: 0.9000  '
                'coco/segm_mAP: 0.2500\n'
                'Iter(val) [8/8]    aAcc: 90.0000  mIoU: 41.5000  mAcc: 50.0000\n')


@pytest.mark.parametrize('task,neck,init,metric', [
    ('detection', 'plain', 'pre-trained', 0.312),
    ('detection', 'adapter', 'random', 0.312),
    ('segmentation', 'plain', 'random', 41.5),
    ('segmentation', 'adapter', 'pre-trained', 41.5),
])
def test_a_dense_run_trains_its_necks_config_from_the_classifier_or_at_random(
        task, neck, init, metric, tmp_path):
    runner = DenseRunner()
    configs = demo_sources.DemoConfigs('vit')
    kwargs = dict(classifier='/c/best.pth', attn_type='ttt', data_root='/data', budget=7,
                  configs=configs, work_dir=str(tmp_path / 'run'), force=False, threads=1,
                  runner=runner)
    run = demo_stages.run_dense(task, neck, init, 2, **kwargs)
    assert run.metric == metric and not run.reused
    (call, ) = runner.runs
    options = demo_recipes.dense_options(
        task, neck, '/data', 7, attn_type='ttt', seed=2,
        checkpoint='/c/best.pth' if init == 'pre-trained' else None)
    assert call['args'] == [
        'tools/train.py', configs.path(demo_recipes.DENSE_TASKS[task]['configs'][neck]),
        '--work-dir', str(tmp_path / 'run'), '--cfg-options', *options]
    assert call['show'] is False and call['threads'] == 1
    assert demo_stages.run_dense(task, neck, init, 2, **kwargs).reused


def test_a_dense_run_refuses_an_unknown_init(tmp_path):
    with pytest.raises(ValueError, match="unknown init 'imagenet'; inits: pre-trained, random"):
        demo_stages.run_dense('detection', 'plain', 'imagenet', 0, classifier='c.pth',
                              attn_type='relu', data_root='/d', budget=1,
                              configs=demo_sources.DemoConfigs('vit'),
                              work_dir=str(tmp_path), force=False, runner=DenseRunner())
