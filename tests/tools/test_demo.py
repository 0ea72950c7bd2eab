"""tools/demo.py: what the console shows of the tools' logs while a stage runs (the full demo
takes minutes; tests/e2e runs its stages)."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN_LINE = ('11/30 14:49:03 - mmengine - INFO - Iter(train) [ 50/1500]  base_lr: 5.0000e-04 '
              'lr: 5.0000e-04  eta: 0:03:12  time: 0.1276  data_time: 0.0031  memory: 0  '
              'grad_norm: 1.2300  loss: 1.7140\n')


@pytest.fixture(scope='module')
def demo():
    spec = importlib.util.spec_from_file_location('linvit_demo', REPO / 'tools' / 'demo.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_progress_lines_keep_the_eta(demo):
    assert demo.shown_line(TRAIN_LINE) == ('Iter(train) [ 50/1500] lr: 5.0000e-04  eta: 0:03:12  '
                                           'time: 0.1276  memory: 0  loss: 1.7140')


@pytest.mark.parametrize('line', [
    '11/30 14:50:00 - mmengine - INFO - Epoch(val) [1][8/8]    accuracy/top1: 47.9167  '
    'data_time: 0.01  time: 0.02\n',
    '11/30 14:50:00 - mmengine - INFO - Iter(val) [400/400]    aAcc: 71.0  mIoU: 25.46\n',
], ids=['accuracy', 'miou'])
def test_metric_lines_are_shown(demo, line):
    shown = demo.shown_line(line)
    assert shown is not None and 'data_time' not in shown and ' - INFO - ' not in shown


def test_other_lines_are_not_shown(demo):
    assert demo.shown_line('11/30 14:50:00 - mmengine - INFO - Checkpoints will be saved to '
                           '/tmp/x.\n') is None
