"""STL10: decoding of the official binary layout, labels, the mmpretrain array pipeline and
clear errors."""
import numpy as np
import pytest
import torch

from linvit_mm.datasets import STL10
from linvit_mm.datasets.stl10 import STL10_CATEGORIES
from mmpretrain.registry import DATASETS

SIDE = 96


def patterned_images(count):
    """Images whose value at (row, col, channel) differs from the transposed position."""
    row = np.arange(SIDE)[:, None, None]
    col = np.arange(SIDE)[None, :, None]
    channel = np.arange(3)[None, None, :]
    return np.stack([(row * 2 + col * 5 + channel * 70 + n * 11) % 256
                     for n in range(count)]).astype(np.uint8)


def write_stl10(root, split, images, labels_1_to_10):
    """Writes one split in the release layout: per image, per channel, column-major bytes."""
    folder = root / 'stl10_binary'
    folder.mkdir(parents=True, exist_ok=True)
    # (N, H, W, C) -> (N, C, W, H): the last axis (rows) varies fastest.
    (folder / f'{split}_X.bin').write_bytes(images.transpose(0, 3, 2, 1).tobytes())
    (folder / f'{split}_y.bin').write_bytes(np.asarray(labels_1_to_10, np.uint8).tobytes())


@pytest.fixture
def stl10_root(tmp_path):
    train_images = patterned_images(12)
    train_labels = [1 + n % 10 for n in range(12)]  # every class, stored as 1..10
    write_stl10(tmp_path, 'train', train_images, train_labels)
    write_stl10(tmp_path, 'test', patterned_images(3)[::-1], [10, 1, 5])
    return tmp_path, train_images, train_labels


def test_single_pixel_lands_at_documented_offset(tmp_path):
    # Byte offset of (row r, column c, channel ch) is ch*96*96 + c*96 + r: set the red byte
    # of row 0, column 5 and the green byte of row 2, column 7 by hand.
    raw = np.zeros(3 * SIDE * SIDE, np.uint8)
    raw[0 * SIDE * SIDE + 5 * SIDE + 0] = 255
    raw[1 * SIDE * SIDE + 7 * SIDE + 2] = 128
    folder = tmp_path / 'stl10_binary'
    folder.mkdir()
    (folder / 'test_X.bin').write_bytes(raw.tobytes())
    (folder / 'test_y.bin').write_bytes(bytes([3]))
    item = STL10(data_root=str(tmp_path), split='test').get_data_info(0)
    img = item['img']
    assert img.shape == (SIDE, SIDE, 3) and img.dtype == np.uint8
    assert img[0, 5, 0] == 255 and img[2, 7, 1] == 128
    assert np.count_nonzero(img) == 2
    assert item['gt_label'] == 2


@pytest.mark.parametrize('split', ['train', 'test'])
def test_images_and_labels_round_trip(stl10_root, split):
    root, train_images, train_labels = stl10_root
    dataset = STL10(data_root=str(root), split=split)
    if split == 'train':
        images, labels = train_images, [label - 1 for label in train_labels]
    else:
        images, labels = patterned_images(3)[::-1], [9, 0, 4]
    assert len(dataset) == len(labels)
    assert [dataset.get_data_info(i)['gt_label'] for i in range(len(dataset))] == labels
    for i, expected in enumerate(images):
        np.testing.assert_array_equal(dataset.get_data_info(i)['img'], expected)
    assert dataset.CLASSES == STL10_CATEGORIES
    assert dataset.metainfo['classes'][:2] == ('airplane', 'bird')


def test_registered_and_built_from_config(stl10_root):
    root, _, _ = stl10_root
    dataset = DATASETS.build(dict(type='STL10', data_root=str(root), split='train'))
    assert isinstance(dataset, STL10)
    assert sorted(set(dataset.get_gt_labels().tolist())) == list(range(10))


def test_cifar_style_train_pipeline(stl10_root):
    # The pipeline of mmpretrain's CIFAR configs: no LoadImageFromFile for array datasets.
    root, _, train_labels = stl10_root
    pipeline = [
        dict(type='RandomCrop', crop_size=SIDE, padding=4),
        dict(type='RandomFlip', prob=0.5, direction='horizontal'),
        dict(type='PackInputs'),
    ]
    dataset = STL10(data_root=str(root), split='train', pipeline=pipeline)
    packed = dataset[3]
    assert packed['inputs'].shape == (3, SIDE, SIDE) and packed['inputs'].dtype == torch.uint8
    assert packed['data_samples'].gt_label.tolist() == [train_labels[3] - 1]


def test_packed_tensor_is_chw_of_decoded_image(stl10_root):
    root, train_images, _ = stl10_root
    dataset = STL10(data_root=str(root), split='train', pipeline=[dict(type='PackInputs')])
    expected = torch.from_numpy(train_images[5].transpose(2, 0, 1).copy())
    assert torch.equal(dataset[5]['inputs'], expected)


def test_horizontal_flip_mirrors_columns(stl10_root):
    # A flip that swaps columns (not rows) only holds if rows and columns were decoded right.
    root, train_images, _ = stl10_root
    pipeline = [dict(type='RandomFlip', prob=1.0, direction='horizontal'),
                dict(type='PackInputs')]
    flipped = STL10(data_root=str(root), split='train', pipeline=pipeline)[0]['inputs']
    expected = torch.from_numpy(train_images[0][:, ::-1].transpose(2, 0, 1).copy())
    assert torch.equal(flipped, expected)


def test_resize_to_224_for_vit(stl10_root):
    root, _, _ = stl10_root
    pipeline = [dict(type='Resize', scale=224, interpolation='bicubic'),
                dict(type='PackInputs')]
    inputs = STL10(data_root=str(root), split='test', pipeline=pipeline)[0]['inputs']
    assert inputs.shape == (3, 224, 224)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize('split', ['unlabeled', 'train+unlabeled', 'val'])
def test_unsupported_split_lists_valid_ones(tmp_path, split):
    with pytest.raises(ValueError, match=r"\['train', 'test'\]"):
        STL10(data_root=str(tmp_path), split=split)


def test_missing_data_root_argument():
    with pytest.raises(ValueError, match='data_root'):
        STL10(split='train')


@pytest.mark.parametrize('missing', ['train_X.bin', 'train_y.bin'])
def test_missing_file_is_named(stl10_root, missing):
    root, _, _ = stl10_root
    (root / 'stl10_binary' / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        STL10(data_root=str(root), split='train')


def test_truncated_image_file(stl10_root):
    root, _, _ = stl10_root
    path = root / 'stl10_binary' / 'train_X.bin'
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError, match='not a multiple'):
        STL10(data_root=str(root), split='train')


def test_image_and_label_counts_must_agree(stl10_root):
    root, _, _ = stl10_root
    path = root / 'stl10_binary' / 'train_y.bin'
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError, match='12 images but .* 11 labels'):
        STL10(data_root=str(root), split='train')


@pytest.mark.parametrize('bad_label', [0, 11], ids=['zero', 'eleven'])
def test_labels_outside_1_to_10(stl10_root, bad_label):
    root, train_images, _ = stl10_root
    write_stl10(root, 'train', train_images[:2], [1, bad_label])
    with pytest.raises(ValueError, match=rf'1\.\.10.*\[{bad_label}\]'):
        STL10(data_root=str(root), split='train')
