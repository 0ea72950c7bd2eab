"""The COCO-layout instance-segmentation set."""
import os
import os.path as osp
from typing import Sequence

import numpy as np

from .drawing import _draw_scene, _rng
from .writing import (FORMAT_VERSION, ImageSize, _check_dense_args, _generate, _save_jpeg,
                      _write_json)


def _polygon_area(polygon: np.ndarray) -> float:
    x, y = polygon[:, 0], polygon[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2)


def make_mini_coco(root,
                   num_train: int = 24,
                   num_val: int = 8,
                   img_size: ImageSize = (128, 96),
                   classes: Sequence[str] = ('circle', 'square', 'triangle', 'star'),
                   max_instances: int = 4,
                   seed: int = 0) -> dict:
    """Write a COCO instance-segmentation set (2017 file names); return its summary dict.

    Every image holds 1..``max_instances`` non-overlapping shapes; the first instance of
    image ``i`` is class ``i % K``, so both splits contain every class whenever they have
    at least K images (needed for a per-class AP).

    Args:
        classes: shape kinds used as categories (ids 1..K), from ``DENSE_SHAPE_KINDS``.
        img_size: ``int`` or ``(width, height)``, at least 32 pixels.

    Returns:
        dict with ``root``, ``format='coco'``, ``classes``, ``splits`` (images per split),
        ``instances`` (per split), ``ann_files``, ``data_prefixes``, ``num_files`` and
        ``num_bytes`` (data files, the marker not counted).
    """
    classes, num_train, num_val, max_instances, (width, height), seed = _check_dense_args(
        classes, num_train, num_val, max_instances, img_size, seed)
    params = dict(format='coco', version=FORMAT_VERSION, num_train=num_train, num_val=num_val,
                  img_size=[width, height], classes=list(classes), max_instances=max_instances,
                  seed=seed)
    categories = [dict(id=i + 1, name=name, supercategory='shape')
                  for i, name in enumerate(classes)]

    def writer(tmp):
        os.makedirs(osp.join(tmp, 'annotations'))
        splits, instances = {}, {}
        ann_id = 1
        for split, count in (('train', num_train), ('val', num_val)):
            img_dir = f'{split}2017'
            os.makedirs(osp.join(tmp, img_dir))
            images, annotations = [], []
            for i in range(count):
                rng = _rng('coco', seed, split, i)
                # Ids continue across splits, as in COCO, so they are unique in the set.
                image_id = (1 if split == 'train' else num_train + 1) + i
                n = int(rng.integers(1, max_instances + 1))
                img, shapes = _draw_scene(rng, classes, classes[i % len(classes)], n,
                                          width, height)
                file_name = f'{image_id:012d}.jpg'
                _save_jpeg(img, osp.join(tmp, img_dir, file_name))
                images.append(dict(id=image_id, file_name=file_name, width=width,
                                   height=height))
                for kind, polygon in shapes:
                    polygon = np.round(polygon, 2)
                    x0, y0 = polygon.min(0)
                    x1, y1 = polygon.max(0)
                    annotations.append(dict(
                        id=ann_id, image_id=image_id, category_id=classes.index(kind) + 1,
                        segmentation=[[float(v) for v in polygon.reshape(-1)]],
                        area=round(_polygon_area(polygon), 2),
                        bbox=[float(x0), float(y0), round(float(x1 - x0), 2),
                              round(float(y1 - y0), 2)],
                        iscrowd=0))
                    ann_id += 1
            coco = dict(info=dict(description='linvit_mm mini COCO (generated shapes)',
                                  version=str(FORMAT_VERSION), year=2017),
                        licenses=[], images=images, annotations=annotations,
                        categories=categories)
            _write_json(osp.join(tmp, 'annotations', f'instances_{split}2017.json'), coco)
            splits[split] = len(images)
            instances[split] = len(annotations)
        return dict(format='coco', classes=list(classes), splits=splits, instances=instances,
                    img_size=[width, height],
                    ann_files=dict(train='annotations/instances_train2017.json',
                                   val='annotations/instances_val2017.json'),
                    data_prefixes=dict(train='train2017/', val='val2017/'))

    return _generate(root, params, writer)

