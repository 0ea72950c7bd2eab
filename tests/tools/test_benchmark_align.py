"""tools/analysis_tools/benchmark_align.py on a tiny LinearViT (seconds; not a timed test)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY_ARCH = '{"embed_dims": 32, "num_layers": 3, "num_heads": 2, "feedforward_channels": 64}'


def load_tool():
    path = REPO / 'tools' / 'analysis_tools' / 'benchmark_align.py'
    spec = importlib.util.spec_from_file_location('benchmark_align', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_tool()
TINY = ['--arch', TINY_ARCH, '--img-size', '32', '--patch-size', '8', '--batch-size', '2',
        '--num-classes', '10', '--threads', '1']


@pytest.fixture(autouse=True)
def restore_threads():
    """The tool sets torch's thread count for the process; give it back afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_benchmark_align_measures_both_steps_and_their_memory(tmp_path, capsys):
    out = tmp_path / 'align.json'
    result = bench.main([*TINY, '--iters', '3', '--warmup', '1', '--json', str(out)])
    assert len(result['plain_samples_ms']) == len(result['align_samples_ms']) == 3
    assert result['ratio'] == pytest.approx(result['align_ms'] / result['plain_ms'])
    pairs = [a / p for a, p in zip(result['align_samples_ms'], result['plain_samples_ms'])]
    assert result['pair_ratio'] == pytest.approx(sorted(pairs)[1])
    losses = result['last_losses']
    assert losses['align']['loss_align'] > 0 and losses['plain']['loss'] > 0
    # each kind of step in a fresh process: positive peaks, and the ratio of the two
    assert result['plain_peak_mib'] > 0 and result['align_peak_mib'] > 0
    assert result['memory_ratio'] == pytest.approx(result['align_peak_mib']
                                                   / result['plain_peak_mib'])
    record = json.loads(out.read_text())
    assert record['attn_type'] == 'relu' and record['target_memory_ratio'] == 0.6
    report = capsys.readouterr().out
    assert 'median of per-pair ratios' in report and 'peak memory align/plain' in report


def test_benchmark_align_subset_of_blocks_without_memory(capsys):
    result = bench.main([*TINY, '--attn-type', 'ttt', '--layers', '0', '--iters', '1',
                         '--warmup', '0', '--no-memory'])
    assert result['last_losses']['align']['loss_align'] > 0
    assert 'memory_ratio' not in result
    assert 'peak memory' not in capsys.readouterr().out


def test_benchmark_align_refuses_a_softmax_student():
    with pytest.raises(SystemExit):
        bench.parse_args(['--attn-type', 'softmax'])
    with pytest.raises(SystemExit):
        bench.parse_args(['--attn-type', 'nope'])
