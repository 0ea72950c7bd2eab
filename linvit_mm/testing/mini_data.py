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

Only numpy, Pillow and the standard library are used here, so importing this module does
not import (or register anything in) mmpretrain, mmdet or mmseg.
"""
import json
import os
import os.path as osp
import shutil
import uuid
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np
from PIL import Image, ImageDraw

MARKER_FILE = 'linvit_mini.json'
# Bump when the bytes written for the same parameters change, so stale roots get rebuilt.
FORMAT_VERSION = 1
JPEG_QUALITY = 85

# The first ADE20K class names (mmseg ``ADE20KDataset.METAINFO['classes']``); the label-map
# logic of mmseg only accepts a metainfo override that names a subset of them.
ADE20K_LEADING_CLASSES = ('wall', 'building', 'sky', 'floor', 'tree', 'ceiling', 'road', 'bed ',
                          'windowpane', 'grass', 'cabinet', 'sidewalk')

SHAPE_KINDS = ('circle', 'square', 'triangle', 'cross', 'star', 'ring')
TEXTURE_KINDS = ('hstripes', 'vstripes', 'dstripes', 'checker', 'dots', 'grid')
# A coarser labelling of the same shapes, for transfer from a shapes model in the low-data
# regime where a pre-trained initialisation matters: each image shows one shape of its group.
SHAPE_GROUPS = {'round': ('circle', 'ring'), 'cornered': ('square', 'triangle'),
                'spiky': ('star', 'cross')}
CLS_TASKS = {'shapes': SHAPE_KINDS, 'textures': TEXTURE_KINDS,
             'shape-groups': tuple(SHAPE_GROUPS)}
# Shapes need more examples than textures: a 4-block, 96-wide ViT (patch 8) trained from
# scratch for 300 iterations of 32 images reaches 54-63% val accuracy on shapes with 40 a
# class (chance 17%) and 94% on textures with 16 a class. The small textures set is also a
# low-data transfer target, where a pre-trained initialisation can show.
DEFAULT_TRAIN_PER_CLASS = {'shapes': 40, 'textures': 16, 'shape-groups': 8}
# Shapes that are simple polygons, so a COCO polygon and a label map describe them exactly.
DENSE_SHAPE_KINDS = ('circle', 'square', 'triangle', 'cross', 'star')

ImageSize = Union[int, Sequence[int]]

# Salts keep the random streams of different generators and splits apart for one seed.
_STREAM_SALT = {'shapes': 11, 'textures': 12, 'shape-groups': 13, 'coco': 21, 'ade': 31}
_SPLIT_SALT = {'train': 1, 'val': 2}


# ----------------------------------------------------------------------------- validation
def _check_int(name, value, minimum=1, maximum=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f'{name} must be an int, got {type(value).__name__}')
    if value < minimum or (maximum is not None and value > maximum):
        bound = f'in [{minimum}, {maximum}]' if maximum is not None else f'>= {minimum}'
        raise ValueError(f'{name} must be {bound}, got {value}')
    return int(value)


def _check_size(name, img_size, minimum) -> Tuple[int, int]:
    """``int`` or ``(width, height)`` -> ``(width, height)``."""
    if isinstance(img_size, (int, np.integer)) and not isinstance(img_size, bool):
        size = (int(img_size), int(img_size))
    elif (isinstance(img_size, (tuple, list)) and len(img_size) == 2
          and all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in img_size)):
        size = (int(img_size[0]), int(img_size[1]))
    else:
        raise TypeError(
            f'{name} must be an int or a (width, height) pair of ints, got {img_size!r}')
    if min(size) < minimum:
        raise ValueError(f'{name} must be at least {minimum} pixels on each side, got {img_size!r}')
    return size


def _check_kinds(name, kinds, valid):
    if isinstance(kinds, str) or not isinstance(kinds, Sequence):
        raise TypeError(f'{name} must be a sequence of names from {valid}, got {kinds!r}')
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in valid]
    if unknown or not kinds:
        raise ValueError(f'{name} must name one or more of {valid}, got {kinds!r}')
    if len(set(kinds)) != len(kinds):
        raise ValueError(f'{name} has duplicates: {kinds!r}')
    return kinds


def _rng(stream: str, seed: int, split: str, index: int) -> np.random.Generator:
    # One stream per image: an image does not depend on how many others are generated.
    return np.random.default_rng([_STREAM_SALT[stream], seed, _SPLIT_SALT[split], index])


# ----------------------------------------------------------------------------- drawing
def _unit_polygon(kind: str) -> np.ndarray:
    """Vertices (P, 2) of a shape centred at 0 whose farthest vertex lies at radius 1."""
    if kind == 'circle':
        t = np.linspace(0, 2 * np.pi, 24, endpoint=False)
        return np.stack([np.cos(t), np.sin(t)], 1)
    if kind in ('square', 'triangle'):
        n = 4 if kind == 'square' else 3
        t = np.linspace(0, 2 * np.pi, n, endpoint=False) - np.pi / 2
        return np.stack([np.cos(t), np.sin(t)], 1)
    if kind == 'cross':
        a = 0.33
        pts = np.array([(a, 1), (a, a), (1, a), (1, -a), (a, -a), (a, -1), (-a, -1), (-a, -a),
                        (-1, -a), (-1, a), (-a, a), (-a, 1)], dtype=np.float64)
        return pts / np.hypot(1, a)
    if kind == 'star':
        t = np.linspace(0, 2 * np.pi, 10, endpoint=False) - np.pi / 2
        r = np.where(np.arange(10) % 2 == 0, 1.0, 0.42)
        return np.stack([r * np.cos(t), r * np.sin(t)], 1)
    raise ValueError(f'unknown polygon kind {kind!r}; valid kinds: {DENSE_SHAPE_KINDS}')


def _place_polygon(kind, center, radius, angle) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    rot = np.array([[c, -s], [s, c]])
    return _unit_polygon(kind) @ rot.T * radius + np.asarray(center, dtype=np.float64)


def _contrasting_colours(rng) -> Tuple[np.ndarray, np.ndarray]:
    """Background and foreground colours at least 35 levels apart in every channel.

    Colour carries no class information; the contrast only guarantees the shape is visible.
    """
    dark = rng.random() < 0.5
    low = rng.integers(0, 111, size=3)
    high = rng.integers(146, 256, size=3)
    return (low, high) if dark else (high, low)


def _smooth_background(rng, width, height, base) -> np.ndarray:
    """A float (H, W, 3) colour field around ``base`` that varies slowly across the image."""
    coarse = np.clip(base[None, None, :] + rng.normal(0, 18, size=(3, 3, 3)), 0, 255)
    field = Image.fromarray(coarse.astype(np.uint8), 'RGB').resize((width, height),
                                                                  Image.BILINEAR)
    return np.asarray(field, dtype=np.float64)


def _finish(canvas: np.ndarray, rng) -> Image.Image:
    # Mild pixel noise so that no pixel value alone identifies the foreground.
    noisy = canvas + rng.normal(0, 2, size=canvas.shape)
    return Image.fromarray(np.clip(np.rint(noisy), 0, 255).astype(np.uint8), 'RGB')


def _polygon_mask(polygon: np.ndarray, width: int, height: int) -> np.ndarray:
    mask = Image.new('L', (width, height), 0)
    ImageDraw.Draw(mask).polygon([tuple(p) for p in polygon], fill=1)
    return np.asarray(mask, dtype=bool)


def _draw_group_image(rng, group, width, height) -> Image.Image:
    kinds = SHAPE_GROUPS[group]
    return _draw_shape_image(rng, kinds[rng.integers(len(kinds))], width, height)


def _draw_shape_image(rng, kind, width, height) -> Image.Image:
    """One shape of ``kind`` at a random position, scale, rotation and colour."""
    bg, fg = _contrasting_colours(rng)
    canvas = _smooth_background(rng, width, height, bg)
    side = min(width, height)
    radius = rng.uniform(0.22, 0.42) * side
    center = (rng.uniform(radius, width - radius), rng.uniform(radius, height - radius))
    if kind == 'ring':
        # Not a simple polygon (it has a hole): the difference of two concentric circles.
        mask = (_polygon_mask(_place_polygon('circle', center, radius, 0), width, height)
                & ~_polygon_mask(_place_polygon('circle', center, 0.55 * radius, 0), width,
                                 height))
    else:
        mask = _polygon_mask(_place_polygon(kind, center, radius, rng.uniform(0, 2 * np.pi)),
                             width, height)
    canvas[mask] = fg + rng.normal(0, 6, size=3)
    return _finish(canvas, rng)


def _texture_pattern(kind, rng, width, height) -> np.ndarray:
    """Boolean (H, W) periodic pattern, random period, phase and a small tilt."""
    side = min(width, height)
    period = rng.uniform(0.12, 0.26) * side
    tilt = np.deg2rad(rng.uniform(-8, 8))
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64)
    u = np.cos(tilt) * xs + np.sin(tilt) * ys + rng.uniform(0, period)
    v = -np.sin(tilt) * xs + np.cos(tilt) * ys + rng.uniform(0, period)
    w = 2 * np.pi / period
    if kind == 'hstripes':
        return np.sin(w * v) > 0
    if kind == 'vstripes':
        return np.sin(w * u) > 0
    if kind == 'dstripes':
        return np.sin(w * (u + v) / np.sqrt(2)) > 0
    if kind == 'checker':
        return np.sin(w * u) * np.sin(w * v) > 0
    if kind == 'dots':
        du = np.mod(u, period) - period / 2
        dv = np.mod(v, period) - period / 2
        return du ** 2 + dv ** 2 < (0.3 * period) ** 2
    if kind == 'grid':
        return (np.mod(u, period) < 0.25 * period) | (np.mod(v, period) < 0.25 * period)
    raise ValueError(f'unknown texture kind {kind!r}; valid kinds: {TEXTURE_KINDS}')


def _draw_texture_image(rng, kind, width, height) -> Image.Image:
    bg, fg = _contrasting_colours(rng)
    canvas = _smooth_background(rng, width, height, bg)
    pattern = _texture_pattern(kind, rng, width, height)
    canvas[pattern] = fg + rng.normal(0, 6, size=3)
    # Uneven lighting: the two colours of a pattern drift across the image, as in photos.
    light = _smooth_background(rng, width, height, np.full(3, 128.0)) / 128.0
    return _finish(canvas * light, rng)


def _scatter_shapes(rng, kinds, first_kind, count, width, height, radius_range):
    """Up to ``count`` non-overlapping shapes: list of (kind, polygon).

    Bounding circles are kept two pixels apart, so every polygon is fully visible and
    instance masks never overlap (GT masks then are exactly the drawn pixels).
    """
    placed = []
    for _ in range(count * 30):
        if len(placed) == count:
            break
        radius = rng.uniform(*radius_range)
        if radius * 2 + 2 > min(width, height):
            continue
        center = np.array([rng.uniform(radius + 1, width - radius - 1),
                           rng.uniform(radius + 1, height - radius - 1)])
        if any(np.hypot(*(center - c)) < radius + r + 2 for c, r, _ in placed):
            continue
        kind = first_kind if not placed else kinds[rng.integers(len(kinds))]
        placed.append((center, radius, kind))
    return [(kind, _place_polygon(kind, center, radius, rng.uniform(0, 2 * np.pi)))
            for center, radius, kind in placed]


def _draw_scene(rng, kinds, first_kind, count, width, height):
    """Background plus non-overlapping shapes, each in its own colour.

    Returns the image and the (kind, polygon) list in drawing order.
    """
    bg, _ = _contrasting_colours(rng)
    canvas = _smooth_background(rng, width, height, bg)
    side = min(width, height)
    shapes = _scatter_shapes(rng, kinds, first_kind, count, width, height,
                             (0.11 * side, 0.3 * side))
    bg_mean = canvas.mean(axis=(0, 1))
    for _, polygon in shapes:
        # Each instance its own colour, but always far from the background it sits on.
        colour = np.where(bg_mean < 128, rng.integers(150, 256, size=3),
                          rng.integers(0, 106, size=3))
        canvas[_polygon_mask(polygon, width, height)] = colour
    return _finish(canvas, rng), shapes


# ----------------------------------------------------------------------------- file I/O
def _save_jpeg(img: Image.Image, path: str):
    # Fixed quality; optimised Huffman tables are deterministic and save about 20%.
    img.save(path, format='JPEG', quality=JPEG_QUALITY, optimize=True)


def _write_text(path, lines):
    with open(path, 'w', encoding='utf-8', newline='\n') as f:
        f.write(''.join(f'{line}\n' for line in lines))


def _write_json(path, obj, indent=None):
    with open(path, 'w', encoding='utf-8', newline='\n') as f:
        json.dump(obj, f, indent=indent, sort_keys=indent is not None)
        f.write('\n')


def _tree_stats(root) -> Tuple[int, int]:
    files, total = 0, 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            files += 1
            total += osp.getsize(osp.join(dirpath, name))
    return files, total


def _read_marker(root) -> Optional[dict]:
    path = osp.join(root, MARKER_FILE)
    if not osp.isfile(path):
        return None
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _with_root(marker: dict, root: str) -> dict:
    summary = dict(marker['summary'])
    summary['root'] = osp.abspath(root)
    return summary


def _generate(root, params: dict, writer) -> dict:
    """Run ``writer(tmp_dir) -> summary`` in a sibling temp dir and rename it to ``root``.

    Idempotent: a root whose marker holds the same ``params`` is returned as it is. A root
    with another marker is replaced; a non-empty root without a marker is never touched.
    Concurrent callers (e.g. several ranks) with equal params all end with the same root.
    """
    root = osp.abspath(os.fspath(root))
    marker = _read_marker(root)
    if marker is not None and marker.get('params') == params:
        return _with_root(marker, root)
    if osp.exists(root) and marker is None and (not osp.isdir(root) or os.listdir(root)):
        raise FileExistsError(
            f'{root} exists and was not written by linvit_mm mini_data (no {MARKER_FILE}); '
            'refusing to overwrite it, pass an empty or new directory')

    parent, name = osp.split(root)
    os.makedirs(parent, exist_ok=True)
    tmp = osp.join(parent, f'.{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}')
    os.makedirs(tmp)
    try:
        summary = writer(tmp)
        # Data files only: the marker is written last, so its presence means "complete".
        files, total = _tree_stats(tmp)
        summary.update(num_files=files, num_bytes=total)
        _write_json(osp.join(tmp, MARKER_FILE), dict(params=params, summary=summary), indent=1)

        stale = None
        if osp.exists(root):
            stale = osp.join(parent, f'.{name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}')
            os.rename(root, stale)
        try:
            os.rename(tmp, root)
        except OSError:
            # Another process renamed its copy in first; keep it if it matches.
            winner = _read_marker(root)
            if winner is None or winner.get('params') != params:
                raise
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
    finally:
        if osp.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return _with_root(_read_marker(root), root)


# ----------------------------------------------------------------------------- ImageNet
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


# ----------------------------------------------------------------------------- COCO
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
    classes = _check_kinds('classes', classes, DENSE_SHAPE_KINDS)
    num_train = _check_int('num_train', num_train)
    num_val = _check_int('num_val', num_val)
    max_instances = _check_int('max_instances', max_instances, 1, 16)
    width, height = _check_size('img_size', img_size, 32)
    seed = _check_int('seed', seed, 0)
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


# ----------------------------------------------------------------------------- ADE20K
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
    classes = _check_kinds('classes', classes, DENSE_SHAPE_KINDS)
    num_train = _check_int('num_train', num_train)
    num_val = _check_int('num_val', num_val)
    max_instances = _check_int('max_instances', max_instances, 1, 16)
    width, height = _check_size('img_size', img_size, 32)
    seed = _check_int('seed', seed, 0)
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


# ----------------------------------------------------------------------------- all of them
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
