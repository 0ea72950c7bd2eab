#!/usr/bin/env python
"""How closely a linear-attention student reproduces its Softmax teacher, block by block.

For a student checkpoint and its teacher, on a few images, the tool prints per block its
operator (a hybrid student's differ from block to block) and

* ``cos attn`` / ``relMSE attn``: cosine similarity and relative MSE between the
  student's and the teacher's attention outputs (what ``AttentionDistillHook``
  matches: the output of each ``BaseAttention`` module, after its projection);
* ``cos block`` / ``relMSE block``: the same between the outputs of the blocks
  (``backbone.layers[i]``, residual stream after the MLP);

and writes them to ``fidelity.csv`` and ``fidelity.png`` in ``--out-dir``. A block
whose attention output is far from the teacher's is one that distillation has not yet
converged on; block outputs show how the differences accumulate along the depth.

Definitions, over all compared tokens ``n`` of all images: ``cos`` is the mean over
tokens of the cosine similarity of the student's and the teacher's ``C``-vectors, and
``relMSE = sum ||s_n - t_n||^2 / sum ||t_n||^2``. A student identical to its teacher
gives 1 and 0. Tokens are aligned as the hook aligns them: patch tokens only when the
student has no class token (mhla, ttt) or the hook is set to ``patch_tokens_only``.

**Student**: the config's ``model``, weights from ``CHECKPOINT`` (an mmengine run
checkpoint or a state dict of the whole model; loaded strictly). The compared module is
the hook's ``student`` (default ``backbone``).

**Teacher**, by default the ``teacher`` of the ``AttentionDistillHook`` in the config's
``custom_hooks``, built and initialised from its own ``init_cfg`` as the hook does.
``--teacher-config`` takes the teacher from another config's ``model`` instead (a
classifier's ``backbone`` or a bare backbone). ``--teacher-checkpoint`` loads the
teacher's weights from a file instead of its ``init_cfg``: an mmengine run checkpoint
of a classifier (keys ``backbone.*``), a bare backbone state dict, or any Softmax ViT
layout ``linvit_mm.transfer`` reads (DeiT, timm, ...).

**Images**: ``--images`` (files and/or folders) through the config's test pipeline, or
the first ``--num-images`` of the config's validation set; either way the config's data
preprocessor makes the batch, and the very same tensor feeds student and teacher.

Example::

    python tools/analysis_tools/attention_fidelity.py \\
        configs/classification/imagenet/linvit-relu-small_fullcopy-distill_32xb128_in1k.py \\
        work_dirs/linvit-relu-small_fullcopy-distill_32xb128_in1k/epoch_300.pth --num-images 16
"""
import argparse
import csv
import os
import os.path as osp
import sys

import torch
import torch.nn.functional as F

IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp', '.webp', '.tif', '.tiff', '.ppm', '.pgm')
CSV_COLUMNS = ('block', 'operator', 'cos_attn', 'relmse_attn', 'cos_block', 'relmse_block',
               'tokens')
DISTILL_HOOK = 'AttentionDistillHook'


# ------------------------------------------------------------------ configs and models
def load_config(path, options=None):
    from mmengine.config import Config
    from mmengine.utils import import_modules_from_strings
    cfg = Config.fromfile(path)
    if options:
        cfg.merge_from_dict(options)
    if cfg.get('custom_imports'):
        import_modules_from_strings(**cfg['custom_imports'])
    return cfg


def find_distill_hook(cfg):
    """The config's AttentionDistillHook entry (a dict), or None."""
    for hook in cfg.get('custom_hooks') or []:
        hook_type = hook.get('type')
        name = hook_type if isinstance(hook_type, str) else getattr(hook_type, '__name__', '')
        if name.split('.')[-1] == DISTILL_HOOK:
            return hook
    return None


def build_model(model_cfg):
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        return MODELS.build(model_cfg)


def load_student(cfg, checkpoint, device):
    from mmengine.runner import load_checkpoint
    model_cfg = cfg.model.copy()
    if cfg.get('data_preprocessor') is not None:
        # what the Runner does: the top-level preprocessor (mean, std) joins the model
        model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)
    model = build_model(model_cfg)
    # strict: comparing a partly random student with its teacher would mislead silently
    try:
        load_checkpoint(model, checkpoint, map_location='cpu', strict=True, logger='current')
    except RuntimeError as err:
        raise ValueError(f'{checkpoint} does not fit the model of the config: {err}') from None
    return model.to(device).eval()


