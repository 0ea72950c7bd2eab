"""The acceptance thresholds of the benchmark tools and the verdicts against them.

The numbers are the benchmarks' (docs/benchmarks.md states them), not properties of the
operators: an operator knows its cost (``core_macs``), the benchmark how close to that cost a
measured speed-up has to come.
"""
import math
import statistics

REFERENCE = 'softmax'


def _operator_variants():
    # imported when needed: the memory probes' fresh interpreters load this package without
    # the models the backbone benchmark builds
    from .backbone import OPERATOR_VARIANTS
    return OPERATOR_VARIANTS

# ------------------------------------------------ backbone (CPU, fp32, batch 1, ViT-S)
# Each operator's speed-up over softmax (forward and training step) at BOUND_TARGET_TOKENS
# must reach this fraction of its MAC-count bound, MACs(softmax) / MACs(operator): the share
# of the arithmetic saving that survives as wall time. An operator without an entry
# (softmax, the reference) has no such target. Every operator is held to its whole bound:
# at these lengths softmax's N x N work dominates, and an operator that loses part of its
# saving to memory passes the MAC count does not see has room to be made faster.
BOUND_FRACTION_TARGETS = {
    'elu': 1.0,
    'relu': 1.0,
    'inline': 1.0,
    'hedgehog': 1.0,
    'mhla': 1.0,
    'ttt': 1.0,
}
BOUND_TARGET_TOKENS = (4096, 16384)
# At the smallest size no linear operator may take more time than softmax.
SMALL_TOKENS, SMALL_SLOWDOWN = 196, 1.0
# There the operators lie within a few percent of softmax, which is as wide as a shared
# machine's noise (on 2026-12-03 a fixed 512 x 512 product loop on two threads of the CPU
# machine took 67 ms at best and 137-161 ms at its 90th percentile). So that verdict is
# taken on the paired ratios of each repetition (operator / softmax, timed within seconds of
# each other) and a distribution-free interval of their median at this confidence: PASS
# where its upper end is within SMALL_SLOWDOWN, FAIL where its lower end is past it, and
# NOISE where the run cannot tell the two apart. With too few repetitions for an interval
# the ratio of the medians decides alone.
SMALL_CONFIDENCE = 0.95
# The training step's peak memory from the first to the second token count may grow by at
# most this factor (4x the tokens: linear growth, plus some slack).
MEMORY_PAIR, MEMORY_GROWTH = (4096, 16384), 4.5
# A hybrid takes at most this many times what its MAC bound predicts at BOUND_TARGET_TOKENS.
HYBRID_EXCESS = 1.1

# ---------------------------------------------------------------- training steps
# Attention alignment against a plain step: median per-pair time ratio and peak memory ratio.
ALIGN_TIME_RATIO = 1.3
ALIGN_MEMORY_RATIO = 0.6
# A step with AttentionDistillHook against one without: median per-pair time ratio.
DISTILL_TIME_RATIO = 1.35


def verdict(passed):
    return 'PASS' if passed else 'FAIL'


def median_interval(values, confidence=SMALL_CONFIDENCE):
    """``(low, high)``: the k-th smallest and k-th largest of ``values``, k the largest rank
    whose binomial tail, P(Binomial(n, 1/2) < k), is at most ``(1 - confidence) / 2``; the
    median lies outside with at most that probability on each side, whatever the values'
    distribution (21 values: the 6th and 16th, 97 %). None where n is too small (n < 6 at
    95 %)."""
    ordered, n = sorted(values), len(values)
    tail = (1 - confidence) / 2
    k, below = 0, 0.5**n  # below = P(Binomial(n, 1/2) <= k)
    while below <= tail:
        k += 1
        below += math.comb(n, k) * 0.5**n
    return (ordered[k - 1], ordered[n - k]) if k else None


def small_target(row, ref, kind):
    """``(verdict, detail)`` of ``row``'s ``kind`` time against softmax's (``ref``) at
    SMALL_TOKENS (see SMALL_CONFIDENCE)."""
    ratio = row[f'{kind}_ms'] / ref[f'{kind}_ms']
    samples, ref_samples = row.get(f'{kind}_samples_ms'), ref.get(f'{kind}_samples_ms')
    interval = None
    if samples and ref_samples and len(samples) == len(ref_samples):
        pairs = [a / b for a, b in zip(samples, ref_samples)]
        interval = median_interval(pairs)
    detail = f'{ratio:.2f}x softmax'
    if interval is None:
        return verdict(ratio <= SMALL_SLOWDOWN), detail
    low, high = interval
    detail += (f' (per repetition {statistics.median(pairs):.2f}x, '
               f'{SMALL_CONFIDENCE:.0%} interval {low:.2f}-{high:.2f}x)')
    if high <= SMALL_SLOWDOWN:
        return 'PASS', detail
    return ('FAIL' if low > SMALL_SLOWDOWN else 'NOISE'), detail


def is_hybrid(operator):
    """Whether an ``--operators`` entry is a hybrid (``relu+softmax@0,11``)."""
    from linvit_mm.models.backbones.hybrid import parse_attn_spec
    return (operator not in _operator_variants()
            and not isinstance(parse_attn_spec(operator), str))


