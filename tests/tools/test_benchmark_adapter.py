"""tools/analysis_tools/benchmark_adapter.py on a ViT-Tiny adapter at a small size (seconds)."""
import csv
import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def load_tool():
    path = REPO / 'tools' / 'analysis_tools' / 'benchmark_adapter.py'
    spec = importlib.util.spec_from_file_location('benchmark_adapter', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_tool()


@pytest.fixture
def one_thread():
    """The tool sets torch's thread count for the process; give it back afterwards."""
    threads = torch.get_num_threads()
    yield ['--threads', '1']
    torch.set_num_threads(threads)


def test_times_each_operator_and_splits_the_time(tmp_path, capsys, one_thread):
    out = tmp_path / 'adapter.csv'
    rows, passed = bench.main(['--arch', 'tiny', '--size', '70', '45', '--operators', 'softmax',
                               'relu', 'mhla', '--repeats', '2', '--warmup', '0', '--csv',
                               str(out), *one_thread])
    assert [row['operator'] for row in rows] == ['softmax', 'relu', 'mhla']
    for row in rows:
        # 70 x 45 is padded to 96 x 64 as mmdet pads to 32: a 6 x 4 patch grid
        assert (row['padded_width'], row['padded_height'], row['patch_tokens']) == (96, 64, 24)
        assert 0 < row['vit_blocks_ms'] < row['total_ms']
        assert row['adapter_ms'] > 0 and len(row['total_samples_ms']) == 2
    assert rows[0]['speedup'] == 1.0
    assert rows[1]['speedup'] == pytest.approx(rows[0]['total_ms'] / rows[1]['total_ms'])
    assert passed == all(row['total_ms'] < rows[0]['total_ms'] for row in rows[1:])
    with open(out) as f:
        assert [r['operator'] for r in csv.DictReader(f)] == ['softmax', 'relu', 'mhla']
    assert (tmp_path / 'adapter.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    printed = capsys.readouterr().out
    assert '| relu |' in printed and f'wrote {out} and {tmp_path / "adapter.png"}' in printed
    assert 'issue' not in printed.lower()


@pytest.mark.parametrize('argv, message', [
    (['--operators', 'softmax', 'performer'], 'unknown operators'),
    (['--operators', 'relu', 'relu'], 'twice'),
    (['--repeats', '0'], '--repeats'),
], ids=['unknown-operator', 'duplicate', 'no-repeats'])
def test_bad_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err