def backbone_of(model, path='backbone'):
    """The LinearViT inside a model (``path``) or the model itself."""
    if hasattr(model, 'layers'):
        return model
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f'{type(model).__name__} has no module {path!r} with ViT blocks '
                         f'(.layers)') from None
    if not hasattr(module, 'layers'):
        raise ValueError(f'{path!r} ({type(module).__name__}) has no ViT blocks (.layers); '
                         f'the tool compares LinearViT backbones')
    return module


def backbone_state_from(raw, backbone, source):
    """Tensors for ``backbone`` from a loaded checkpoint of one of the accepted layouts."""
    expected = backbone.state_dict()
    state = raw.get('state_dict', raw) if isinstance(raw, dict) else raw
    if set(expected) <= set(state):
        picked = state
    elif any(key.startswith('backbone.') for key in state):
        picked = {k[len('backbone.'):]: v for k, v in state.items() if k.startswith('backbone.')}
    else:
        from linvit_mm.transfer.checkpoint import load_softmax_checkpoint
        mapped = load_softmax_checkpoint(raw).state_dict
        picked = {k[len('backbone.'):]: v for k, v in mapped.items() if k.startswith('backbone.')}
    picked = {k: v for k, v in picked.items() if k in expected}
    missing = sorted(set(expected) - set(picked))
    if missing:
        raise ValueError(f'{source}: no weights for the teacher\'s {", ".join(missing[:8])}'
                         f'{" ..." if len(missing) > 8 else ""} ({len(missing)} of '
                         f'{len(expected)} tensors missing)')
    return picked


def load_teacher_weights(backbone, checkpoint):
    from linvit_mm.utils import load_checkpoint_file
    raw = load_checkpoint_file(checkpoint, map_location='cpu')
    state = backbone_state_from(raw, backbone, checkpoint)
    try:
        backbone.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f'{checkpoint}: the weights do not fit the teacher: {err}') from None


def build_teacher(student_cfg, teacher_config=None, teacher_checkpoint=None, device='cpu'):
    """The teacher backbone, and where it came from (for the report)."""
    if teacher_config is not None:
        teacher_cfg = load_config(teacher_config).model
        source = f'model of {teacher_config}'
    else:
        hook = find_distill_hook(student_cfg)
        if hook is None:
            raise ValueError('the config has no AttentionDistillHook in custom_hooks to take '
                             'the teacher from; give --teacher-config (and '
                             '--teacher-checkpoint)')
        teacher_cfg = hook['teacher']
        source = f'{DISTILL_HOOK} teacher of the config'
    teacher = build_model(teacher_cfg)
    if teacher_checkpoint is not None:
        load_teacher_weights(backbone_of(teacher), teacher_checkpoint)
        source += f', weights from {teacher_checkpoint}'
    else:
        teacher.init_weights()  # its init_cfg loads the checkpoint, as in the hook
        init_cfg = teacher_cfg.get('init_cfg') or teacher_cfg.get('backbone', {}).get('init_cfg')
        source += f', initialised by {dict(init_cfg) if init_cfg else "its default init"}'
    teacher = teacher.to(device).eval()
    return backbone_of(teacher), source


# ------------------------------------------------------------------ images
def image_files(paths):
    files = []
    for path in paths:
        if osp.isdir(path):
            found = sorted(
                osp.join(root, name) for root, _, names in os.walk(path) for name in names
                if name.lower().endswith(IMAGE_SUFFIXES))
            if not found:
                raise ValueError(f'no images ({", ".join(IMAGE_SUFFIXES)}) under {path}')
            files += found
        elif osp.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f'--images: {path} is neither a file nor a folder')
    return files


def _dataset_cfg(cfg, loaders):
    for loader in loaders:
        if cfg.get(loader) and cfg[loader].get('dataset'):
            return cfg[loader].dataset
    raise ValueError(f'the config has none of {loaders} with a dataset')


def packed_samples(cfg, images=None, num_images=8):
    """The config's test pipeline applied to files, or the first validation samples."""
    from mmengine.dataset import Compose
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import DATASETS, TRANSFORMS
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        if images:
            pipeline_cfg = _dataset_cfg(cfg, ('test_dataloader', 'val_dataloader')).pipeline
            pipeline = Compose([TRANSFORMS.build(t) for t in pipeline_cfg])
            return [pipeline(dict(img_path=path)) for path in image_files(images)]
        dataset = DATASETS.build(_dataset_cfg(cfg, ('val_dataloader', 'test_dataloader')))
        count = min(num_images, len(dataset))
        if count == 0:
            raise ValueError('the validation set of the config is empty')
        return [dataset[i] for i in range(count)]


