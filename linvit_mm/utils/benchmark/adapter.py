"""The adapter benchmark (``benchmark_adapter.py``): LinearViTAdapter's forward per operator
at detection size, side by side, split by hooks into the ViT blocks and the adapter's own
parts."""
import statistics
import time

import torch

from .common import ForwardClock, padded, quiet_mmengine_logs, rotated, synchronise
from .targets import REFERENCE


def build_adapter(attn_type, arch, device):
    from linvit_mm.models.adapters import LinearViTAdapter
    model = LinearViTAdapter(vit=dict(arch=arch, attn_type=attn_type, img_size=224))
    with quiet_mmengine_logs():
        model.init_weights()
    return model.to(device).eval()


@torch.no_grad()
def timed_forward(model, clock, images, device):
    clock.take()
    synchronise(device)
    start = time.perf_counter()
    outs = model(images)
    synchronise(device)
    total = time.perf_counter() - start
    return total, clock.take(), outs


def benchmark(operators, arch, size, device, repeats, warmup, log=print):
    width, height = size
    pad_w, pad_h = padded(width), padded(height)
    torch.manual_seed(0)
    images = torch.randn(1, 3, pad_h, pad_w, device=device)
    models, clocks = {}, {}
    for op in operators:
        models[op] = build_adapter(op, arch, device)
        clocks[op] = ForwardClock(models[op].vit.layers, device)
    patch = models[operators[0]].vit.patch_size
    samples = {op: [] for op in operators}
    block_samples = {op: [] for op in operators}
    for rep in range(warmup + repeats):
        for op in rotated(operators, rep):
            total, blocks, outs = timed_forward(models[op], clocks[op], images, device)
            del outs
            if rep >= warmup:
                samples[op].append(total)
                block_samples[op].append(blocks)
        if rep >= warmup:
            log(f'repeat {rep - warmup + 1}/{repeats}: ' + '  '.join(
                f'{op} {samples[op][-1] * 1e3:.0f}' for op in operators) + ' ms')
    rows = []
    for op in operators:
        total = statistics.median(samples[op])
        blocks = statistics.median(block_samples[op])
        rows.append(dict(operator=op, width=width, height=height, padded_width=pad_w,
                         padded_height=pad_h, patch_tokens=(pad_h // patch) * (pad_w // patch),
                         total_ms=total * 1e3, vit_blocks_ms=blocks * 1e3,
                         adapter_ms=statistics.median(
                             t - b for t, b in zip(samples[op], block_samples[op])) * 1e3,
                         total_samples_ms=[t * 1e3 for t in samples[op]]))
    add_speedups(rows)
    return rows


def add_speedups(rows):
    reference = next((row for row in rows if row['operator'] == REFERENCE), None)
    for row in rows:
        if reference is None:
            row['speedup'] = row['speedup_vit_blocks'] = None
            continue
        row['speedup'] = reference['total_ms'] / row['total_ms']
        row['speedup_vit_blocks'] = reference['vit_blocks_ms'] / row['vit_blocks_ms']
