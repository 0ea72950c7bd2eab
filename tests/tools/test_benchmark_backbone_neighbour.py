"""benchmark_backbone.py --busy-neighbour: its options and its table, the runs faked."""
import importlib.util
from pathlib import Path

import pytest

from linvit_mm.utils.benchmark import neighbour_ratios

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope='module')
def bench():
    path = REPO / 'tools' / 'analysis_tools' / 'benchmark_backbone.py'
    spec = importlib.util.spec_from_file_location('benchmark_backbone_neighbour', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extra_policies_extend_the_torch_default(bench):
    assert bench.parse_neighbour_policy('spin:GOMP_SPINCOUNT=1000,OMP_PROC_BIND=true') == (
        'spin', {'GOMP_SPINCOUNT': '1000', 'OMP_PROC_BIND': 'true'})


@pytest.mark.parametrize('text', ['spin', ':GOMP_SPINCOUNT=1', 'spin:GOMP_SPINCOUNT',
                                  'spin:=1'], ids=['no-colon', 'no-label', 'no-value', 'no-name'])
def test_bad_extra_policies_are_refused(bench, text, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(['--busy-neighbour', '--neighbour-policy', text])
    assert 'LABEL:VAR=VALUE' in capsys.readouterr().err


def test_busy_neighbour_prints_every_policy_side_by_side(bench, monkeypatch, capsys):
    seen = {}

    def fake_run(policies, steps, warmup, log=print, rounds=1):
        seen.update(policies=policies, steps=steps, warmup=warmup, rounds=rounds)
        rows = [dict(policy=label, neighbour=n, ms=10. if n == 'idle' else 20., threads=2,
                     wait_policy=env.get('OMP_WAIT_POLICY', '-'))
                for label, env in policies.items() for n in ('idle', 'busy')]
        return neighbour_ratios(rows)

    monkeypatch.setattr(bench, 'run_neighbour_benchmark', fake_run)
    rows = bench.main(['--busy-neighbour', '--neighbour-steps', '3', '--neighbour-warmup', '0',
                       '--neighbour-policy', 'spin:GOMP_SPINCOUNT=1000',
                       '--neighbour-rounds', '2'])
    assert list(seen['policies']) == ['torch default', 'linvit_mm tools', '1 thread', 'spin']
    assert seen['policies']['spin']['GOMP_SPINCOUNT'] == '1000'
    assert 'OMP_WAIT_POLICY' not in seen['policies']['spin']
    assert (seen['steps'], seen['warmup'], seen['rounds']) == (3, 0, 2)
    out = capsys.readouterr().out
    assert len(rows) == 8
    for label in seen['policies']:
        assert out.count(label) >= 2  # its idle and its busy row


@pytest.mark.parametrize('option', ['--neighbour-steps', '--neighbour-rounds'])
def test_neighbour_steps_and_rounds_must_be_positive(bench, option, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(['--busy-neighbour', option, '0'])
    assert '--neighbour-steps and --neighbour-rounds must be >= 1' in capsys.readouterr().err