# ------------------------------------------------------------------ recording
class BlockRecorder:
    """Attention and block outputs of one backbone's forward, by block index."""

    def __init__(self, backbone):
        from linvit_mm.models.attention import BaseAttention
        self.attn = {}
        self.block = {}
        self.handles = []
        self.operators = []
        for index, layer in enumerate(backbone.layers):
            attn = [m for m in layer.modules() if isinstance(m, BaseAttention)]
            if len(attn) != 1:
                raise ValueError(f'block {index} holds {len(attn)} attention operators '
                                 f'(linvit_mm BaseAttention); expected one')
            self.operators.append(attn[0].attn_type)
            self.handles.append(attn[0].register_forward_hook(self._keeper(self.attn, index)))
            self.handles.append(layer.register_forward_hook(self._keeper(self.block, index)))

    @staticmethod
    def _keeper(store, index):
        def keep(module, args, output):
            store[index] = (output[0] if isinstance(output, tuple) else output).detach()
        return keep

    def clear(self):
        self.attn.clear()
        self.block.clear()

    def remove(self):
        for handle in self.handles:
            handle.remove()


class Agreement:
    """Running sums for the cosine similarity and relative MSE of one block output."""

    def __init__(self):
        self.cos_sum = 0.
        self.tokens = 0
        self.squared_error = 0.
        self.squared_norm = 0.

    def add(self, student, teacher):
        if student.shape != teacher.shape:
            raise ValueError(f'student {tuple(student.shape)} and teacher '
                             f'{tuple(teacher.shape)} outputs differ after token alignment')
        student, teacher = student.double(), teacher.double()
        self.cos_sum += float(F.cosine_similarity(student, teacher, dim=-1).sum())
        self.tokens += student.numel() // student.shape[-1]
        self.squared_error += float((student - teacher).pow(2).sum())
        self.squared_norm += float(teacher.pow(2).sum())

    @property
    def cosine(self):
        return self.cos_sum / self.tokens

    @property
    def rel_mse(self):
        return self.squared_error / max(self.squared_norm, torch.finfo(torch.float64).tiny)


@torch.no_grad()
def compare(student, teacher, batches, patch_tokens_only):
    """Per-block agreement of ``student`` and ``teacher`` backbones on preprocessed batches."""
    from linvit_mm.engine.hooks.attention_distill_hook import align_tokens
    if len(student.layers) != len(teacher.layers):
        raise ValueError(f'the student has {len(student.layers)} blocks, the teacher '
                         f'{len(teacher.layers)}; they must match block for block')
    num_blocks = len(student.layers)
    stats = {kind: [Agreement() for _ in range(num_blocks)] for kind in ('attn', 'block')}
    student_rec, teacher_rec = BlockRecorder(student), BlockRecorder(teacher)
    try:
        for inputs in batches:
            student_rec.clear()
            teacher_rec.clear()
            student(inputs)
            teacher(inputs)
            for kind in ('attn', 'block'):
                student_out, teacher_out = getattr(student_rec, kind), getattr(teacher_rec, kind)
                for index in range(num_blocks):
                    num_patches = student_out[index].shape[-2] - student.num_extra_tokens
                    stats[kind][index].add(*align_tokens(student_out[index], teacher_out[index],
                                                         num_patches, patch_tokens_only,
                                                         is_map=False))
    finally:
        student_rec.remove()
        teacher_rec.remove()
    return [dict(block=index, operator=student_rec.operators[index],
                 cos_attn=stats['attn'][index].cosine,
                 relmse_attn=stats['attn'][index].rel_mse,
                 cos_block=stats['block'][index].cosine,
                 relmse_block=stats['block'][index].rel_mse,
                 tokens=stats['attn'][index].tokens) for index in range(num_blocks)]


def preprocessed_batches(model, samples, batch_size, device):
    from mmengine.dataset import pseudo_collate
    for start in range(0, len(samples), batch_size):
        batch = pseudo_collate(samples[start:start + batch_size])
        yield model.data_preprocessor(batch, training=False)['inputs'].to(device)


# ------------------------------------------------------------------ output
def format_table(rows):
    lines = [f'{"block":>5}  {"operator":>9}  {"cos attn":>9}  {"relMSE attn":>11}  '
             f'{"cos block":>9}  {"relMSE block":>12}']
    for row in rows:
        lines.append(f'{row["block"]:>5}  {row["operator"]:>9}  {row["cos_attn"]:>9.5f}  '
                     f'{row["relmse_attn"]:>11.3e}  {row["cos_block"]:>9.5f}  '
                     f'{row["relmse_block"]:>12.3e}')
    return '\n'.join(lines)


