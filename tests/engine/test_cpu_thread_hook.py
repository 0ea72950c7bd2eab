"""CPUThreadHook and the entry tools/train.py and tools/test.py add for it: the tools'
thread governor polled before every iteration, only where the tool chose the thread count."""
import logging
import types

import pytest
from mmengine.config import Config
from mmengine.registry import HOOKS

from linvit_mm.engine.hooks import CPUThreadHook, cpu_thread_hook
from linvit_mm.engine.launch import add_cpu_thread_hook

AUTOMATIC = {'OMP_NUM_THREADS': '2', 'LINVIT_MM_AUTO_THREADS': '2'}
ENTRY = dict(type='CPUThreadHook')


def test_added_where_the_tool_chose_the_thread_count():
    cfg = Config(dict(default_hooks=dict(logger=dict(type='LoggerHook'))))
    notes = add_cpu_thread_hook(cfg, AUTOMATIC)
    assert cfg.default_hooks.cpu_threads == ENTRY
    assert cfg.default_hooks.logger == dict(type='LoggerHook')
    assert notes == ["added default_hooks.cpu_threads={'type': 'CPUThreadHook'}: fewer "
                     'intra-op threads while other processes hold some of the cores']
    cfg = Config(dict())
    add_cpu_thread_hook(cfg, AUTOMATIC)
    assert cfg.default_hooks == dict(cpu_threads=ENTRY)


@pytest.mark.parametrize('fields, environ', [
    (dict(), {'OMP_NUM_THREADS': '2'}),
    (dict(), {'OMP_NUM_THREADS': '1', 'LINVIT_MM_AUTO_THREADS': '2'}),
    (dict(default_hooks=dict(cpu_threads=None)), AUTOMATIC),
    (dict(default_hooks=dict(cpu_threads=dict(type='CPUThreadHook', interval=5.))), AUTOMATIC),
    (dict(custom_hooks=[dict(type='linvit_mm.CPUThreadHook')]), AUTOMATIC),
], ids=['users-count', 'count-split-by-a-parent', 'switched-off', 'configured', 'custom-hook'])
def test_not_added_where_the_count_is_not_the_tools_or_the_config_decides(fields, environ):
    cfg = Config(fields)
    before = cfg.to_dict()
    assert add_cpu_thread_hook(cfg, environ) == []
    assert cfg.to_dict() == before


class Governor:
    def __init__(self):
        self.polls, self.threads, self.cpus = 0, 2, [0, 1]

    def poll(self):
        self.polls += 1
        return self.threads


def runner_with_log():
    return types.SimpleNamespace(logger=logging.getLogger('cpu-thread-hook-test'))


def test_the_hook_polls_before_every_iteration_of_every_loop(monkeypatch, caplog):
    governor = Governor()
    seen = {}

    def fake(interval, log=None):
        seen.update(interval=interval, log=log)
        return governor

    monkeypatch.setattr(cpu_thread_hook, 'tool_thread_governor', fake)
    hook = HOOKS.build(dict(type='CPUThreadHook', interval=0.5))
    assert isinstance(hook, CPUThreadHook) and hook.priority == 'VERY_HIGH'
    runner = runner_with_log()
    with caplog.at_level(logging.INFO, logger='cpu-thread-hook-test'):
        hook.before_run(runner)
    assert seen == dict(interval=0.5, log=runner.logger.info)
    assert ('CPUThreadHook: 2 intra-op threads, fewer while other processes hold some of the '
            '2 CPUs (checked every 0.5 s)') in caplog.text
    hook.before_train_iter(runner, 0, None)
    hook.before_val_iter(runner, 0, None)
    hook.before_test_iter(runner, 0, None)
    assert governor.polls == 3


def test_without_a_governor_the_hook_says_so_and_does_nothing(monkeypatch, caplog):
    monkeypatch.setattr(cpu_thread_hook, 'tool_thread_governor', lambda interval, log: None)
    hook = CPUThreadHook()
    runner = runner_with_log()
    with caplog.at_level(logging.INFO, logger='cpu-thread-hook-test'):
        hook.before_run(runner)
    assert 'the intra-op thread count stays as set' in caplog.text
    hook.before_train_iter(runner, 0, None)  # nothing to poll, nothing fails


@pytest.mark.parametrize('interval', [0, -1])
def test_the_hook_refuses_a_bad_interval(interval):
    with pytest.raises(ValueError, match=f'interval must be > 0 seconds, got {interval}'):
        CPUThreadHook(interval=interval)


def test_the_hook_decides_every_second_by_default():
    assert CPUThreadHook().interval == 1.
