#!/usr/bin/env python
"""Check and time linvit_mm on a GPU in one short run; write a JSON record and a table.

    python tools/device_check.py --out DIR [--budget-s 480] [--dry-run]

Made for a machine lent for minutes: torch and triton installed, OpenMMLab absent. The
pure-Python packages linvit_mm imports travel as wheels (``bash tools/fetch_device_wheels.sh``
writes them into ``work_dirs/device_wheels``); the check installs them into a temporary
directory first when ``import mmengine`` fails. Each section records its result or its error
and the run goes on, within ``--budget-s`` seconds:

1. ``environment``: torch, triton, the GPU, whether it computes in bf16;
2. ``tests``: the CUDA cases of the operators' and ops' tests (``pytest -m cuda``) and the
   fused-kernel tests (compiled kernels, bf16 included);
3. ``core``: the attention core alone, forward + backward in bf16 at ViT-B heads (12 x 64):
   FlashAttention (SDPA restricted to its flash kernel), the fused linear kernels and the
   PyTorch form of the same core, at 197 tokens (batch 64) and 4096 tokens (batch 2);
4. ``modules``: every operator's attention module (qkv, core, proj) forward + backward
   under bf16 autocast, ViT-S and ViT-B widths, 224 px batch 64 and 1024 px batch 2, with
   what the forward saves for the backward; relu, elu, hedgehog and inline
   fused and unfused;
5. ``training``: LinearViT-S training steps (AdamW, bf16 autocast), relu against softmax,
   eager and compiled (``torch.compile``), with the CUDA kernels one step launches;
6. ``distillation``: the cost of ``AttentionDistillHook`` (frozen Softmax teacher, lambda
   50) on a ViT-S relu classifier's step, bf16, in alternating pairs;
7. ``backbone``: ``benchmark_backbone.py --device cuda --amp`` (every operator's LinearViT-S,
   224 px batch 64 and 1024 px batch 2, against its MAC bound).

``--dry-run`` runs every section on the CPU at toy sizes (the fused kernels under Triton's
interpreter), as the test suite does, to prove the script before a GPU is lent.
Timings use ``torch.utils.benchmark`` (CUDA-synchronised); ratios are side by side in one run.
"""
import argparse
import json
import os
import os.path as osp
import platform
import subprocess
import sys
import tempfile
import time
import traceback

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
WHEELS = osp.join(REPO, 'work_dirs', 'device_wheels')
if REPO not in sys.path:
    # run as a script, Python puts tools/ on the path, not the checkout it belongs to; the
    # lent machine has no linvit_mm installed
    sys.path.insert(0, REPO)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Check and time linvit_mm on a GPU')
    parser.add_argument('--out', required=True, help='directory for the JSON and the table')
    parser.add_argument('--budget-s', type=float, default=480.,
                        help='stop starting new sections after this many seconds')
    parser.add_argument('--dry-run', action='store_true',
                        help='every section on the CPU at toy sizes')
    args = parser.parse_args(argv)
    if not args.budget_s > 0:
        parser.error(f'--budget-s must be > 0, got {args.budget_s}')
    return args


def ensure_openmmlab():
    """Make mmengine, mmcv-lite and mmpretrain importable from the carried wheels; returns
    what was done."""
    try:
        import mmengine  # noqa: F401
        import mmpretrain  # noqa: F401
        return 'present'
    except ImportError:
        pass
    wheels = sorted(f for f in os.listdir(WHEELS) if f.endswith('.whl')) if osp.isdir(
        WHEELS) else []
    if not wheels:
        raise RuntimeError(f'mmengine is not installed and {WHEELS} holds no wheels '
                           '(bash tools/fetch_device_wheels.sh writes them)')
    site = tempfile.mkdtemp(prefix='linvit-site-')
    subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', '--no-index',
                    '--no-deps', '--target', site, *(osp.join(WHEELS, w) for w in wheels)],
                   check=True)
    sys.path.insert(0, site)
    os.environ['PYTHONPATH'] = os.pathsep.join(
        p for p in (site, REPO, os.environ.get('PYTHONPATH')) if p)
    return f'installed {len(wheels)} wheels into {site}'


# ------------------------------------------------------------------ timing
def timed(fn, device, min_time):
    """Median seconds per call of ``fn``."""
    import torch.utils.benchmark as benchmark
    fn()  # compile / warm up
    timer = benchmark.Timer(stmt='fn()', globals=dict(fn=fn))
    if device.type == 'cuda':
        return timer.blocked_autorange(min_run_time=min_time).median
    return timer.timeit(2).median


