"""What every mini-set writer shares: argument checks that name the argument, the file
writers, and the write-to-a-temporary-sibling-then-rename step with its marker."""
import json
import os
import os.path as osp
import shutil
import uuid
from typing import Optional, Sequence, Tuple, Union

import numpy as np
from PIL import Image

from .drawing import DENSE_SHAPE_KINDS

MARKER_FILE = 'linvit_mini.json'
# Bump when the bytes written for the same parameters change, so stale roots get rebuilt.
FORMAT_VERSION = 1
JPEG_QUALITY = 85

ImageSize = Union[int, Sequence[int]]


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



def _check_dense_args(classes, num_train, num_val, max_instances, img_size, seed):
    """The arguments of the dense sets (COCO, ADE20K), checked: ``(classes, num_train,
    num_val, max_instances, (width, height), seed)``."""
    return (_check_kinds('classes', classes, DENSE_SHAPE_KINDS),
            _check_int('num_train', num_train), _check_int('num_val', num_val),
            _check_int('max_instances', max_instances, 1, 16),
            _check_size('img_size', img_size, 32), _check_int('seed', seed, 0))


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

