"""tpkit.shapes.detect: the weight-free detector of shapes scenes, alone and as the GenEval judge's."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tpkit.geneval import detectors
from tpkit.shapes import scenes as shapes
from tpkit.errors import RewardError
from tpkit.shapes.detect import components, detect

from conftest import DATA


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def crowded_scene(rng: np.random.Generator) -> shapes.Scene:
    """2-4 objects, each touching or overlapping an earlier one of another colour, mostly small."""
    while True:
        objects = []
        for _ in range(int(rng.integers(2, 5))):
            shape = shapes.SHAPES[int(rng.integers(len(shapes.SHAPES)))]
            size = float(rng.uniform(shapes.MIN_SIZE, 18.0))
            if not objects:
                x, y = rng.uniform(20, 44, 2)
                colour = shapes.COLOURS[int(rng.integers(len(shapes.COLOURS)))]
            else:
                p = objects[int(rng.integers(len(objects)))]
                colour = [c for c in shapes.COLOURS if c != p.colour][int(rng.integers(len(shapes.COLOURS) - 1))]
                angle, reach = rng.uniform(0, 2 * math.pi), (p.size + size) / 2 * rng.uniform(0.6, 1.05)
                x, y = p.x + reach * math.cos(angle), p.y + reach * math.sin(angle)
            if not (size / 2 + 1 <= min(x, y) and max(x, y) <= shapes.CANVAS - 1 - size / 2):
                break
            objects.append(shapes.Obj(shape, colour, float(x), float(y), size))
        if len(objects) >= 2 and shapes.valid_layout(objects):
            return shapes.Scene(objects, "", {})


def _score(scenes, images) -> tuple[int, int, list]:
    """(objects found with the right class and colour, objects, misses): a detection of the object's
    colour whose box overlaps its visible box by IoU >= 0.5, score > 0.3, the right class."""
    found, total, misses = 0, 0, []
    for scene, image in zip(scenes, images):
        dets = detect(image)
        for truth in shapes.true_detections(scene, image.shape[0]):
            total += 1
            hits = [d for d in dets if d["color"] == truth["color"] and _iou(d["box"], truth["box"]) >= 0.5]
            best = max(hits, key=lambda d: _iou(d["box"], truth["box"]), default=None)
            if best is not None and best["class"] == truth["class"] and best["score"] > 0.3:
                found += 1
            else:
                misses.append((scene, truth["class"], truth["color"], best))
    return found, total, misses


def test_components():
    mask = np.zeros((6, 7), bool)
    mask[0, :3] = mask[1, 2] = True  # one piece
    mask[3:5, 4:] = True  # another
    mask[5, 0] = True  # a third
    labels, n = components(mask)
    assert n == 3 and set(np.unique(labels)) == {0, 1, 2, 3}
    assert len({labels[0, 0], labels[1, 2]}) == 1 and labels[3, 4] != labels[0, 0] != labels[5, 0]


def test_detector_finds_99_percent_of_objects_in_500_scenes():
    """300 random scenes of every task plus 200 crowded ones (touching, overlapping, small objects)."""
    rng = np.random.default_rng(2026)
    scenes = [shapes.sample_scene(rng) for _ in range(300)] + [crowded_scene(rng) for _ in range(200)]
    found, total, misses = _score(scenes, [shapes.render(s) for s in scenes])
    overlapping = sum(any(t["mask"].sum() < m.sum() for t, m in zip(shapes.true_detections(s),
                                                                    shapes._coverage_masks(s.objects, 64)))
                      for s in scenes[300:])
    assert total > 900 and overlapping > 50
    assert found / total >= 0.99, misses[:5]


def test_independently_drawn_scenes():
    """Scenes drawn here with PIL (no antialiasing, other proportions, colours off the palette by up
    to 25 per channel, 64 and 160 px), not by tpkit's renderer."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(5)
    found = total = 0
    for size in (64, 160):
        for _ in range(40):
            image = Image.new("RGB", (size, size), (int(rng.integers(235, 256)),) * 3)
            draw = ImageDraw.Draw(image)
            truth = []
            slots = rng.permutation(4)[: int(rng.integers(1, 5))]  # quadrants: objects never touch
            for slot in slots:
                shape = shapes.SHAPES[int(rng.integers(len(shapes.SHAPES)))]
                colour = shapes.COLOURS[int(rng.integers(len(shapes.COLOURS)))]
                rgb = tuple(int(np.clip(v + rng.integers(-25, 26), 0, 255)) for v in shapes.PALETTE[colour])
                s = size * rng.uniform(0.18, 0.4)
                cx = size * (0.25 + 0.5 * (slot % 2)) + rng.uniform(-2, 2)
                cy = size * (0.25 + 0.5 * (slot // 2)) + rng.uniform(-2, 2)
                x0, y0, x1, y1 = cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2
                if shape == "circle":
                    draw.ellipse([x0, y0, x1, y1], fill=rgb)
                elif shape == "square":
                    draw.rectangle([x0, y0, x1, y1], fill=rgb)
                elif shape == "triangle":  # equilateral, not the renderer's isosceles
                    h = s * math.sqrt(3) / 2
                    draw.polygon([(cx, cy - h / 2), (x1, cy + h / 2), (x0, cy + h / 2)], fill=rgb)
                else:
                    draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=rgb)
                truth.append((shape, colour))
            dets = [d for d in detect(image) if d["score"] > 0.3]
            total += len(truth)
            found += sum(min(sum((d["class"], d["color"]) == t for d in dets), truth.count(t)) for t in set(truth))
            assert len(dets) == len(truth)
    assert found / total >= 0.99


def test_nothing_in_noise_and_off_palette_colours():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (64, 64, 3)).astype(np.uint8)
    assert all(d["score"] <= 0.3 for d in detect(noise))
    image = np.full((64, 64, 3), 255, np.uint8)
    image[10:30, 10:30] = (128, 128, 128)  # grey
    image[40:60, 40:60] = (160, 32, 240)  # purple
    assert detect(image) == []


