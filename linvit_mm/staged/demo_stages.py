"""Running the demo's stages: each a ``tools/train.py`` run (a subprocess, or with
:class:`InProcessTools` the tool's ``main`` in this process) into its own work directory,
reused when a finished run had the same config and options."""
import collections
import contextlib
import importlib.util
import io
import json
import os
import os.path as osp
import re
import subprocess
import sys
import threading
import time
import uuid

from .recipes import (ALIGN_STAGES, CLS_CONFIG, DENSE_INITS, DENSE_TASKS, LORA_STAGES, REPO,
                      TEACHER_CONFIG, TEACHER_SET, data_options, dense_options, recipe_stages,
                      schedule_options, stage_options)

MERGE_LORA = osp.join('tools', 'model_converters', 'merge_lora.py')
# Lines of the tools' logs worth showing while a stage runs.
PROGRESS = re.compile(r'Iter\(train\)|Epoch\(train\)|accuracy/top1|bbox_mAP_copypaste|'
                      r'segm_mAP_copypaste|mIoU: |Error|error:')
# Fields of those lines left out of the console (the log file keeps them); mmengine's eta
# stays, it says how long the stage has left.
HIDDEN_FIELDS = re.compile(r'\s+(base_lr|data_time|grad_norm): \S+')
_print_lock = threading.Lock()


def log(message):
    with _print_lock:
        print(f'[demo {time.strftime("%H:%M:%S")}] {message}', flush=True)


def shown_line(line):
    """What the console shows of a line of a tool's log: a progress line without the
    logger's prefix and the ``HIDDEN_FIELDS``, or ``None`` for the other lines."""
    if not PROGRESS.search(line):
        return None
    return HIDDEN_FIELDS.sub('', line.rstrip().split(' - INFO - ')[-1])


def run_tool(args, log_path, show=True, threads=None):
    """Run a tool with the current interpreter, tee its output into log_path."""
    command = [sys.executable] + args
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    lines = []
    with open(log_path, 'w') as log_file:
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log_file.write(line)
            lines.append(line)
            shown = shown_line(line) if show else None
            if shown is not None:
                with _print_lock:
                    print('    ' + shown, flush=True)
        proc.wait()
    if proc.returncode != 0:
        tail = ''.join(lines[-30:])
        raise SystemExit(f'demo: {" ".join(args[:2])} failed (exit {proc.returncode}); '
                         f'log: {log_path}\n{tail}')
    return ''.join(lines)


def _runner(runner):
    # looked up when called, so that replacing run_tool (as tests do) reaches every stage
    return run_tool if runner is None else runner


class InProcessTools:
    """A ``runner`` that runs the tools in this process: the same ``main`` of ``tools/train.py``
    with the same arguments, less the interpreter start-up and imports, which on two cores
    take longer than a 30-step run itself. mmengine names a run by its config and the second
    it starts, so each run gets its own ``experiment_name`` (two runs of one config within a
    second would otherwise share a logger and message hub) and its own visualizer. Output is
    captured by redirecting ``sys.stdout``, which is global: one run at a time."""

    def __init__(self, threads=None, label='in_process'):
        self.modules = {}
        self.threads = threads
        self.label = label

    def __call__(self, args, log_path, show=True, threads=None):
        import torch
        if threads or self.threads:
            torch.set_num_threads(threads or self.threads)
        path = args[0]
        if path not in self.modules:
            # tools/ is not a package: the tool's file is its module
            spec = importlib.util.spec_from_file_location(
                f'linvit_tool_{osp.splitext(osp.basename(path))[0]}', osp.join(REPO, path))
            self.modules[path] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(self.modules[path])
        argv = [str(arg) for arg in args[1:]]
        if osp.basename(path) in ('train.py', 'test.py'):
            # the visualizer is a named singleton too, and mmdet's and mmseg's configs name
            # theirs 'visualizer': a detection run after a segmentation run would draw with it
            run = f'{self.label}_{uuid.uuid4().hex[:12]}'
            argv += [f'experiment_name={run}', f'visualizer.name={run}']
        stream = io.StringIO()
        try:
            with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
                self.modules[path].main(argv)
        except BaseException as error:
            with open(log_path, 'w') as f:
                f.write(stream.getvalue())
            raise SystemExit(f'{self.label}: {" ".join(args[:2])} failed ({error!r}); '
                             f'log: {log_path}') from error
        with open(log_path, 'w') as f:
            f.write(stream.getvalue())
        return stream.getvalue()


def last_checkpoint(work_dir):
    marker = osp.join(work_dir, 'last_checkpoint')
    if not osp.isfile(marker):
        return None
    path = open(marker).read().strip()
    return path if osp.isfile(path) else None


def metric(output, name):
    found = re.findall(rf'{re.escape(name)}: ([-\d.]+)', output)
    if not found:
        raise SystemExit(f'demo: the output has no {name}')
    return float(found[-1])


# A finished training: its last checkpoint, the metric of its final validation (None for a
# run without one), its wall time and whether it was reused from an earlier demo run.
Trained = collections.namedtuple('Trained', 'checkpoint metric seconds reused')


