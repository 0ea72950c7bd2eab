"""tools/device_check.py, dry run: every section on the CPU at toy sizes (the fused kernels
under Triton's interpreter), the JSON record and the table written."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about 30 s: it runs the fused-kernel tests in a subprocess too
def test_the_dry_run_fills_every_section(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / 'tools' / 'device_check.py'), '--dry-run',
                          '--out', str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads((tmp_path / 'device_check.json').read_text())
    sections = record['sections']
    assert list(sections) == ['environment', 'tests', 'core', 'modules', 'training',
                              'distillation', 'backbone']
    assert not [name for name, section in sections.items() if 'error' in section]
    fused = sections['tests']['result']['fused kernels']
    assert fused['returncode'] == 0, fused['tail']
    (core, ) = sections['core']['result']
    assert core['fused_applies'] and core['fused_ms'] > 0 and core['flash_ms'] > 0
    operators = {row['operator'] for row in sections['modules']['result']}
    assert {'softmax', 'relu', 'relu (pytorch)', 'hedgehog (pytorch)', 'ttt'} <= operators
    assert all('ms' in row and row['saved_mb'] > 0 for row in sections['modules']['result'])
    training = sections['training']['result']
    assert {(row['operator'], row['mode']) for row in training} == {
        (op, mode) for op in ('softmax', 'relu') for mode in ('eager', 'compiled')}
    assert all(row['finite'] and row['step_ms'] > 0 and row['launches'] > 0 for row in training)
    # inductor's code calls fewer ATen operators than the eager step
    launches = {(row['operator'], row['mode']): row['launches'] for row in training}
    assert launches['relu', 'compiled'] < launches['relu', 'eager']
    (distill, ) = sections['distillation']['result']
    # values, not their order: at toy sizes under the interpreter the timings are noise
    assert min(distill['with_ms'], distill['without_ms'], distill['teacher_ms']) > 0
    assert 0 < distill['teacher_fraction'] < 1
    backbone = sections['backbone']['result']
    assert {row['operator'] for row in backbone} >= {'softmax', 'relu'}
    assert all(row['launches'] > 0 and row['saved_mib'] > 0 for row in backbone)
    table = (tmp_path / 'device_check.md').read_text()
    assert '## core' in table and '| relu (pytorch) |' in table


def test_a_bad_budget_is_refused(capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location('device_check', REPO / 'tools' /
                                                  'device_check.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit):
        module.parse_args(['--out', 'x', '--budget-s', '0'])
    assert '--budget-s must be > 0' in capsys.readouterr().err
