"""Pieces the analysis tools (``tools/analysis_tools/benchmark_*.py``) share."""
import json
import logging
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import torch


def parse_arch(value):
    """``--arch``: a LinearViT arch name (``'small'``) or a JSON dict of the four arch keys.

    A dict passes through, so a value parsed once can be parsed again.
    """
    if isinstance(value, dict):
        return value
    text = value.strip()
    if text.startswith('{'):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f'--arch {text!r} is not valid JSON: {err}') from None
    return text


# mmdet's DetDataPreprocessor pad_size_divisor in the Mask R-CNN configs
DETECTION_PAD_DIVISOR = 32


def padded(length, divisor=DETECTION_PAD_DIVISOR):
    """``length`` rounded up to a multiple of ``divisor``, as the data preprocessor pads."""
    return -(-length // divisor) * divisor


def rotated(items, shift):
    """``items`` rotated left by ``shift``: each repeat of a side-by-side timing starts with
    another variant, so no variant always runs first (cold caches) or last."""
    shift %= len(items)
    return list(items[shift:]) + list(items[:shift])


def synchronise(device):
    """Wait for queued CUDA work, so a wall clock read after it covers that work."""
    if torch.device(device).type == 'cuda':
        torch.cuda.synchronize(device)


@contextmanager
def quiet_mmengine_logs(level=logging.WARNING):
    """Raise the current mmengine logger's level for a block.

    ``init_weights`` logs every parameter's initialisation at INFO, which buries a
    benchmark's own output; the tools only need the values.
    """
    from mmengine.logging import MMLogger
    logger = MMLogger.get_current_instance()
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)


class ForwardClock:
    """Summed wall time of the forwards of some modules, through their own forward hooks.

    Times a part of a model (its ViT blocks, a distillation teacher) inside a larger
    forward without changing that forward.
    """

    def __init__(self, modules, device):
        self.device = device
        self.total = 0.
        self._start = None
        self.handles = []
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._begin))
            self.handles.append(module.register_forward_hook(self._end))

    def _begin(self, *args):
        synchronise(self.device)
        self._start = time.perf_counter()

    def _end(self, *args):
        synchronise(self.device)
        self.total += time.perf_counter() - self._start

    def take(self):
        """Seconds summed since the last ``take``; restarts the sum."""
        total, self.total = self.total, 0.
        return total

    def remove(self):
        for handle in self.handles:
            handle.remove()


def add_training_step_args(parser, iters, pair):
    """The options of the tools that time a student's training step against another step.

    ``iters``: the default number of timed pairs; ``pair``: what one pair is, for the help.
    """
    parser.add_argument('--arch', default='small', type=parse_arch,
                        help='LinearViT arch name or a JSON dict (default: small)')
    parser.add_argument('--attn-type', default='relu', help='student operator (default: relu)')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--img-size', type=int, default=224)
    parser.add_argument('--patch-size', type=int, default=16)
    parser.add_argument('--num-classes', type=int, default=1000)
    parser.add_argument('--iters', type=int, default=iters, help=f'timed pairs ({pair})')
    parser.add_argument('--warmup', type=int, default=2, help='untimed pairs first')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--amp', action='store_true',
                        help='mixed precision: fp16 AmpOptimWrapper on CUDA, bf16 on CPU')
    parser.add_argument('--threads', type=int, default=None,
                        help='torch intra-op threads (default: torch default)')


def check_training_step_args(parser, args):
    """Refuse, through ``parser.error``, what :func:`add_training_step_args` options cannot
    measure: no timed pair, an unknown or a Softmax student, CUDA where there is none."""
    from linvit_mm.models.attention import attention_class, attention_types
    if args.iters < 1 or args.warmup < 0 or args.batch_size < 1:
        parser.error('--iters and --batch-size must be >= 1, --warmup >= 0')
    try:
        attention_class(args.attn_type)
    except ValueError as err:
        parser.error(str(err))
    if args.attn_type == 'softmax':
        parser.error('--attn-type softmax: the student would be its own teacher; choose a '
                     f'linear operator ({", ".join(attention_types()[1:])})')
    if torch.device(args.device).type == 'cuda' and not torch.cuda.is_available():
        parser.error('--device cuda: CUDA is not available on this machine')


# ---------------------------------------------------------------- beside a busy neighbour
# The step of the demo's teacher stage: LinearViT 4 blocks, width 96 (3 heads), 64 px
# images in 8 px patches, batch 32, Softmax attention, mean of the outputs, AdamW.
NEIGHBOUR_ARCH = dict(embed_dims=96, num_layers=4, num_heads=3, feedforward_channels=384)
NEIGHBOUR_STEP = dict(arch=NEIGHBOUR_ARCH, attn_type='softmax', img_size=64, patch_size=8,
                      batch_size=32)
NEIGHBOUR_STEPS, NEIGHBOUR_WARMUP = 30, 5
# A single-threaded process that keeps its core busy until it is killed.
SPINNER_CODE = 'while True:\n    pass\n'


def neighbour_policies(environ=None):
    """``{label: environment}`` of the runs the busy-neighbour mode compares.

    ``torch default``: none of the OpenMP thread or wait variables (what a plain script gets);
    ``linvit_mm tools``: what a tool sets on a machine where the user set none
    (:func:`linvit_mm.cpu_threads.tool_environment`); ``1 thread``: the torch default wait,
    one intra-op thread, the reference a busy neighbour should not fall far below.
    """
    from linvit_mm.cpu_threads import THREAD_VARIABLES, WAIT_VARIABLES, tool_environment
    environ = os.environ if environ is None else environ
    plain = {k: v for k, v in environ.items() if k not in WAIT_VARIABLES + THREAD_VARIABLES}
    return {'torch default': plain,
            'linvit_mm tools': dict(plain, **tool_environment(plain)),
            '1 thread': dict(plain, OMP_NUM_THREADS='1')}


