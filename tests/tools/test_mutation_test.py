"""tools/analysis_tools/mutation_test.py: the mutants of a snippet (each one's edited line),
and runs on a tiny module with its tiny test file: a kill, a survivor, a timeout, refusals,
interrupts, and the module byte-identical afterwards every time."""
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_tool():
    path = REPO / 'tools' / 'analysis_tools' / 'mutation_test.py'
    spec = importlib.util.spec_from_file_location('mutation_test', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mt = load_tool()

SNIPPET = '''\
"""Module doc: 1 + 2 < 3."""
from typing import Literal


def scale(x: int = 2, *, clip: Literal[True, False] = True) -> float:
    """Scaled 2 * x."""
    y = x * 0.5 - 1
    if x < 0 and not clip:
        y += x ** 2
    print(f'{x + 1}', '\u00e9' + 'x', -y)
    if y == x:
        raise ValueError(f'bad {y + 1}', 3 - 1)
    assert y >= 0, 'y+%d' % (x + 1)
    return sorted([y], reverse=False)[0]


if __name__ == '__main__':
    scale(1)
'''

# (kind, line, shown as, shown mutated, the line once mutated), in source order. Nothing
# from the docstrings, the annotations, the f-string, the string '+', the raise, the
# assert's message or the __main__ block.
EXPECTED = [
    ('number', 5, '2', '3',
     'def scale(x: int = 3, *, clip: Literal[True, False] = True) -> float:'),
    ('boolean', 5, 'True', 'False',
     'def scale(x: int = 2, *, clip: Literal[True, False] = False) -> float:'),
    ('arithmetic', 7, 'x * 0.5', 'x / 0.5', '    y = x / 0.5 - 1'),
    ('number', 7, 'x * 0.5', 'x * 1.0', '    y = x * 1.0 - 1'),
    ('arithmetic', 7, 'x * 0.5 - 1', 'x * 0.5 + 1', '    y = x * 0.5 + 1'),
    ('number', 7, 'x * 0.5 - 1', 'x * 0.5 - 0', '    y = x * 0.5 - 0'),
    ('comparison', 8, 'x < 0', 'x <= 0', '    if x <= 0 and not clip:'),
    ('number', 8, 'x < 0', 'x < 1', '    if x < 1 and not clip:'),
    ('boolean-op', 8, 'x < 0 and (not clip)', 'x < 0 or not clip', '    if x < 0 or not clip:'),
    ('not', 8, 'not clip', 'clip', '    if x < 0 and clip:'),
    ('arithmetic', 9, 'y += x ** 2', 'y -= x ** 2', '        y -= x ** 2'),
    ('arithmetic', 9, 'x ** 2', 'x * 2', '        y += x * 2'),
    ('number', 9, 'x ** 2', 'x ** 3', '        y += x ** 3'),
    ('delete-call', 10, "print(f'{x + 1}', '\u00e9' + 'x', -y)", 'pass', '    pass'),
    ('negation', 10, '-y', 'y', "    print(f'{x + 1}', '\u00e9' + 'x', y)"),
    ('comparison', 11, 'y == x', 'y != x', '    if y != x:'),
    ('comparison', 13, 'y >= 0', 'y > 0', "    assert y > 0, 'y+%d' % (x + 1)"),
    ('number', 13, 'y >= 0', 'y >= 1', "    assert y >= 1, 'y+%d' % (x + 1)"),
    ('keyword', 14, 'reverse=False', 'reverse=True', '    return sorted([y], reverse=True)[0]'),
    ('number', 14, 'sorted([y], reverse=False)[0]', 'sorted([y], reverse=False)[1]',
     '    return sorted([y], reverse=False)[1]'),
]


@pytest.mark.parametrize('newline', ['\n', '\r\n'], ids=['lf', 'crlf'])
def test_mutants_of_a_snippet(tmp_path, newline):
    data = SNIPPET.replace('\n', newline).encode('utf-8')
    mutants = mt.generate(tmp_path / 'snippet.py', data)
    got = []
    for m in mutants:
        mutated = mt.mutated_bytes(data, m)
        before, after = data.split(newline.encode()), mutated.split(newline.encode())
        # one line changes, the rest of the file (its line ends too) is byte-identical
        assert len(after) == len(before)
        changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
        assert changed == [m.line - 1]
        got.append((m.kind, m.line, m.original, m.mutant, after[m.line - 1].decode()))
    assert got == EXPECTED
    assert {m.scope for m in mutants} == {'scale'}


def test_selection_by_lines_functions_and_count(tmp_path):
    data = b'def f(a):\n    return a + 1\n\n\nclass C:\n    def g(self, b):\n        return b * 2\n'
    mutants = mt.generate(tmp_path / 'm.py', data)
    assert [(m.line, m.scope) for m in mutants] == [(2, 'f')] * 2 + [(7, 'C.g')] * 2
    assert [m.line for m in mt.select(mutants, lines=[(7, 9)])] == [7, 7]
    assert [m.line for m in mt.select(mutants, functions=['g'])] == [7, 7]
    assert [m.line for m in mt.select(mutants, functions=['C'])] == [7, 7]
    assert [m.line for m in mt.select(mutants, functions=['f'])] == [2, 2]
    assert [m.line for m in mt.select(mutants, max_mutants=2)] == [2, 7]


# ------------------------------------------------------------------------- runs
MODULE = '''\
def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def countdown(n, step):
    while n > 0:
        n = n - step
    return n
'''

TESTS = '''\
from tiny import add, countdown


def test_add():
    assert add(2, 3) == {total}


def test_countdown():
    assert countdown(3, 1) == 0
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    # the tool must keep its test runs from writing bytecode, whatever the caller's setting
    monkeypatch.delenv('PYTHONDONTWRITEBYTECODE', raising=False)
    module = tmp_path / 'tiny.py'
    module.write_bytes(MODULE.encode())
    # an mtime in the past, whole seconds away from now: restored exactly, never reused
    os.utime(module, ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    (tmp_path / 'test_tiny.py').write_text(TESTS.format(total=5))
    return tmp_path


def mutation_main(project, *args):
    out = project / 'out' / 'results.json'
    argv = [str(project / 'tiny.py'), '--tests', str(project / 'test_tiny.py'),
            '--out', str(out), *args]
    return mt.main(argv, cwd=project), out


def assert_intact(project):
    module = project / 'tiny.py'
    assert module.read_bytes() == MODULE.encode()
    assert module.stat().st_mtime_ns == 1_600_000_000_123_456_789
    assert not (project / 'out' / 'results.json.backup').exists()
    # the test runs write no bytecode that a later run could take for the module's
    assert not (project / '__pycache__').exists()


FORKED = pytest.mark.parametrize('runs', [[], ['--preload', 'json']], ids=['subprocess', 'forked'])


@FORKED
def test_kill_and_survivor(project, capsys, runs):
    rc, out = mutation_main(project, '--functions', 'add', 'sub', *runs)
    assert rc == 0
    results = json.loads(out.read_text())
    by_line = {r['line']: r for r in results['results']}
    assert sorted(by_line) == [2, 6]
    assert by_line[2]['status'] == 'killed'
    assert by_line[2]['killed_by'].endswith('test_tiny.py::test_add')
    assert by_line[6]['status'] == 'survived'  # sub() has no test
    survivor = f'{project / "tiny.py"}:6: a - b -> a + b'
    assert results['survivors'] == [survivor]
    assert (results['mutants'], results['killed'], results['survived'], results['timeouts'],
            results['score']) == (2, 1, 1, 0, 0.5)
    printed = capsys.readouterr().out
    assert 'score: 50.0%' in printed and survivor in printed
    assert_intact(project)


@FORKED
def test_a_timeout_is_killed_and_the_module_restored(project, runs):
    # n - step -> n + step never ends
    rc, out = mutation_main(project, '--lines', '11', '--timeout', '1', *runs)
    assert rc == 0
    results = json.loads(out.read_text())
    assert [(r['line'], r['status']) for r in results['results']] == [(11, 'timeout')]
    assert (results['timeouts'], results['killed'], results['score']) == (1, 0, 1.0)
    assert_intact(project)


@FORKED
def test_a_failing_baseline_is_refused(project, capsys, runs):
    (project / 'test_tiny.py').write_text(TESTS.format(total=6))
    rc, out = mutation_main(project, *runs)
    assert rc == 2
    assert 'fail without any mutant' in capsys.readouterr().err
    assert not out.exists()
    assert_intact(project)


def test_preloading_the_module_under_mutation_is_refused(project, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.delitem(sys.modules, 'tiny', raising=False)
    rc, out = mutation_main(project, '--preload', 'tiny')
    assert rc == 2
    assert 'imports the module(s) under mutation (tiny)' in capsys.readouterr().err
    assert not out.exists()
    assert_intact(project)


def fake_runs(monkeypatch, project, interrupt):
    """Baseline passes; the first mutant's run checks the module on disk is the mutant, then
    is interrupted."""
    calls = []

    def run_tests(tests, timeout, cwd=None):
        calls.append(timeout)
        if len(calls) == 1:
            return 'passed', 0.1, ''
        assert (project / 'tiny.py').read_bytes() != MODULE.encode()
        interrupt()
        return 'passed', 0.1, ''

    monkeypatch.setattr(mt, 'run_tests', run_tests)
    return calls


def ctrl_c():
    raise KeyboardInterrupt


def sigterm():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler interrupts this


class OursNotTheTools(Exception):
    pass


def not_the_tools(signum, frame):
    raise OursNotTheTools


@pytest.mark.parametrize('interrupt', [ctrl_c, sigterm], ids=['ctrl-c', 'sigterm'])
def test_an_interrupt_restores_the_module(project, monkeypatch, interrupt):
    calls = fake_runs(monkeypatch, project, interrupt)
    # a handler of our own, so that a tool without one does not end this pytest
    previous = signal.signal(signal.SIGTERM, not_the_tools)
    try:
        run_interrupted(project, interrupt)
    finally:
        assert signal.getsignal(signal.SIGTERM) is not_the_tools
        signal.signal(signal.SIGTERM, previous)
    assert len(calls) == 2
    assert_intact(project)


def run_interrupted(project, interrupt):
    if interrupt is ctrl_c:
        rc, out = mutation_main(project, '--functions', 'add')
        assert rc == 130
    else:
        with pytest.raises(SystemExit) as exc:
            mutation_main(project, '--functions', 'add')
        assert exc.value.code == 128 + signal.SIGTERM
        out = project / 'out' / 'results.json'
    assert json.loads(out.read_text())['pending'] == 1


def test_a_stale_backup_is_refused_then_restored(project, capsys):
    # a run killed outright leaves the backup and, maybe, a mutant on disk
    module = project / 'tiny.py'
    backup = mt.Backup(project / 'out' / 'results.json.backup')
    backup.write({module: (module.read_bytes(), None)})
    module.write_bytes(MODULE.replace('a + b', 'a - b').encode())
    rc, _ = mutation_main(project)
    assert rc == 2
    assert 'did not finish' in capsys.readouterr().err
    assert module.read_bytes() != MODULE.encode()
    rc, _ = mutation_main(project, '--restore')
    assert rc == 0
    assert module.read_bytes() == MODULE.encode()
    assert not backup.dir.exists()


def test_each_mutant_gets_its_own_mtime(monkeypatch):
    run = mt.MutationRun([], [], 'out.json')
    now = 1_700_000_000
    monkeypatch.setattr(mt.time, 'time', lambda: now + 0.25)
    # same second as the original's, then twice within one second
    stamps = [run._stamp(now * 10**9 + 5) for _ in range(3)]
    assert stamps == [(now + 1) * 10**9, (now + 2) * 10**9, (now + 3) * 10**9]
