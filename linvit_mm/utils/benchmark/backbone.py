"""The backbone benchmark (``benchmark_backbone.py``): each operator's LinearViT timed side by
side at one input size, its MAC-count bound and its training step's peak memory."""
import contextlib
import gc
import statistics

import torch

from linvit_mm.models.attention.mhla import OFFICIAL_IMAGENET

from .common import (Stopwatch, kernel_launches, quiet_mmengine_logs, rotated,
                     saved_activations, scalar_loss)
from .load import BackgroundLoad, wait_for_quiet
from .memory import PROBE_GRID, cuda_step_peak_mib, rss_step_peak, run_probe
from .targets import REFERENCE

# Forms of an operator measured under their own names beside its default form:
# name -> (operator, extra LinearViT arguments).
OPERATOR_VARIANTS = {
    'mhla-offnorm': ('mhla', dict(attn_cfg=dict(normaliser='official'))),
    'mhla-official': ('mhla', dict(attn_cfg=OFFICIAL_IMAGENET, qkv_bias=False)),
    # LoLCATs' released configs: a map for the queries and one for the keys, kaiming-uniform
    'hedgehog-untied': ('hedgehog', dict(attn_cfg=dict(tie_qk=False,
                                                       feature_init='kaiming_uniform'))),
    # InLine-DeiT's local residual branch, off in the paper's form
    'inline-residual': ('inline', dict(attn_cfg=dict(residual=True))),
    # the PyTorch form of an operator whose core runs on the fused kernels on CUDA
    **{f'{op}-pytorch': (op, dict(attn_cfg=dict(fused=False)))
       for op in ('relu', 'elu', 'hedgehog', 'inline')},
}


def build_backbone(attn_type, arch, size, patch_size=16, init=True):
    """A LinearViT for ``size``-px inputs; ``init`` runs the DeiT initialisation (values
    only matter for timing through denormals and the like, never for MAC counts)."""
    from linvit_mm.models.backbones.linear_vit import LinearViT
    attn_type, extra = OPERATOR_VARIANTS.get(attn_type, (attn_type, {}))
    model = LinearViT(arch=arch, attn_type=attn_type, img_size=size, patch_size=patch_size,
                      **extra)
    if not init:
        return model
    with quiet_mmengine_logs():
        model.init_weights()
    return model


def mac_bound(attn_type, size, arch='small', patch_size=16, blocks_only=False):
    """``MACs(softmax) / MACs(attn_type)`` for a LinearViT at ``size`` px.

    ``blocks_only`` leaves the patch embedding out (the per-block ratio).
    """
    from linvit_mm.utils.complexity import count_macs
    key = 'blocks' if blocks_only else 'total'
    macs = {op: count_macs(build_backbone(op, arch, size, patch_size, init=False), size)[key]
            for op in (REFERENCE, attn_type)}
    return macs[REFERENCE] / macs[attn_type]


def time_forward(model, images):
    """``eval()`` forward under ``no_grad``: its :class:`Stopwatch`."""
    model.eval()
    with torch.no_grad(), Stopwatch(images.device) as watch:
        model(images)
    return watch


def time_train_step(model, images):
    """``train()`` forward and backward of :func:`scalar_loss`, gradients set to ``None``
    first, outside the clock: its :class:`Stopwatch`."""
    model.train()
    model.zero_grad(set_to_none=True)
    with Stopwatch(images.device) as watch:
        scalar_loss(model(images)).backward()
    return watch


@contextlib.contextmanager
def step_precision(device, amp):
    """``amp``: bf16 autocast, and on CUDA scaled-dot-product attention restricted to its
    FlashAttention kernel, so the Softmax reference is FlashAttention or the run fails
    (SDPA: "No available kernel") instead of timing a slower kernel; fp32 otherwise."""
    if not amp:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    device = torch.device(device)
    flash = (sdpa_kernel(SDPBackend.FLASH_ATTENTION) if device.type == 'cuda'
             else contextlib.nullcontext())
    with torch.autocast(device.type, dtype=torch.bfloat16), flash:
        yield


