"""The dense benchmark (``benchmark_dense.py``): backbone + neck (plain pyramid or ViT-Adapter)
per attention variant, forward and training step, and the activations a training step saves."""
import statistics
import time

import torch

from .common import padded, quiet_mmengine_logs, rotated, saved_activations, synchronise

NECKS = ('plain', 'adapter')
WINDOWED = 'softmax-win'
WINDOW_SIZE = 14
SIZES = ((1333, 800), (512, 512))


def variants(operators):
    """``softmax``, ``softmax-win`` and the other operators, in that order."""
    names = ['softmax', WINDOWED] if 'softmax' in operators else []
    return names + [op for op in operators if op != 'softmax']


def windowed_blocks(num_layers):
    """Every block but the last of each quarter (0, 1, 3, 4, 6, 7, 9, 10 of 12)."""
    quarter = max(num_layers // 4, 1)
    return [i for i in range(num_layers) if (i + 1) % quarter]


def build(neck, variant, arch, device):
    from linvit_mm.models import LinearViT, LinearViTAdapter, LinearViTPlainPyramid
    attn_type = 'softmax' if variant == WINDOWED else variant
    vit = dict(arch=arch, attn_type=attn_type, img_size=224)
    sizes = LinearViT.resolve_arch(arch)
    if variant == WINDOWED:
        vit.update(window_size=WINDOW_SIZE,
                   window_block_indexes=windowed_blocks(sizes['num_layers']))
    if neck == 'plain':
        model = LinearViTPlainPyramid(vit=vit)
    else:
        # ViT-Adapter's settings of its widths; another width: one deformable head per ViT head
        heads, ratio = LinearViTAdapter.DEFORM_DEFAULTS.get(sizes['embed_dims'],
                                                            (sizes['num_heads'], 1.0))
        model = LinearViTAdapter(vit=vit, deform_num_heads=heads, deform_ratio=ratio)
    with quiet_mmengine_logs():
        model.init_weights()
    return model.to(device)


@torch.no_grad()
def time_forward(model, images, device):
    model.eval()
    synchronise(device)
    start = time.perf_counter()
    model(images)
    synchronise(device)
    return time.perf_counter() - start


def time_train_step(model, images, device):
    """Wall time of forward + backward, and the bytes autograd saved for the backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    if torch.device(device).type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
    synchronise(device)
    start = time.perf_counter()
    with saved_activations([model]) as saved:
        outs = model(images)
        loss = sum(out.float().mean() for out in outs)
    loss.backward()
    synchronise(device)
    elapsed = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device)
            if torch.device(device).type == 'cuda' else None)
    return elapsed, saved['bytes'], peak


def benchmark(size, arch, operators, necks, device, repeats, warmup, log=print):
    width, height = size
    torch.manual_seed(0)
    images = torch.randn(1, 3, padded(height), padded(width), device=device)
    keys = [(neck, variant) for neck in necks for variant in variants(operators)]
    models = {key: build(*key, arch, device) for key in keys}
    forward = {key: [] for key in keys}
    train = {key: [] for key in keys}
    saved, peak = {}, {}
    for rep in range(warmup + repeats):
        for key in rotated(keys, rep):
            f = time_forward(models[key], images, device)
            t, saved[key], peak[key] = time_train_step(models[key], images, device)
            if rep >= warmup:
                forward[key].append(f)
                train[key].append(t)
        if rep >= warmup:
            log(f'{width}x{height} repeat {rep - warmup + 1}/{repeats} done')
    patch = models[keys[0]].vit.patch_size
    rows = []
    for neck, variant in keys:
        key = (neck, variant)
        rows.append(dict(size=f'{width}x{height}', neck=neck, variant=variant,
                         tokens=(padded(height) // patch) * (padded(width) // patch),
                         forward_ms=statistics.median(forward[key]) * 1e3,
                         train_ms=statistics.median(train[key]) * 1e3,
                         saved_mb=saved[key] / 2**20,
                         peak_mb=None if peak[key] is None else peak[key] / 2**20))
    add_ratios(rows)
    return rows


def add_ratios(rows):
    """``*_x``: the global Softmax row of the same neck and size over this one;
    ``adapter_over_plain_*``: the adapter row over the plain row of the same variant."""
    index = {(r['size'], r['neck'], r['variant']): r for r in rows}
    for row in rows:
        reference = index.get((row['size'], row['neck'], 'softmax'))
        plain = index.get((row['size'], 'plain', row['variant']))
        for field in ('forward_ms', 'train_ms', 'saved_mb'):
            name = field.split('_')[0]
            row[f'{name}_x'] = reference[field] / row[field] if reference else None
            row[f'adapter_over_plain_{name}'] = (
                row[field] / plain[field] if plain and row['neck'] == 'adapter' else None)
