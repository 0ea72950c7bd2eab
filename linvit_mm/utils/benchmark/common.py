"""Pieces the benchmark tools (``tools/analysis_tools/benchmark_*.py``) share: argument
parsing, wall clocks, the random batch of a training step.

Why wall clocks rather than ``torch.utils.benchmark.Timer``: the benchmarks time several
variants *interleaved* (every repetition runs each variant once, the order rotated, or A B
B A pairs) so that load from other processes on a shared machine hits all of them alike,
retake a pair timed under load, split a forward by module hooks, and keep a fixed number of
warm-up and timed steps that the published tables state. ``Timer.blocked_autorange`` times
one statement in a block of its own choosing, which gives none of these. The clocks here
synchronise CUDA before reading, as ``Timer`` does.
"""
import json
import logging
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


@contextmanager
def saved_activations(modules=()):
    """Counts the bytes autograd saves for the backward inside the block: yields a dict whose
    ``'bytes'`` holds, once the block ends, the size of every distinct storage saved (a
    tensor saved twice, or two views of one buffer, count once), the parameters of
    ``modules`` left out (they are the model's, not activations). Device-agnostic: the same
    count on a CPU and a GPU for the same computation."""
    weights = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[(storage.data_ptr(), tensor.device)] = storage.nbytes()
        return tensor

    result = {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result
    result['bytes'] = sum(storages.values())


def kernel_launches(fn, device):
    """How many device kernels one call of ``fn`` launches on CUDA (``torch.profiler``'s
    kernel events); on a CPU, how many ATen operators it calls, the closest count there.
    The fewer, the less a step waits on launch overhead at small sizes."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == 'cuda'
    synchronise(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        synchronise(device)
    events = prof.events()
    if cuda:
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events if e.name.startswith('aten::') and e.cpu_parent is None)


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


class Stopwatch:
    """Wall time and this process's CPU time (all threads) of a block, in ms.

    Wall time is the latency the tables report. CPU time is a diagnostic for shared
    machines: a thread that waits for a core, or for a peer that waits for one, adds
    wall time but little CPU time.
    """

    def __init__(self, device):
        self.device = device
        self.wall_ms = self.cpu_ms = None

    def __enter__(self):
        synchronise(self.device)
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        synchronise(self.device)
        self.wall_ms = (time.perf_counter() - self._wall) * 1e3
        self.cpu_ms = (time.process_time() - self._cpu) * 1e3


def scalar_loss(outputs):
    """The mean of every output, summed: a loss whose backward reaches every output."""
    return sum(out.float().mean() for out in outputs)


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
