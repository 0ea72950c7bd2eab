#!/usr/bin/env python3
"""Build (or bring up to date) the linvit_mm virtual environment in one command.

    python3.11 tools/setup_env.py            # or: bash tools/setup_env.sh

The environment lives at ``$LINVIT_VENV`` (default ``<repo>/.venv``). Each step
records a stamp, the hash of everything that decides its result; a step whose
stamp is unchanged is skipped, so a second run returns in seconds and a changed
requirement file redoes only the steps that read it.

mmcv 2.1.0 (the newest mmcv that mmdet 3.3 / mmseg 1.2 accept) ships no wheel
for torch 2.14, so it is compiled from its sdist with its C++ ops (CPU ops here,
CUDA ops where ``nvcc`` and a CUDA device exist). The compiled wheel is kept in
a wheelhouse (``$LINVIT_WHEELHOUSE``, default ``~/.cache/linvit_mm/wheelhouse``)
keyed by mmcv, torch, Python and the op flavour, so a new venv does not
recompile. Everything that could fail (downloads, the compile) happens before
the environment is touched, and a failed step names its log. A step's own output
goes to its log; the console gets a line with the elapsed time every
``HEARTBEAT_S`` seconds while a step runs (the mmcv compile takes about 10 min).
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _sibling(name):
    """A module beside this script, by path: the script runs with nothing installed, from any
    working directory, and also under runpy (where its folder is not on sys.path)."""
    spec = spec_from_file_location(name, Path(__file__).resolve().parent / f'{name}.py')
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mmcv_subset = _sibling('mmcv_subset')
REQ = REPO / 'requirements'
CONSTRAINTS = REQ / 'constraints.txt'
REQUIRED_PYTHON = (3, 11)
MMCV_VERSION = '2.1.0'
# torch >= 2.10 headers refuse anything older than C++20; mmcv 2.1.0 asks for 17. -g0: the
# debug information the interpreter's CFLAGS ask for is most of the compile time and 30 of the
# wheel's 32 MB, and nobody steps through mmcv's ops in gdb.
MMCV_PATCHES = (("extra_compile_args['cxx'] = ['-std=c++17']",
                 "extra_compile_args['cxx'] = ['-std=c++20', '-g0']"),
                ("extra_compile_args['nvcc'] += ['-std=c++17']",
                 "extra_compile_args['nvcc'] += ['-std=c++20']"))
# The ops the build compiles (mmcv_subset.py); LINVIT_MMCV_OPS=all compiles every op.
MMCV_OPS = REQ / 'mmcv_ops.txt'
FRESH_VENV_FREE_GB = 12.0  # venv ~6.1 GB plus the mmcv build tree and pip caches
UPDATE_FREE_GB = 2.0
# A long step (the torch download, the mmcv compile) says it is alive this often; pip and
# the compiler write only to the step's log.
HEARTBEAT_S = 30.


class StepFailed(RuntimeError):
    pass


def log(msg):
    print(f'[setup_env {time.strftime("%H:%M:%S")}] {msg}', flush=True)


def format_elapsed(seconds):
    """``45 s``, ``4 min 30 s``, ``1 h 02 min``."""
    seconds = int(seconds)
    if seconds < 60:
        return f'{seconds} s'
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f'{minutes} min {seconds:02d} s'
    hours, minutes = divmod(minutes, 60)
    return f'{hours} h {minutes:02d} min'


def sha256_of(*parts):
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            part = part.read_bytes()
        if isinstance(part, str):
            part = part.encode()
        digest.update(part)
        digest.update(b'\0')
    return digest.hexdigest()[:16]


def pinned_version(name):
    for line in CONSTRAINTS.read_text().splitlines():
        match = re.match(rf'^{re.escape(name)}==(\S+)', line.strip())
        if match:
            return match.group(1)
    raise StepFailed(f'{name} is not pinned in {CONSTRAINTS}')


class Env:
    """The venv, its stamps and a log directory for the steps' output."""

    def __init__(self, path):
        self.path = Path(path).resolve()
        self.python = self.path / 'bin' / 'python'
        self.stamps = self.path / '.linvit_stamps'
        self.logs = self.path / '.linvit_logs'

    def usable(self):
        if not self.python.exists():
            return False
        probe = subprocess.run([str(self.python), '-c', 'import sys; print(sys.version_info[:2])'],
                               capture_output=True, text=True)
        return probe.returncode == 0 and probe.stdout.strip() == str(REQUIRED_PYTHON)

    def stamp_ok(self, step, value):
        stamp = self.stamps / step
        return stamp.exists() and stamp.read_text() == value

    def write_stamp(self, step, value):
        self.stamps.mkdir(parents=True, exist_ok=True)
        (self.stamps / step).write_text(value)

    def clear_stamps_after(self, step, order):
        """A redone step invalidates every step that was built on top of it."""
        for later in order[order.index(step) + 1:]:
            (self.stamps / later).unlink(missing_ok=True)

    def run(self, step, cmd, env=None, cwd=None, doing=None):
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f'{step}.log'
        return run_logged(step, cmd, log_path, env=env, cwd=cwd, doing=doing)

    def pip(self, step, *args, env=None, doing=None):
        return self.run(step, [str(self.python), '-m', 'pip', *args], env=env, doing=doing)

    def py(self, code, env=None):
        out = subprocess.run([str(self.python), '-c', code], capture_output=True, text=True,
                             env=env)
        if out.returncode != 0:
            raise StepFailed(f'python in the venv failed:\n{out.stderr[-2000:]}')
        return out.stdout.strip()


