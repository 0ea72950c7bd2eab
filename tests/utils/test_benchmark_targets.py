"""linvit_mm.utils.benchmark.targets: the thresholds and the verdicts of each benchmark."""
import pytest

from linvit_mm.models.attention import attention_types
from linvit_mm.utils.benchmark import targets


def _row(tokens, op, fwd, train, peak, bound):
    return dict(patch_tokens=tokens, operator=op, fwd_ms=fwd, train_ms=train, peak_mib=peak,
                mac_bound=bound, speedup_fwd=None, speedup_train=None)


def test_target_verdicts():
    small_fwd = dict(softmax=10., elu=10., relu=10.1, inline=9., mhla=9.9, ttt=10.)
    rows = [_row(196, op, fwd, 30., 10., None) for op, fwd in small_fwd.items()]
    for tokens in targets.BOUND_TARGET_TOKENS:
        for op, fraction in targets.bound_fractions(small_fwd).items():
            bound = 3.
            speedup = bound * (fraction + .01 if op != 'ttt' else .5)
            row = _row(tokens, op, 100. / speedup, 100. / speedup,
                       100. if tokens == 4096 else 450., bound)
            row.update(speedup_fwd=speedup, speedup_train=speedup,
                       fwd_pct_of_bound=100 * speedup / bound,
                       train_pct_of_bound=100 * speedup / bound)
            rows.append(row)
    rows[-1]['peak_mib'] = 451.  # ttt at 16384 tokens: 4.51x its 4096-token peak
    verdicts = {name: verdict for name, verdict, _ in targets.evaluate_targets(rows)}
    assert 'SKIP' not in verdicts.values()
    assert sorted(name for name, verdict in verdicts.items() if verdict == 'FAIL') == sorted([
        'relu fwd @ 196 tokens <= 1.0x softmax',
        'ttt fwd speed-up >= 100% of MAC bound @ 4096 tokens',
        'ttt train speed-up >= 100% of MAC bound @ 4096 tokens',
        'ttt fwd speed-up >= 100% of MAC bound @ 16384 tokens',
        'ttt train speed-up >= 100% of MAC bound @ 16384 tokens',
        'ttt train peak memory @ 16384 <= 4.5x @ 4096 tokens'])


def _hybrid_rows(mixing):
    """softmax, relu and relu+softmax@0,11 rows at both target sizes: relu at its MAC bound
    (3x), the hybrid ``mixing`` times what its blocks' operators predict. Its MAC bound is
    that of 2 blocks at 1x and 10 at 3x: 12 / (2 + 10 / 3) = 2.25."""
    rows = []
    blocks = ['softmax'] + ['relu'] * 10 + ['softmax']
    for tokens in targets.BOUND_TARGET_TOKENS:
        softmax = _row(tokens, 'softmax', 100., 100., None, 1.)
        relu = _row(tokens, 'relu', 100. / 3, 100. / 3, None, 3.)
        relu.update(speedup_fwd=3., speedup_train=3., fwd_pct_of_bound=100.,
                    train_pct_of_bound=100.)
        predicted = 2 / 12 * 100. + 10 / 12 * 100. / 3
        hybrid = _row(tokens, 'relu+softmax@0,11', mixing * predicted, mixing * predicted,
                      None, 2.25)
        hybrid.update(speedup_fwd=100. / hybrid['fwd_ms'], speedup_train=100. / hybrid['fwd_ms'],
                      block_operators=blocks)
        rows += [softmax, relu, hybrid]
    return rows


def hybrid_verdicts(rows):
    return [result for result in targets.evaluate_targets(rows)
            if result[0].startswith('relu+softmax@0,11')]


def test_hybrid_target_is_its_mac_bound_plus_ten_percent():
    within = hybrid_verdicts(_hybrid_rows(mixing=1.05))
    assert [name for name, _, _ in within] == [
        f'relu+softmax@0,11 {kind} time <= 1.1x what its MAC bound predicts @ {tokens} tokens'
        for tokens in targets.BOUND_TARGET_TOKENS for kind in ('fwd', 'train')]
    assert {verdict for _, verdict, _ in within} == {'PASS'}
    assert within[0][2] == ("1.05x softmax time / MAC bound (2.14x of 2.25x); 1.05x what its "
                            "blocks' operators predict")
    beyond = hybrid_verdicts(_hybrid_rows(mixing=1.15))
    assert {verdict for _, verdict, _ in beyond} == {'FAIL'}
    assert 'relu+softmax@0,11' not in targets.bound_fractions(['relu', 'relu+softmax@0,11'])


