"""The generated mini datasets: determinism, size, layout, learnable signal, and loading
through the real mmpretrain / mmdet / mmseg datasets, pipelines and metrics."""
import hashlib
import json
import os
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from linvit_mm.testing.mini_data import (ADE20K_LEADING_CLASSES, MARKER_FILE, MINI_SETS,
                                         make_mini_ade, make_mini_all, make_mini_coco,
                                         make_mini_imagenet)


def tree_digest(root):
    """{relative path: sha1 of the bytes} of every file under ``root``."""
    digest = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = osp.join(dirpath, name)
            with open(path, 'rb') as f:
                digest[osp.relpath(path, root)] = hashlib.sha1(f.read()).hexdigest()
    return digest


@pytest.fixture(scope='module')
def summaries(mini_data_root):
    # The sets already exist: this only reads their markers.
    return make_mini_all(mini_data_root)


def test_import_registers_nothing_downstream():
    # The writers must not import (and so register into) the task libraries. The package
    # linvit_mm itself imports mmengine (and linvit_mm.datasets mmpretrain), so the parents
    # are stood in for by bare packages and only the mini_data package runs its code.
    import linvit_mm
    import linvit_mm.testing
    code = ('import importlib, sys, types\n'
            f'for name, path in (("linvit_mm", {linvit_mm.__path__[0]!r}), '
            f'("linvit_mm.testing", {linvit_mm.testing.__path__[0]!r})):\n'
            '    sys.modules[name] = types.ModuleType(name)\n'
            '    sys.modules[name].__path__ = [path]\n'
            'importlib.import_module("linvit_mm.testing.mini_data")\n'
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('mmdet', 'mmseg', 'mmpretrain', 'mmengine') or m.startswith('linvit_mm.')"
            " and not m.startswith('linvit_mm.testing.mini_data')))")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "['linvit_mm.testing']"


# ----------------------------------------------------------------------------- determinism
def test_same_seed_gives_identical_bytes(mini_data_root, tmp_path):
    make_mini_all(tmp_path / 'again', seed=0)
    for name in MINI_SETS:
        first, second = tree_digest(mini_data_root / name), tree_digest(tmp_path / 'again' / name)
        assert first == second, f'{name}: regenerated files differ'


SMALL_MAKERS = {
    'imagenet-shapes': lambda root, seed: make_mini_imagenet(
        root, num_classes=3, train_per_class=2, val_per_class=1, img_size=32, seed=seed),
    'imagenet-textures': lambda root, seed: make_mini_imagenet(
        root, num_classes=3, train_per_class=2, val_per_class=1, img_size=32, seed=seed,
        task='textures'),
    'coco': lambda root, seed: make_mini_coco(root, num_train=2, num_val=2, seed=seed),
    'ade': lambda root, seed: make_mini_ade(root, num_train=2, num_val=2, seed=seed),
}


@pytest.mark.parametrize('maker', list(SMALL_MAKERS.values()), ids=list(SMALL_MAKERS))
def test_other_seed_changes_every_image(maker, tmp_path):
    maker(tmp_path / 's0', 0)
    maker(tmp_path / 's1', 1)
    first, second = tree_digest(tmp_path / 's0'), tree_digest(tmp_path / 's1')
    assert first.keys() == second.keys()
    images = [p for p in first if p.lower().endswith(('.jpeg', '.jpg'))]
    assert images and all(first[p] != second[p] for p in images)


def test_tasks_differ(summaries):
    shapes, textures = summaries['imagenet'], summaries['imagenet_transfer']
    assert shapes['task'] == 'shapes' and textures['task'] == 'textures'
    assert not set(shapes['classes']) & set(textures['classes'])


# ----------------------------------------------------------------------------- size/layout
def test_default_sets_are_small(mini_data_root, summaries):
    total = sum(s['num_bytes'] for s in summaries.values())
    assert total < 1024 ** 2, f'mini sets take {total} bytes'
    for name, summary in summaries.items():
        root = mini_data_root / name
        files = sum(len(f) for _, _, f in os.walk(root))
        assert files == summary['num_files'] + 1, name  # + the marker
        assert summary['root'] == str(root)


