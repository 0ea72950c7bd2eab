"""The whole linvit_mm recipe at small scale, on CPU, from nothing.

    python tools/demo.py [--attn-type relu] [--work-dir work_dirs/demo]

1. writes the generated mini data sets (ImageNet / COCO / ADE20K layouts);
2. pre-trains a small Softmax ViT on a shapes set (the teacher);
3. transfers it into a linear ViT on a *different* task (the shapes grouped into
   round / cornered / spiky, from 8 new images a group) under Random, Copy, MLPCopy,
   MLPCopy + distillation and FullCopy + distillation, with equal budgets, evaluates
   each with tools/test.py, prints the accuracy table and draws a bar chart;
4. carries the best classifier into Mask R-CNN + ViT-Adapter (mini COCO, box and
   mask AP) and UperNet + ViT-Adapter (mini ADE20K, mIoU).

Every stage runs the same ``tools/train.py`` / ``tools/test.py`` and the configs in
``configs/demo/`` (thin overrides of the real ones). A stage whose checkpoint
exists is reused; ``--force`` redoes everything.
"""
import argparse
import json
import os
import os.path as osp
import re
import subprocess
import sys
import time

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO_CONFIGS = osp.join(REPO, 'configs', 'demo')
TEACHER_CONFIG = 'linvit-softmax-mini_random_1xb32_mini-shapes.py'
SETTINGS = ('random', 'copy', 'mlpcopy', 'mlpcopy-distill', 'fullcopy-distill')
# The teacher learns from a larger shapes set than the tests use (150 images a class).
TEACHER_SET = dict(task='shapes', train_per_class=150, val_per_class=16)
DET_CONFIG = 'mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py'
SEG_CONFIG = 'upernet_linvit-adapter-relu-mini_mini-ade.py'
# Lines of the tools' logs worth showing while a stage runs.
PROGRESS = re.compile(r'Iter\(train\)|Epoch\(train\)|accuracy/top1|bbox_mAP_copypaste|'
                      r'segm_mAP_copypaste|mIoU: |Error|error:')
# Fields of those lines left out of the console (the log file keeps them); mmengine's eta
# stays, it says how long the stage has left.
HIDDEN_FIELDS = re.compile(r'\s+(base_lr|data_time|grad_norm): \S+')


def log(message):
    print(f'[demo {time.strftime("%H:%M:%S")}] {message}', flush=True)


def shown_line(line):
    """What the console shows of a line of a tool's log: a progress line without the
    logger's prefix and the ``HIDDEN_FIELDS``, or ``None`` for the other lines."""
    if not PROGRESS.search(line):
        return None
    return HIDDEN_FIELDS.sub('', line.rstrip().split(' - INFO - ')[-1])


def run_tool(args, log_path, show=True):
    """Run a tool with the current interpreter, tee its output into log_path."""
    command = [sys.executable] + args
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    lines = []
    with open(log_path, 'w') as log_file:
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            log_file.write(line)
            lines.append(line)
            shown = shown_line(line) if show else None
            if shown is not None:
                print('    ' + shown, flush=True)
        proc.wait()
    if proc.returncode != 0:
        tail = ''.join(lines[-30:])
        raise SystemExit(f'demo: {" ".join(args[:2])} failed (exit {proc.returncode}); '
                         f'log: {log_path}\n{tail}')
    return ''.join(lines)


def last_checkpoint(work_dir):
    marker = osp.join(work_dir, 'last_checkpoint')
    if not osp.isfile(marker):
        return None
    path = open(marker).read().strip()
    return path if osp.isfile(path) else None


def train(config, work_dir, options, force):
    ckpt = last_checkpoint(work_dir)
    if ckpt and not force:
        log(f'reusing {ckpt}')
        return ckpt
    os.makedirs(work_dir, exist_ok=True)
    run_tool(['tools/train.py', osp.join(DEMO_CONFIGS, config), '--work-dir', work_dir,
              '--cfg-options', *options], osp.join(work_dir, 'train.log'))
    return last_checkpoint(work_dir)


def test(config, checkpoint, work_dir, options, extra=()):
    return run_tool(['tools/test.py', osp.join(DEMO_CONFIGS, config), checkpoint, '--work-dir',
                     work_dir, *extra, '--cfg-options', *options],
                    osp.join(work_dir, 'test.log'), show=False)