def time_neighbour_step(steps=NEIGHBOUR_STEPS, warmup=NEIGHBOUR_WARMUP, **step):
    """Mean wall time (ms) of ``steps`` training steps after ``warmup`` untimed ones, with
    this process's threading as it is; returns ``dict(ms, threads, samples_ms)``."""
    from linvit_mm.models.backbones.linear_vit import LinearViT
    step = dict(NEIGHBOUR_STEP, **step)
    torch.manual_seed(0)
    model = LinearViT(arch=step['arch'], attn_type=step['attn_type'], img_size=step['img_size'],
                      patch_size=step['patch_size'])
    with quiet_mmengine_logs():
        model.init_weights()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    images = torch.randn(step['batch_size'], 3, step['img_size'], step['img_size'])
    samples = []
    for index in range(warmup + steps):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        sum(out.float().mean() for out in model(images)).backward()
        optimizer.step()
        if index >= warmup:
            samples.append((time.perf_counter() - started) * 1e3)
    return dict(ms=sum(samples) / len(samples), threads=torch.get_num_threads(),
                samples_ms=samples)


def _neighbour_child(options):
    # Runs in the fresh process of one measurement: its environment is the policy's.
    print(json.dumps(time_neighbour_step(**json.loads(options))), flush=True)


def measure_in_subprocess(env, steps, warmup, **step):
    """:func:`time_neighbour_step` in a fresh interpreter with environment ``env`` (libgomp
    reads its variables once, when torch loads, so each policy needs its own process)."""
    code = ('import sys\nfrom linvit_mm.utils.benchmark import _neighbour_child\n'
            '_neighbour_child(sys.argv[1])\n')
    options = json.dumps(dict(step, steps=steps, warmup=warmup))
    result = subprocess.run([sys.executable, '-c', code, options], env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f'the busy-neighbour measurement failed (exit '
                           f'{result.returncode}):\n{result.stderr[-3000:]}')
    return json.loads(result.stdout.strip().splitlines()[-1])


@contextmanager
def busy_neighbour(cpu=None):
    """A single-threaded spinning process, pinned to ``cpu`` (default: the last CPU this
    process may use, so that it takes one of the measured run's cores), for a block."""
    if cpu is None and hasattr(os, 'sched_getaffinity'):
        cpu = max(os.sched_getaffinity(0))
    code = SPINNER_CODE if cpu is None else (
        f'import os\nos.sched_setaffinity(0, {{{cpu}}})\n' + SPINNER_CODE)
    proc = subprocess.Popen([sys.executable, '-c', code])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def run_neighbour_benchmark(policies=None, steps=NEIGHBOUR_STEPS, warmup=NEIGHBOUR_WARMUP,
                            measure=measure_in_subprocess, neighbour=busy_neighbour,
                            log=print, **step):
    """Each policy of ``policies`` (default :func:`neighbour_policies`) idle, then beside a
    busy neighbour; one row per (policy, neighbour), ratios from :func:`neighbour_ratios`."""
    policies = neighbour_policies() if policies is None else policies
    rows = []
    for label, env in policies.items():
        for busy in (False, True):
            if busy:
                with neighbour():
                    result = measure(env, steps, warmup, **step)
            else:
                result = measure(env, steps, warmup, **step)
            rows.append(dict(policy=label, neighbour='busy' if busy else 'idle',
                             threads=result['threads'], ms=result['ms'],
                             wait_policy=env.get('OMP_WAIT_POLICY', '-')))
            log(f'  {label:16s} {rows[-1]["neighbour"]:4s} {result["threads"]} threads '
                f'{result["ms"]:8.1f} ms/step')
    return neighbour_ratios(rows)


def neighbour_ratios(rows, reference=('1 thread', 'idle'), baseline='torch default'):
    """Adds, in place: ``x_idle`` (over the same policy idle), ``x_ref`` (over the reference
    row: one thread, idle) and ``x_baseline`` (over the baseline policy, same neighbour)."""
    by_key = {(row['policy'], row['neighbour']): row for row in rows}
    ref = by_key.get(reference)
    for row in rows:
        idle = by_key.get((row['policy'], 'idle'))
        base = by_key.get((baseline, row['neighbour']))
        row['x_idle'] = row['ms'] / idle['ms'] if idle else None
        row['x_ref'] = row['ms'] / ref['ms'] if ref else None
        row['x_baseline'] = row['ms'] / base['ms'] if base else None
    return rows


def format_neighbour_table(rows):
    """The rows side by side: ms per step and the three ratios of :func:`neighbour_ratios`."""
    def ratio(value):
        return f'{value:9.2f}x' if value is not None else f'{"-":>10s}'

    head = (f'{"policy":16s} {"neighbour":9s} {"threads":>7s} {"OMP_WAIT_POLICY":>15s} '
            f'{"ms/step":>9s} {"x idle":>10s} {"x 1 thr":>10s} {"x default":>10s}')
    lines = [head, '-' * len(head)]
    for row in rows:
        lines.append(f'{row["policy"]:16s} {row["neighbour"]:9s} {row["threads"]:7d} '
                     f'{row["wait_policy"]:>15s} {row["ms"]:9.1f} {ratio(row["x_idle"])} '
                     f'{ratio(row["x_ref"])} {ratio(row["x_baseline"])}')
    return '\n'.join(lines)
