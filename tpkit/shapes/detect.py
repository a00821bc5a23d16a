"""A weight-free detector for `tpkit.shapes.scenes` scenes: GenEval detections (class, score, box, colour).

`tpkit eval geneval --detector shapes` and the `geneval` / `geneval-strict` rewards with option
`detector=shapes` use it in place of Mask2Former + CLIP: it reports each object's colour itself, so no
colour classifier is loaded. Only NumPy (and Pillow to resize) is needed.

How it works, per image
-----------------------
1. Work at `WORK` px (64): larger images are box-averaged down (boxes are scaled back up after).
2. Colour segmentation, tolerant of blur, noise and washed-out colours: every pixel is projected on
   each line from the white background to a palette colour (`tpkit.shapes.scenes.PALETTE`): alpha is how
   far along (0 white, 1 the colour), the residual how far off the line. A pixel is colour c when
   it is at least half way to c (alpha >= 0.5) and within `MAX_RESIDUAL` of c's line (the closest
   line wins), background when it is less than half way to every colour, else nothing (the blend
   where two colours meet, off-palette colours). A blurred edge is a blend with white, so it stays
   on the line: the `alpha >= 0.5` outline of a blurred straight edge does not move.
3. Objects: per colour, the `SOLID` (alpha >= 0.75) pixels are opened (3x3), which removes
   structures under 3 px wide (seams, strokes, noise) and cuts thin bridges; each connected piece
   left is an object's core, grown back to the colour's pixels within 2 px of it that are connected
   to it (restoring tips and the soft rim). Objects under `MIN_AREA` px are dropped; a region with
   no solid pixels (grey is half way to black) is no object.
4. Shape: the object's alpha around its box is compared with each shape (circle, square, upright
   triangle, downward triangle (also a "triangle"), diamond) drawn into a box and blurred by a
   Gaussian of each sigma in `BLURS` (0-2.2 px): blur rounds a small diamond and cuts a triangle's
   tip, so a blurry object is compared with shapes blurred as much, never with sharp ones. The box
   is the seen one pushed out by how much that shape's `alpha >= 0.5` region shrinks at that blur
   (`retraction`: tips and corners fade first), then refined on a sub-pixel grid (and, where another
   colour touches a side, pushed under it). Pixels of other colours are left out (they may hide
   part of the object); both alphas go through clip((a - 0.1) / 0.8) so that noise on the white
   does not count. The class is the best soft intersection-over-union (IoU).
5. Score = fit x margin x colour x plausible: fit = clip((IoU - 0.6) / 0.2), margin = clip(0.5 +
   (IoU - runner-up IoU) / 0.1) (ambiguous blobs score low), colour = clip(1.5 - mean residual / 50)
   over the core's inner pixels (off-palette colours score low), plausible = 0 unless the fitted box
   is 9-30 px, at most 1.3 x as wide as tall (or tall as wide) and at least 75 % of the shape is
   seen (not under other colours or off the image; `MIN_SEEN`, `SIZES`, `MAX_ASPECT`): the scenes'
   objects fill 10-24 px square boxes, 85 % visible, so flat colour fields, rectangles and shapes
   mostly made up under other colours are no objects. Clean renders score > 0.9, so GenEval's
   counting threshold keeps them; blobs that fit no shape, or fit two, fall under its 0.3 threshold.

Accuracy (objects found with the right class and colour, score > 0.3; 500 scenes, 300 random and
200 crowded, ~1000 objects; tests/test_shapes_detect.py checks smaller sets):
    image                                      before    now
    clean render                                99.8 %  100.0 %
    Gaussian blur sigma 1 px                    73.1 %   99.3 %
    blur 1.5 + noise 15 (per channel)           42.5 %   96.6 %
    blur 1.5 + noise 15 + colours off by <=20   40.9 %   94.7 %
    blur 2 + noise 20                           28.0 %   78.2 %

  Under blur 1.5 + noise 15 a wrong class is rare (of ~230 each: 10 circles read as diamonds, 8
  squares as circles, 4 diamonds as circles, 2 triangles as diamonds); at blur 1 px, 2 in 1060.
  Noise, blank or noisy white, flat colours (palette ones too) and smooth random colour fields
  give no detection above 0.3.

Failure modes that remain: objects hidden by more than about a quarter (the scene rules allow
15 %) can take another shape's silhouette or score low; two same-colour objects closer than ~2 px
merge into one candidate (the scene rules keep 3 px between them; a generated image that lets them
touch is judged as drawing one blob, as GenEval's detector would); a shape smaller than ~9 px is
dropped or misread; off-palette colours (orange, purple, grey) are not objects at all. A shape drawn
in two palette colours (tiny-shapes sometimes bleeds a second colour into one) is split into two
segments that each fit badly: with the second colour over the right 20 % of its width the class is
still found (0.975 of them above 0.9), over 35 % 0.825 above 0.3 and 0.645 above 0.9, over half 0.525
and 0.140 (`bench/shapes/detector_two_colours.py`), where GenEval's detector would see one object. Heavier
degradation costs objects: at blur 2 px + noise 20 small triangles lose their tips to the noise
(missed, rarely read as another class) and about 1 in 10 small circles and squares read as
diamonds and circles. Images made of blocks (a palette colour field upsampled from a coarse grid)
hold genuinely square patches, which are detected as squares.

On tiny-shapes' own images (an audit by eye of the base model's first 96 failed images in its
held-out evaluation, seed 0, 2026-12-03): 3 or 4 are the detector's mistakes rather than the
model's. Shapes shaded darker than their palette colour (a navy triangle: its darkest pixels lie
nearer black's line than blue's, so it splits into a "black" and a "blue" part that both fit
badly), and clear but slightly uneven shapes in counting prompts, whose score (~0.75) falls under
GenEval's counting threshold 0.9. The rest are the model's: empty canvases and specks, blobs that
fit no shape, another shape drawn than the one named, objects in the wrong place. A likely fix,
shades of a colour counted as that colour (the white-colour-black triangle in place of the
white-colour line), would move every accuracy measured so far by a point or two, so it waits for
a rerun of the comparison.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import groupby
from typing import Sequence

import numpy as np

from tpkit.shapes import scenes as shapes

WORK = shapes.CANVAS
MIN_AREA = 20  # px at WORK size
GROW = 2
NAMES = ("background",) + shapes.COLOURS
_REFS = np.array([shapes.BACKGROUND] + [shapes.PALETTE[c] for c in shapes.COLOURS], dtype=np.float32)


# --------------------------------------------------------------------------------------------
# Binary morphology and connected components (NumPy only)
# --------------------------------------------------------------------------------------------


def erode(mask: np.ndarray) -> np.ndarray:
    """3x3 erosion (outside the image counts as empty): along rows, then along columns (the 3x3
    square is separable: 4 in-place ANDs, not 9 shifted copies)."""
    out = mask.copy()
    out[:, 1:] &= mask[:, :-1]
    out[:, :-1] &= mask[:, 1:]
    out[:, [0, -1]] = False
    rows = out.copy()
    out[1:] &= rows[:-1]
    out[:-1] &= rows[1:]
    out[[0, -1]] = False
    return out


def dilate(mask: np.ndarray, r: int = 1) -> np.ndarray:
    """(2r+1) x (2r+1) dilation: r 3x3 ones, each along rows, then along columns (separable)."""
    for _ in range(r):
        grown = mask.copy()
        grown[:, 1:] |= mask[:, :-1]
        grown[:, :-1] |= mask[:, 1:]
        rows = grown.copy()
        grown[1:] |= rows[:-1]
        grown[:-1] |= rows[1:]
        mask = grown
    return mask


def components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """4-connected components: (labels (H, W) int, 0 = none, 1..n; n), numbered in raster order of
    their first pixel. Labelled within the mask's bounding box (objects are small: fewer pixels
    per pass, the same raster order)."""
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    out = np.zeros(mask.shape, dtype=np.int32)
    if not len(rows):
        return out, 0
    box = (slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1))
    out[box], n = _components(mask[box])
    return out, n


def _components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """`components` by min-label propagation with pointer jumping (a few dozen vectorised passes)."""
    h, w = mask.shape
    big = h * w
    idx = np.arange(big).reshape(h, w)
    lab = np.where(mask, idx, big)
    while True:
        new = lab.copy()
        new[1:] = np.minimum(new[1:], np.where(mask[:-1], lab[:-1], big))
        new[:-1] = np.minimum(new[:-1], np.where(mask[1:], lab[1:], big))
        new[:, 1:] = np.minimum(new[:, 1:], np.where(mask[:, :-1], lab[:, :-1], big))
        new[:, :-1] = np.minimum(new[:, :-1], np.where(mask[:, 1:], lab[:, 1:], big))
        new = np.where(mask, new, big)
        flat = new.ravel()
        inside = flat < big
        for _ in range(4):  # pointer jumping: a label points at a pixel whose label is smaller still
            flat[inside] = flat[flat[inside]]
        if np.array_equal(new, lab):
            break
        lab = new
    roots = np.unique(lab[mask])
    out = np.zeros((h, w), dtype=np.int32)
    out[mask] = np.searchsorted(roots, lab[mask]) + 1
    return out, len(roots)


# --------------------------------------------------------------------------------------------
# Shape templates
# --------------------------------------------------------------------------------------------

TEMPLATES = ("circle", "square", "triangle", "triangle_down", "diamond")
_CLASS = {"triangle_down": "triangle"}
_SUB = 4  # template coverage: SUB x SUB samples per pixel
_GROW_BOX = (-0.25, 0.25, 0.75)  # px added to each side of the mask's box when fitting (sub-pixel edges, tips)


def inside(name: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Whether points (u, v) of the unit box (v down) are inside the shape filling it."""
    if name == "circle":
        return (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25
    if name == "square":
        return (u >= 0) & (u <= 1) & (v >= 0) & (v <= 1)
    if name == "triangle":
        return (np.abs(u - 0.5) <= v / 2) & (v <= 1)
    if name == "triangle_down":
        return (np.abs(u - 0.5) <= (1 - v) / 2) & (v >= 0)
    if name == "diamond":
        return np.abs(u - 0.5) + np.abs(v - 0.5) <= 0.5
    raise ValueError(name)


def _row_span(name: str, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where (u from, u to) a row at height v of the unit box is inside the shape (empty: from > to)."""
    inrow = (v >= 0) & (v <= 1)
    if name == "circle":
        half = np.sqrt(np.clip(0.25 - (v - 0.5) ** 2, 0, None))
    elif name == "square":
        half = np.full_like(v, 0.5)
    elif name == "triangle":
        half = v / 2
    elif name == "triangle_down":
        half = (1 - v) / 2
    elif name == "diamond":
        half = 0.5 - np.abs(v - 0.5)
    else:
        raise ValueError(name)
    half = np.where(inrow, half, -1.0)
    return 0.5 - half, 0.5 + half


@lru_cache(maxsize=64)
def _grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """The y of each of the SUB sample rows per pixel row (h * SUB) and the x of each pixel column's
    edges (w + 1): built once per crop size, not per template."""
    ys = (np.arange(h)[:, None] + (np.arange(_SUB) + 0.5)[None] / _SUB).ravel()
    px = np.arange(w + 1, dtype=np.float64)
    ys.flags.writeable = px.flags.writeable = False
    return ys, px


def coverages(names: Sequence[str], boxes: np.ndarray, h: int, w: int) -> np.ndarray:
    """(n, h, w): per shape of `names` (n) and box of `boxes` (n, 4), the fraction of each pixel of
    an h x w grid (pixel (0, 0) spans [0, 1]^2) that the shape filling the continuous box [x0, y0,
    x1, y1] (x0 < x1, y0 < y1) covers: exact along x, SUB rows per pixel. All boxes at once (a fit
    tries dozens), over the pixels they can touch (1 px more for rounding): the crop around an
    object is mostly empty."""
    ys, px = _grid(h, w)
    boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
    c0, r0 = (max(int(np.floor(boxes[:, i::2].min())) - 1, 0) for i in (0, 1))
    c1, r1 = (min(int(np.ceil(boxes[:, i::2].max())) + 1, n) for i, n in ((0, w), (1, h)))
    out = np.zeros((len(boxes), h, w), np.float32)
    if r0 >= r1 or c0 >= c1:
        return out
    x0, y0, x1, y1 = boxes.T[..., None]  # each (n, 1)
    v = (ys[r0 * _SUB:r1 * _SUB].reshape(-1, _SUB).T[:, None] - y0) / (y1 - y0)  # (SUB, n, rows): sample rows
    lo, hi = np.empty_like(v), np.empty_like(v)
    start = 0
    for name, run in groupby(names):  # each run of boxes of one shape
        stop = start + len(list(run))
        lo[:, start:stop], hi[:, start:stop] = _row_span(name, v[:, start:stop])
        start = stop
    lo, hi = x0 + lo * (x1 - x0), x0 + hi * (x1 - x0)
    # A sample row covers clip(edge, lo, hi) - lo left of a pixel edge; a pixel's share is the
    # difference at its two edges (0 on an empty row, lo > hi), as min(x + 1, hi) - max(x, lo) clipped
    # to [0, 1] (bit for bit). Laid out (columns, n, rows) for long inner loops, a pixel's SUB rows
    # added one at a time into buffers that stay in the CPU cache (arrays of all rows at once do not).
    edges = np.empty((c1 - c0 + 1,) + v.shape[1:])
    total, part = np.empty((c1 - c0,) + v.shape[1:]), np.empty((c1 - c0,) + v.shape[1:])
    for i in range(_SUB):
        np.maximum(px[c0:c1 + 1, None, None], lo[i], out=edges)
        np.minimum(edges, hi[i], out=edges)
        np.subtract(edges[1:], edges[:-1], out=part if i else total)
        if i:
            total += part
    total /= _SUB  # the rows' mean, added in np.mean's order
    out[:, r0:r1, c0:c1] = total.transpose(1, 2, 0)
    return out


def coverage(name: str, box: Sequence[float], h: int, w: int) -> np.ndarray:
    """`coverages` of one shape and box: (h, w)."""
    return coverages([name], np.array([box]), h, w)[0]


BLURS = (0.0, 0.5, 0.8, 1.1, 1.4, 1.8, 2.2)  # Gaussian blur (sigma, px) the fits try, beyond antialiasing
SOFT = 0.1  # alphas (object's and template's) are mapped by clip((a - SOFT) / (1 - 2 SOFT)) before comparing


@lru_cache(maxsize=1024)
def _gauss(n: int, sigma: float) -> np.ndarray:
    """n x n matrix of a 1-D Gaussian blur (zero outside the grid; identity for sigma 0)."""
    if sigma <= 0:
        return np.eye(n, dtype=np.float32)
    i = np.arange(n)
    g = np.exp(-((i[:, None] - i[None]) ** 2) / (2 * sigma * sigma))
    r = np.arange(-n, n + 1)
    return (g / np.exp(-(r ** 2) / (2 * sigma * sigma)).sum()).astype(np.float32)


def blurred(cover: np.ndarray, sigmas: Sequence[float]) -> np.ndarray:
    """Each coverage of `cover` (n, h, w) blurred by a Gaussian of its sigma of `sigmas` (what a
    blurry image of the shape looks like): one stacked matrix product per distinct sigma."""
    _, h, w = cover.shape
    sigmas = np.asarray(sigmas, np.float64)
    out = np.empty_like(cover)
    for sigma in np.unique(sigmas):
        sel = sigmas == sigma
        out[sel] = cover[sel] if sigma <= 0 else _gauss(h, float(sigma)) @ cover[sel] @ _gauss(w, float(sigma)).T
    return out


@lru_cache(maxsize=4096)
def retraction(name: str, sigma: float, size: int) -> tuple[float, float, float, float]:
    """How far (px: left, top, right, bottom) the box of the shape's `alpha >= 0.5` region shrinks
    when a `size` px shape is blurred by `sigma` (tips and corners fade first; straight edges stay)."""
    if sigma <= 0:
        return (0.0, 0.0, 0.0, 0.0)
    k = 4  # samples per px
    pad = int(np.ceil(3 * sigma)) + 1
    n = (size + 2 * pad) * k
    c = (np.arange(n) + 0.5) / k - pad
    v, u = np.meshgrid(c / size, c / size, indexing="ij")
    fine = inside(name, u, v).astype(np.float32)
    g = _gauss(n, sigma * k)
    seen = (g @ fine @ g.T) >= 0.5
    ys, xs = np.nonzero(seen)
    if not len(xs):
        return (0.0, 0.0, 0.0, 0.0)
    sharp_ys, sharp_xs = np.nonzero(fine >= 0.5)
    return (float(xs.min() - sharp_xs.min()) / k, float(ys.min() - sharp_ys.min()) / k,
            float(sharp_xs.max() - xs.max()) / k, float(sharp_ys.max() - ys.max()) / k)


_EXTEND = (1.0, 2.0, 3.0, 4.0, 6.0)  # px a side hidden by another object may extend beyond what is seen
HIDDEN_REACH = max(_EXTEND) + 1


def candidate_boxes(box: Sequence[float], hidden: Sequence[bool] = (False,) * 4,
                    grow: Sequence[float] = _GROW_BOX) -> list[tuple[float, ...]]:
    """Boxes to fit shapes into: the seen box grown by each of `grow` px (x and y apart) and, for
    each side (left, top, right, bottom) hidden by another object, that side pushed out by _EXTEND."""
    x0, y0, x1, y1 = (float(v) for v in box)
    out = [(x0 - gx, y0 - gy, x1 + gx, y1 + gy) for gx in grow for gy in grow]
    g = _GROW_BOX[1]
    for side, is_hidden in enumerate(hidden):
        if is_hidden:
            for e in _EXTEND:
                grown = [x0 - g, y0 - g, x1 + g, y1 + g]
                grown[side] += -e if side < 2 else e
                out.append(tuple(grown))
    return out


def _soft(a: np.ndarray) -> np.ndarray:
    return np.clip((a - SOFT) / (1 - 2 * SOFT), 0.0, 1.0)


def _soft_ious(a: np.ndarray, keep: np.ndarray, templates: np.ndarray) -> np.ndarray:
    """Soft IoU (sum of min / sum of max) of the soft object `a` (h, w) with each of `templates`
    (n, h, w), over the `keep` pixels: float64 (n,), 0 where both are empty."""
    t = _soft(templates) * keep
    n = len(t)
    inter = np.minimum(a, t).reshape(n, -1).sum(-1).astype(np.float64)
    union = np.maximum(a, t).reshape(n, -1).sum(-1).astype(np.float64)
    return np.divide(inter, union, out=np.zeros(n), where=union != 0)


def _template_ious(a: np.ndarray, keep: np.ndarray, names: Sequence[str], boxes: np.ndarray,
                   sigmas: Sequence[float]) -> np.ndarray:
    """Soft IoUs of `a` with the shapes `names` drawn into `boxes` (n, 4) and blurred by `sigmas`:
    every template of a fit in a few array ops."""
    return _soft_ious(a, keep, blurred(coverages(names, boxes, *a.shape), sigmas))


def shape_fits(alpha: np.ndarray, ignore: np.ndarray, boxes: Sequence[tuple[float, ...]],
               sigma: float = 0.0) -> dict[str, float]:
    """Per shape, the best soft IoU (sum of min / sum of max) of an object's coverage `alpha` (h, w)
    with the shape drawn into one of `boxes` (grid coordinates) and blurred by `sigma`, over the
    pixels not in `ignore`."""
    keep = ~ignore
    a = _soft(alpha) * keep
    boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
    return {name: float(_template_ious(a, keep, [name] * len(boxes), boxes, [sigma] * len(boxes)).max())
            for name in TEMPLATES}


def fit_blurred(alpha: np.ndarray, ignore: np.ndarray, box: Sequence[float], hidden: Sequence[bool]
                ) -> dict[str, tuple[float, float, tuple[float, ...]]]:
    """Per shape: (best soft IoU, its blur sigma, its box). For each blur of BLURS the seen `box` is pushed
    out by that shape's `retraction` and the fit is made as `shape_fits` does; the best blur is
    then refined with all of `candidate_boxes` (ties go to the first blur, box tried). Each of the
    two rounds is one batch of templates: one Python step per template (~130 per object) made the
    detector cost about as much CPU as the diffusion transformer."""
    keep = ~ignore
    a = _soft(alpha) * keep
    x0, y0, x1, y1 = (float(v) for v in box)
    size = min(max(int(4 * round(max(x1 - x0, y1 - y0) / 4)), 8), 24)
    pushed = np.array([[retraction(name, sigma, size) for sigma in BLURS] for name in TEMPLATES])  # (shapes, blurs, 4)
    grown = np.array([x0, y0, x1, y1]) + pushed * [-1, -1, 1, 1]
    ious = _template_ious(a, keep, [name for name in TEMPLATES for _ in BLURS],
                          _q(grown, _GROW_BOX[1]).reshape(-1, 4), BLURS * len(TEMPLATES))
    ious = ious.reshape(len(TEMPLATES), len(BLURS))
    blur = ious.argmax(1)  # per shape, its best blur
    cands = [_q(np.array(candidate_boxes(grown[i, j], hidden))) for i, j in enumerate(blur)]
    refined = _template_ious(a, keep, [name for name, c in zip(TEMPLATES, cands) for _ in c], np.concatenate(cands),
                             [BLURS[j] for j, c in zip(blur, cands) for _ in c])
    out, start = {}, 0
    for i, (name, j, c) in enumerate(zip(TEMPLATES, blur, cands)):
        iou, best_box = float(ious[i, j]), _q(grown[i, j], _GROW_BOX[1])
        k = start + int(refined[start:start + len(c)].argmax())
        if refined[k] > iou:
            iou, best_box = float(refined[k]), c[k - start]
        out[name] = (iou, BLURS[j], tuple(float(v) for v in best_box))
        start += len(c)
    return out


def _q(box: np.ndarray, grow: float = 0.0) -> np.ndarray:
    """Boxes (..., 4) grown by `grow`, on a 1/8 px grid (where the fits place boxes)."""
    return np.round((np.asarray(box, np.float64) + np.array([-grow, -grow, grow, grow])) * 8) / 8


def _clip01(x: float) -> float:
    return float(min(1.0, max(0.0, x)))


# --------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------

_BG = np.array(shapes.BACKGROUND, np.float32)
_DIRS = _REFS[1:] - _BG  # (5, 3): from the background to each colour
MAX_RESIDUAL = 80.0  # px's distance (RGB) from the white-to-colour line that still counts as that colour
SOLID = 0.75  # alpha of an object's core pixels
FIT = (0.6, 0.8)  # soft IoU of the best shape fit that scores 0 and 1
SIZES = (9.0, 30.0)  # px (at WORK size) of a fitted shape's box that scores 1 (objects are 10-24)
MIN_SEEN = 0.75  # fraction of a fitted shape left visible that scores 1 (the scenes keep 85 %)
AREA = {"circle": np.pi / 4, "square": 1.0, "triangle": 0.5, "triangle_down": 0.5, "diamond": 0.5}
MAX_ASPECT = 1.3  # width / height of a fitted shape's box that scores 1 (shapes are as wide as tall)


def colour_alphas(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel and palette colour (H, W, 5): alpha (where on the white-to-colour line the pixel
    projects, 0 = white, 1 = the colour) and residual (RGB distance from that line)."""
    x = rgb.astype(np.float32) - _BG
    alpha = (x @ _DIRS.T) / (_DIRS * _DIRS).sum(-1)
    off = [np.square(x[..., c, None] - alpha * _DIRS[:, c]) for c in range(3)]  # per channel (H, W, 5):
    return alpha, np.sqrt(off[0] + off[1] + off[2])  # no (H, W, 5, 3) array, nor a reduce over its 3 channels


def segment(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel: index into NAMES (0 background, -1 nothing) and its residual. A pixel is colour c
    when it is at least half way from white to c (alpha >= 0.5) and within MAX_RESIDUAL of that line
    (the closest such line wins); background when it is less than half way to every colour."""
    return _segment(*colour_alphas(rgb))


def _segment(alpha: np.ndarray, resid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`segment` from `colour_alphas`' output (which `detect` needs too: computed once)."""
    ok = (alpha >= 0.5) & (resid <= MAX_RESIDUAL)
    r = np.where(ok, resid, np.inf)
    nearest = r.argmin(-1)
    d = np.take_along_axis(resid, nearest[..., None], -1)[..., 0]
    labels = np.where(ok.any(-1), nearest + 1, np.where((alpha < 0.5).all(-1), 0, -1))
    return labels, d


def _work_image(image) -> tuple[np.ndarray, float]:
    """RGB uint8 array at WORK px (box-averaged down if larger) and the factor back to the input's pixels."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image, dtype=np.uint8))
    image = image.convert("RGB")
    w, h = image.size
    if max(w, h) <= WORK:
        return np.asarray(image), 1.0
    scale = WORK / max(w, h)
    small = image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BOX)
    return np.asarray(small), 1.0 / scale


def detect(image) -> list[dict]:
    """GenEval detections of one image (PIL image or uint8 RGB array), most confident first:
    {"class", "score", "box": [x0, y0, x1, y1] in the input's pixels, "color", "mask": None}."""
    rgb, back = _work_image(image)
    alphas, resid = colour_alphas(rgb)
    labels, _ = _segment(alphas, resid)
    min_area = MIN_AREA * (rgb.shape[0] * rgb.shape[1]) / (WORK * WORK)
    found = []
    for k, colour in enumerate(shapes.COLOURS, start=1):
        mask = labels == k
        if not mask.any():
            continue
        solid = mask & (alphas[..., k - 1] >= SOLID)
        cores, n = components(dilate(erode(solid)) & solid)
        if not n:
            continue
        pieces, _ = components(mask)
        others = (labels > 0) & ~mask
        for c in range(1, n + 1):
            core = cores == c
            piece = np.isin(pieces, np.unique(pieces[core]))
            obj = piece & dilate(core, GROW)
            if np.count_nonzero(obj) < min_area:
                continue
            ignore = others | (mask & ~obj)  # other colours (may hide it) and other objects of its colour
            found.append(_describe(obj, core, others, ignore, rgb, resid[..., k - 1], colour, back))
    found.sort(key=lambda d: -d["score"])
    return found


def alpha_of(rgb: np.ndarray, colour: str) -> np.ndarray:
    """How much of each pixel a flat `colour` covers, if the pixel blends it with the background."""
    c = np.array(shapes.PALETTE[colour], np.float32)
    b = np.array(shapes.BACKGROUND, np.float32)
    d = c - b
    return np.clip(((rgb.astype(np.float32) - b) @ d) / float(d @ d), 0.0, 1.0)


def _describe(obj: np.ndarray, core: np.ndarray, others: np.ndarray, ignore: np.ndarray, rgb: np.ndarray,
              resid: np.ndarray, colour: str, back: float) -> dict:
    ys, xs = np.nonzero(obj)
    y0, y1, x0, x1 = int(ys.min()), int(ys.max()) + 1, int(xs.min()), int(xs.max()) + 1
    ty, tx = np.nonzero(dilate(obj) & others)  # where another colour touches it: it may hide a side
    hidden = (bool((tx <= x0 + 1).any()), bool((ty <= y0 + 1).any()), bool((tx >= x1 - 2).any()),
              bool((ty >= y1 - 2).any()))
    m = int(HIDDEN_REACH) + 1 if any(hidden) else 4  # pixels around the box to compare
    h, w = obj.shape
    py0, py1, px0, px1 = max(y0 - m, 0), min(y1 + m, h), max(x0 - m, 0), min(x1 + m, w)
    crop = (slice(py0, py1), slice(px0, px1))
    alpha = alpha_of(rgb[crop], colour)
    fits = fit_blurred(alpha, ignore[crop], (x0 - px0, y0 - py0, x1 - px0, y1 - py0), hidden)
    ranked = sorted(((k, v[0]) for k, v in fits.items()), key=lambda kv: -kv[1])
    best, iou = ranked[0]
    cls = _CLASS.get(best, best)
    runner_up = next(v for k, v in ranked[1:] if _CLASS.get(k, k) != cls)
    inner = erode(core)
    inner = inner if inner.any() else core
    fit = _clip01((iou - FIT[0]) / (FIT[1] - FIT[0]))
    margin = _clip01(0.5 + (iou - runner_up) / 0.1)
    purity = _clip01(1.5 - float(resid[inner].mean()) / 50.0)
    bx0, by0, bx1, by1 = fits[best][2]
    size = max(bx1 - bx0, by1 - by0)
    aspect = size / max(min(bx1 - bx0, by1 - by0), 1e-6)
    lo, hi = SIZES
    cov = coverage(best, fits[best][2], *alpha.shape)
    seen = float((cov * ~ignore[crop]).sum()) / (AREA[best] * (bx1 - bx0) * (by1 - by0))  # the rest: hidden
    plausible = (_clip01(1 - (MIN_SEEN - seen) / 0.15) * _clip01((size - lo + 1) / 1) * _clip01((hi + 4 - size) / 4)
                 * _clip01(1 - (aspect - MAX_ASPECT) / 0.2))
    return {"class": cls, "score": fit * margin * purity * plausible, "color": colour,
            "box": [x0 * back, y0 * back, x1 * back, y1 * back], "mask": None}


class ShapesDetector:
    """`detector=shapes`: the GenEval judge's detector for `tpkit.shapes.scenes` scenes (no weights, no device).

    workers >= 2 spreads the images over that many processes (started on first use, kept for the
    process's life): the detector is NumPy on one core (~8 ms an image), so where the model runs on a
    GPU, scoring a TP-GRPO round's ~1150 branch images in one reward thread is CPU-bound. Spawned,
    not forked: the parent holds torch and CUDA state. The detections do not depend on workers.
    """

    name = "shapes"

    def __init__(self, workers: int = 0):
        import threading

        self.workers = workers
        self._pool = None
        self._lock = threading.Lock()  # several reward threads may make the first call at once

    def __call__(self, images: Sequence, batch_size: int | None = None) -> list[list[dict]]:
        if self.workers < 2 or len(images) < 2:
            return [detect(im) for im in images]
        with self._lock:
            if self._pool is None:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        arrays = [np.asarray(im.convert("RGB") if hasattr(im, "convert") else im) for im in images]
        return list(self._pool.map(detect, arrays, chunksize=max(1, len(arrays) // (2 * self.workers))))