def test_imagenet_layout(mini_data_root, summaries):
    for name in ('imagenet', 'imagenet_transfer'):
        root, summary = mini_data_root / name, summaries[name]
        classes = (root / 'meta' / 'classes.txt').read_text().split('\n')[:-1]
        assert classes == summary['classes']
        for split, count in summary['splits'].items():
            lines = (root / 'meta' / f'{split}.txt').read_text().splitlines()
            assert len(lines) == count
            labels = []
            for line in lines:
                rel_path, label = line.split(' ')
                class_dir = rel_path.split('/')[0]
                assert classes.index(class_dir) == int(label)
                assert rel_path.endswith('.JPEG')
                labels.append(int(label))
            assert sorted(set(labels)) == list(range(len(classes)))
            with Image.open(root / split / lines[0].split(' ')[0]) as img:
                assert img.format == 'JPEG' and img.mode == 'RGB'
                assert list(img.size) == summary['img_size']


def test_coco_annotations_are_consistent(mini_data_root, summaries):
    root, summary = mini_data_root / 'coco', summaries['coco']
    ann_ids = set()
    for split in ('train', 'val'):
        with open(root / summary['ann_files'][split]) as f:
            coco = json.load(f)
        assert [c['name'] for c in coco['categories']] == summary['classes']
        assert [c['id'] for c in coco['categories']] == list(range(1, len(summary['classes']) + 1))
        images = {img['id']: img for img in coco['images']}
        assert len(images) == summary['splits'][split]
        assert len(coco['annotations']) == summary['instances'][split]
        # Every class in every split, as per-class AP needs.
        category_ids = {c['id'] for c in coco['categories']}
        assert {a['category_id'] for a in coco['annotations']} == category_ids
        for img in images.values():
            assert (root / summary['data_prefixes'][split] / img['file_name']).is_file()
        for ann in coco['annotations']:
            assert ann['id'] not in ann_ids
            ann_ids.add(ann['id'])
            img = images[ann['image_id']]
            x, y, w, h = ann['bbox']
            assert w > 1 and h > 1 and x >= 0 and y >= 0
            assert x + w <= img['width'] and y + h <= img['height']
            polygon = np.array(ann['segmentation'][0]).reshape(-1, 2)
            np.testing.assert_allclose(polygon.min(0), [x, y], atol=0.02)
            np.testing.assert_allclose(polygon.max(0), [x + w, y + h], atol=0.02)
            assert 0 < ann['area'] < w * h and ann['iscrowd'] == 0


def test_ade_label_maps(mini_data_root, summaries):
    root, summary = mini_data_root / 'ade', summaries['ade']
    num_classes = len(summary['classes'])
    assert summary['ade20k_classes'] == list(ADE20K_LEADING_CLASSES[:num_classes])
    for split, folder in (('train', 'training'), ('val', 'validation')):
        pngs = sorted((root / 'annotations' / folder).iterdir())
        jpgs = sorted((root / 'images' / folder).iterdir())
        assert [p.stem for p in pngs] == [p.stem for p in jpgs]
        assert len(pngs) == summary['splits'][split]
        seen = set()
        for png in pngs:
            with Image.open(png) as label_img:
                assert label_img.mode == 'L'
                label = np.asarray(label_img)
            assert label.shape == tuple(summary['img_size'][::-1])
            values = set(np.unique(label).tolist())
            # 0 "other" only on boundaries, 1 background, 2.. shapes.
            assert values <= set(range(num_classes + 1)) and {0, 1} <= values
            assert (label == 0).mean() < 0.2
            seen |= values
        assert seen == set(range(num_classes + 1)), f'{split}: some class never appears'


# ----------------------------------------------------------------------------- idempotency
DENSE_MAKERS = {'coco': (make_mini_coco, 'train2017'), 'ade': (make_mini_ade, 'images/training')}


