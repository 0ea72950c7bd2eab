"""The pictures of the mini sets: shapes, textures and scenes of non-overlapping shapes, each
drawn from its own random stream (numpy and Pillow only)."""
from typing import Tuple

import numpy as np
from PIL import Image, ImageDraw

SHAPE_KINDS = ('circle', 'square', 'triangle', 'cross', 'star', 'ring')
TEXTURE_KINDS = ('hstripes', 'vstripes', 'dstripes', 'checker', 'dots', 'grid')
# A coarser labelling of the same shapes, for transfer from a shapes model in the low-data
# regime where a pre-trained initialisation matters: each image shows one shape of its group.
SHAPE_GROUPS = {'round': ('circle', 'ring'), 'cornered': ('square', 'triangle'),
                'spiky': ('star', 'cross')}
# Shapes that are simple polygons, so a COCO polygon and a label map describe them exactly.
DENSE_SHAPE_KINDS = ('circle', 'square', 'triangle', 'cross', 'star')

# Salts keep the random streams of different generators and splits apart for one seed.
_STREAM_SALT = {'shapes': 11, 'textures': 12, 'shape-groups': 13, 'coco': 21, 'ade': 31}
_SPLIT_SALT = {'train': 1, 'val': 2}


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