# --------------------------------------------------------------------------------------------
# As the GenEval judge's detector
# --------------------------------------------------------------------------------------------


def test_load_models_shapes_loads_no_clip():
    detector, colours = detectors.load_models("shapes", "no/such-clip")
    assert colours is None and detector.name == "shapes"


def test_rewards_with_the_shapes_detector():
    from PIL import Image

    from tpkit.rewards.registry import load_rewards, score_images

    rng = np.random.default_rng(3)
    scenes = [shapes.sample_scene(rng, task) for task in shapes.TAGS]
    images = [Image.fromarray(shapes.render(s)) for s in scenes]
    rewards = load_rewards({"geneval": 1.0, "geneval-strict": 1.0},
                           {"geneval": {"detector": "shapes"}, "geneval-strict": {"detector": "shapes", "clip": "x"}})
    right = score_images(rewards, images, [s.prompt for s in scenes], [s.metadata for s in scenes])
    assert right["reward_geneval"] == [1.0] * 6 and right["reward_geneval_strict"] == [1.0] * 6
    wrong_meta = [scenes[(i + 1) % 6].metadata for i in range(6)]  # each image judged against another task's prompt
    wrong = score_images(rewards, images, [m["prompt"] for m in wrong_meta], wrong_meta)
    assert sum(wrong["reward_geneval_strict"]) <= 1 and sum(wrong["reward_geneval"]) < 3  # a colour_attr scene has a single object

    # soft = true: the dense score averaged over detection thresholds; clean renders score > 0.9,
    # so it is a little under 1 for the right prompts
    soft = load_rewards({"geneval": 1.0}, {"geneval": {"detector": "shapes", "soft": True}})
    right_soft = score_images(soft, images, [s.prompt for s in scenes], [s.metadata for s in scenes])["reward"]
    assert all(0.85 < r <= 1.0 for r in right_soft), right_soft
    wrong_soft = score_images(soft, images, [m["prompt"] for m in wrong_meta], wrong_meta)["reward"]
    assert sum(wrong_soft) < 3
    with pytest.raises(RewardError, match="'soft' must be true or false"):
        load_rewards({"geneval": 1.0}, {"geneval": {"detector": "shapes", "soft": "yes"}})
    with pytest.raises(RewardError, match="no option 'soft'"):  # the verdict has nothing to soften
        load_rewards({"geneval-strict": 1.0}, {"geneval-strict": {"detector": "shapes", "soft": True}})

    # top_n = true: GenEval's view of the detections; 1.0 exactly where the verdict is right
    top = load_rewards({"geneval": 1.0}, {"geneval": {"detector": "shapes", "top_n": True}})
    assert score_images(top, images, [s.prompt for s in scenes], [s.metadata for s in scenes])["reward"] == [1.0] * 6
    wrong_top = score_images(top, images, [m["prompt"] for m in wrong_meta], wrong_meta)["reward"]
    assert [r == 1.0 for r in wrong_top] == [r == 1.0 for r in wrong["reward_geneval_strict"]]
    with pytest.raises(RewardError, match="soft and top_n"):
        load_rewards({"geneval": 1.0}, {"geneval": {"detector": "shapes", "soft": True, "top_n": True}})
    with pytest.raises(RewardError, match="'top_n' must be true or false"):
        load_rewards({"geneval": 1.0}, {"geneval": {"detector": "shapes", "top_n": 1}})


