"""tpkit.shapes: scenes of coloured shapes, their GenEval prompts and the train/test split."""

from __future__ import annotations

import numpy as np
import pytest

from tpkit.geneval import judge as geneval
from tpkit.geneval import prompts as gp
from tpkit.shapes import scenes as shapes

from conftest import DATA


def test_vocabulary_is_genevals():
    assert len(shapes.SHAPES) >= 3 and len(shapes.COLOURS) >= 5
    assert set(shapes.COLOURS) <= set(geneval.COLOURS)
    palette = [np.array(shapes.PALETTE[c], float) for c in shapes.COLOURS]
    gaps = [np.linalg.norm(a - b) for i, a in enumerate(palette) for b in palette[i + 1:]]
    assert min(gaps) > 150 and all(np.linalg.norm(p - shapes.BACKGROUND) > 250 for p in palette)


def test_scenes_are_deterministic():
    a = [shapes.sample_scene(np.random.default_rng(7)) for _ in range(3)]
    b = [shapes.sample_scene(np.random.default_rng(7)) for _ in range(3)]
    assert a == b
    assert all(np.array_equal(shapes.render(x), shapes.render(y)) for x, y in zip(a, b))
    rng = np.random.default_rng(8)
    assert shapes.sample_scene(rng) != shapes.sample_scene(rng)


def test_scene_is_exactly_what_its_prompt_says():
    rng = np.random.default_rng(0)
    for task in shapes.TAGS:
        for _ in range(10):
            scene = shapes.sample_scene(rng, task)
            meta = scene.metadata
            assert meta["tag"] == task and meta["prompt"] == scene.prompt
            assert len(scene.objects) == sum(c["count"] for c in meta["include"])
            assert {o.shape for o in scene.objects} == {c["class"] for c in meta["include"]}
            judgement = geneval.judge(meta, shapes.true_detections(scene))
            assert judgement.correct and judgement.score == 1.0, (scene, judgement.reason)
            image = shapes.render(scene)
            assert image.shape == (64, 64, 3) and image.dtype == np.uint8
            colours, counts = np.unique(image.reshape(-1, 3), axis=0, return_counts=True)
            assert tuple(colours[counts.argmax()]) == shapes.BACKGROUND  # plain background


def test_scene_for_metadata_and_render_size():
    meta = shapes.metadata("color_attr", "circle", "square", colour="red", colour_b="blue")
    assert meta["prompt"] == "a photo of a red circle and a blue square"
    scene = shapes.scene_for(meta, np.random.default_rng(1), size=128)
    assert [(o.shape, o.colour) for o in scene.objects] == [("circle", "red"), ("square", "blue")]
    assert shapes.render(scene).shape == (128, 128, 3) and shapes.render(scene, 32).shape == (32, 32, 3)
    assert geneval.judge(meta, shapes.true_detections(scene)).correct
    with pytest.raises(ValueError):
        shapes.scene_for({"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a dog"},
                         np.random.default_rng(0))


def test_prompts_use_genevals_templates():
    assert shapes.metadata("counting", "triangle", count=3)["prompt"] == "a photo of three triangles"
    assert shapes.metadata("counting", "triangle", count=3)["exclude"] == [{"class": "triangle", "count": 4}]
    pos = shapes.metadata("position", "circle", "square", relation="left of")
    assert pos["prompt"] == "a photo of a circle left of a square"
    assert pos["include"] == [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}]
    assert shapes.metadata("colors", "diamond", colour="yellow")["prompt"] == "a photo of a yellow diamond"


def test_splits_are_disjoint_and_cover_every_task():
    train, test = shapes.prompts("train"), shapes.prompts("test")
    assert len(train) == 6 * shapes.DEFAULT_N["train"] and len(test) == 6 * shapes.DEFAULT_N["test"]
    train_keys, test_keys = {gp.prompt_key(m) for m in train}, {gp.prompt_key(m) for m in test}
    assert not train_keys & test_keys
    assert not {m["prompt"] for m in train} & {m["prompt"] for m in test}
    for tag in shapes.TAGS:
        assert any(m["tag"] == tag for m in train) and any(m["tag"] == tag for m in test)
        # every held-out group is listed (n per task is at least the number of groups)
        groups = {gp.prompt_key(m) for m in shapes.split_prompts(tag, "test")}
        assert len(groups) <= shapes.DEFAULT_N["test"] or tag == "color_attr"
    assert all(not shapes.is_test(m) for m in train) and all(shapes.is_test(m) for m in test)
    assert shapes.prompts("test", 5, seed=3) == shapes.prompts("test", 5, seed=3)
    for m in train + test:
        geneval.check_meta(m)


def test_shipped_prompt_files_are_what_the_command_writes(tmp_path):
    import subprocess
    import sys
    data = DATA
    for split in ("train", "test"):
        out = tmp_path / f"{split}.jsonl"
        done = subprocess.run([sys.executable, "-m", "tpkit", "prompts", "shapes", "--split", split, "--out", str(out)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert out.read_bytes() == (data / f"shapes-{split}.jsonl").read_bytes()
    bad = subprocess.run([sys.executable, "-m", "tpkit", "prompts", "shapes", "--split", "val", "--out",
                          str(tmp_path / "x.jsonl")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--split train" in bad.stdout + bad.stderr
