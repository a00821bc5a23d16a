"""Scenes of coloured shapes with GenEval prompts: the `tiny-shapes` testbed's data (docs/design.md section 7).

A scene is a plain white square canvas (64 px by default) holding 1-4 flat-coloured shapes, exactly
the objects its GenEval prompt names: an unspecified attribute (a colour the prompt does not ask
for, position, size) is random, but nothing the prompt does not mention appears. Everything derives
from a `numpy.random.Generator`, so a seed gives the same scenes and the same pixels.

Vocabulary
----------
* `SHAPES`: circle, square, triangle, diamond. Never rotated: a square is axis-aligned, a triangle
  points up (base at the bottom, as tall as wide), a diamond is a square standing on a corner (as
  tall as wide). Each fills a `size` x `size` box, so the four differ clearly in how they fill it
  (square 1, circle pi/4, triangle and diamond 1/2, with different silhouettes).
* `COLOURS`: red, yellow, green, blue, black (GenEval colour names), flat RGB values `PALETTE` at
  least 160 apart from each other in RGB and at least 250 from the white `BACKGROUND`. White because
  it is the colour farthest from all five (an antialiased edge is a blend of one colour with white,
  which is never mistaken for another palette colour) and GenEval never asks about backgrounds.
  Colours whose blends make a third palette colour (orange between red and yellow, purple between
  red and blue) are left out on purpose.

Scene rules (what the detector and the pretraining data rely on)
---------------------------------------------------------------
* objects are `MIN_SIZE`..`MAX_SIZE` px wide (10-24 at 64 px; scaled with the canvas), fully inside
  the canvas with a 1 px margin;
* two objects of the same colour never touch: at least `SAME_COLOUR_GAP` (3 px) of background
  between their pixels, so counting objects of a colour is well defined;
* objects of different colours may touch and overlap, later ones drawn on top, but every object
  keeps at least `MIN_VISIBLE` (85 %) of its pixels visible;
* the prompt holds for the rendered scene by GenEval's own rules: the scene's true visible boxes,
  given to `tpkit.geneval.judge` as perfect detections, are judged correct with Flow-GRPO's dense
  score 1.0; a `position` relation also holds when each box edge moves by up to 1 px, so a detector
  that is off by a pixel at antialiased edges still sees it.

Prompts and the train/test split
--------------------------------
Prompts follow GenEval's templates, articles and plurals (`tpkit.geneval.prompts`: "a photo of a red
circle", "a photo of three triangles", "a photo of a circle left of a square", ...) and its rules:
two_object / position / color_attr name two different shapes, color_attr two different colours,
counting asks for 2-4 and excludes one more. The whole prompt space is small (4 shapes, 5 colours:
4 + 12 + 12 + 20 + 48 + 240 distinct prompt strings), so the split is a rule on it, not a list:
per task, the prompts are grouped by GenEval's order-free `prompt_key` ("A and B" == "B and A",
"A left of B" == "B right of A"), the groups are ordered by a salted SHA-256 of the key, and the
first third (rounded up) are held out for test (`is_test`). Every task is in both splits, and no
train prompt is a test prompt even after reordering its objects or mirroring its relation: RL on
the train split is measured on combinations of shapes, colours, counts and relations it never
trained on (pretraining, like SD3.5's, sees scenes of every prompt).
`prompts(split, n)` lists `n` prompts per task, cycling over the split's prompts (all of its
groups are listed before any repeats) so that every task has the same number of lines.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from tpkit.errors import ConfigError
from tpkit.geneval import prompts as gp
from tpkit.geneval.judge import judge

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
COLOURS: tuple[str, ...] = ("red", "yellow", "green", "blue", "black")
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "yellow": (250, 210, 0),
    "green": (30, 180, 50),
    "blue": (20, 60, 220),
    "black": (20, 20, 20),
}
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
TAGS: tuple[str, ...] = gp.TAGS
RELATIONS: tuple[str, ...] = gp.RELATIONS

CANVAS = 64  # scene coordinates are pixels of a CANVAS x CANVAS image; render() scales them
MIN_SIZE, MAX_SIZE = 10.0, 24.0  # object width = height, in canvas pixels
MARGIN = 1.0
SAME_COLOUR_GAP = 3  # px of background between two objects of the same colour
MIN_VISIBLE = 0.85  # fraction of each object's pixels not covered by later objects
MAX_COUNT = 4
SUPERSAMPLE = 4  # render at 4x and average down: antialiased edges, flat insides
SPLIT_SALT = "tpkit-shapes-split-v1"
TEST_FRACTION = 1 / 3
DEFAULT_N = {"train": 80, "test": 16}  # prompts per task in `prompts(split)`
DEFAULT_SEED = 0
_MAX_TRIES = 10_000


@dataclass
class Obj:
    """One shape: its box is [x - size/2, y - size/2, x + size/2, y + size/2] in canvas pixels."""

    shape: str
    colour: str
    x: float
    y: float
    size: float


@dataclass
class Scene:
    objects: list[Obj]  # drawing order: later objects cover earlier ones
    prompt: str
    metadata: dict  # GenEval metadata: tag, include[, exclude], prompt
    size: int = CANVAS  # the image size render() gives by default (object coordinates are canvas pixels)


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def _meta(tag: str, include: list[dict], prompt: str, exclude: list[dict] | None = None) -> dict:
    out: dict[str, Any] = {"tag": tag, "include": include}
    if exclude:
        out["exclude"] = exclude
    out["prompt"] = prompt
    return out


def metadata(tag: str, a: str, b: str | None = None, *, colour: str | None = None, colour_b: str | None = None,
             count: int = 1, relation: str | None = None) -> dict:
    """GenEval metadata and prompt for one scene description (GenEval's templates and clause order:
    for `position` the reference object `b` comes first, `a` carries [relation, 0])."""
    art, T = gp.with_article, gp.TEMPLATES
    if tag == "single_object":
        return _meta(tag, [{"class": a, "count": 1}], T[tag].format(a=art(a)))
    if tag == "two_object":
        return _meta(tag, [{"class": a, "count": 1}, {"class": b, "count": 1}], T[tag].format(a=art(a), b=art(b)))
    if tag == "counting":
        return _meta(tag, [{"class": a, "count": count}],
                     T[tag].format(number=gp.NUMBERS[count], plural=gp.make_plural(a)),
                     exclude=[{"class": a, "count": count + 1}])
    if tag == "colors":
        return _meta(tag, [{"class": a, "count": 1, "color": colour}], T[tag].format(ca=art(colour), obj=a))
    if tag == "position":
        return _meta(tag, [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}],
                     T[tag].format(a=art(a), relation=relation, b=art(b)))
    if tag == "color_attr":
        return _meta(tag, [{"class": a, "count": 1, "color": colour}, {"class": b, "count": 1, "color": colour_b}],
                     T[tag].format(ca=art(colour), obj=a, cb=art(colour_b), obj_b=b))
    raise ValueError(f"unknown task {tag!r}; one of {', '.join(TAGS)}")


@lru_cache(maxsize=None)
def _all_prompts(tag: str) -> tuple[dict, ...]:
    """Every prompt of a task, in a fixed order (the metadata dicts are shared: copy before changing)."""
    pairs = [(a, b) for a in SHAPES for b in SHAPES if a != b]
    if tag == "single_object":
        items = [metadata(tag, a) for a in SHAPES]
    elif tag == "two_object":
        items = [metadata(tag, a, b) for a, b in pairs]
    elif tag == "counting":
        items = [metadata(tag, a, count=n) for a in SHAPES for n in range(2, MAX_COUNT + 1)]
    elif tag == "colors":
        items = [metadata(tag, a, colour=c) for a in SHAPES for c in COLOURS]
    elif tag == "position":
        items = [metadata(tag, a, b, relation=r) for a, b in pairs for r in RELATIONS]
    elif tag == "color_attr":
        items = [metadata(tag, a, b, colour=ca, colour_b=cb) for a, b in pairs for ca in COLOURS for cb in COLOURS
                 if ca != cb]
    else:
        raise ValueError(f"unknown task {tag!r}; one of {', '.join(TAGS)}")
    return tuple(items)


def _key_rank(key: tuple) -> str:
    return hashlib.sha256(f"{SPLIT_SALT}|{key!r}".encode()).hexdigest()


@lru_cache(maxsize=None)
def _test_keys(tag: str) -> frozenset:
    keys = sorted({gp.prompt_key(m) for m in _all_prompts(tag)}, key=_key_rank)
    return frozenset(keys[: math.ceil(len(keys) * TEST_FRACTION)])


def is_test(meta: dict) -> bool:
    """Whether a prompt is held out for test (the split rule in the module docstring)."""
    return gp.prompt_key(meta) in _test_keys(meta["tag"])


def split_prompts(tag: str, split: str | None = None) -> list[dict]:
    """All prompts of a task in one split (None: both), as fresh dicts."""
    if split not in (None, "train", "test"):
        raise ValueError(f"unknown split {split!r}: train or test")
    return [_copy(m) for m in _all_prompts(tag) if split is None or is_test(m) == (split == "test")]


def prompts(split: str, n: int | None = None, seed: int = DEFAULT_SEED) -> list[dict]:
    """GenEval metadata lines for `split`: `n` per task (default 80 train, 16 test), tasks in GenEval's
    order. Within a task the split's prompt groups (by `prompt_key`) are shuffled by `seed`; lines go
    round-robin over the groups, each group's wordings in turn, until `n` (so every group appears
    once before any appears twice)."""
    n = DEFAULT_N.get(split, 0) if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    out: list[dict] = []
    for t, tag in enumerate(TAGS):
        groups: dict[tuple, list[dict]] = {}
        for m in split_prompts(tag, split):
            groups.setdefault(gp.prompt_key(m), []).append(m)
        keys = sorted(groups, key=_key_rank)
        order = np.random.default_rng([seed, t]).permutation(len(keys))
        ordered = [groups[keys[i]] for i in order]
        for i in range(n):
            group = ordered[i % len(ordered)]
            out.append(_copy(group[(i // len(ordered)) % len(group)]))
    return out


def _copy(meta: dict) -> dict:
    import copy

    return copy.deepcopy(meta)


# --------------------------------------------------------------------------------------------
# Scenes
# --------------------------------------------------------------------------------------------


def sample_scene(rng: np.random.Generator, task: str | None = None, size: int = CANVAS,
                 split: str | None = None) -> Scene:
    """A random scene satisfying a random prompt of `task` (None: a random task). split "train" or
    "test" draws the prompt from that split only; None draws from all prompts (as pretraining does)."""
    task = TAGS[int(rng.integers(len(TAGS)))] if task is None else task
    if task not in TAGS:
        raise ValueError(f"unknown task {task!r}; one of {', '.join(TAGS)}")
    candidates = split_prompts(task, split)
    return scene_for(candidates[int(rng.integers(len(candidates)))], rng, size)


def scene_for(meta: dict, rng: np.random.Generator, size: int = CANVAS) -> Scene:
    """A random scene for GenEval metadata: the include clauses' objects (count each; the clause's
    colour or a random one), random sizes and places, redrawn until every scene rule holds."""
    specs = _object_specs(meta, rng)
    for _ in range(_MAX_TRIES):
        objects = _place(specs, rng)
        if objects is not None and satisfied(meta, objects):
            return Scene(objects=objects, prompt=meta["prompt"], metadata=_copy(meta), size=size)
    raise ValueError(f"could not place a scene for {meta.get('prompt')!r}")


MAX_OBJECTS = MAX_COUNT + 1  # an edited scene holds at most this many (a counting prompt's 4 plus one extra)
EDITS = ("drop", "add", "recolour", "reshape")


def edited_scene(meta: dict, rng: np.random.Generator, edits: int, size: int = CANVAS) -> Scene:
    """A near miss of `meta`: its objects after `edits` random edits (drop one, add one of a class of the
    prompt or another, recolour one, reshape one), placed at random under the layout rules and not checked
    against the prompt (a relation holds or not by chance). `truth_score` says how near: graded scenes of
    one prompt, the way the generator's samples are graded, from empty canvas to the prompt itself."""
    specs = _object_specs(meta, rng)
    for _ in range(edits):
        kind = EDITS[int(rng.integers(len(EDITS)))]
        if kind == "add" and len(specs) < MAX_OBJECTS:
            shape = specs[int(rng.integers(len(specs)))][0] if specs and rng.random() < 0.5 else _pick(rng, SHAPES)
            specs.append((shape, _pick(rng, COLOURS)))
        elif specs and kind != "add":
            i = int(rng.integers(len(specs)))
            shape, colour = specs[i]
            if kind == "drop":
                specs.pop(i)
            elif kind == "recolour":
                specs[i] = (shape, _pick(rng, [c for c in COLOURS if c != colour]))
            else:
                specs[i] = (_pick(rng, [s for s in SHAPES if s != shape]), colour)
    for _ in range(_MAX_TRIES):
        objects = _place(specs, rng)
        if objects is not None:
            return Scene(objects=objects, prompt=meta["prompt"], metadata=_copy(meta), size=size)
    raise ValueError(f"could not place an edited scene for {meta.get('prompt')!r}")