def test_every_linear_operator_has_its_bound_fraction():
    assert set(targets.BOUND_FRACTION_TARGETS) == set(attention_types()) - {'softmax'}
    assert targets.BOUND_FRACTION_TARGETS == dict(elu=1., relu=1., inline=1., hedgehog=1.,
                                                  mhla=1., ttt=1.)
    assert (targets.SMALL_TOKENS, targets.SMALL_SLOWDOWN) == (196, 1.0)


def test_an_operator_form_takes_its_operators_fraction_and_softmax_has_none():
    fractions = dict(targets.BOUND_FRACTION_TARGETS, mhla=.5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(targets, 'BOUND_FRACTION_TARGETS', fractions)
        assert targets.bound_fractions(['softmax', 'relu', 'mhla-official',
                                        'mhla-offnorm']) == {
            'relu': 1., 'mhla-official': .5, 'mhla-offnorm': .5}


def test_adapter_target_needs_every_linear_operator_faster():
    rows = [dict(operator='softmax', total_ms=100.), dict(operator='relu', total_ms=60.),
            dict(operator='ttt', total_ms=120.)]
    passed, lines = targets.adapter_target(rows)
    assert not passed and lines == ['relu: 60 ms vs softmax 100 ms -> PASS',
                                    'ttt: 120 ms vs softmax 100 ms -> FAIL']
    assert targets.adapter_target(rows[:2])[0]
    assert targets.adapter_target([dict(operator='relu', total_ms=100.),
                                   dict(operator='softmax', total_ms=100.)])[0] is False
    assert targets.adapter_target(rows[1:])[0] is None


def test_training_step_thresholds():
    assert (targets.ALIGN_TIME_RATIO, targets.ALIGN_MEMORY_RATIO) == (1.3, 0.6)
    assert targets.DISTILL_TIME_RATIO == 1.35


@pytest.mark.parametrize('n,ranks', [(5, None), (6, (1, 6)), (10, (2, 9)), (21, (6, 16)),
                                     (100, (40, 61))])
def test_median_interval_takes_the_order_statistics_of_the_binomial_table(n, ranks):
    """95 % ranks from the binomial distribution by hand (n = 10: P(X <= 1) = 11 / 1024 is
    within 2.5 %, P(X <= 2) = 56 / 1024 is not; n = 100: the textbook 40th and 61st)."""
    values = [float(v) for v in range(n, 0, -1)]  # given unsorted: n ... 1
    expected = None if ranks is None else tuple(float(r) for r in ranks)
    assert targets.median_interval(values) == expected


def _small_rows(softmax_ms, op_ms):
    softmax = _row(196, 'softmax', sorted(softmax_ms)[len(softmax_ms) // 2], 30., None, 1.)
    op = _row(196, 'relu', sorted(op_ms)[len(op_ms) // 2], 30., None, 1.05)
    softmax['fwd_samples_ms'], op['fwd_samples_ms'] = softmax_ms, op_ms
    return op, softmax


@pytest.mark.parametrize('factors,expected', [
    ([.96, .97, .98, .99] * 5 + [1.04], 'PASS'),
    ([1.01, 1.02, 1.03, 1.04] * 5 + [.95], 'FAIL'),
    ([.97, 1.03] * 10 + [1.], 'NOISE'),
], ids=['pass', 'fail', 'noise'])
def test_small_target_decides_on_the_paired_ratios_interval(factors, expected):
    softmax_ms = [100. + 7 * (i % 5) for i in range(21)]  # a machine whose speed drifts
    op, softmax = _small_rows(softmax_ms, [f * t for f, t in zip(factors, softmax_ms)])
    verdict, detail = targets.small_target(op, softmax, 'fwd')
    assert verdict == expected
    assert '95% interval' in detail
    assert detail.startswith(f'{op["fwd_ms"] / softmax["fwd_ms"]:.2f}x softmax (per repetition')


def test_small_target_pairs_each_repetition_with_its_own():
    """Every ratio of the medians says 1.05x, the pairs of the same repetitions do not: the
    operator's samples are softmax's, 5 % slower, in another order."""
    softmax_ms = [100. + 2 * i for i in range(21)]
    shuffled = softmax_ms[10:] + softmax_ms[:10]
    op, softmax = _small_rows(softmax_ms, [1.05 * t for t in shuffled])
    assert targets.small_target(op, softmax, 'fwd')[0] == 'NOISE'
    op, softmax = _small_rows(softmax_ms, [1.05 * t for t in softmax_ms])
    assert targets.small_target(op, softmax, 'fwd')[0] == 'FAIL'


def test_small_target_without_samples_takes_the_ratio_of_medians():
    op, softmax = _small_rows([100.] * 3, [101.] * 3)
    assert targets.small_target(op, softmax, 'fwd') == ('FAIL', '1.01x softmax')
    del op['fwd_samples_ms']
    op['fwd_ms'] = 99.
    assert targets.small_target(op, softmax, 'fwd') == ('PASS', '0.99x softmax')
