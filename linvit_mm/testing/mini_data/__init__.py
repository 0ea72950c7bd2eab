"""Generated mini datasets in the real on-disk formats of ImageNet, COCO and ADE20K.

They let the tests, the demo and end-to-end runs drive the *upstream* OpenMMLab datasets,
pipelines and metrics (mmpretrain ``ImageNet``/``CustomDataset``, mmdet ``CocoDataset`` +
``CocoMetric``, mmseg ``ADE20KDataset`` + ``IoUMetric``) on a CPU in seconds. Every image
carries a learnable signal (the class is the shape or the texture, never the colour or the
position), so a tiny ViT moves well above chance in a few hundred iterations.

Layouts written (``root`` is what each function receives):

* ``make_mini_imagenet``::

      root/train/<class>/<class>_00000.JPEG      root/meta/train.txt  ("<class>/<file> <label>")
      root/val/<class>/<class>_val_00000.JPEG    root/meta/val.txt
      root/meta/classes.txt                      (one class name a line, label order)

  Read it with ``ImageNet(data_root=root, split='train', metainfo=dict(classes=...))`` or
  ``CustomDataset(data_root=root, ann_file='meta/train.txt', data_prefix='train',
  metainfo=dict(classes=...))``. ``ImageNet`` declares 1000 classes, so the class names
  must be passed; ``summary['classes']`` (and ``meta/classes.txt``) hold them. A path to
  ``classes.txt`` is read relative to the working directory, not to ``data_root`` (and
  mmengine keeps a ``metainfo`` string it cannot open as the class *name*): pass the list or
  an absolute path. Labels number the classes in sorted name order, so scanning the class
  folders without ``ann_file`` yields the same labels.
  ``task='shapes'`` (circle, square, ...) and ``task='textures'`` (stripes, checker, ...)
  are two unrelated problems: pre-train on one, transfer to the other.

* ``make_mini_coco``: ``root/annotations/instances_{train,val}2017.json`` and
  ``root/{train,val}2017/<12-digit id>.jpg``. Instances never overlap, so each polygon is
  exactly what is visible; bbox ``[x, y, w, h]``, polygon ``segmentation``, shoelace
  ``area``, ``iscrowd=0``. Load with ``CocoDataset(metainfo=dict(classes=summary['classes']))``.

* ``make_mini_ade``: ``root/images/{training,validation}/ADE_{train,val}_00000001.jpg`` and
  ``root/annotations/{training,validation}/*.png`` (uint8). As in ADE20K, 0 is "other"
  (here the one-pixel boundary of every shape) and classes are stored as 1..K: 1 is the
  background, 2..K the shapes. ``ADE20KDataset`` (``reduce_zero_label=True``) turns 0 into
  255 (ignored) and c into c-1. Its 150 class names are fixed, and a ``metainfo`` override
  must name a subset of them (mmseg builds a label map from the names), so the K classes
  stand in for the first K ADE20K names: pass
  ``metainfo=dict(classes=summary['ade20k_classes'])`` (== ``ADE20KDataset.METAINFO
  ['classes'][:K]``) and use ``num_classes=K`` in the decode heads. Without the override
  the dataset keeps 150 classes; the unused ones are NaN in ``IoUMetric`` and ``nanmean``
  skips them, so mIoU is the same.

In pipelines, name transforms with their scope (``'mmdet.LoadAnnotations'``,
``'mmseg.LoadAnnotations'``) or build under a default scope: with none, a bare
``'LoadAnnotations'`` silently resolves to mmcv's generic class, which rejects
``with_mask`` (mmdet) or fails on the missing ``instances`` key (mmseg).

Every function is deterministic in ``seed``, writes into a temporary sibling directory and
renames it into place, and records its parameters in ``root/linvit_mini.json``; calling it
again with the same parameters returns that summary without writing anything.

The writers live in ``imagenet``, ``coco`` and ``ade``, the pictures in ``drawing``, what they
share in ``writing``. Only numpy, Pillow and the standard library are used here, so importing
this package does not import (or register anything in) mmpretrain, mmdet or mmseg.
"""
import os
import os.path as osp
from typing import Dict, Optional

from .ade import ADE20K_LEADING_CLASSES, make_mini_ade
from .coco import make_mini_coco
from .drawing import DENSE_SHAPE_KINDS, SHAPE_GROUPS, SHAPE_KINDS, TEXTURE_KINDS
from .imagenet import CLS_TASKS, DEFAULT_TRAIN_PER_CLASS, make_mini_imagenet
from .writing import FORMAT_VERSION, JPEG_QUALITY, MARKER_FILE, ImageSize

__all__ = ['ADE20K_LEADING_CLASSES', 'CLS_TASKS', 'DEFAULT_TRAIN_PER_CLASS', 'DENSE_SHAPE_KINDS',
           'FORMAT_VERSION', 'ImageSize', 'JPEG_QUALITY', 'MARKER_FILE', 'MINI_SETS',
           'SET_GROUPS', 'SHAPE_GROUPS', 'SHAPE_KINDS', 'TEXTURE_KINDS', 'make_mini_ade',
           'make_mini_all', 'make_mini_coco', 'make_mini_imagenet']

MINI_SETS = ('imagenet', 'imagenet_transfer', 'imagenet_groups', 'coco', 'ade')
SET_GROUPS = {'cls': ('imagenet', 'imagenet_transfer', 'imagenet_groups'), 'coco': ('coco',),
              'ade': ('ade',)}


def make_mini_all(root, seed: int = 0, only: Optional[str] = None) -> Dict[str, dict]:
    """Write the default mini sets under ``root``; return ``{set name: summary}``.

    ``root/imagenet`` (shapes), ``root/imagenet_transfer`` (textures),
    ``root/imagenet_groups`` (shape groups, 8 training images a class, 16 for validation),
    ``root/coco`` and ``root/ade``. ``only`` is one of ``'cls'``, ``'coco'``, ``'ade'`` to write a subset.
    """
    if only is not None and only not in SET_GROUPS:
        raise ValueError(f'only must be None or one of {tuple(SET_GROUPS)}, got {only!r}')
    wanted = MINI_SETS if only is None else SET_GROUPS[only]
    root = os.fspath(root)
    makers = dict(
        imagenet=lambda: make_mini_imagenet(osp.join(root, 'imagenet'), seed=seed,
                                            task='shapes'),
        imagenet_transfer=lambda: make_mini_imagenet(osp.join(root, 'imagenet_transfer'),
                                                     seed=seed, task='textures'),
        imagenet_groups=lambda: make_mini_imagenet(osp.join(root, 'imagenet_groups'),
                                                   seed=seed, task='shape-groups',
                                                   val_per_class=16),
        coco=lambda: make_mini_coco(osp.join(root, 'coco'), seed=seed),
        ade=lambda: make_mini_ade(osp.join(root, 'ade'), seed=seed))
    return {name: makers[name]() for name in wanted}