def mirrored(scene: Scene, meta: dict, axis: str) -> Scene:
    """`scene` reflected across the canvas's vertical centre line (axis "x": left and right swap) or its
    horizontal one ("y": above and below swap), captioned `meta`. Each shape keeps its orientation (a
    triangle still points up), so "y" places the same objects upside down rather than flipping the image."""
    if axis not in ("x", "y"):
        raise ValueError(f"axis {axis!r} is not x or y")
    objects = [replace(o, x=CANVAS - o.x) if axis == "x" else replace(o, y=CANVAS - o.y) for o in scene.objects]
    return Scene(objects=objects, prompt=meta["prompt"], metadata=_copy(meta), size=scene.size)


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def truth_score(meta: dict, objects: Sequence[Obj]) -> float:
    """Flow-GRPO's dense score of `meta` with the true visible boxes as perfect detections: what the
    generator's samples are graded by, on a scene whose content is known."""
    return judge(meta, _perfect_detections(objects, visible_boxes(objects), [0] * len(objects))).score


def _perfect_detections(objects: Sequence[Obj], boxes: list[list[float]], grow: Sequence[float]) -> list[dict]:
    """Detections at confidence 1 with each box's edges moved out by `grow` px."""
    return [{"class": o.shape, "score": 1.0, "color": o.colour, "box": [b[0] - d, b[1] - d, b[2] + d, b[3] + d]}
            for o, b, d in zip(objects, boxes, grow)]