def test_worker_processes_detect_the_same():
    """workers=2: the images go to two spawned processes, the detections come back unchanged and in order."""
    from PIL import Image

    from tpkit.shapes.detect import ShapesDetector

    rng = np.random.default_rng(5)
    images = [Image.fromarray(shapes.render(shapes.sample_scene(rng, task))) for task in shapes.TAGS * 2]
    images[3] = images[3].resize((128, 128))  # any size, as in the calling thread
    pooled = ShapesDetector(workers=2)
    try:
        assert pooled(images) == ShapesDetector()(images)
    finally:
        pooled._pool.shutdown()
    assert detectors.load_models("shapes", workers=2)[0] is detectors.load_models("shapes", workers=2)[0]  # one pool
    with pytest.raises(RewardError, match="workers must be an integer >= 0"):
        from tpkit.rewards.registry import load_rewards

        load_rewards({"geneval": 1.0}, {"geneval": {"detector": "shapes", "workers": -1}})
    with pytest.raises(RewardError, match="workers applies to detector=shapes only"):
        load_rewards({"geneval": 1.0}, {"geneval": {"workers": 4}})


def _write_geneval_folder(root, metas, scenes_for) -> None:
    import json

    from PIL import Image

    for i, (meta, scenes) in enumerate(zip(metas, scenes_for)):
        folder = root / f"{i:05d}"
        (folder / "samples").mkdir(parents=True)
        (folder / "metadata.jsonl").write_text(json.dumps(meta) + "\n")
        for j, scene in enumerate(scenes):
            Image.fromarray(shapes.render(scene)).save(folder / "samples" / f"{j:04d}.png")


def test_eval_geneval_end_to_end(tmp_path):
    """`tpkit eval geneval --images DIR --detector shapes`: renders of the shipped test prompts are
    judged right (accuracy 1), renders of another prompt wrong."""
    import json
    import subprocess
    import sys

    from tpkit import evaluate
    from tpkit.config import EvalConfig
    from tpkit.geneval.prompts import prompt_key

    metas = [json.loads(line) for line in open(DATA / "shapes-test.jsonl")]
    rng = np.random.default_rng(0)
    _write_geneval_folder(tmp_path / "right", metas, [[shapes.scene_for(m, rng)] for m in metas])
    cmd = [sys.executable, "-m", "tpkit", "eval", "geneval", "--images", str(tmp_path / "right"), "--detector",
           "shapes", "--out", str(tmp_path / "eval-right")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "eval-right" / "summary.json").read_text())
    assert summary["overall"] == 1.0 and set(summary["tasks"]) == set(shapes.TAGS)

    metas = metas[::4]  # 4 per task
    others = [next(o for o in metas[i + 1:] + metas[:i] if prompt_key(o) != prompt_key(m)) for i, m in enumerate(metas)]
    _write_geneval_folder(tmp_path / "wrong", metas, [[shapes.scene_for(o, rng)] for o in others])
    evaluate.run(EvalConfig(kind="geneval", out=str(tmp_path / "eval-wrong"), images=str(tmp_path / "wrong"),
                            reward_options={"geneval": {"detector": "shapes"}}))
    wrong = json.loads((tmp_path / "eval-wrong" / "summary.json").read_text())
    assert wrong["overall"] < 0.3


