"""tools/analysis_tools/benchmark_backbone.py: tiny end-to-end runs, the targets' lines, the
options.

The measurement and the verdicts are tested in tests/utils/test_benchmark_backbone_timing.py
and tests/utils/test_benchmark_targets.py."""
import csv
import importlib.util
import re
from pathlib import Path

import pytest

from linvit_mm.models.attention import attention_types
from linvit_mm.utils.benchmark import backbone

REPO = Path(__file__).resolve().parents[2]
TINY_ARCH = dict(embed_dims=64, num_layers=2, num_heads=2, feedforward_channels=128)


@pytest.fixture(scope='module')
def bench():
    path = REPO / 'tools' / 'analysis_tools' / 'benchmark_backbone.py'
    spec = importlib.util.spec_from_file_location('benchmark_backbone', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_writes_table_csv_and_plot(bench, tmp_path, capsys):
    rows = bench.main(['--arch', '{"embed_dims": 64, "num_layers": 2, "num_heads": 2, '
                       '"feedforward_channels": 128}', '--sizes', '32', '64', '--repeats', '1',
                       '--warmup', '0', '--threads', '1', '--no-memory', '--out-dir',
                       str(tmp_path)])
    printed = capsys.readouterr().out
    assert '64x64 px, 16 patch tokens' in printed and 'CPU checks' in printed
    with open(tmp_path / 'benchmark_backbone.csv', newline='') as f:
        reader = csv.DictReader(f)
        records = list(reader)
    assert tuple(reader.fieldnames) == bench.CSV_COLUMNS
    assert [(r['size'], r['operator']) for r in records] == [
        (str(size), op) for size in (32, 64) for op in attention_types()]
    for record in records:
        assert float(record['fwd_ms']) > 0 and float(record['train_ms']) > 0
        assert float(record['mac_bound']) == pytest.approx(
            backbone.mac_bound(record['operator'], int(record['size']), TINY_ARCH), rel=1e-9)
        assert record['peak_mib'] == ''
        assert float(record['saved_mib']) > 0 and int(record['launches']) > 0
    softmax = [r for r in records if r['operator'] == 'softmax']
    assert all(float(r['speedup_fwd']) == 1 and float(r['mac_bound']) == 1 for r in softmax)
    assert len(rows) == 2 * len(attention_types())
    assert (tmp_path / 'benchmark_backbone.png').stat().st_size > 0


def test_targets_not_checked_are_one_line(bench):
    results = [('relu fwd @ 196 tokens <= 1.1x softmax', 'PASS', '1.02x softmax'),
               ('relu fwd speed-up >= 90% of MAC bound @ 4096 tokens', 'SKIP', 'not measured'),
               ('relu train peak memory @ 16384 <= 4.5x @ 4096 tokens', 'SKIP', 'no memory')]
    lines = bench.format_targets(results).splitlines()
    assert lines[1] == '  PASS   relu fwd @ 196 tokens <= 1.1x softmax: 1.02x softmax'
    assert len(lines) == 3 and lines[2].startswith('  2 targets not checked: they need')
    assert 'SKIP' not in '\n'.join(lines)
    assert len(bench.format_targets(results[:1]).splitlines()) == 2


def test_unknown_operator_is_rejected(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(['--operators', 'softmax', 'performer'])


def test_a_hybrid_is_measured_beside_its_operators(bench, tmp_path):
    rows = bench.main(['--arch', '{"embed_dims": 64, "num_layers": 2, "num_heads": 2, '
                       '"feedforward_channels": 128}', '--operators', 'softmax', 'relu',
                       'relu+softmax@-1', '--sizes', '64', '--repeats', '1', '--warmup', '0',
                       '--threads', '1', '--no-memory', '--out-dir', str(tmp_path)])
    by_op = {row['operator']: row for row in rows}
    assert list(by_op) == ['softmax', 'relu', 'relu+softmax@1']  # as LinearViT names it
    hybrid = by_op['relu+softmax@1']
    assert hybrid['block_operators'] == ['relu', 'softmax']
    assert hybrid['mac_bound'] == pytest.approx(
        backbone.mac_bound('relu+softmax@1', 64, TINY_ARCH), rel=1e-12)
    # one block of each: its MACs are the mean of the two models' (same patch embedding)
    assert hybrid['macs'] == pytest.approx((by_op['softmax']['macs'] + by_op['relu']['macs']) / 2,
                                           rel=1e-12)


@pytest.mark.parametrize('operator, message', [
    ('relu+softmax@12', 'holds block 12, outside the 12 blocks'),
    ('relu+performer@1', "unknown attention type 'performer'"),
    ('relu+softmax', 'is not an operator@blocks part'),
])
def test_a_bad_hybrid_is_rejected(bench, capsys, operator, message):
    with pytest.raises(SystemExit):
        bench.parse_args(['--operators', 'softmax', operator])
    assert message in capsys.readouterr().err


def test_the_released_forms_of_hedgehog_and_inline_are_measured_by_name(bench):
    """hedgehog-untied builds LoLCATs' released maps (one for the keys too, kaiming-uniform,
    not the identity), inline-residual InLine-DeiT's residual branch; both take their
    operator's bound target and pass ``--operators`` as they are."""
    import torch

    from linvit_mm.utils.benchmark.targets import BOUND_FRACTION_TARGETS, bound_fractions
    untied = backbone.build_backbone('hedgehog-untied', TINY_ARCH, 32).layers[0].attn
    assert not untied.tie_qk and untied.feature_proj_k is not None
    assert untied.feature_init == 'kaiming_uniform'
    assert not torch.allclose(untied.feature_proj[0], torch.eye(untied.head_dims))
    tied = backbone.build_backbone('hedgehog', TINY_ARCH, 32).layers[0].attn
    assert tied.tie_qk and tied.feature_proj_k is None
    assert backbone.build_backbone('inline-residual', TINY_ARCH, 32).layers[0].attn.residual
    assert backbone.build_backbone('inline', TINY_ARCH, 32).layers[0].attn.residual is None
    assert bound_fractions(['hedgehog-untied', 'inline-residual']) == {
        'hedgehog-untied': BOUND_FRACTION_TARGETS['hedgehog'],
        'inline-residual': BOUND_FRACTION_TARGETS['inline']}
    assert bench.parse_args(['--operators', 'softmax', 'hedgehog-untied', 'inline-residual',
                             '--no-memory']).operators == ['softmax', 'hedgehog-untied',
                                                           'inline-residual']


@pytest.mark.parametrize('argv, message', [
    (['--sizes', '0'], r'--sizes \[0\]: each size must be a positive multiple of the patch size '
                       r'16 px'),
    (['--sizes', '224', '-32'], r'--sizes \[-32\]'),
    (['--sizes', '100'], r'--sizes \[100\]'),
    (['--arch', '{"embed_dims": 0, "num_layers": 2, "num_heads": 1, '
                '"feedforward_channels": 4}'], '--arch: every size must be >= 1'),
    (['--max-retakes', '-1'], '--max-retakes must be >= 0, got -1'),
    (['--max-background', '-1'], '--max-background is a number of busy cores >= 0'),
    (['--max-background', 'nan'], '--max-background is a number of busy cores >= 0'),
    (['--threads', '0'], '--threads must be >= 1'),
    (['--compile', '--warmup', '0'], '--compile needs a warm-up of at least 1'),
    (['--compile', '--large-from', '0', '--large-warmup', '0'],
     '--compile needs a warm-up of at least 1'),
], ids=['size-0', 'negative-size', 'not-a-multiple', 'arch-width-0', 'retakes', 'background',
        'background-nan', 'threads', 'compile-without-warmup', 'compile-without-large-warmup'])
def test_bad_arguments_are_refused_before_any_model_is_built(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


def test_an_out_dir_that_is_a_file_is_refused(bench, capsys, tmp_path):
    (tmp_path / 'file').write_text('')
    with pytest.raises(SystemExit):
        bench.parse_args(['--out-dir', str(tmp_path / 'file')])
    assert 'is a file, not a directory' in capsys.readouterr().err


def test_gpu_options_are_refused_on_the_cpu(bench, capsys):
    for argv in (['--amp'], ['--batch-size', '4']):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert '--amp and --batch-size are GPU options' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(['--device', 'cuda', '--batch-size', '0'])
    assert '--batch-size must be >= 1' in capsys.readouterr().err


def test_a_batch_under_bf16_autocast_is_timed_and_recorded():
    """The GPU mode's step (batch, bf16 autocast) runs on the CPU too, at the function level;
    on CUDA it also pins Softmax to FlashAttention."""
    rows = backbone.benchmark_size(32, ['softmax', 'relu'], TINY_ARCH, 'cpu', 1, 0,
                                   log=lambda msg: None, batch_size=2, amp=True)
    assert [(r['operator'], r['batch_size'], r['precision']) for r in rows] == [
        ('softmax', 2, 'bf16 autocast'), ('relu', 2, 'bf16 autocast')]
    assert all(r['fwd_ms'] > 0 and r['train_ms'] > 0 for r in rows)


@pytest.mark.slow  # inductor compiles two models: 7 s here with a warm cache, more without
def test_compiled_models_are_timed_and_each_step_counts_its_launches():
    """``compile``: the models run through torch.compile (the rows say so); each row counts
    what one training step launches (ATen calls on a CPU), far fewer once inductor fused the
    step."""
    import torch
    torch._dynamo.reset()
    eager, compiled = (backbone.benchmark_size(32, ['softmax', 'relu'], TINY_ARCH, 'cpu', 1, 1,
                                               log=lambda msg: None, compile=mode)
                       for mode in (False, True))
    assert [r['mode'] for r in eager + compiled] == ['eager'] * 2 + ['compiled'] * 2
    for plain, fused in zip(eager, compiled):
        assert fused['train_ms'] > 0 and fused['macs'] == plain['macs']
        assert 0 < fused['launches'] < plain['launches'] / 4, (plain, fused)


@pytest.mark.parametrize('operator', ['relu', 'elu', 'hedgehog', 'inline'])
def test_the_pytorch_form_of_a_fused_operator_is_measured_by_name(bench, operator):
    """``<op>-pytorch`` builds the operator with ``fused=False``, beside the default, so a GPU
    run times the fused kernels against the PyTorch form in one table."""
    fused = backbone.build_backbone(operator, TINY_ARCH, 32).layers[0].attn
    plain = backbone.build_backbone(f'{operator}-pytorch', TINY_ARCH, 32).layers[0].attn
    assert fused.attn_type == plain.attn_type == operator
    assert fused.fused and not plain.fused
    assert bench.parse_args(['--operators', 'softmax', operator, f'{operator}-pytorch',
                             '--no-memory']).operators == ['softmax', operator,
                                                           f'{operator}-pytorch']
