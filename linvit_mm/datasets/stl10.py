"""STL-10 read from the official binary release (``stl10_binary.tar.gz``).

Layout of the release, as documented by its authors (Coates, Lee & Ng, AISTATS 2011)::

    stl10_binary/train_X.bin   5000 images      stl10_binary/train_y.bin   5000 labels
    stl10_binary/test_X.bin    8000 images      stl10_binary/test_y.bin    8000 labels
    stl10_binary/class_names.txt, fold_indices.txt, unlabeled_X.bin (100000 images)

Each image is 96 x 96 x 3 uint8 bytes: channel after channel (R, G, B), and inside a
channel *column-major* (MATLAB order: the first 96 bytes are the first column, top to
bottom). Labels are one uint8 byte each, numbered 1..10.
"""
from typing import List, Optional

import numpy as np
from mmengine.fileio import exists, get, join_path

from mmpretrain.datasets import BaseDataset
from mmpretrain.registry import DATASETS

STL10_CATEGORIES = ('airplane', 'bird', 'car', 'cat', 'deer', 'dog', 'horse', 'monkey', 'ship',
                    'truck')
STL10_IMAGE_SIZE = 96


def decode_stl10_images(raw: bytes) -> np.ndarray:
    """Turn the bytes of an ``*_X.bin`` file into an (N, 96, 96, 3) uint8 RGB array."""
    side = STL10_IMAGE_SIZE
    image_bytes = 3 * side * side
    if len(raw) % image_bytes:
        raise ValueError(f'STL-10 image file holds {len(raw)} bytes, not a multiple of '
                         f'{image_bytes} (3 x {side} x {side}): the file is truncated or not '
                         'an STL-10 *_X.bin file')
    # Bytes run (image, channel, column, row); HWC wants (image, row, column, channel).
    images = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3, side, side)
    return np.ascontiguousarray(images.transpose(0, 3, 2, 1))


def decode_stl10_labels(raw: bytes) -> np.ndarray:
    """Turn the bytes of a ``*_y.bin`` file into int64 labels 0..9."""
    labels = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    outside = labels[(labels < 1) | (labels > len(STL10_CATEGORIES))]
    if outside.size:
        raise ValueError(f'STL-10 labels are stored as 1..{len(STL10_CATEGORIES)}, but the '
                         f'label file holds {sorted(set(outside.tolist()))}')
    return labels - 1


@DATASETS.register_module()
class STL10(BaseDataset):
    """`STL-10 <https://cs.stanford.edu/~acoates/stl10/>`_ labelled splits (10 classes, 96x96).

    Items are ``{'img': (96, 96, 3) uint8 RGB array, 'gt_label': int}``, like mmpretrain's
    ``CIFAR10``: use array pipelines (no ``LoadImageFromFile``) and a data preprocessor with
    ``to_rgb=False``.

    Args:
        data_root (str): Folder that holds ``stl10_binary/`` (the extracted archive).
        split (str): ``'train'`` (5000 images) or ``'test'`` (8000 images). The unlabelled
            100k split is not supported: it has no labels to train a classifier on.
        metainfo (dict, optional): Overrides the class names. Defaults to None.
        data_prefix (str): Sub-folder of ``data_root`` that holds ``stl10_binary/``.
            Defaults to ''.
        **kwargs: Other arguments of :class:`mmpretrain.datasets.BaseDataset`
            (``pipeline``, ``test_mode``, ``indices``, ...).
    """

    METAINFO = {'classes': STL10_CATEGORIES}
    SPLITS = ('train', 'test')
    base_folder = 'stl10_binary'

    def __init__(self,
                 data_root: str = '',
                 split: str = 'train',
                 metainfo: Optional[dict] = None,
                 data_prefix: str = '',
                 **kwargs):
        if split not in self.SPLITS:
            raise ValueError(f"STL10 split must be one of {list(self.SPLITS)}, got {split!r} "
                             "(the 'unlabeled' split has no labels and is not supported)")
        if not data_root and not data_prefix:
            raise ValueError('STL10 needs `data_root`: the folder that holds stl10_binary/')
        self.split = split
        super().__init__(
            ann_file='',  # the binaries carry their own labels
            metainfo=metainfo,
            data_root=data_root,
            data_prefix=dict(root=data_prefix),
            **kwargs)

    def _split_file(self, suffix: str) -> str:
        path = join_path(self.data_prefix['root'], self.base_folder, f'{self.split}_{suffix}.bin')
        if not exists(path):
            raise FileNotFoundError(
                f'STL-10 file {path} not found. Extract stl10_binary.tar.gz so that '
                f'{self.base_folder}/ lies in data_root ({self.data_root!r})')
        return path

    def load_data_list(self) -> List[dict]:
        images_path, labels_path = self._split_file('X'), self._split_file('y')
        images = decode_stl10_images(get(images_path))
        labels = decode_stl10_labels(get(labels_path))
        if len(images) != len(labels):
            raise ValueError(f'{images_path} holds {len(images)} images but {labels_path} '
                             f'holds {len(labels)} labels')
        return [{'img': img, 'gt_label': int(label)} for img, label in zip(images, labels)]

    def extra_repr(self) -> List[str]:
        return [f'Split: \t{self.split}', f"Prefix of data: \t{self.data_prefix['root']}"]
