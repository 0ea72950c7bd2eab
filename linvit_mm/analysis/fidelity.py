"""How closely a student's blocks reproduce its Softmax teacher's, on the same images.

Per block, two outputs are compared: the attention output (the output of the block's
``BaseAttention`` module, after its projection: what ``AttentionDistillHook`` matches) and
the block output (``backbone.layers[i]``, the residual stream after the MLP).

Over all compared tokens ``n`` of all images, ``cos`` is the mean over tokens of the cosine
similarity of the student's and the teacher's ``C``-vectors, and
``relMSE = sum ||s_n - t_n||^2 / sum ||t_n||^2`` (:class:`Agreement`). A student identical
to its teacher gives 1 and 0. Tokens are aligned as the hook aligns them.
"""
import os
import os.path as osp

import torch
import torch.nn.functional as F

from linvit_mm.models import pairing

__all__ = ['IMAGE_SUFFIXES', 'Agreement', 'BlockRecorder', 'compare_blocks', 'image_files',
           'packed_samples', 'preprocessed_batches', 'uses_patch_tokens_only']

IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp', '.webp', '.tif', '.tiff', '.ppm', '.pgm')


# ------------------------------------------------------------------ images
def image_files(paths):
    """The image files among ``paths`` (files, and folders searched recursively, sorted).

    Raises:
        FileNotFoundError: a path is neither a file nor a folder.
        ValueError: a folder holds no image.
    """
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
    """The config's test pipeline applied to ``images`` (files and/or folders), or the first
    ``num_images`` samples of its validation set."""
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


def preprocessed_batches(model, samples, batch_size, device):
    """Batches of ``samples`` through the model's data preprocessor (the input tensors)."""
    from mmengine.dataset import pseudo_collate
    for start in range(0, len(samples), batch_size):
        batch = pseudo_collate(samples[start:start + batch_size])
        yield model.data_preprocessor(batch, training=False)['inputs'].to(device)


# ------------------------------------------------------------------ recording
class BlockRecorder:
    """Attention and block outputs of one backbone's forward, by block index.

    Raises:
        ValueError: a block holds no or several linvit_mm attention operators.
    """

    def __init__(self, backbone):
        from linvit_mm.models.attention import BaseAttention
        self.attn = {}
        self.block = {}
        self.handles = []
        self.operators = []
        for index, layer in enumerate(backbone.layers):
            attn = [m for m in layer.modules() if isinstance(m, BaseAttention)]
            if len(attn) != 1:
                self.remove()
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
    """Running sums for the cosine similarity and relative MSE of one output, over batches
    of ``(..., tokens, C)`` tensors."""

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


def uses_patch_tokens_only(student, teacher, hook_cfg=None):
    """The hook's rule (:func:`linvit_mm.models.pairing.patch_tokens_only`): patch tokens
    only if its ``patch_tokens_only`` asks, or when student and teacher do not lead their
    sequences with the same extra tokens (class token, registers)."""
    return pairing.patch_tokens_only(pairing.token_layout(student), pairing.token_layout(teacher),
                                     (hook_cfg or {}).get('patch_tokens_only'))


@torch.no_grad()
def compare_blocks(student, teacher, batches, patch_tokens_only):
    """Per-block agreement of ``student`` and ``teacher`` backbones on preprocessed batches.

    Returns:
        list[dict]: one row per block: ``block``, ``operator`` (the student's),
        ``cos_attn``, ``relmse_attn``, ``cos_block``, ``relmse_block`` and ``tokens`` (the
        compared tokens of all images).

    Raises:
        ValueError: the two cannot be compared block for block (depth, width, heads, patch
            size), every problem named.
    """
    # any teacher operator may be measured, and the weights are already loaded
    pairing.refuse(pairing.fit_problems(student, teacher, allow_non_softmax=True,
                                        require_weights=False),
                   'the teacher cannot be compared with the student')
    num_blocks = len(student.layers)
    stats = {kind: [Agreement() for _ in range(num_blocks)] for kind in ('attn', 'block')}
    student_rec = BlockRecorder(student)
    try:
        teacher_rec = BlockRecorder(teacher)
    except ValueError:
        student_rec.remove()
        raise
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
                    stats[kind][index].add(*pairing.align_tokens(
                        student_out[index], teacher_out[index], num_patches, patch_tokens_only))
    finally:
        student_rec.remove()
        teacher_rec.remove()
    return [dict(block=index, operator=student_rec.operators[index],
                 cos_attn=stats['attn'][index].cosine,
                 relmse_attn=stats['attn'][index].rel_mse,
                 cos_block=stats['block'][index].cosine,
                 relmse_block=stats['block'][index].rel_mse,
                 tokens=stats['attn'][index].tokens) for index in range(num_blocks)]