@pytest.mark.parametrize('name', list(DENSE_MAKERS))
def test_dense_sets_have_the_sizes_asked_for(name, tmp_path):
    maker, train_dir = DENSE_MAKERS[name]
    summary = maker(tmp_path / name, num_train=3, num_val=2, img_size=(40, 32), max_instances=2)
    assert summary['splits'] == dict(train=3, val=2)
    images = sorted((tmp_path / name / train_dir).iterdir())
    assert len(images) == 3
    with Image.open(images[0]) as img:
        assert img.size == (40, 32)


def test_second_call_writes_nothing(tmp_path):
    root = tmp_path / 'cls'
    first = make_mini_imagenet(root, num_classes=2, train_per_class=1, val_per_class=1,
                               img_size=16)
    marker_mtime = os.stat(root / MARKER_FILE).st_mtime_ns
    digest = tree_digest(root)
    second = make_mini_imagenet(root, num_classes=2, train_per_class=1, val_per_class=1,
                                img_size=16)
    assert second == first
    assert os.stat(root / MARKER_FILE).st_mtime_ns == marker_mtime
    assert tree_digest(root) == digest
    # Other parameters replace the set, and no temporary folder is left beside it.
    third = make_mini_imagenet(root, num_classes=3, train_per_class=1, val_per_class=1,
                               img_size=16)
    assert third['splits'] == dict(train=3, val=3)
    assert len((root / 'meta' / 'train.txt').read_text().splitlines()) == 3
    assert os.listdir(tmp_path) == ['cls']


def test_foreign_directory_is_not_overwritten(tmp_path):
    (tmp_path / 'mine').mkdir()
    (tmp_path / 'mine' / 'precious.txt').write_text('keep me')
    with pytest.raises(FileExistsError, match='refusing to overwrite'):
        make_mini_coco(tmp_path / 'mine', num_train=1, num_val=1)
    assert (tmp_path / 'mine' / 'precious.txt').read_text() == 'keep me'
    # An empty folder is fine.
    (tmp_path / 'empty').mkdir()
    make_mini_coco(tmp_path / 'empty', num_train=1, num_val=1)


@pytest.mark.parametrize(
    'call, error, message',
    [(lambda r: make_mini_imagenet(r, task='digits'), ValueError,
      "one of \\('shapes', 'textures', 'shape-groups'\\)"),
     (lambda r: make_mini_imagenet(r, num_classes=7), ValueError, 'num_classes must be in'),
     (lambda r: make_mini_imagenet(r, img_size=(64, 64, 3)), TypeError, 'img_size'),
     (lambda r: make_mini_imagenet(r, train_per_class=2.5), TypeError, 'train_per_class'),
     (lambda r: make_mini_coco(r, classes=('circle', 'ring')), ValueError, 'circle'),
     (lambda r: make_mini_coco(r, classes='circle'), TypeError, 'sequence'),
     (lambda r: make_mini_ade(r, img_size=8), ValueError, 'at least 32'),
     (lambda r: make_mini_all(r, only='det'), ValueError, "'cls', 'coco', 'ade'")],
    ids=['task', 'num-classes', 'img-size-shape', 'float-count', 'coco-ring', 'classes-str',
         'tiny-image', 'only'])
def test_bad_arguments_are_named(call, error, message, tmp_path):
    with pytest.raises(error, match=message):
        call(tmp_path / 'x')
    assert not (tmp_path / 'x').exists()


# ----------------------------------------------------------------------------- signal
def _fft_features(paths):
    """Log-magnitude of the low 2-D frequencies of the standardised grey image.

    Translation-invariant, so it sees the shape or texture and not where it is.
    """
    feats = []
    for path in paths:
        with Image.open(path) as img:
            grey = np.asarray(img.convert('L').resize((32, 32), Image.BILINEAR), np.float64)
        grey = (grey - grey.mean()) / (grey.std() + 1e-6)
        mag = np.abs(np.fft.fft2(grey))
        feats.append(np.log1p(np.concatenate([mag[:12, :12], mag[-12:, :12]])).ravel())
    return np.stack(feats)