def bound_fractions(operators):
    """``{operator: BOUND_FRACTION_TARGETS entry}`` of the measured operators that have one
    (an operator form takes its operator's; hybrids have their own target,
    ``HYBRID_EXCESS``)."""
    variants = _operator_variants()
    fractions = {op: BOUND_FRACTION_TARGETS.get(variants.get(op, (op, ))[0])
                 for op in operators if not is_hybrid(op)}
    return {op: fraction for op, fraction in fractions.items() if fraction is not None}


def blockwise_prediction(row, by_key, kind):
    """What the hybrid's blocks' operators predict for its ``kind`` time: each block charged
    its operator's measured time per block, ``sum_op n_op / L * t(op)``; None when one of
    them was not measured at that size."""
    blocks = row['block_operators']
    predicted = 0.
    for op in set(blocks):
        single = by_key.get((row['patch_tokens'], op))
        if single is None:
            return None
        predicted += blocks.count(op) / len(blocks) * single[f'{kind}_ms']
    return predicted


def hybrid_targets(rows, by_key):
    results = []
    hybrids = [op for op in dict.fromkeys(row['operator'] for row in rows) if is_hybrid(op)]
    for tokens in BOUND_TARGET_TOKENS:
        for op in hybrids:
            row = by_key.get((tokens, op))
            for kind in ('fwd', 'train'):
                name = (f'{op} {kind} time <= {HYBRID_EXCESS:.1f}x what its MAC bound predicts '
                        f'@ {tokens} tokens')
                if row is None or row['mac_bound'] is None:
                    results.append((name, 'SKIP', 'size or softmax not measured'))
                    continue
                excess = row['mac_bound'] / row[f'speedup_{kind}']
                detail = (f'{excess:.2f}x softmax time / MAC bound ({row[f"speedup_{kind}"]:.2f}x '
                          f'of {row["mac_bound"]:.2f}x)')
                predicted = blockwise_prediction(row, by_key, kind)
                if predicted is not None:
                    detail += (f"; {row[f'{kind}_ms'] / predicted:.2f}x what its blocks' "
                               f'operators predict')
                results.append((name, verdict(excess <= HYBRID_EXCESS), detail))
    return results


def evaluate_targets(rows):
    """The backbone targets as ``(name, 'PASS' | 'FAIL' | 'NOISE' | 'SKIP', detail)``
    triples (NOISE: see SMALL_CONFIDENCE)."""
    by_key = {(row['patch_tokens'], row['operator']): row for row in rows}
    targets = bound_fractions(dict.fromkeys(row['operator'] for row in rows))
    results = []
    for tokens in BOUND_TARGET_TOKENS:
        for op, fraction in targets.items():
            row = by_key.get((tokens, op))
            for kind in ('fwd', 'train'):
                name = f'{op} {kind} speed-up >= {fraction:.0%} of MAC bound @ {tokens} tokens'
                if row is None or row['mac_bound'] is None:
                    results.append((name, 'SKIP', 'size or softmax not measured'))
                    continue
                pct = row[f'{kind}_pct_of_bound']
                results.append((name, verdict(pct >= 100 * fraction),
                                f'{row[f"speedup_{kind}"]:.2f}x of {row["mac_bound"]:.2f}x '
                                f'= {pct:.0f}%'))
    for op in targets:
        row, ref = by_key.get((SMALL_TOKENS, op)), by_key.get((SMALL_TOKENS, REFERENCE))
        for kind in ('fwd', 'train'):
            name = f'{op} {kind} @ {SMALL_TOKENS} tokens <= {SMALL_SLOWDOWN}x softmax'
            if row is None or ref is None:
                results.append((name, 'SKIP', 'size or softmax not measured'))
                continue
            results.append((name, *small_target(row, ref, kind)))
    results += hybrid_targets(rows, by_key)
    small, large = MEMORY_PAIR
    for op in targets:
        name = f'{op} train peak memory @ {large} <= {MEMORY_GROWTH}x @ {small} tokens'
        lo, hi = by_key.get((small, op)), by_key.get((large, op))
        if lo is None or hi is None or lo['peak_mib'] is None or hi['peak_mib'] is None:
            results.append((name, 'SKIP', 'size or memory not measured'))
            continue
        growth = hi['peak_mib'] / lo['peak_mib']
        results.append((name, verdict(growth <= MEMORY_GROWTH),
                        f'{hi["peak_mib"]:.0f} / {lo["peak_mib"]:.0f} MiB = {growth:.2f}x'))
    return results


def adapter_target(rows, reference=REFERENCE):
    """The adapter target: every linear operator's forward is faster than softmax's.
    ``(passed, lines)``; ``passed`` is None where softmax was not measured."""
    by_op = {row['operator']: row for row in rows}
    if reference not in by_op:
        return None, ['softmax not measured: no comparison']
    lines, passed = [], True
    for op, row in by_op.items():
        if op == reference:
            continue
        ok = row['total_ms'] < by_op[reference]['total_ms']
        passed &= ok
        lines.append(f'{op}: {row["total_ms"]:.0f} ms vs softmax '
                     f'{by_op[reference]["total_ms"]:.0f} ms -> {verdict(ok)}')
    return passed, lines