def _object_specs(meta: dict, rng: np.random.Generator) -> list[tuple[str, str]]:
    specs = []
    for clause in meta["include"]:
        if clause["class"] not in SHAPES:
            raise ValueError(f"class {clause['class']!r} is not a shape ({', '.join(SHAPES)})")
        for _ in range(int(clause["count"])):
            colour = clause.get("color") or COLOURS[int(rng.integers(len(COLOURS)))]
            if colour not in COLOURS:
                raise ValueError(f"colour {colour!r} is not one of {', '.join(COLOURS)}")
            specs.append((clause["class"], colour))
    return specs


def _place(specs: list[tuple[str, str]], rng: np.random.Generator) -> list[Obj] | None:
    """Random sizes and centres (on a quarter-pixel grid), or None if the layout breaks a rule."""
    objects = []
    for shape, colour in specs:
        s = float(np.round(rng.uniform(MIN_SIZE, MAX_SIZE) * 4) / 4)
        lo, hi = MARGIN + s / 2, CANVAS - MARGIN - s / 2
        x, y = (float(np.round(rng.uniform(lo, hi) * 4) / 4) for _ in range(2))
        objects.append(Obj(shape, colour, x, y, s))
    return objects if valid_layout(objects) else None


def valid_layout(objects: Sequence[Obj]) -> bool:
    """The layout rules: same-colour objects SAME_COLOUR_GAP px apart, each MIN_VISIBLE visible
    (sizes and margins are the sampler's business)."""
    masks = _coverage_masks(objects, CANVAS)
    visible = _visible(masks)
    for i, (o, m, v) in enumerate(zip(objects, masks, visible)):
        if v.sum() < MIN_VISIBLE * m.sum():
            return False
        for j in range(i):
            if objects[j].colour == o.colour and (_dilate(m, SAME_COLOUR_GAP) & masks[j]).any():
                return False
    return True


