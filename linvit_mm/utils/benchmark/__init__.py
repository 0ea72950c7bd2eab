"""What the benchmark tools (``tools/analysis_tools/benchmark_*.py``) measure and how: timing
protocols, memory probes, random batches and the acceptance thresholds (:mod:`.targets`).
The tools parse arguments, print, and write tables and plots.

``common``: argument helpers, clocks, ``padded``/``rotated``; ``load``: other processes' load;
``memory``: peak-memory probes; ``neighbour``: the busy-neighbour comparison; ``backbone``,
``adapter``, ``dense``, ``align``, ``distill`` (with ``steps``): each tool's measurement;
``targets``: the thresholds and verdicts.
"""
from .common import (DETECTION_PAD_DIVISOR, ForwardClock, Stopwatch, add_training_step_args,
                     check_training_step_args, padded, parse_arch, quiet_mmengine_logs, rotated,
                     scalar_loss, synchronise)
from .load import BackgroundLoad, wait_for_quiet
from .memory import (MMAP_THRESHOLD, PROBE_GRID, cuda_step_peak_mib, probe_environment,
                     reset_peak_rss, rss_step_peak, run_probe, status_kib)
from .neighbour import (NEIGHBOUR_ARCH, NEIGHBOUR_STEP, NEIGHBOUR_STEPS, NEIGHBOUR_WARMUP,
                        SPINNER_CODE, _neighbour_child, busy_neighbour, format_neighbour_table,
                        measure_in_subprocess, neighbour_policies, neighbour_ratios,
                        run_neighbour_benchmark, time_neighbour_step)
from .targets import (ALIGN_MEMORY_RATIO, ALIGN_TIME_RATIO, BOUND_FRACTION_TARGETS,
                      BOUND_TARGET_TOKENS, DISTILL_TIME_RATIO, HYBRID_EXCESS, MEMORY_GROWTH,
                      MEMORY_PAIR, SMALL_SLOWDOWN, SMALL_TOKENS)

__all__ = [
    'ALIGN_MEMORY_RATIO', 'ALIGN_TIME_RATIO', 'BOUND_FRACTION_TARGETS', 'BOUND_TARGET_TOKENS',
    'BackgroundLoad', 'DETECTION_PAD_DIVISOR', 'DISTILL_TIME_RATIO', 'ForwardClock',
    'HYBRID_EXCESS', 'MEMORY_GROWTH', 'MEMORY_PAIR', 'MMAP_THRESHOLD', 'NEIGHBOUR_ARCH',
    'NEIGHBOUR_STEP', 'NEIGHBOUR_STEPS', 'NEIGHBOUR_WARMUP', 'PROBE_GRID', 'SMALL_SLOWDOWN',
    'SMALL_TOKENS', 'SPINNER_CODE', 'Stopwatch', 'add_training_step_args',
    'busy_neighbour', 'check_training_step_args', 'cuda_step_peak_mib',
    'format_neighbour_table', 'measure_in_subprocess', 'neighbour_policies',
    'neighbour_ratios', 'padded', 'parse_arch', 'probe_environment', 'quiet_mmengine_logs',
    'reset_peak_rss', 'rotated', 'rss_step_peak', 'run_neighbour_benchmark', 'run_probe',
    'scalar_loss', 'status_kib', 'synchronise', 'time_neighbour_step', 'wait_for_quiet'
]
