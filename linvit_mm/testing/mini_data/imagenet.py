"""The ImageNet-layout classification sets (shapes, textures, shape groups)."""
import os
import os.path as osp
from typing import Optional

from .drawing import (SHAPE_GROUPS, SHAPE_KINDS, TEXTURE_KINDS, _draw_group_image,
                      _draw_shape_image, _draw_texture_image, _rng)
from .writing import (FORMAT_VERSION, ImageSize, _check_int, _check_size, _generate, _save_jpeg,
                      _write_text)

CLS_TASKS = {'shapes': SHAPE_KINDS, 'textures': TEXTURE_KINDS,
             'shape-groups': tuple(SHAPE_GROUPS)}
# Shapes need more examples than textures: a 4-block, 96-wide ViT (patch 8) trained from
# scratch for 300 iterations of 32 images reaches 54-63% val accuracy on shapes with 40 a
# class (chance 17%) and 94% on textures with 16 a class. The small textures set is also a
# low-data transfer target, where a pre-trained initialisation can show.
DEFAULT_TRAIN_PER_CLASS = {'shapes': 40, 'textures': 16, 'shape-groups': 8}


def make_mini_imagenet(root,
                       num_classes: Optional[int] = None,
                       train_per_class: Optional[int] = None,
                       val_per_class: int = 8,
                       img_size: ImageSize = 64,
                       seed: int = 0,
                       task: str = 'shapes') -> dict:
    """Write an ImageNet-style classification set; return its summary dict.

    Args:
        root: directory to create (its parent is created too).
        num_classes: the first ``num_classes`` kinds of ``task`` (default: all of them, 6
            for shapes and textures, 3 for shape groups); labels number them in sorted name
            order.
        train_per_class: training images per class; ``None`` picks the task's default
            (``DEFAULT_TRAIN_PER_CLASS``).
        val_per_class: validation images per class.
        img_size: ``int`` or ``(width, height)``, at least 16 pixels.
        seed: all pixels and file bytes are a function of the parameters and this seed.
        task: ``'shapes'`` (one coloured shape on a smooth background), ``'textures'``
            (a periodic pattern filling the image) or ``'shape-groups'`` (the shapes
            labelled by group: round, cornered, spiky; few images a class): problems to
            pre-train on and transfer to.

    Returns:
        dict with ``root``, ``format='imagenet'``, ``task``, ``classes`` (label order),
        ``splits`` (images per split), ``ann_files``, ``num_files`` and ``num_bytes``.
    """
    if task not in CLS_TASKS:
        raise ValueError(f'task must be one of {tuple(CLS_TASKS)}, got {task!r}')
    kinds = CLS_TASKS[task]
    num_classes = _check_int('num_classes', len(kinds) if num_classes is None else num_classes,
                             2, len(kinds))
    if train_per_class is None:
        train_per_class = DEFAULT_TRAIN_PER_CLASS[task]
    train_per_class = _check_int('train_per_class', train_per_class)
    val_per_class = _check_int('val_per_class', val_per_class)
    width, height = _check_size('img_size', img_size, 16)
    seed = _check_int('seed', seed, 0)
    # Labels follow the sorted folder names, which is the order mmpretrain's CustomDataset
    # assigns when it scans the folders without an annotation file: both modes then agree.
    classes = sorted(kinds[:num_classes])
    draw = {'shapes': _draw_shape_image, 'textures': _draw_texture_image,
            'shape-groups': _draw_group_image}[task]
    params = dict(format='imagenet', version=FORMAT_VERSION, task=task, num_classes=num_classes,
                  train_per_class=train_per_class, val_per_class=val_per_class,
                  img_size=[width, height], seed=seed)

    def writer(tmp):
        os.makedirs(osp.join(tmp, 'meta'))
        splits = {}
        for split, per_class in (('train', train_per_class), ('val', val_per_class)):
            lines = []
            for label, name in enumerate(classes):
                os.makedirs(osp.join(tmp, split, name))
                for i in range(per_class):
                    rng = _rng(task, seed, split, label * 100003 + i)
                    fname = f'{name}/{name}_{"val_" if split == "val" else ""}{i:05d}.JPEG'
                    _save_jpeg(draw(rng, name, width, height), osp.join(tmp, split, fname))
                    lines.append(f'{fname} {label}')
            _write_text(osp.join(tmp, 'meta', f'{split}.txt'), lines)
            splits[split] = len(lines)
        _write_text(osp.join(tmp, 'meta', 'classes.txt'), classes)
        return dict(format='imagenet', task=task, classes=classes, splits=splits,
                    img_size=[width, height],
                    ann_files=dict(train='meta/train.txt', val='meta/val.txt'),
                    data_prefixes=dict(train='train', val='val'))

    return _generate(root, params, writer)

