"""tools/train.py, tools/test.py and tools/dist_train.sh on the generated mini ImageNet set."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# every test here runs whole tools or trainings (seconds each on 2 cores)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'


def data_options(mini_data_root):
    root = mini_data_root / 'imagenet'
    return [f'{loader}.dataset.data_root={root}'
            for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]


def run_tool(args, timeout=600, env=None, returncode=0):
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    output = proc.stdout + proc.stderr
    assert proc.returncode == returncode, output[-4000:]
    return output


def train(work_dir, mini_data_root, *extra, options=(), returncode=0):
    return run_tool([sys.executable, 'tools/train.py', str(TINY_CONFIG), '--work-dir',
                     str(work_dir), *extra, '--cfg-options',
                     *data_options(mini_data_root), *options], returncode=returncode)


def trained_iters(log):
    return [int(i) for i in re.findall(r'Iter\(train\) \[\s*(\d+)/\d+\]', log)]


@pytest.fixture(scope='module')
def trained_run(tmp_path_factory, mini_data_root):
    work_dir = tmp_path_factory.mktemp('train')
    log = train(work_dir, mini_data_root)
    return work_dir, log


def test_stack_imports_and_compiled_ops_run_on_cpu():
    import mmdet  # noqa: F401
    import mmpretrain  # noqa: F401
    import mmseg  # noqa: F401
    from mmcv.ops import MultiScaleDeformableAttention, RoIAlign, batched_nms, nms

    feats = torch.randn(1, 4, 16, 16, requires_grad=True)
    rois = torch.tensor([[0., 1., 1., 9., 9.], [0., 4., 2., 14., 12.]])
    pooled = RoIAlign(output_size=(3, 3), spatial_scale=1., sampling_ratio=2)(feats, rois)
    pooled.sum().backward()
    assert pooled.shape == (2, 4, 3, 3) and feats.grad.abs().sum() > 0

    boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 10., 10.], [20., 20., 30., 30.]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    _, keep = nms(boxes, scores, iou_threshold=0.5)
    assert keep.tolist() == [0, 2]
    _, keep = batched_nms(boxes, scores, torch.tensor([0, 1, 0]), dict(iou_threshold=0.5))
    assert sorted(keep.tolist()) == [0, 1, 2]

    attn = MultiScaleDeformableAttention(embed_dims=32, num_heads=4, num_levels=2, num_points=2,
                                         batch_first=True)
    shapes = torch.tensor([[8, 8], [4, 4]])
    value = torch.randn(1, 80, 32, requires_grad=True)
    query = torch.randn(1, 5, 32)
    out = attn(query, value=value, reference_points=torch.rand(1, 5, 2, 2),
               spatial_shapes=shapes, level_start_index=torch.tensor([0, 64]))
    out.sum().backward()
    assert out.shape == (1, 5, 32) and value.grad.abs().sum() > 0


def test_train_writes_checkpoints_and_validates(trained_run):
    work_dir, log = trained_run
    assert trained_iters(log) == [1, 2]
    assert (work_dir / 'iter_2.pth').is_file()
    assert 'accuracy/top1' in log
    last = (work_dir / 'last_checkpoint').read_text().strip()
    assert last.endswith('iter_2.pth')


def test_train_adds_the_safeguards_the_config_lacks(trained_run):
    work_dir, log = trained_run
    # The tiny config, like any upstream-based one, has neither: the log says what was added.
    assert "added default_hooks.check_loss={'type': 'FiniteLossHook'}" in log
    assert "checkpoints written atomically (default_hooks.checkpoint.backend_args=" in log
    dumped = (work_dir / 'tiny_cls_mini.py').read_text()
    assert "backend_args=dict(backend='atomic_local')" in dumped
    assert "check_loss=dict(type='FiniteLossHook')" in dumped
    assert not [p.name for p in work_dir.iterdir() if p.name.endswith('.tmp')]


def test_train_sizes_its_threads_to_the_free_cores_unless_the_user_chose(trained_run):
    _, log = trained_run
    users = any(name in os.environ for name in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS'))
    assert ("added default_hooks.cpu_threads={'type': 'CPUThreadHook'}" in log) is not users
    if not users:
        assert 'CPUThreadHook: ' in log and 'intra-op threads, fewer while other processes' in log


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, 'sched_getaffinity')
                    else True, reason='needs two usable CPUs and sched_getaffinity')
def test_train_beside_a_busy_process_drops_to_the_cores_left(mini_data_root, tmp_path):
    """A run beside a process spinning on one of two CPUs: the governor gives that core up
    (decided every 0.1 s here, so that a short run sees it)."""
    from linvit_mm.utils.benchmark import busy_neighbour
    if any(name in os.environ for name in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS')):
        pytest.skip('the thread count is the user\'s here: the governor leaves it alone')
    with busy_neighbour():
        log = train(tmp_path / 'busy', mini_data_root, options=[
            'default_hooks.cpu_threads.type=CPUThreadHook',
            'default_hooks.cpu_threads.interval=0.1', 'train_cfg.max_iters=40',
            'train_cfg.val_interval=40', 'default_hooks.checkpoint.interval=40'])
    cores = int(re.search(r'CPUThreadHook: (\d+) intra-op threads', log).group(1))
    if cores < 2:
        pytest.skip('one physical core: no thread to give up')
    assert re.search(rf'intra-op threads {cores} -> {cores - 1}: other processes use', log), \
        log[-3000:]


def test_diverging_run_fails_before_saving_its_nan_weights(mini_data_root, tmp_path):
    # lr 1e30: the first step puts the weights near 1e30, the second forward overflows.
    log = train(tmp_path, mini_data_root, '--no-validate', returncode=1,
                options=['optim_wrapper.optimizer.lr=1e30', 'train_cfg.max_iters=4'])
    assert trained_iters(log) == [1]
    assert 'FloatingPointError: non-finite training loss at iteration 2: loss=nan.' in log
    assert sorted(p.name for p in tmp_path.glob('*.pth')) == ['iter_1.pth']
    assert (tmp_path / 'last_checkpoint').read_text().endswith('iter_1.pth')


def test_resume_auto_and_from_path(trained_run, mini_data_root, tmp_path):
    work_dir, _ = trained_run
    resumed = tmp_path / 'resumed'
    resumed.mkdir()
    # Resume from an explicit path into a fresh work dir, then auto-resume there.
    log = train(resumed, mini_data_root, '--resume', str(work_dir / 'iter_2.pth'),
                options=['train_cfg.max_iters=3'])
    assert trained_iters(log) == [3]
    log = train(resumed, mini_data_root, '--resume', options=['train_cfg.max_iters=4'])
    assert 'resumed' in log.lower()
    assert trained_iters(log) == [4]
    ckpt = torch.load(resumed / 'iter_4.pth', map_location='cpu', weights_only=False)
    assert ckpt['meta']['iter'] == 4


def test_amp_on_cpu_trains_in_bf16(mini_data_root, tmp_path):
    from linvit_mm.engine.optim_wrapper import cpu_has_native_bf16
    log = train(tmp_path, mini_data_root, '--amp', '--no-validate')
    assert trained_iters(log) == [1, 2]
    assert 'CPUAmpOptimWrapper' in (tmp_path / 'tiny_cls_mini.py').read_text()
    # the slow-bf16 warning where (and only where) this CPU has no native bf16
    warned = re.search(r'WARNING - CPUAmpOptimWrapper: this CPU has no native bf16', log)
    assert bool(warned) == (cpu_has_native_bf16() is False)


def test_mmengine_compile_option_trains_through_the_tool(mini_data_root, tmp_path):
    """mmengine's ``compile`` option (``torch.compile`` of the model's train step) works
    through tools/train.py; aot_eager traces what inductor would compile, without the
    minutes of code generation on 2 cores."""
    log = train(tmp_path, mini_data_root, '--no-validate',
                options=['compile.backend=aot_eager'])
    assert trained_iters(log) == [1, 2]
    assert 'Model has been "compiled"' in log


def test_test_tool_evaluates_and_dumps(trained_run, tmp_path, mini_data_root):
    work_dir, _ = trained_run
    out = tmp_path / 'preds.pkl'
    log = run_tool([sys.executable, 'tools/test.py', str(TINY_CONFIG),
                    str(work_dir / 'iter_2.pth'), '--work-dir', str(tmp_path), '--out',
                    str(out), '--cfg-options', *data_options(mini_data_root)])
    top1 = float(re.search(r'accuracy/top1: ([\d.]+)', log).group(1))
    assert 0 <= top1 <= 100
    assert out.is_file()


def test_dist_train_two_processes_with_gloo(mini_data_root, tmp_path):
    log = run_tool(['bash', 'tools/dist_train.sh', str(TINY_CONFIG), '2', '--work-dir',
                    str(tmp_path), '--cfg-options', *data_options(mini_data_root)],
                   env=dict(PYTHON=sys.executable, PORT='29517'))
    assert 'gloo process group, rank 0 of 2' in log
    assert trained_iters(log) == [1, 2]
    assert (tmp_path / 'iter_2.pth').is_file()
    log = run_tool(['bash', 'tools/dist_train.sh', str(TINY_CONFIG), '2', '--work-dir',
                    str(tmp_path), '--resume', '--cfg-options', *data_options(mini_data_root),
                    'train_cfg.max_iters=3'],
                   env=dict(PYTHON=sys.executable, PORT='29518'))
    assert trained_iters(log) == [3]


FAKE_PYTHON = """#!/usr/bin/env bash
echo "{name} ran: $*"
"""


@pytest.fixture
def fake_checkout(tmp_path):
    """The launch scripts in a checkout whose interpreters only say which ran, plus a
    ``python`` first on PATH; returns (checkout, environment)."""
    checkout = tmp_path / 'checkout'
    (checkout / 'tools').mkdir(parents=True)
    for script in ('dist_train.sh', 'dist_test.sh', 'venv_python.sh'):
        (checkout / 'tools' / script).write_text((REPO / 'tools' / script).read_text())
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for path, name in ((bin_dir / 'python', 'PATH python'),
                       (checkout / '.venv' / 'bin' / 'python', 'venv python'),
                       (tmp_path / 'other' / 'bin' / 'python', 'LINVIT_VENV python')):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(FAKE_PYTHON.format(name=name))
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ('PYTHON', 'LINVIT_VENV')}
    env['PATH'] = f'{bin_dir}{os.pathsep}{env["PATH"]}'
    return checkout, env


@pytest.mark.parametrize('script, args, tool_args', [
    ('dist_train.sh', ['cfg.py', '2', '--amp'], 'train.py cfg.py --launcher pytorch --amp'),
    ('dist_test.sh', ['cfg.py', 'ckpt.pth', '2', '--tta'],
     'test.py cfg.py ckpt.pth --launcher pytorch --tta'),
])
def test_dist_scripts_run_the_checkouts_venv(fake_checkout, tmp_path, script, args, tool_args):
    checkout, env = fake_checkout

    def launch(**extra_env):
        proc = subprocess.run(['bash', str(checkout / 'tools' / script), *args],
                              capture_output=True, text=True, env={**env, **extra_env})
        return proc.returncode, proc.stdout.strip(), proc.stderr

    # no activated environment: the checkout's .venv, not whatever python is on PATH
    code, out, _ = launch()
    assert code == 0 and out.startswith('venv python ran: -m torch.distributed.run ')
    assert '--nproc_per_node=2' in out and out.endswith(tool_args)
    code, out, _ = launch(PYTHON=str(tmp_path / 'bin' / 'python'))
    assert out.startswith('PATH python ran: -m torch.distributed.run ')
    code, out, _ = launch(LINVIT_VENV=str(tmp_path / 'other'))
    assert out.startswith('LINVIT_VENV python ran: ')
    code, _, err = launch(LINVIT_VENV=str(tmp_path / 'missing'))
    assert code == 1 and f'LINVIT_VENV={tmp_path / "missing"} has no bin/python' in err
    (checkout / '.venv' / 'bin' / 'python').unlink()
    code, out, _ = launch()
    assert out.startswith('PATH python ran: ')  # without a .venv, an activated environment
