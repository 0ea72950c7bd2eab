"""ImageNet test sets whose folder names are not ImageNet wnids.

ImageNet-V2 (Recht et al., ICML 2019) names its class folders by the ImageNet-1k class
index, ``0`` .. ``999``. mmpretrain's ``CustomDataset`` numbers folders in sorted *string*
order (``'10'`` before ``'2'``), which scrambles the labels; ``ImageNetV2`` reads the index
from the name instead.

ImageNet-Sketch, ImageNet-A and ImageNet-R name their folders by wnid, and ImageNet-1k
numbers its classes in sorted wnid order, so ``CustomDataset`` / ``ImageNet`` label them
correctly (ImageNet-A/R: 200 sorted wnids -> labels 0..199, scored with ``SubsetAccuracy``).
"""
from typing import Dict, List, Optional

from mmengine.fileio import get_file_backend
from mmengine.logging import MMLogger

from mmpretrain.datasets import CustomDataset
from mmpretrain.datasets.categories import IMAGENET_CATEGORIES
from mmpretrain.datasets.custom import get_samples
from mmpretrain.registry import DATASETS


@DATASETS.register_module()
class ImageNetV2(CustomDataset):
    """`ImageNet-V2 <https://github.com/modestyachts/ImageNetV2>`_: class folders named by index.

    Layout (``imagenetv2-matched-frequency.tar.gz`` extracts to it; the ``threshold0.7`` and
    ``top-images`` variants share it)::

        imagenetv2-matched-frequency-format-val/
            0/<image>.jpeg ... 1/ ... 999/

    Args:
        data_root (str): The extracted folder (the one holding ``0`` .. ``999``).
        data_prefix (str | dict): Sub-folder of ``data_root`` with the class folders.
            Defaults to ''.
        metainfo (dict, optional): Class names, indexed like the folder numbers. Defaults to
            the 1000 ImageNet-1k names.
        **kwargs: Other arguments of :class:`mmpretrain.datasets.CustomDataset`
            (``pipeline``, ``extensions``, ``indices``, ...).
    """

    METAINFO = {'classes': IMAGENET_CATEGORIES}

    def __init__(self,
                 data_root: str = '',
                 data_prefix='',
                 metainfo: Optional[dict] = None,
                 **kwargs):
        for unsupported in ('ann_file', 'with_label'):
            if unsupported in kwargs:
                raise TypeError(f'ImageNetV2 reads its labels from the folder names; '
                                f'`{unsupported}` is not accepted')
        if not data_root and not data_prefix:
            raise ValueError('ImageNetV2 needs `data_root`: the folder holding 0 .. 999')
        super().__init__(data_root=data_root, data_prefix=data_prefix, metainfo=metainfo,
                         **kwargs)

    def _folder_labels(self, backend) -> Dict[str, int]:
        root = self.img_prefix
        if not backend.isdir(root):
            raise FileNotFoundError(f'ImageNet-V2 folder {root} not found')
        folders = sorted(backend.list_dir_or_file(root, list_dir=True, list_file=False))
        not_numbers = [name for name in folders if not name.isdigit()]
        if not_numbers:
            raise ValueError(f'ImageNet-V2 class folders are named 0 .. 999, but {root} also '
                             f'holds {not_numbers}')
        num_classes = len(self.CLASSES)
        folder_to_idx = {name: int(name) for name in folders}
        too_large = [name for name, label in folder_to_idx.items() if label >= num_classes]
        if too_large:
            raise ValueError(f'ImageNet-V2 folders {too_large} in {root} exceed the '
                             f'{num_classes} classes of the metainfo')
        if len(set(folder_to_idx.values())) != len(folders):
            raise ValueError(f'ImageNet-V2 folders in {root} name the same class twice: '
                             f'{folders}')
        return folder_to_idx

    def _find_samples(self):
        backend = get_file_backend(self.img_prefix, enable_singleton=True)
        folder_to_idx = self._folder_labels(backend)
        samples, empty_folders = get_samples(
            self.img_prefix, folder_to_idx, is_valid_file=self.is_valid_file, backend=backend)
        self.folder_to_idx = folder_to_idx
        if not samples:
            raise RuntimeError(f'Found no image in the class folders of {self.img_prefix} '
                               f'(extensions {", ".join(sorted(self.extensions))})')
        if empty_folders:
            MMLogger.get_current_instance().warning(
                f'ImageNet-V2 class folders without images: {", ".join(sorted(empty_folders))}')
        return samples

    def extra_repr(self) -> List[str]:
        return [f'Root of dataset: \t{self.img_prefix}']