def run_logged(step, cmd, log_path, env=None, cwd=None, doing=None, heartbeat_s=None):
    """Run ``cmd``; stream it to ``log_path``; raise naming the step and log on failure.

    While it runs, a line ``<doing>: <elapsed> elapsed`` reaches the console every
    ``heartbeat_s`` seconds (default ``HEARTBEAT_S``), so a step that takes minutes
    is not mistaken for a hung one.
    """
    doing = doing or f'{step}: running'
    heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, 'w') as fh:
        fh.write('$ ' + ' '.join(map(str, cmd)) + '\n')
        fh.flush()
        started = time.monotonic()
        proc = subprocess.Popen(list(map(str, cmd)), stdout=fh, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd)
        try:
            while True:
                try:
                    returncode = proc.wait(timeout=heartbeat_s)
                    break
                except subprocess.TimeoutExpired:
                    log(f'{doing}: {format_elapsed(time.monotonic() - started)} elapsed '
                        f'(log: {log_path})')
        except BaseException:
            # Ctrl-C or any other way out: the step must not keep running unseen.
            proc.kill()
            proc.wait()
            raise
    if returncode != 0:
        tail = log_path.read_text(errors='replace').splitlines()[-25:]
        raise StepFailed(f'step "{step}" failed (exit {returncode}); full log: {log_path}\n'
                         + '\n'.join('    ' + line for line in tail))
    return log_path


def check_python():
    if sys.version_info[:2] != REQUIRED_PYTHON:
        raise StepFailed(
            f'step "preflight" failed: Python {REQUIRED_PYTHON[0]}.{REQUIRED_PYTHON[1]} is '
            f'required (the torch 2.14.1 wheels are cp311), this is {sys.version.split()[0]} '
            f'at {sys.executable}. Run the script with python3.11.')


def check_disk(path, need_gb, what):
    probe = path
    while not probe.exists():
        probe = probe.parent
    free_gb = shutil.disk_usage(probe).free / 2**30
    if free_gb < need_gb:
        raise StepFailed(f'step "preflight" failed: {what} needs about {need_gb:.0f} GiB free '
                         f'on {probe}, only {free_gb:.1f} GiB is free. Nothing was changed.')


def pip_env(extra=None):
    env = dict(os.environ)
    env['PIP_DISABLE_PIP_VERSION_CHECK'] = '1'
    env.update(extra or {})
    return env


def step_venv(env):
    if env.usable():
        return False
    if env.path.exists():
        # A half-made venv (interrupted first run) holds nothing worth keeping.
        log(f'{env.path} exists but has no working Python {REQUIRED_PYTHON}; recreating it')
        shutil.rmtree(env.path)
    run_logged('venv', [sys.executable, '-m', 'venv', env.path],
               env.path.parent / f'.{env.path.name}-venv.log')
    return True


def requirement_step(env, step, files, order):
    stamp = sha256_of(sys.version, CONSTRAINTS, *files)
    if env.stamp_ok(step, stamp):
        log(f'{step}: up to date')
        return
    log(f'{step}: installing {", ".join(f.name for f in files)} (log: {env.logs / step}.log)')
    args = ['install', '-c', CONSTRAINTS]
    for f in files:
        args += ['-r', f]
    env.pip(step, *args, env=pip_env(), doing=f'{step}: installing')
    env.clear_stamps_after(step, order)
    env.write_stamp(step, stamp)


def mmcv_flavour(env):
    """'cuda' where nvcc and a CUDA device exist (GPU users need CUDA ops), else 'cpu'."""
    if shutil.which('nvcc') is None:
        return 'cpu'
    has_gpu = env.py('import torch; print(torch.cuda.is_available())') == 'True'
    if not has_gpu:
        return 'cpu'
    arch = env.py('import torch; print("".join(map(str, torch.cuda.get_device_capability())))')
    return f'cuda-sm{arch}'