@pytest.mark.parametrize('name', ['imagenet', 'imagenet_transfer'])
def test_class_is_learnable_from_content(name, mini_data_root, summaries):
    """Nearest class mean on translation-invariant features: far above chance.

    Raw pixels sit at chance on purpose (position and colour are random).
    """
    root = mini_data_root / name
    data = {}
    for split in ('train', 'val'):
        ann_file = root / 'meta' / f'{split}.txt'
        lines = [line.split(' ') for line in ann_file.read_text().splitlines()]
        data[split] = (_fft_features([root / split / p for p, _ in lines]),
                       np.array([int(label) for _, label in lines]))
    (x_train, y_train), (x_val, y_val) = data['train'], data['val']
    num_classes = len(summaries[name]['classes'])
    means = np.stack([x_train[y_train == c].mean(0) for c in range(num_classes)])
    pred = ((x_val[:, None] - means[None]) ** 2).sum(-1).argmin(1)
    accuracy = (pred == y_val).mean()
    assert accuracy > 3 / num_classes, f'{name}: nearest-class-mean accuracy {accuracy:.3f}'


# ----------------------------------------------------------------------------- upstream
# Transforms are named with their scope ('mmdet.LoadAnnotations'): without a default scope
# a bare 'LoadAnnotations' silently resolves to mmcv's generic class, which rejects
# ``with_mask`` (mmdet) or looks for ``instances`` (mmseg).
def _transform_classes(dataset):
    return [f'{type(t).__module__.split(".")[0]}.{type(t).__name__}'
            for t in dataset.pipeline.transforms]


def test_mmpretrain_imagenet_and_custom_dataset(mini_data_root, summaries):
    pytest.importorskip('mmpretrain')
    from mmpretrain.datasets import CustomDataset, ImageNet

    summary = summaries['imagenet']
    root = str(mini_data_root / 'imagenet')
    pipeline = [dict(type='mmpretrain.LoadImageFromFile'), dict(type='mmpretrain.PackInputs')]
    for split in ('train', 'val'):
        dataset = ImageNet(data_root=root, split=split, pipeline=pipeline,
                           metainfo=dict(classes=summary['classes']))
        assert len(dataset) == summary['splits'][split]
        assert list(dataset.metainfo['classes']) == summary['classes']
        lines = (mini_data_root / 'imagenet' / 'meta' / f'{split}.txt').read_text().splitlines()
        for index in (0, len(dataset) - 1):
            packed = dataset[index]
            rel_path, label = lines[index].split(' ')
            assert packed['inputs'].shape == (3, *summary['img_size'][::-1])
            assert packed['data_samples'].gt_label.tolist() == [int(label)]
            assert packed['data_samples'].img_path == osp.join(root, split, rel_path)
        # Scanning the class folders (no annotation file) gives the same labels.
        scanned = CustomDataset(data_root=root, data_prefix=split,
                                classes=osp.join(root, 'meta', 'classes.txt'))
        assert sorted((d['img_path'], d['gt_label']) for d in scanned.load_data_list()) == \
            sorted((d['img_path'], d['gt_label']) for d in dataset.load_data_list())


def _coco_map(dataset, summary, root, perturb):
    from mmdet.evaluation import CocoMetric
    import torch

    metric = CocoMetric(ann_file=str(root / summary['ann_files']['val']),
                        metric=['bbox', 'segm'])
    metric.dataset_meta = dataset.metainfo
    for index in range(len(dataset)):
        sample = dataset[index]['data_samples']
        gt = sample.gt_instances
        pred = dict(bboxes=gt.bboxes.tensor.clone(), labels=gt.labels.clone(),
                    scores=torch.ones(len(gt.labels)),
                    masks=torch.from_numpy(gt.masks.to_ndarray().astype(bool)))
        perturb(pred)
        metric.process({}, [dict(img_id=sample.img_id, ori_shape=sample.ori_shape,
                                 pred_instances=pred)])
    return metric.evaluate(len(dataset))


