"""linvit_mm.staged.demo_stages: the console's view of the tools' logs and the reuse of finished
stages."""
import os
import re
from pathlib import Path

import pytest

from linvit_mm.staged import demo_stages
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
        output = runner([tool, 'ok'], str(tmp_path / 'a.log'))
        assert torch.get_num_threads() == 1
        runner([tool, 'again'], str(tmp_path / 'b.log'), threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / 'a.log').read_text() == output
    # a train.py run is named apart from any other run of the same config in this second
    assert re.search(r"argv \['ok', 'experiment_name=here_[0-9a-f]{12}'\]", output)
    assert list(runner.modules) == [tool]
    with pytest.raises(SystemExit, match=rf"here: {re.escape(tool)} fail failed "
                                         rf"\(RuntimeError\('asked to fail'\)\); log: "):
        runner([tool, 'fail'], str(tmp_path / 'c.log'))
    assert 'line 39' in (tmp_path / 'c.log').read_text()