def visible_boxes(objects: Sequence[Obj]) -> list[list[float]]:
    """Each object's true visible box [x0, y0, x1, y1] in canvas pixels (what a perfect detector sees)."""
    return [_box(v) for v in _visible(_coverage_masks(objects, CANVAS))]


def satisfied(meta: dict, objects: list[Obj], boxes: list[list[float]] | None = None) -> bool:
    """GenEval's judge, given the true visible boxes as perfect detections, finds the prompt true
    (dense score 1), also with every box edge moved by -1, 0 or +1 px when the prompt has a position.
    boxes: `visible_boxes(objects)` when already known (judging many prompts on one scene)."""
    boxes = visible_boxes(objects) if boxes is None else boxes
    deltas = [0, -1, 1] if any("position" in c for c in meta["include"]) else [0]
    for da in deltas:
        for db in deltas:
            j = judge(meta, _perfect_detections(objects, boxes, [da] + [db] * (len(objects) - 1)))
            if not j.correct or j.score < 1.0:
                return False
    return True


def true_detections(scene: Scene, size: int | None = None) -> list[dict]:
    """The scene's objects as GenEval detections: class, colour, visible box and mask at `size` px."""
    size = size or scene.size
    masks = _visible(_coverage_masks(scene.objects, size))
    return [{"class": o.shape, "color": o.colour, "score": 1.0, "box": _box(m), "mask": m}
            for o, m in zip(scene.objects, masks)]


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def _polygon(o: Obj, scale: float) -> tuple[str, list[tuple[float, float]]]:
    """The shape's outline at `scale` pixels per canvas pixel: ("ellipse", [box corners]) or
    ("polygon", vertices)."""
    h = o.size / 2
    x0, y0, x1, y1 = ((o.x - h) * scale, (o.y - h) * scale, (o.x + h) * scale, (o.y + h) * scale)
    cx, cy = o.x * scale, o.y * scale
    if o.shape == "circle":
        return "ellipse", [(x0, y0), (x1, y1)]
    if o.shape == "square":
        return "polygon", [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    if o.shape == "triangle":
        return "polygon", [(cx, y0), (x1, y1), (x0, y1)]
    if o.shape == "diamond":
        return "polygon", [(cx, y0), (x1, cy), (cx, y1), (x0, cy)]
    raise ValueError(f"unknown shape {o.shape!r}")


def _draw(draw, o: Obj, scale: float, fill) -> None:
    kind, pts = _polygon(o, scale)
    if kind == "ellipse":
        (x0, y0), (x1, y1) = pts
        draw.ellipse([x0, y0, x1 - 1, y1 - 1], fill=fill)  # PIL's ellipse box includes its last pixel
    else:
        draw.polygon(pts, fill=fill)


def render(scene: Scene, size: int | None = None) -> np.ndarray:
    """The scene as uint8 RGB (size, size, 3; default scene.size): white background, objects in order, flat colours,
    edges antialiased by drawing at SUPERSAMPLE x and averaging down. Deterministic."""
    from PIL import Image, ImageDraw

    size = size or scene.size
    big = size * SUPERSAMPLE
    image = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for o in scene.objects:
        _draw(draw, o, big / CANVAS, PALETTE[o.colour])
    return np.asarray(image.resize((size, size), Image.Resampling.BOX), dtype=np.uint8).copy()


def blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """A render blurred like a generated image's soft edges: separable Gaussian of `sigma` px, edges
    repeated; float64 (H, W, 3). For measuring the detector on model-like images, not used by it."""
    r = math.ceil(3 * sigma)
    k = np.exp(-np.arange(-r, r + 1) ** 2 / (2 * sigma * sigma))
    k /= k.sum()
    a = image.astype(np.float64)
    for axis in (0, 1):
        pad = [(0, 0)] * 3
        pad[axis] = (r, r)
        p = np.pad(a, pad, mode="edge")
        a = sum(w * np.take(p, np.arange(i, i + a.shape[axis]), axis=axis) for i, w in enumerate(k))
    return a


def _coverage_masks(objects: Sequence[Obj], size: int) -> list[np.ndarray]:
    """Per object, the pixels (size x size) it covers at least half of, drawn alone."""
    from PIL import Image, ImageDraw

    big = size * SUPERSAMPLE
    out = []
    for o in objects:
        image = Image.new("L", (big, big), 0)
        _draw(ImageDraw.Draw(image), o, big / CANVAS, 255)
        out.append(np.asarray(image.resize((size, size), Image.Resampling.BOX)) >= 128)
    return out


def _visible(masks: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for i, m in enumerate(masks):
        covered = np.zeros_like(m)
        for later in masks[i + 1:]:
            covered |= later
        out.append(m & ~covered)
    return out


def _box(mask: np.ndarray) -> list[float]:
    """[x_first, y_first, x_last + 1, y_last + 1] of a mask (mmdetection's mask2bbox)."""
    ys, xs = np.nonzero(mask)
    if not len(xs):
        return [0.0, 0.0, 0.0, 0.0]
    return [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]


def _dilate(mask: np.ndarray, r: int) -> np.ndarray:
    """Dilation by a (2r+1) x (2r+1) square."""
    out = mask.copy()
    for _ in range(r):
        grown = out.copy()
        grown[1:] |= out[:-1]
        grown[:-1] |= out[1:]
        grown[:, 1:] |= grown[:, :-1].copy()
        grown[:, :-1] |= grown[:, 1:].copy()
        out = grown
    return out


def write_prompts(out, split: str, n: int | None = None, seed: int = DEFAULT_SEED):
    """`tpkit prompts shapes`: write `prompts(split, n, seed)` as GenEval metadata .jsonl; its path."""
    if split not in ("train", "test"):
        raise ConfigError(f"unknown split {split!r}", "use --split train or --split test")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"--n {n!r} must be a whole number >= 1", "pass --n 1 or more (prompts per task)")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"--seed {seed!r} must be a whole number >= 0", "e.g. --seed 0 (the shipped files' order)")
    return gp.write_jsonl(out, prompts(split, n, seed))