def test_mmdet_coco_dataset_and_metric(mini_data_root, summaries):
    pytest.importorskip('mmdet')
    pytest.importorskip('pycocotools')
    from mmdet.datasets import CocoDataset
    import torch

    summary = summaries['coco']
    root = mini_data_root / 'coco'
    datasets = {}
    for split in ('train', 'val'):
        datasets[split] = CocoDataset(
            data_root=str(root), ann_file=summary['ann_files'][split],
            data_prefix=dict(img=summary['data_prefixes'][split]),
            metainfo=dict(classes=tuple(summary['classes'])), test_mode=split == 'val',
            pipeline=[dict(type='mmdet.LoadImageFromFile'),
                      dict(type='mmdet.LoadAnnotations', with_bbox=True, with_mask=True),
                      dict(type='mmdet.PackDetInputs')])
        # Training filters empty images; none is empty.
        assert len(datasets[split]) == summary['splits'][split]
    dataset = datasets['val']
    assert _transform_classes(dataset) == ['mmcv.LoadImageFromFile', 'mmdet.LoadAnnotations',
                                           'mmdet.PackDetInputs']
    packed = dataset[0]
    gt = packed['data_samples'].gt_instances
    assert packed['inputs'].shape == (3, *summary['img_size'][::-1])
    assert gt.masks.to_ndarray().shape[1:] == tuple(summary['img_size'][::-1])
    assert len(gt.labels) == len(gt.bboxes) == len(gt.masks) >= 1

    exact = _coco_map(dataset, summary, root, perturb=lambda pred: None)
    assert exact['coco/bbox_mAP'] == pytest.approx(1.0)
    assert exact['coco/segm_mAP'] == pytest.approx(1.0)

    def shift_right(pred):
        pred['bboxes'][:, 0::2] += 3
        pred['masks'] = torch.roll(pred['masks'], 3, dims=2)

    shifted = _coco_map(dataset, summary, root, perturb=shift_right)
    assert shifted['coco/bbox_mAP'] < 0.9 and shifted['coco/segm_mAP'] < 0.9


@pytest.mark.parametrize('override', [True, False], ids=['first-k-ade-classes', '150-classes'])
def test_mmseg_ade20k_dataset_and_metric(override, mini_data_root, summaries):
    pytest.importorskip('mmseg')
    from mmseg.datasets import ADE20KDataset
    from mmseg.evaluation import IoUMetric

    summary = summaries['ade']
    num_classes = len(summary['classes'])
    assert ADE20KDataset.METAINFO['classes'][:len(ADE20K_LEADING_CLASSES)] == \
        ADE20K_LEADING_CLASSES
    kwargs = dict(metainfo=dict(classes=summary['ade20k_classes'])) if override else {}
    dataset = ADE20KDataset(
        data_root=str(mini_data_root / 'ade'), data_prefix=summary['data_prefixes']['val'],
        test_mode=True, pipeline=[dict(type='mmseg.LoadImageFromFile'),
                                  dict(type='mmseg.LoadAnnotations'),
                                  dict(type='mmseg.PackSegInputs')], **kwargs)
    assert _transform_classes(dataset) == ['mmcv.LoadImageFromFile', 'mmseg.LoadAnnotations',
                                           'mmseg.PackSegInputs']
    assert len(dataset) == summary['splits']['val']
    assert len(dataset.metainfo['classes']) == (num_classes if override else 150)

    def miou(perturb):
        metric = IoUMetric(iou_metrics=['mIoU'])
        metric.dataset_meta = dataset.metainfo
        labels = set()
        for index in range(len(dataset)):
            gt = dataset[index]['data_samples'].gt_sem_seg.data
            labels |= set(gt.unique().tolist())
            metric.process({}, [dict(pred_sem_seg=dict(data=perturb(gt.clone())),
                                     gt_sem_seg=dict(data=gt))])
        return float(metric.evaluate(len(dataset))['mIoU']), labels

    exact, labels = miou(lambda pred: pred)
    # reduce_zero_label: PNG 0 ("other") -> 255 (ignored), c -> c - 1.
    assert labels == set(range(num_classes)) | {255}
    assert exact == pytest.approx(100.0)

    def background_as_first_shape(pred):
        pred[pred == 0] = 1
        return pred

    wrong, _ = miou(background_as_first_shape)
    assert wrong < 90