def forward_backward(module_or_fn, inputs, autocast_dtype, device):
    """A closure running forward + backward once (grads of the inputs and parameters)."""
    import torch

    def step():
        with torch.autocast(device.type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            out = module_or_fn(*inputs)
        out.float().square().mean().backward()
    return step


def saved_memory(module, inputs, autocast_dtype, device):
    """Bytes autograd saves for the backward in the forward (``saved_activations``: distinct
    storages, the module's weights left out; the same count on every device)."""
    import torch

    from linvit_mm.utils.benchmark.common import saved_activations
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        with saved_activations([module]) as saved:
            out = module(*inputs)
    del out
    return saved['bytes']


# ------------------------------------------------------------------ sections
def environment(device):
    import torch
    info = dict(python=platform.python_version(), torch=torch.__version__,
                device=str(device))
    try:
        import triton
        info['triton'] = triton.__version__
    except ImportError:
        info['triton'] = None
    if device.type == 'cuda':
        info.update(gpu=torch.cuda.get_device_name(device),
                    capability='.'.join(map(str, torch.cuda.get_device_capability(device))),
                    bf16=torch.cuda.is_bf16_supported())
    return info


def tests(dry_run, deadline):
    runs = {}
    selections = {'fused kernels': ['tests/ops/test_linear_attention_kernels.py']}
    if not dry_run:
        # the operators' and ops' CUDA cases; test modules that need mmdet / mmseg (absent on
        # a bare machine) fail to collect, which must not stop the others
        selections['cuda cases'] = ['tests/models', 'tests/ops', '-m', 'cuda',
                                    '--continue-on-collection-errors']
    for name, argv in selections.items():
        left = deadline - time.time()
        if left < 30:
            runs[name] = dict(skipped='out of time')
            continue
        started = time.time()
        env = dict(os.environ)
        if dry_run:
            env.update(TRITON_INTERPRET='1', LINVIT_MM_FUSED='1')
        try:
            run = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                                  *argv], cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=min(left, 300))
            runs[name] = dict(returncode=run.returncode, seconds=round(time.time() - started, 1),
                              summary=(run.stdout.strip().splitlines() or [''])[-1],
                              tail=run.stdout[-1500:] if run.returncode else '')
        except subprocess.TimeoutExpired:
            runs[name] = dict(returncode=None, summary='timed out')
    return runs