# --------------------------------------------------------------------------------------------
# Model-like degradation: blur, noise, off-palette colours
# --------------------------------------------------------------------------------------------


def _degrade(image: np.ndarray, rng: np.random.Generator, sigma: float, noise: float = 0.0, shift: float = 0.0):
    a = (shapes.blur(image, sigma) if sigma > 0 else image.astype(np.float64)) + rng.uniform(-shift, shift, 3) + rng.normal(0, noise, image.shape) * (noise > 0)
    return np.clip(np.round(a), 0, 255).astype(np.uint8)


def _confusion(scenes, images) -> tuple[float, dict]:
    """(fraction of objects found right, {(true class, detected class or None): count})."""
    found, total, misses = _score(scenes, images)
    confusion: dict = {}
    for _, cls, _, best in misses:
        key = (cls, best["class"] if best is not None and best["score"] > 0.3 else None)
        confusion[key] = confusion.get(key, 0) + 1
    return found / total, confusion


@pytest.fixture(scope="module")
def degraded_scenes():
    rng = np.random.default_rng(11)
    return [shapes.sample_scene(rng) for _ in range(70)] + [crowded_scene(rng) for _ in range(30)]


def test_blurred_scenes(degraded_scenes):
    """Gaussian blur sigma 1 px (a generated image's soft edges): 97 % of objects, no class swaps
    beyond the odd one (blurred diamonds must not read as circles, nor squares as circles)."""
    rng = np.random.default_rng(0)
    acc, confusion = _confusion(degraded_scenes, [_degrade(shapes.render(s), rng, 1.0) for s in degraded_scenes])
    assert acc >= 0.97, confusion
    assert sum(n for (t, d), n in confusion.items() if d is not None) <= 2, confusion


def test_blurred_noisy_off_palette_scenes(degraded_scenes):
    """Blur 1.5 px, noise sigma 15 per channel and the whole image's colours off by up to 20 per
    channel: 90 % of objects; a wrong class stays rare (squares never become circles)."""
    rng = np.random.default_rng(1)
    images = [_degrade(shapes.render(s), rng, 1.5, 15.0, 20.0) for s in degraded_scenes]
    acc, confusion = _confusion(degraded_scenes, images)
    assert acc >= 0.9, confusion
    assert sum(n for (t, d), n in confusion.items() if d is not None) <= 0.05 * 200, confusion
    assert confusion.get(("square", "circle"), 0) <= 2, confusion


def test_nothing_in_degraded_negatives():
    """Noise, blurred noise, blank and noisy white, flat colours (palette ones too: no shape fills
    the canvas) and smooth random colour fields: no detection scores above 0.3."""
    from PIL import Image

    rng = np.random.default_rng(4)
    images = []
    for _ in range(8):
        noise = rng.integers(0, 256, (64, 64, 3)).astype(np.uint8)
        white = np.full((64, 64, 3), 255, np.uint8)
        flat = np.broadcast_to(rng.integers(0, 256, 3).astype(np.uint8), (64, 64, 3))
        palette = np.broadcast_to(np.array(shapes.PALETTE[shapes.COLOURS[int(rng.integers(5))]], np.uint8), (64, 64, 3))
        field = np.asarray(Image.fromarray(rng.integers(0, 256, (16, 16, 3)).astype(np.uint8)).resize(
            (64, 64), Image.Resampling.BICUBIC))
        images += [noise, _degrade(noise, rng, 1.5), white, _degrade(white, rng, 0.0, 15.0), flat, palette, field]
    assert all(d["score"] <= 0.3 for image in images for d in detect(image))
