"""ImageNet-V2 labels from numeric folder names; ImageNet-Sketch (wnid folders) through the
upstream CustomDataset / ImageNet with ImageNet-1k labels."""
import importlib.resources

import numpy as np
import pytest
from PIL import Image

from linvit_mm.datasets import ImageNetV2
from mmpretrain.datasets import CustomDataset, ImageNet
from mmpretrain.datasets.categories import IMAGENET_CATEGORIES
from mmpretrain.registry import DATASETS


def imagenet_wnids():
    """The 1000 ImageNet-1k wnids in label order, from timm's class list."""
    text = importlib.resources.files('timm.data').joinpath('_info', 'imagenet_synsets.txt')
    return text.read_text().split()


def write_image(path, value, ext='.jpeg'):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(path.with_suffix(ext))


@pytest.fixture
def imagenet_v2_root(tmp_path):
    root = tmp_path / 'imagenetv2-matched-frequency-format-val'
    for folder in ['0', '1', '2', '10']:
        for n in range(2):
            write_image(root / folder / f'img{n}', int(folder) * 10 + n)
    return root


def test_v2_labels_are_folder_numbers(imagenet_v2_root):
    dataset = ImageNetV2(data_root=str(imagenet_v2_root))
    labels = {info['img_path'].split('/')[-2]: info['gt_label']
              for info in (dataset.get_data_info(i) for i in range(len(dataset)))}
    assert labels == {'0': 0, '1': 1, '2': 2, '10': 10}
    assert len(dataset) == 8
    assert dataset.CLASSES == IMAGENET_CATEGORIES
    assert dataset.CLASSES[10].startswith('brambling')


def test_custom_dataset_would_scramble_v2(imagenet_v2_root):
    # The reason for ImageNetV2: string order puts '10' before '2'.
    dataset = CustomDataset(data_root=str(imagenet_v2_root))
    assert dataset.CLASSES == ('0', '1', '10', '2')
    assert dataset.folder_to_idx['10'] == 2


def test_v2_through_pipeline(imagenet_v2_root):
    pipeline = [dict(type='LoadImageFromFile'), dict(type='ResizeEdge', scale=16),
                dict(type='CenterCrop', crop_size=16), dict(type='PackInputs')]
    dataset = DATASETS.build(dict(type='ImageNetV2', data_root=str(imagenet_v2_root),
                                  pipeline=pipeline))
    labels = sorted(dataset[i]['data_samples'].gt_label.item() for i in range(len(dataset)))
    assert labels == [0, 0, 1, 1, 2, 2, 10, 10]
    assert dataset[0]['inputs'].shape == (3, 16, 16)


def test_v2_data_prefix(imagenet_v2_root):
    dataset = ImageNetV2(data_root=str(imagenet_v2_root.parent),
                         data_prefix=imagenet_v2_root.name)
    assert sorted(set(dataset.get_gt_labels().tolist())) == [0, 1, 2, 10]


@pytest.mark.parametrize('folder, message', [('n01440764', 'named 0 .. 999'),
                                             ('1000', 'exceed the 1000 classes'),
                                             ('010', 'same class twice')],
                         ids=['wnid', 'too-large', 'duplicate'])
def test_v2_bad_folders(imagenet_v2_root, folder, message):
    write_image(imagenet_v2_root / folder / 'img', 0)
    with pytest.raises(ValueError, match=message):
        ImageNetV2(data_root=str(imagenet_v2_root))


def test_v2_missing_root(tmp_path):
    with pytest.raises(FileNotFoundError, match='not-there'):
        ImageNetV2(data_root=str(tmp_path / 'not-there'))


def test_v2_no_images(tmp_path):
    (tmp_path / '3').mkdir()
    with pytest.raises(RuntimeError, match='no image'):
        ImageNetV2(data_root=str(tmp_path))


@pytest.mark.parametrize('argument', ['ann_file', 'with_label'])
def test_v2_rejects_annotation_arguments(imagenet_v2_root, argument):
    with pytest.raises(TypeError, match=argument):
        ImageNetV2(data_root=str(imagenet_v2_root), **{argument: 'meta/val.txt'})


# ----------------------------------------------------------------------------- Sketch
@pytest.fixture
def sketch_root(tmp_path):
    """All 1000 wnid folders (as the real ``sketch/``), one placeholder JPEG name each.

    The placeholders are never decoded: the folder scan alone fixes the labels.
    """
    root = tmp_path / 'imagenet-sketch' / 'sketch'
    for wnid in imagenet_wnids():
        (root / wnid).mkdir(parents=True)
        (root / wnid / f'{wnid}_1.JPEG').touch()
    return root


def test_timm_wnid_list_is_sorted():
    # ImageNet-1k labels number the sorted wnids; the claim below rests on this.
    wnids = imagenet_wnids()
    assert len(wnids) == 1000 and wnids == sorted(wnids)
    assert wnids[0] == 'n01440764' and IMAGENET_CATEGORIES[0].startswith('tench')


def test_sketch_wnid_folders_get_imagenet_labels(sketch_root):
    wnids = imagenet_wnids()
    dataset = CustomDataset(data_root=str(sketch_root))
    assert dataset.CLASSES == tuple(wnids)
    assert all(dataset.folder_to_idx[wnid] == label for label, wnid in enumerate(wnids))
    labels = [dataset.get_data_info(i)['gt_label'] for i in range(len(dataset))]
    folders = [dataset.get_data_info(i)['img_path'].split('/')[-2] for i in range(len(dataset))]
    assert labels == [wnids.index(folder) for folder in folders]


def test_sketch_through_imagenet_type_keeps_class_names(sketch_root):
    # ImageNet (no split, no meta/) scans folders the same way and names the classes.
    dataset = ImageNet(data_root=str(sketch_root))
    assert len(dataset) == 1000 and dataset.CLASSES == IMAGENET_CATEGORIES
    assert dataset.get_data_info(999)['gt_label'] == 999
    assert dataset.get_data_info(999)['img_path'].endswith(imagenet_wnids()[999] + '_1.JPEG')