def measure_train_step(model, images, measure):
    """``measure(step)`` of a training step (``train()`` mode, forward and backward of
    :func:`scalar_loss`), the gradients cleared before and after."""
    model.train()
    model.zero_grad(set_to_none=True)
    result = measure(lambda: scalar_loss(model(images)).backward())
    model.zero_grad(set_to_none=True)
    return result


def cuda_train_peak_mib(model, images):
    """A training step's peak allocated CUDA memory over what was allocated before it."""
    return measure_train_step(model, images,
                              lambda step: cuda_step_peak_mib(step, images.device))


def probe_train_peak(attn_type, arch, size, threads):
    """Runs inside the fresh subprocess (:func:`cpu_train_peak_mib`): the training step's
    peak resident set over the resident set just before it, and the step's time."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_backbone(attn_type, arch, size)
    warm_side = PROBE_GRID * model.patch_size
    time_train_step(model, torch.randn(1, 3, warm_side, warm_side))
    images = torch.randn(1, 3, size, size)
    model.zero_grad(set_to_none=True)
    peak, watch = rss_step_peak(lambda: time_train_step(model, images))
    return dict(peak, step_ms=watch.wall_ms)


def cpu_train_peak_mib(attn_type, arch, size, threads):
    """:func:`probe_train_peak` in a fresh process: MiB."""
    return run_probe(f'{__name__}:probe_train_peak', f'for {attn_type} at {size}px',
                     attn_type=attn_type, arch=arch, size=size, threads=threads)['peak_mib']


def train_saved_mib(model, images, module):
    """MiB autograd saves for the backward in a training step's forward (``module``'s
    parameters left out): the activations a step keeps, the same count on every device."""
    model.train()
    with saved_activations([module]) as saved:
        out = scalar_loss(model(images))
    del out
    return saved['bytes'] / 2**20


def train_step_launches(model, images):
    """Kernels (CUDA) or ATen calls (CPU) of one training step: :func:`.common.kernel_launches`."""
    return measure_train_step(model, images, lambda step: kernel_launches(step, images.device))


def benchmark_size(size, operators, arch, device, repeats, warmup, log=print,
                   max_background=None, max_retakes=0, quiet_timeout_s=900., batch_size=1,
                   amp=False, compile=False):
    """Interleaved timings of every operator at one size; returns one dict per operator.

    ``batch_size`` images a step; ``amp``: bf16 autocast (:func:`step_precision`);
    ``compile``: every model through ``torch.compile`` (inductor), compiled during the
    warm-up (give at least one warm-up repetition, or the first timed one includes it).

    Every repetition runs every operator once, in an order rotated by one per repetition;
    latencies are medians over the ``repeats`` after ``warmup`` untimed repetitions. With
    ``max_background``, a timed (forward, training step) pair during which other
    processes kept more cores busy than that is thrown away and taken again, after
    waiting for a quiet moment, up to ``max_retakes`` times; the last take is kept
    whatever its load. ``retakes`` in the result counts them.
    """
    from linvit_mm.utils.complexity import count_macs, patch_grid
    device = torch.device(device)
    torch.manual_seed(0)
    modules = {op: build_backbone(op, arch, size).to(device) for op in operators}
    models = {op: torch.compile(m) if compile else m for op, m in modules.items()}
    images = torch.randn(batch_size, 3, size, size, device=device)
    samples = {(op, key): [] for op in operators
               for key in ('fwd_ms', 'train_ms', 'fwd_cpu_ms', 'train_cpu_ms')}
    cuda_peak = {}
    retakes = dict.fromkeys(operators, 0)
    busy_core_s = timed_s = 0.  # other processes' load over the kept pairs, time-weighted
    for rep in range(warmup + repeats):
        for op in rotated(operators, rep):
            for attempt in range(max_retakes + 1):
                pair_load = BackgroundLoad()
                pair_load.start()
                with step_precision(device, amp):
                    fwd = time_forward(models[op], images)
                    train = time_train_step(models[op], images)
                models[op].zero_grad(set_to_none=True)
                busy = pair_load.stop()
                if (rep < warmup or max_background is None or busy is None
                        or busy <= max_background or attempt == max_retakes):
                    break
                retakes[op] += 1
                log(f'  {size}px {op:8s} retake: other processes kept {busy:.2f} cores busy '
                    f'(fwd {fwd.wall_ms:.1f} ms, train {train.wall_ms:.1f} ms)')
                wait_for_quiet(max_background, quiet_timeout_s)
            if rep >= warmup:
                if busy is not None:
                    pair_s = (fwd.wall_ms + train.wall_ms) / 1e3
                    busy_core_s += busy * pair_s
                    timed_s += pair_s
                for key, value in (('fwd_ms', fwd.wall_ms), ('train_ms', train.wall_ms),
                                   ('fwd_cpu_ms', fwd.cpu_ms), ('train_cpu_ms', train.cpu_ms)):
                    samples[op, key].append(value)
            log(f'  {size}px {"warm-up" if rep < warmup else f"rep {rep - warmup + 1}"} '
                f'{op:8s} fwd {fwd.wall_ms:10.1f} ms  train {train.wall_ms:10.1f} ms  '
                f'(cpu {fwd.cpu_ms:10.1f} / {train.cpu_ms:10.1f} ms)'
                + ('' if busy is None else f'  others {busy:.2f} cores'))
    background_cores = busy_core_s / timed_s if timed_s else None
    with step_precision(device, amp):
        launches = {op: train_step_launches(models[op], images) for op in operators}
        saved = {op: train_saved_mib(models[op], images, modules[op]) for op in operators}
        if device.type == 'cuda':
            cuda_peak = {op: cuda_train_peak_mib(models[op], images) for op in operators}
    hw_shape = patch_grid(modules[operators[0]], size)
    rows = []
    for op in operators:
        macs = count_macs(modules[op], size)['total']
        rows.append(dict(size=size, patch_tokens=hw_shape[0] * hw_shape[1],
                         tokens=modules[op].num_extra_tokens + hw_shape[0] * hw_shape[1],
                         operator=op, block_operators=modules[op].attn_types,
                         batch_size=batch_size, precision='bf16 autocast' if amp else 'fp32',
                         mode='compiled' if compile else 'eager',
                         launches=launches[op], saved_mib=saved[op],
                         peak_mib=cuda_peak.get(op), macs=macs,
                         fwd_samples_ms=samples[op, 'fwd_ms'],
                         train_samples_ms=samples[op, 'train_ms'],
                         background_cores=background_cores, retakes=retakes[op],
                         **{key: statistics.median(samples[op, key])
                            for key in ('fwd_ms', 'train_ms', 'fwd_cpu_ms', 'train_cpu_ms')}))
    del models, modules
    gc.collect()
    return rows


def add_ratios(rows):
    """Speed-ups and MAC bounds against the softmax row of the same size, in place."""
    by_size = {}
    for row in rows:
        by_size.setdefault(row['size'], {})[row['operator']] = row
    for group in by_size.values():
        ref = group.get(REFERENCE)
        for row in group.values():
            if ref is None:
                row.update(speedup_fwd=None, speedup_train=None, mac_bound=None,
                           fwd_pct_of_bound=None, train_pct_of_bound=None,
                           cpu_speedup_fwd=None, cpu_speedup_train=None)
                continue
            row['speedup_fwd'] = ref['fwd_ms'] / row['fwd_ms']
            row['speedup_train'] = ref['train_ms'] / row['train_ms']
            row['cpu_speedup_fwd'] = ref['fwd_cpu_ms'] / row['fwd_cpu_ms']
            row['cpu_speedup_train'] = ref['train_cpu_ms'] / row['train_cpu_ms']
            row['mac_bound'] = ref['macs'] / row['macs']
            row['fwd_pct_of_bound'] = 100 * row['speedup_fwd'] / row['mac_bound']
            row['train_pct_of_bound'] = 100 * row['speedup_train'] / row['mac_bound']
    return rows