def wheelhouse():
    default = Path(os.environ.get('XDG_CACHE_HOME', Path.home() / '.cache')) / 'linvit_mm'
    return Path(os.environ.get('LINVIT_WHEELHOUSE', default / 'wheelhouse'))


def mmcv_ops_selection():
    """The op stems to compile (CPU and CUDA builds alike): those of
    ``requirements/mmcv_ops.txt``, or None for every op (``LINVIT_MMCV_OPS=all``)."""
    wanted = os.environ.get('LINVIT_MMCV_OPS', '').strip()
    if wanted == 'all':
        return None
    if wanted:
        raise StepFailed(f'LINVIT_MMCV_OPS={wanted!r}: the only value it takes is "all" '
                         f'(unset, the ops of {MMCV_OPS} are compiled)')
    return tuple(sorted(mmcv_subset.read_kept_ops(MMCV_OPS)))


def build_mmcv_wheel(env, flavour, ops, target_dir):
    """Download the mmcv sdist, apply MMCV_PATCHES, keep ``ops`` (None: all), compile a wheel
    into target_dir."""
    with tempfile.TemporaryDirectory(prefix='linvit-mmcv-') as tmp:
        tmp = Path(tmp)
        log('mmcv: downloading the sdist')
        # torch must be importable for mmcv's setup.py, hence no build isolation.
        env.pip('mmcv-download', 'download', '--no-deps', '--no-binary', ':all:',
                '--no-build-isolation', '-d', tmp / 'sdist', f'mmcv=={MMCV_VERSION}',
                env=pip_env(), doing='mmcv: downloading the sdist')
        sdists = list((tmp / 'sdist').glob('mmcv-*.tar.gz'))
        if len(sdists) != 1:
            raise StepFailed(f'step "mmcv-download" found {sdists} instead of one sdist')
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(tmp / 'src', filter='data')
        src = next((tmp / 'src').iterdir())
        setup_py = src / 'setup.py'
        text = setup_py.read_text()
        for old, new in MMCV_PATCHES:
            if old not in text:
                raise StepFailed(f'mmcv {MMCV_VERSION} setup.py no longer contains {old!r}; '
                                 'update MMCV_PATCHES in tools/setup_env.py')
            text = text.replace(old, new)
        setup_py.write_text(text)
        if ops is not None:
            try:
                bound = mmcv_subset.trim_tree(src, ops)
            except mmcv_subset.TrimError as err:
                raise StepFailed(f'step "mmcv-build" cannot keep only {", ".join(ops)}: {err}')
            log(f'mmcv: compiling the ops {", ".join(ops)} ({len(bound)} functions; '
                'LINVIT_MMCV_OPS=all compiles every op)')
        build_env = pip_env({'MMCV_WITH_OPS': '1', 'MAX_JOBS': str(os.cpu_count() or 2)})
        if flavour == 'cpu':
            # mmcv builds CUDA ops whenever torch sees a GPU; FORCE_CUDA=0 does not stop it.
            build_env['CUDA_VISIBLE_DEVICES'] = ''
        else:
            build_env['FORCE_CUDA'] = '1'
        log(f'mmcv: compiling {flavour} ops ({"about 2 min" if ops else "about 10-35 min"} '
            f'on 2 cores; log: {env.logs}/mmcv-build.log)')
        started = time.time()
        env.pip('mmcv-build', 'wheel', '--no-deps', '--no-build-isolation', '-w', tmp / 'wheel',
                src, env=build_env, doing=f'mmcv: compiling {flavour} ops')
        log(f'mmcv: compiled in {time.time() - started:.0f} s')
        wheel = next((tmp / 'wheel').glob('mmcv-*.whl'))
        target_dir.mkdir(parents=True, exist_ok=True)
        # Copy then rename, so an interrupted copy never looks like a cached wheel.
        partial = target_dir / (wheel.name + '.partial')
        shutil.copyfile(wheel, partial)
        partial.rename(target_dir / wheel.name)