def write_csv(rows, path):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f'{v:.8g}' if isinstance(v, float) else v)
                             for k, v in row.items()})


def plot(rows, path, title):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    blocks = [row['block'] for row in rows]
    fig, (ax_cos, ax_mse) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label, marker in (('attn', 'attention output', 'o'), ('block', 'block output', 's')):
        ax_cos.plot(blocks, [row[f'cos_{key}'] for row in rows], marker=marker, label=label)
        ax_mse.plot(blocks, [row[f'relmse_{key}'] for row in rows], marker=marker, label=label)
    ax_cos.set_ylabel('cosine similarity')
    ax_mse.set_ylabel('relative MSE')
    for ax in (ax_cos, ax_mse):
        ax.set_xlabel('block')
        ax.set_xticks(blocks)
        ax.grid(alpha=.3)
    # one legend below both panels, where it cannot cover a curve
    fig.legend(*ax_cos.get_legend_handles_labels(), loc='lower center', ncol=2, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, .07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ CLI
def parse_args(argv=None):
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser(
        description='Per-block cosine similarity and relative MSE between a student and its '
        'Softmax teacher (attention outputs and block outputs)')
    parser.add_argument('config', help='config of the student (a distillation config names '
                        'its teacher)')
    parser.add_argument('checkpoint', help='student checkpoint (mmengine run checkpoint)')
    parser.add_argument('--teacher-config', default=None,
                        help="config whose model is the teacher (default: the config's "
                        'AttentionDistillHook teacher)')
    parser.add_argument('--teacher-checkpoint', default=None,
                        help="teacher weights, instead of the teacher's init_cfg")
    source = parser.add_mutually_exclusive_group()
    source.add_argument('--images', nargs='+', default=None,
                        help='image files and/or folders, through the test pipeline')
    source.add_argument('--num-images', type=int, default=8,
                        help='first N images of the validation set (default: 8)')
    parser.add_argument('--batch-size', type=int, default=4)
    parser.add_argument('--out-dir', default=None,
                        help='where fidelity.csv and fidelity.png go (default: '
                        'work_dirs/attention_fidelity/<config name>)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default=None,
                        help='override settings of the student config (key=value)')
    args = parser.parse_args(argv)
    if args.num_images < 1 or args.batch_size < 1:
        parser.error('--num-images and --batch-size must be >= 1')
    if args.out_dir is None:
        args.out_dir = osp.join('work_dirs', 'attention_fidelity',
                                osp.splitext(osp.basename(args.config))[0])
    return args


def main(argv=None):
    args = parse_args(argv)
    from mmengine.utils import track_iter_progress

    import linvit_mm.engine  # noqa: F401  (registers the hook, installs the safe loader)
    import linvit_mm.models  # noqa: F401
    cfg = load_config(args.config, args.cfg_options)
    hook = find_distill_hook(cfg) or {}
    student_path = hook.get('student', 'backbone')
    model = load_student(cfg, args.checkpoint, args.device)
    student = backbone_of(model, student_path)
    teacher, teacher_source = build_teacher(cfg, args.teacher_config, args.teacher_checkpoint,
                                            device=args.device)
    # the hook's rule: patch tokens only if asked, or when the student has no class token
    patch_only = bool(hook.get('patch_tokens_only')) or not getattr(student, 'with_cls_token',
                                                                    True)
    samples = packed_samples(cfg, args.images, args.num_images)
    num_batches = -(-len(samples) // args.batch_size)
    print(f'comparing {len(samples)} images, {num_batches} batches of up to {args.batch_size}')
    batches = track_iter_progress(
        (preprocessed_batches(model, samples, args.batch_size, args.device), num_batches),
        file=sys.stdout)
    rows = compare(student, teacher, batches, patch_only)

    os.makedirs(args.out_dir, exist_ok=True)
    csv_path = osp.join(args.out_dir, 'fidelity.csv')
    png_path = osp.join(args.out_dir, 'fidelity.png')
    write_csv(rows, csv_path)
    student_type = getattr(student, 'attn_type', type(student).__name__)
    plot(rows, png_path, f'{osp.basename(args.config)} ({student_type}) vs teacher, '
         f'{len(samples)} images{", patch tokens" if patch_only else ""}')
    print(f'student: {student_type} {student_path} of {args.config}, weights {args.checkpoint}')
    print(f'teacher: {teacher_source}')
    print(f'{len(samples)} images, {"patch tokens only" if patch_only else "all tokens"}')
    print(format_table(rows))
    print(f'wrote {csv_path} and {png_path}')
    return rows


if __name__ == '__main__':
    main()