def core(device, sizes, dtype, min_time):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from linvit_mm.ops.linear_attention import (fused_applies, normalised_linear_attention,
                                                normalised_linear_attention_torch)
    rows = []
    for batch, heads, tokens, width in sizes:
        q, k, v = (torch.randn(batch, heads, tokens, width, device=device, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        backend = SDPBackend.FLASH_ATTENTION if device.type == 'cuda' else SDPBackend.MATH

        def flash():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)

        forms = dict(flash=flash,
                     fused=lambda: normalised_linear_attention(q, k, v, 1e-6, 'relu',
                                                               fused=True),
                     pytorch=lambda: normalised_linear_attention_torch(q, k, v, 1e-6, 'relu'))
        row = dict(batch=batch, heads=heads, tokens=tokens, width=width, dtype=str(dtype),
                   fused_applies=fused_applies(q, k, v))
        for name, fn in forms.items():
            if name == 'fused' and not row['fused_applies']:
                continue
            row[f'{name}_ms'] = 1e3 * timed(forward_backward(fn, (), None, device), device,
                                            min_time)
        if 'fused_ms' in row:
            row['flash_over_fused'] = row['flash_ms'] / row['fused_ms']
        row['flash_over_pytorch'] = row['flash_ms'] / row['pytorch_ms']
        rows.append(row)
    return rows


def modules(device, widths, sizes, autocast_dtype, min_time):
    import torch

    from linvit_mm.models.attention import attention_class, attention_types, build_attention
    from linvit_mm.utils.complexity import attention_macs
    rows = []
    for embed_dims, heads in widths:
        for batch, grid in sizes:
            group = []
            for attn_type in attention_types():
                operator = attention_class(attn_type)
                tokens = int(operator.uses_cls_token) + grid * grid
                variants = [dict()]
                if 'fused' in operator.options and attn_type != 'softmax':
                    variants.append(dict(fused=False))
                for options in variants:
                    torch.manual_seed(0)
                    module = build_attention(attn_type, embed_dims=embed_dims, num_heads=heads,
                                             **options).to(device)
                    x = torch.randn(batch, tokens, embed_dims, device=device,
                                    requires_grad=True)

                    def call(x, module=module):
                        return module(x, (grid, grid))

                    row = dict(operator=attn_type + (' (pytorch)' if options else ''),
                               embed_dims=embed_dims, heads=heads, batch=batch, tokens=tokens,
                               gmacs=batch * sum(attention_macs(module, tokens,
                                                                (grid, grid)).values()) / 1e9)
                    try:
                        row['ms'] = 1e3 * timed(
                            forward_backward(call, (x, ), autocast_dtype, device), device,
                            min_time)
                        row['saved_mb'] = saved_memory(
                            module, (x, (grid, grid)), autocast_dtype, device) / 2**20
                    except Exception as err:  # recorded; the sweep goes on
                        row['error'] = f'{type(err).__name__}: {err}'[:300]
                    group.append(row)
            softmax = next((r for r in group if r['operator'] == 'softmax' and 'ms' in r), None)
            for row in group:
                if softmax is not None and 'ms' in row:
                    row['vs_softmax'] = row['ms'] / softmax['ms']
            rows += group
    return rows


def checked_arch(device):
    """ViT-S on a GPU; a two-block toy for the CPU dry run."""
    return 'small' if device.type == 'cuda' else dict(embed_dims=32, num_layers=2,
                                                      num_heads=2, feedforward_channels=64)


def training(device, img_size, batch, autocast_dtype, operators=('softmax', 'relu'),
             modes=('eager', 'compiled')):
    """LinearViT training steps (AdamW) per operator, eager and through ``torch.compile``
    (inductor; compiled by the untimed steps), with the kernels one step launches."""
    import torch

    from linvit_mm.models.backbones import LinearViT
    from linvit_mm.utils.benchmark.common import kernel_launches
    rows = []
    for mode in modes:
        for attn_type in operators:
            torch.manual_seed(0)
            model = LinearViT(arch=checked_arch(device), attn_type=attn_type,
                              img_size=img_size, out_type='avg_featmap').to(device)
            run = torch.compile(model) if mode == 'compiled' else model
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            images = torch.randn(batch, 3, img_size, img_size, device=device)

            def step(run=run, optimizer=optimizer, images=images):
                with torch.autocast(device.type, dtype=autocast_dtype,
                                    enabled=autocast_dtype is not None):
                    loss = run(images)[-1].float().square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return loss.detach()

            started = time.time()
            losses = [step().item() for _ in range(2)]
            warm_s = time.time() - started
            rows.append(dict(operator=attn_type, mode=mode, img_size=img_size, batch=batch,
                             step_ms=1e3 * timed(step, device, 1.0),
                             launches=kernel_launches(step, device),
                             first_steps_s=warm_s, finite=all(v == v for v in losses)))
    for row in rows:
        softmax = next(r for r in rows if r['mode'] == row['mode'] and r['operator'] == 'softmax')
        row['vs_softmax'] = row['step_ms'] / softmax['step_ms']
    return rows


def distillation(device, img_size, batch, amp, iters, warmup):
    """The attention-distillation step's cost (``benchmark_distill.py``): a ViT-S relu
    classifier's training step with ``AttentionDistillHook`` (frozen Softmax teacher,
    lambda 50) against the same step without it, in alternating pairs."""
    import types

    from linvit_mm.utils.benchmark.distill import benchmark
    options = types.SimpleNamespace(arch=checked_arch(device), attn_type='relu',
                                    batch_size=batch, img_size=img_size, patch_size=16,
                                    num_classes=10,
                                    device=str(device), amp=amp, loss_weight=50.,
                                    iters=iters, warmup=warmup)
    result = benchmark(options, log=lambda message: None)
    return [{key: result[key] for key in ('without_ms', 'with_ms', 'teacher_ms', 'pair_ratio',
                                          'teacher_fraction', 'passed')}]


def backbone(out_dir, dry_run):
    """``benchmark_backbone.py`` in its GPU mode: every operator's LinearViT-S side by side,
    bf16 autocast, Softmax on FlashAttention, at 224 px batch 64 and 1024 px batch 2."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        'benchmark_backbone', osp.join(REPO, 'tools', 'analysis_tools', 'benchmark_backbone.py'))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    if importlib.util.find_spec('matplotlib') is None:
        tool.plot = lambda *args, **kwargs: None  # a bare machine: the table and CSV only
    if dry_run:
        runs = [['--sizes', '32', '--repeats', '1', '--warmup', '0', '--arch',
                 '{"embed_dims": 32, "num_layers": 2, "num_heads": 2, '
                 '"feedforward_channels": 64}']]
    else:
        runs = [['--device', 'cuda', '--amp', '--batch-size', '64', '--sizes', '224'],
                ['--device', 'cuda', '--amp', '--batch-size', '2', '--sizes', '1024']]
    rows = []
    for index, argv in enumerate(runs):
        out = osp.join(out_dir, f'backbone_{index}')
        for row in tool.main([*argv, '--repeats', '3', '--warmup', '1', '--no-memory',
                              '--out-dir', out] if not dry_run else
                             [*argv, '--no-memory', '--out-dir', out]):
            rows.append({key: row.get(key) for key in (
                'size', 'tokens', 'operator', 'batch_size', 'precision', 'fwd_ms', 'train_ms',
                'peak_mib', 'saved_mib', 'launches', 'speedup_fwd', 'speedup_train',
                'mac_bound', 'train_pct_of_bound')})
    return rows


# ------------------------------------------------------------------ report
def markdown(record):
    lines = [f"# linvit_mm device check, {record['started']}", '']
    env = record['sections'].get('environment', {}).get('result', {})
    lines += [', '.join(f'{k} {v}' for k, v in env.items()), '']
    for name, section in record['sections'].items():
        if name == 'environment':
            continue
        lines.append(f'## {name} ({section.get("seconds", 0):.0f} s)')
        if 'error' in section:
            lines += ['', '```', section['error'][-1500:], '```', '']
            continue
        result = section.get('result')
        if isinstance(result, dict):
            lines += [''] + [f'- {k}: {v.get("summary", v)}' for k, v in result.items()] + ['']
        elif isinstance(result, list) and result:
            keys = list(dict.fromkeys(k for row in result for k in row))
            lines += ['', '| ' + ' | '.join(keys) + ' |', '|' + '---|' * len(keys)]
            for row in result:
                lines.append('| ' + ' | '.join(
                    f'{row[k]:.3g}' if isinstance(row.get(k), float) else str(row.get(k, ''))
                    for k in keys) + ' |')
            lines.append('')
    return '\n'.join(lines) + '\n'


def main(argv=None):
    args = parse_args(argv)
    started = time.time()
    deadline = started + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    if args.dry_run:
        os.environ.setdefault('TRITON_INTERPRET', '1')
        os.environ.setdefault('LINVIT_MM_FUSED', '1')
    record = dict(started=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started)),
                  command=' '.join([osp.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
                  sections={})
    record['openmmlab'] = ensure_openmmlab()
    import torch
    device = torch.device('cpu' if args.dry_run or not torch.cuda.is_available() else 'cuda')
    bf16 = torch.bfloat16 if device.type == 'cuda' else None
    if args.dry_run:
        plan = dict(
            environment=lambda: environment(device),
            tests=lambda: tests(True, deadline),
            core=lambda: core(device, [(1, 2, 70, 16)], torch.float32, 0.),
            modules=lambda: modules(device, [(32, 2)], [(1, 4)], None, 0.),
            training=lambda: training(device, 32, 2, None),
            distillation=lambda: distillation(device, 32, 2, False, 2, 1),
            backbone=lambda: backbone(args.out, True))
    else:
        plan = dict(
            environment=lambda: environment(device),
            tests=lambda: tests(False, deadline),
            core=lambda: core(device, [(64, 12, 197, 64), (2, 12, 4096, 64)], bf16, 0.3),
            modules=lambda: modules(device, [(384, 6), (768, 12)], [(64, 14), (2, 64)], bf16,
                                    0.3),
            training=lambda: training(device, 224, 64, bf16),
            distillation=lambda: distillation(device, 224, 64, True, 6, 2),
            backbone=lambda: backbone(args.out, False))
    for name, run in plan.items():
        if time.time() > deadline:
            record['sections'][name] = dict(error='skipped: the time budget was spent')
            continue
        section_start = time.time()
        try:
            record['sections'][name] = dict(result=run())
        except Exception:
            record['sections'][name] = dict(error=traceback.format_exc())
        record['sections'][name]['seconds'] = round(time.time() - section_start, 1)
        with open(osp.join(args.out, 'device_check.json'), 'w') as f:
            json.dump(record, f, indent=1, default=str)
    record['seconds'] = round(time.time() - started, 1)
    with open(osp.join(args.out, 'device_check.json'), 'w') as f:
        json.dump(record, f, indent=1, default=str)
    with open(osp.join(args.out, 'device_check.md'), 'w') as f:
        f.write(markdown(record))
    print(markdown(record))
    failed = [name for name, section in record['sections'].items() if 'error' in section]
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