def step_mmcv(env, order):
    flavour = mmcv_flavour(env)
    ops = mmcv_ops_selection()
    torch_version = env.py('import torch; print(torch.__version__)')
    key = (f'mmcv-{MMCV_VERSION}-torch{torch_version}-py{sys.version_info[0]}'
           f'{sys.version_info[1]}-{flavour}-{"all" if ops is None else "ops"}-'
           f'{sha256_of(repr(MMCV_PATCHES), repr(ops), Path(mmcv_subset.__file__))[:8]}')
    stamp = sha256_of(key)
    if env.stamp_ok('mmcv', stamp):
        log(f'mmcv: up to date ({key})')
        return
    cache_dir = wheelhouse() / key
    wheels = list(cache_dir.glob('mmcv-*.whl'))
    if wheels:
        log(f'mmcv: using the cached wheel {wheels[0]}')
    else:
        build_mmcv_wheel(env, flavour, ops, cache_dir)
        wheels = list(cache_dir.glob('mmcv-*.whl'))
    # With its dependencies (mmengine, opencv, ...) pinned by the constraints, so that
    # the ops can be checked right away.
    env.pip('mmcv-install', 'install', '--force-reinstall', '-c', CONSTRAINTS, wheels[0],
            env=pip_env(), doing='mmcv: installing the wheel')
    env.py('import mmcv.ops, torch; '
           'from mmcv.ops import nms, roi_align; '
           'nms(torch.rand(4, 4).sort(1)[0], torch.rand(4), 0.5); '
           'roi_align(torch.rand(1, 2, 8, 8), torch.tensor([[0., 1., 1., 6., 6.]]), (2, 2))')
    env.clear_stamps_after('mmcv', order)
    env.write_stamp('mmcv', stamp)


def step_project(env, order):
    # The checkout's own path too: the editable install and the link lead to one checkout, so
    # an environment shared by a second checkout must be pointed at it.
    stamp = sha256_of(REPO / 'setup.py', str(env.path), str(REPO))
    if env.stamp_ok('project', stamp):
        log('project: up to date')
        return
    log('project: installing linvit_mm in editable mode')
    env.pip('project', 'install', '--no-deps', '--no-build-isolation', '-e', REPO,
            '--config-settings', 'editable_mode=compat', env=pip_env())
    link_package_for_mim(env)
    env.write_stamp('project', stamp)


def link_package_for_mim(env):
    """Make ``<site-packages>/linvit_mm`` lead to the source package.

    mim (search, train, test) and mmengine find a package's ``.mim`` folder (configs, tools,
    model-index.yml) under ``<location of its distribution>/<module>``. The editable install
    of setuptools >= 80 leaves the distribution in site-packages and the code here, so that
    path would not exist; the legacy ``setup.py develop`` layout they were written for gave
    it. A link restores it; both paths lead to the same files.
    """
    purelib = Path(env.py('import sysconfig; print(sysconfig.get_paths()["purelib"])'))
    link, target = purelib / 'linvit_mm', REPO / 'linvit_mm'
    if link.is_symlink():
        link.unlink()
    elif link.exists():
        raise StepFailed(f'{link} is not a link to {target}: remove that copy of linvit_mm '
                         f'(pip uninstall linvit_mm) and run again')
    link.symlink_to(target, target_is_directory=True)
    env.py('import os.path as osp; from mim.utils import get_installed_path; '
           'assert osp.isdir(osp.join(get_installed_path("linvit_mm"), ".mim", "configs"))')


def verify(env):
    versions = env.py(
        'import json, torch, torchvision, mmengine, mmcv, mmcv.ops, mmdet, mmseg, '
        'mmpretrain, timm, linvit_mm; '
        'print(json.dumps({m.__name__: m.__version__ for m in '
        '(torch, torchvision, mmengine, mmcv, mmdet, mmseg, mmpretrain, timm, linvit_mm)}))')
    return json.loads(versions)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--venv', default=os.environ.get('LINVIT_VENV', REPO / '.venv'),
                        help='where the environment lives (env: LINVIT_VENV)')
    args = parser.parse_args(argv)
    env = Env(args.venv)
    started = time.time()
    order = ['build', 'torch', 'mmcv', 'openmmlab', 'project']
    try:
        log('preflight: Python and disk space')
        check_python()
        fresh = not env.usable()
        check_disk(env.path.parent, FRESH_VENV_FREE_GB if fresh else UPDATE_FREE_GB,
                   'a new environment' if fresh else 'updating the environment')
        if step_venv(env):
            log(f'venv: created {env.path}')
        else:
            log(f'venv: reusing {env.path}')
        requirement_step(env, 'build', [REQ / 'build.txt'], order)
        requirement_step(env, 'torch', [REQ / 'torch.txt'], order)
        step_mmcv(env, order)
        requirement_step(env, 'openmmlab',
                         [REQ / 'mminstall.txt', REQ / 'runtime.txt', REQ / 'tests.txt'], order)
        step_project(env, order)
        log('verify: importing the stack')
        versions = verify(env)
    except StepFailed as err:
        print(f'\nsetup_env: {err}', file=sys.stderr)
        return 1
    log('ready: ' + ', '.join(f'{k} {v}' for k, v in versions.items()))
    log(f'done in {time.time() - started:.0f} s; python: {env.python}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
