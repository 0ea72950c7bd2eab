"""tools/analysis_tools/benchmark_dense.py on a tiny 8-block ViT at small sizes (seconds)."""
import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ARCH = '{"embed_dims": 32, "num_layers": 8, "num_heads": 2, "feedforward_channels": 64}'


def load_tool():
    path = REPO / 'tools' / 'analysis_tools' / 'benchmark_dense.py'
    spec = importlib.util.spec_from_file_location('benchmark_dense', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = load_tool()


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield ['--threads', '1']
    torch.set_num_threads(threads)


def test_every_neck_and_variant_side_by_side(capsys, one_thread):
    rows = bench.main(['--arch', ARCH, '--operators', 'softmax', 'relu', '--sizes', '70x45',
                       '130x100', '--repeats', '1', '--warmup', '0', *one_thread])
    keys = [(r['size'], r['neck'], r['variant']) for r in rows]
    assert keys == [(size, neck, variant) for size in ('70x45', '130x100')
                    for neck in ('plain', 'adapter') for variant in ('softmax', 'softmax-win',
                                                                     'relu')]
    # padded to 32 as mmdet pads: 96 x 64 and 160 x 128, patch 16
    assert [r['tokens'] for r in rows] == [24] * 6 + [80] * 6
    index = {key: row for key, row in zip(keys, rows)}
    for (size, neck, variant), row in index.items():
        assert row['forward_ms'] > 0 and row['train_ms'] > 0 and row['saved_mb'] > 0
        reference = index[(size, neck, 'softmax')]
        assert row['train_x'] == pytest.approx(reference['train_ms'] / row['train_ms'])
        if neck == 'adapter':
            plain = index[(size, 'plain', variant)]
            assert row['adapter_over_plain_saved'] == pytest.approx(
                row['saved_mb'] / plain['saved_mb'])
        else:
            assert row['adapter_over_plain_forward'] is None
    # the adapter keeps more for its backward than the plain pyramid around the same ViT
    assert index[('130x100', 'adapter', 'relu')]['saved_mb'] > \
        index[('130x100', 'plain', 'relu')]['saved_mb']
    table = capsys.readouterr().out
    assert '| 130x100 (80 tok) | adapter | softmax-win |' in table


@pytest.mark.parametrize('argv, message', [
    (['--sizes', '13x'], '--sizes are WxH'),
    (['--operators', 'nope'], 'unknown operators'),
    (['--repeats', '0'], '--repeats must be'),
], ids=['bad_size', 'unknown_operator', 'no_repeats'])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err
