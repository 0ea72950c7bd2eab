"""The ADE20K-layout semantic-segmentation set."""
import os
import os.path as osp
from typing import Sequence

import numpy as np
from PIL import Image

from .drawing import DENSE_SHAPE_KINDS, _draw_scene, _polygon_mask, _rng
from .writing import FORMAT_VERSION, ImageSize, _check_dense_args, _generate, _save_jpeg

# The first ADE20K class names (mmseg ``ADE20KDataset.METAINFO['classes']``); the label-map
# logic of mmseg only accepts a metainfo override that names a subset of them.
ADE20K_LEADING_CLASSES = ('wall', 'building', 'sky', 'floor', 'tree', 'ceiling', 'road', 'bed ',
                          'windowpane', 'grass', 'cabinet', 'sidewalk')

def _boundary(label: np.ndarray) -> np.ndarray:
    """Pixels whose 4-neighbourhood holds another label (image border not counted)."""
    edge = np.zeros(label.shape, dtype=bool)
    diff_v = label[1:, :] != label[:-1, :]
    diff_h = label[:, 1:] != label[:, :-1]
    edge[1:, :] |= diff_v
    edge[:-1, :] |= diff_v
    edge[:, 1:] |= diff_h
    edge[:, :-1] |= diff_h
    return edge


def make_mini_ade(root,
                  num_train: int = 24,
                  num_val: int = 8,
                  img_size: ImageSize = (128, 96),
                  classes: Sequence[str] = DENSE_SHAPE_KINDS,
                  max_instances: int = 4,
                  seed: int = 0) -> dict:
    """Write an ADE20K-layout semantic-segmentation set; return its summary dict.

    PNG values: 0 "other" (a one-pixel boundary around every shape, ignored after
    ``reduce_zero_label``), 1 background, 2..K+1 the shape ``classes``. After mmseg's
    reduction the labels are 0..K (``summary['classes']`` in that order, background first).

    Returns:
        dict with ``root``, ``format='ade20k'``, ``classes`` (label order after
        ``reduce_zero_label``), ``ade20k_classes`` (the ADE20K names to pass as
        ``metainfo=dict(classes=...)``), ``splits``, ``data_prefixes``, ``num_files``,
        ``num_bytes``.
    """
    classes, num_train, num_val, max_instances, (width, height), seed = _check_dense_args(
        classes, num_train, num_val, max_instances, img_size, seed)
    params = dict(format='ade20k', version=FORMAT_VERSION, num_train=num_train,
                  num_val=num_val, img_size=[width, height], classes=list(classes),
                  max_instances=max_instances, seed=seed)
    all_classes = ['background'] + list(classes)
    if len(all_classes) > len(ADE20K_LEADING_CLASSES):
        raise ValueError(f'at most {len(ADE20K_LEADING_CLASSES) - 1} shape classes are supported')

    def writer(tmp):
        splits = {}
        for split, folder, stem, count in (('train', 'training', 'ADE_train', num_train),
                                           ('val', 'validation', 'ADE_val', num_val)):
            os.makedirs(osp.join(tmp, 'images', folder))
            os.makedirs(osp.join(tmp, 'annotations', folder))
            for i in range(count):
                rng = _rng('ade', seed, split, i)
                n = int(rng.integers(1, max_instances + 1))
                img, shapes = _draw_scene(rng, classes, classes[i % len(classes)], n,
                                          width, height)
                label = np.ones((height, width), dtype=np.uint8)
                for kind, polygon in shapes:
                    label[_polygon_mask(polygon, width, height)] = classes.index(kind) + 2
                label[_boundary(label)] = 0
                name = f'{stem}_{i + 1:08d}'
                _save_jpeg(img, osp.join(tmp, 'images', folder, f'{name}.jpg'))
                Image.fromarray(label, 'L').save(
                    osp.join(tmp, 'annotations', folder, f'{name}.png'), format='PNG',
                    optimize=False)
            splits[split] = count
        return dict(format='ade20k', classes=all_classes,
                    ade20k_classes=list(ADE20K_LEADING_CLASSES[:len(all_classes)]),
                    splits=splits, img_size=[width, height], reduce_zero_label=True,
                    data_prefixes=dict(
                        train=dict(img_path='images/training',
                                   seg_map_path='annotations/training'),
                        val=dict(img_path='images/validation',
                                 seg_map_path='annotations/validation')))

    return _generate(root, params, writer)

