"""tools/analysis_tools/benchmark_distill.py on a tiny LinearViT (seconds)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY_ARCH = '{"embed_dims": 32, "num_layers": 2, "num_heads": 2, "feedforward_channels": 64}'


def load_tool():
    path = REPO / 'tools' / 'analysis_tools' / 'benchmark_distill.py'
    spec = importlib.util.spec_from_file_location('benchmark_distill', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_tool()
TINY = ['--arch', TINY_ARCH, '--img-size', '32', '--patch-size', '8', '--batch-size', '2',
        '--num-classes', '10']


@pytest.fixture
def one_thread():
    """The tool sets torch's thread count for the process; give it back afterwards."""
    threads = torch.get_num_threads()
    yield ['--threads', '1']
    torch.set_num_threads(threads)


@pytest.mark.parametrize('attn_type', ['relu', 'mhla'], ids=['relu', 'mhla-no-cls-token'])
def test_measures_both_kinds_of_step(tmp_path, capsys, attn_type, one_thread):
    out = tmp_path / 'distill.json'
    result = bench.main([*TINY, '--attn-type', attn_type, '--iters', '3', '--warmup', '1',
                         '--json', str(out), *one_thread])
    assert len(result['without_samples_ms']) == len(result['with_samples_ms']) == 3
    assert 0 < result['teacher_ms'] < result['with_ms']
    assert result['ratio'] == pytest.approx(result['with_ms'] / result['without_ms'])
    assert result['min_ratio'] == pytest.approx(min(result['with_samples_ms'])
                                                / min(result['without_samples_ms']))
    pairs = [w / wo for w, wo in zip(result['with_samples_ms'], result['without_samples_ms'])]
    assert result['pair_ratio'] == pytest.approx(sorted(pairs)[1])
    assert result['passed'] == (result['pair_ratio'] <= bench.TARGET_RATIO)
    # the distillation steps went through the hook and summed its loss into the total
    losses = result['last_losses']
    assert losses['loss_distill'] > 0
    assert losses['loss'] == pytest.approx(losses['loss_distill'] + losses['loss_task'])
    record = json.loads(out.read_text())
    assert record['attn_type'] == attn_type and record['ratio'] == result['ratio']
    assert (tmp_path / 'distill.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    report = capsys.readouterr().out
    assert 'ratio with/without' in report and ('PASS' in report or 'FAIL' in report)
    assert f'wrote {out} and {tmp_path / "distill.png"}' in report


@pytest.mark.parametrize('argv, message', [
    (['--attn-type', 'softmax'], 'its own teacher'),
    (['--attn-type', 'linformer'], 'unknown attention type'),
    (['--iters', '0'], '--iters'),
], ids=['softmax-student', 'unknown-operator', 'no-iterations'])
def test_bad_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err