def train(config, work_dir, options, force, metric_name=None, show=True, threads=None,
          runner=None):
    """Train ``config`` (a config file's path) into ``work_dir``; return ``Trained``.

    ``runner`` runs the tool (default :func:`run_tool`: a subprocess; :class:`InProcessTools`
    runs its ``main`` here), as do the other functions that take one.

    A finished run of the same config and options, from the same versions of the config and
    of the files the options name (checkpoints of earlier stages: their modification times),
    is reused (its ``demo_run.json``); any other content of ``work_dir`` is trained over.
    """
    record_path = osp.join(work_dir, 'demo_run.json')
    values = [config] + [option.split('=', 1)[-1] for option in options]
    request = dict(config=config, options=list(options),
                   inputs={path: osp.getmtime(path) for path in values if osp.isfile(path)})
    if not force and osp.isfile(record_path):
        with open(record_path) as f:
            record = json.load(f)
        if ({k: record.get(k) for k in request} == request
                and osp.isfile(record['checkpoint'])):
            return Trained(record['checkpoint'], record['metric'], record['seconds'], True)
    os.makedirs(work_dir, exist_ok=True)
    if osp.exists(record_path):
        os.remove(record_path)
    started = time.time()
    output = _runner(runner)(['tools/train.py', config, '--work-dir', work_dir, '--cfg-options',
                              *options], osp.join(work_dir, 'train.log'), show=show,
                             threads=threads)
    run = Trained(last_checkpoint(work_dir), metric(output, metric_name) if metric_name else None,
                  time.time() - started, False)
    with open(record_path, 'w') as f:
        json.dump(dict(request, **run._asdict()), f, indent=1)
    return run


def train_teacher(work_dir, data_root, iters, force, configs, runner=None):
    """The Softmax teacher on ``TEACHER_SET`` (``configs``: ``DemoConfigs``): ``Trained`` with
    its top-1."""
    options = data_options(osp.join(data_root, TEACHER_SET)) + schedule_options(
        TEACHER_CONFIG, iters)
    return train(configs.path(TEACHER_CONFIG), work_dir, options, force,
                 metric_name='accuracy/top1', runner=runner)


def run_recipe(recipe, seed, *, steps, attn_type, teacher, data_root, configs, work_dir, force,
               threads=None, runner=None):
    """Train every stage of ``recipe`` for one seed into ``work_dir/<stage>`` (``configs``:
    ``DemoConfigs``); return ``Trained``: the last stage's checkpoint and top-1, the stages'
    seconds summed, reused when every stage was."""
    stages = []
    for stage, iters in recipe_stages(recipe, steps):
        options = stage_options(stage, iters, attn_type=attn_type, seed=seed, teacher=teacher,
                                data_root=data_root,
                                previous=stages[-1].checkpoint if stages else None)
        stages.append(train(configs.path(CLS_CONFIG.format(stage=stage)),
                            osp.join(work_dir, stage), options, force,
                            metric_name=None if stage in ALIGN_STAGES else 'accuracy/top1',
                            show=False, threads=threads, runner=runner))
    return Trained(stages[-1].checkpoint, stages[-1].metric, sum(s.seconds for s in stages),
                   all(s.reused for s in stages))


def plain_checkpoint(recipe, seed, checkpoint, *, steps, attn_type, teacher, data_root, configs,
                     work_dir, runner=None):
    """The classifier checkpoint of a finished run as a plain LinearViT classifier: a LoRA
    fine-tuning checkpoint has its factors merged in (tools/model_converters/merge_lora.py);
    the others are plain already."""
    stage, _ = recipe_stages(recipe, steps)[-1]
    if stage not in LORA_STAGES:
        return checkpoint
    stages = recipe_stages(recipe, steps)
    previous = last_checkpoint(osp.join(work_dir, stages[-2][0]))
    options = stage_options(stage, stages[-1][1], attn_type=attn_type, seed=seed,
                            teacher=teacher, data_root=data_root, previous=previous)
    merged = osp.join(work_dir, stage, 'merged.pth')
    _runner(runner)([MERGE_LORA, configs.path(CLS_CONFIG.format(stage=stage)), checkpoint,
                     merged, '--cfg-options', *options],
                    osp.join(work_dir, stage, 'merge.log'), show=False)
    return merged


def run_dense(task, neck, init, seed, *, classifier, attn_type, data_root, budget, configs,
              work_dir, force, threads=None, runner=None):
    """One dense run: ``task``'s config for ``neck`` (``DENSE_TASKS``), its ViT the
    ``classifier`` checkpoint's (``init='pre-trained'``) or initialised at random
    (``'random'``), trained for ``budget`` epochs / iterations into ``work_dir``; return
    ``Trained`` with the metric of its final validation (the whole validation set)."""
    if init not in DENSE_INITS:
        raise ValueError(f'unknown init {init!r}; inits: {", ".join(DENSE_INITS)}')
    spec = DENSE_TASKS[task]
    options = dense_options(task, neck, data_root, budget, attn_type=attn_type, seed=seed,
                            checkpoint=classifier if init == 'pre-trained' else None)
    return train(configs.path(spec['configs'][neck]), work_dir, options, force,
                 metric_name=spec['metric'], show=False, threads=threads, runner=runner)