def metric(output, name):
    found = re.findall(rf'{re.escape(name)}: ([-\d.]+)', output)
    if not found:
        raise SystemExit(f'demo: the test output has no {name}')
    return float(found[-1])


def cls_data_options(root):
    return [f'{loader}.dataset.data_root={root}'
            for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]


def bar_chart(results, attn_type, teacher_acc, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    names = list(results)
    values = [results[n] for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    colours = ['#9e9e9e', '#64b5f6', '#1e88e5', '#e53935', '#8e24aa']
    bars = ax.bar(names, values, color=colours[:len(names)])
    for bar, value in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, value + 0.8, f'{value:.1f}', ha='center')
    ax.axhline(100 / 3, color='k', ls=':', lw=1, label='chance')
    ax.set_ylabel('top-1 accuracy (%)')
    ax.set_ylim(0, 105)
    ax.tick_params(axis='x', labelsize=8)
    ax.set_title(f'Softmax teacher ({teacher_acc:.1f}% on shapes) -> {attn_type} ViT '
                 'on shape groups', fontsize=9)
    ax.legend(loc='upper left', fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    from linvit_mm.models.attention import attention_types
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--attn-type', default='relu',
                        choices=attention_types(),
                        help='operator of the linear student (default relu)')
    parser.add_argument('--work-dir', default=osp.join(REPO, 'work_dirs', 'demo'))
    parser.add_argument('--data-root', default=osp.join(REPO, 'data', 'mini'))
    parser.add_argument('--teacher-iters', type=int, default=1500)
    parser.add_argument('--transfer-iters', type=int, default=200)
    parser.add_argument('--det-epochs', type=int, default=12)
    parser.add_argument('--seg-iters', type=int, default=400)
    parser.add_argument('--skip-dense', action='store_true', help='stop after classification')
    parser.add_argument('--force', action='store_true', help='redo stages already done')
    args = parser.parse_args(argv)
    started = time.time()
    work = osp.abspath(args.work_dir)
    os.makedirs(work, exist_ok=True)

    log(f'1/4 mini data sets -> {args.data_root}')
    sys.path.insert(0, REPO)
    from linvit_mm.testing.mini_data import make_mini_all, make_mini_imagenet
    summaries = make_mini_all(args.data_root)
    shapes = osp.join(args.data_root, 'imagenet_large')
    summaries['imagenet_large'] = make_mini_imagenet(shapes, **TEACHER_SET)
    for name, summary in summaries.items():
        log(f'    {name}: {summary["num_files"]} files in {summary["root"]}')
    groups = osp.join(args.data_root, 'imagenet_groups')

    log(f'2/4 pre-train the Softmax teacher on shapes ({args.teacher_iters} iterations)')
    schedule = lambda iters: [  # noqa: E731
        f'train_cfg.max_iters={iters}', f'train_cfg.val_interval={iters}',
        f'default_hooks.checkpoint.interval={iters}', f'param_scheduler.1.end={iters}']
    teacher_dir = osp.join(work, 'teacher')
    teacher = train(TEACHER_CONFIG, teacher_dir,
                    cls_data_options(shapes) + schedule(args.teacher_iters), args.force)
    teacher_acc = metric(test(TEACHER_CONFIG, teacher, teacher_dir, cls_data_options(shapes)),
                         'accuracy/top1')
    log(f'    teacher: {teacher_acc:.2f}% top-1 on shapes (chance 16.7%)')

    log(f'3/4 transfer into a {args.attn_type} ViT on shape groups (8 images a group), '
        f'{args.transfer_iters} iterations each')
    results, checkpoints = {}, {}
    for setting in SETTINGS:
        config = f'linvit-relu-mini_{setting}_1xb24_mini-groups.py'
        run_dir = osp.join(work, f'{args.attn_type}_{setting}')
        options = cls_data_options(groups) + schedule(args.transfer_iters) + [
            f'model.backbone.attn_type={args.attn_type}',
            f'model.backbone.init_cfg.checkpoint={teacher}']
        if setting.endswith('distill'):
            options.append(f'custom_hooks.0.teacher.init_cfg.checkpoint={teacher}')
        log(f'    {setting}')
        checkpoints[setting] = train(config, run_dir, options, args.force)
        results[setting] = metric(test(config, checkpoints[setting], run_dir, options),
                                  'accuracy/top1')

    print()
    print(f'  {args.attn_type} ViT on shape groups ({args.transfer_iters} iterations each), '
          f'initialised from a Softmax ViT pre-trained on shapes ({teacher_acc:.1f}%):')
    print(f'  {"setting":<18}{"top-1 (%)":>10}')
    for setting, acc in results.items():
        print(f'  {setting:<18}{acc:>10.2f}')
    print()
    chart = osp.join(work, 'transfer_accuracy.png')
    bar_chart(results, args.attn_type, teacher_acc, chart)
    log(f'    bar chart: {chart}')
    summary = dict(attn_type=args.attn_type, teacher_top1=teacher_acc, transfer_top1=results)

    if not args.skip_dense:
        best = max(SETTINGS, key=lambda s: (results[s], SETTINGS.index(s)))
        log(f'4/4 dense prediction from the best classifier ({best}: {results[best]:.2f}%)')
        backbone = [f'model.backbone.vit.attn_type={args.attn_type}',
                    f'model.backbone.pretrained={checkpoints[best]}']
        coco = osp.join(args.data_root, 'coco') + '/'
        det_options = backbone + [
            f'train_dataloader.dataset.data_root={coco}',
            f'val_dataloader.dataset.data_root={coco}',
            f'test_dataloader.dataset.data_root={coco}',
            f'val_evaluator.ann_file={coco}annotations/instances_val2017.json',
            f'test_evaluator.ann_file={coco}annotations/instances_val2017.json',
            f'train_cfg.max_epochs={args.det_epochs}',
            f'train_cfg.val_interval={args.det_epochs}',
            f'default_hooks.checkpoint.interval={args.det_epochs}']
        det_dir = osp.join(work, f'mask-rcnn_{args.attn_type}')
        log(f'    Mask R-CNN + adapter on mini COCO ({args.det_epochs} epochs)')
        det_ckpt = train(DET_CONFIG, det_dir, det_options, args.force)
        det_out = test(DET_CONFIG, det_ckpt, det_dir, det_options,
                       extra=['--show-dir', osp.join(det_dir, 'vis')])
        box_ap, mask_ap = metric(det_out, 'coco/bbox_mAP'), metric(det_out, 'coco/segm_mAP')

        ade = osp.join(args.data_root, 'ade')
        seg_options = backbone + [
            f'train_dataloader.dataset.data_root={ade}',
            f'val_dataloader.dataset.data_root={ade}',
            f'test_dataloader.dataset.data_root={ade}',
            f'train_cfg.max_iters={args.seg_iters}', f'train_cfg.val_interval={args.seg_iters}',
            f'default_hooks.checkpoint.interval={args.seg_iters}',
            f'param_scheduler.1.end={args.seg_iters}']  # warm-up: the first 20 iterations
        seg_dir = osp.join(work, f'upernet_{args.attn_type}')
        log(f'    UperNet + adapter on mini ADE20K ({args.seg_iters} iterations)')
        seg_ckpt = train(SEG_CONFIG, seg_dir, seg_options, args.force)
        seg_out = test(SEG_CONFIG, seg_ckpt, seg_dir, seg_options,
                       extra=['--show-dir', osp.join(seg_dir, 'vis')])
        miou = metric(seg_out, 'mIoU')
        print()
        print(f'  from the {best} classifier ({args.attn_type}):')
        print(f'  Mask R-CNN (mini COCO val): box mAP {box_ap:.3f} ({100 * box_ap:.1f} AP), '
              f'mask mAP {mask_ap:.3f} ({100 * mask_ap:.1f} AP)')
        print(f'  UperNet (mini ADE20K val):  mIoU {miou:.2f}')
        print()
        summary.update(best_setting=best, coco_bbox_mAP=box_ap, coco_segm_mAP=mask_ap,
                       ade_mIoU=miou)

    with open(osp.join(work, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=2)
    log(f'done in {time.time() - started:.0f} s; results in {work}/summary.json')
    return summary


if __name__ == '__main__':
    main()
