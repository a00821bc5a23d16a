"""`tiny-shapes-pickscore`: the testbed's CLIP preference model (tpkit.shapes.preference).

Its captions (one detail wrong, checked false by GenEval's judge), its train/test discipline (no test
prompt is ever read in training), its training command (resumable, refusing another recipe), and the
shipped model's quality on held-out prompts through the real `pickscore` reward path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import cli

from tpkit import layout
from tpkit.models.names import SHAPES_PICKSCORE
from tpkit.shapes import preference
from tpkit.shapes import scenes as shapes


@pytest.mark.parametrize("tag", shapes.TAGS)
def test_one_detail_wrong_changes_exactly_one_thing(tag):
    for meta in shapes.split_prompts(tag)[:12]:
        wrong = preference.one_detail_wrong(meta)
        assert wrong and all(w["tag"] == tag and w["prompt"] != meta["prompt"] for w in wrong)
        p = preference._parts(meta)
        for w in wrong:
            q = preference._parts(w)
            changed = {k for k in p.keys() | q.keys() if p.get(k) != q.get(k)}
            swapped = changed == {"colour", "colour_b"} and (q["colour"], q["colour_b"]) == (p["colour_b"], p["colour"])
            assert len(changed) == 1 or swapped, (meta["prompt"], w["prompt"])
        if tag == "color_attr":
            p = preference._parts(meta)
            swapped = shapes.metadata(tag, p["a"], p["b"], colour=p["colour_b"], colour_b=p["colour"])["prompt"]
            assert swapped in [w["prompt"] for w in wrong]
        if tag == "position":
            p = preference._parts(meta)
            mirrored = shapes.metadata(tag, p["a"], p["b"], relation=preference.OPPOSITE[p["relation"]])["prompt"]
            assert mirrored in [w["prompt"] for w in wrong]


def test_negatives_are_false_for_the_scene_and_training_never_reads_a_test_prompt():
    rng = np.random.default_rng(0)
    test_prompts = {m["prompt"] for tag in shapes.TAGS for m in shapes.split_prompts(tag, "test")}
    for _ in range(3):
        batch = preference.make_batch(rng, preference.Recipe(pairs=6, negatives=6))
        assert batch.pixels.shape == (12, 3, preference.SIZE, preference.SIZE)
        assert float(batch.pixels.min()) >= -1 and float(batch.pixels.max()) <= 1
        read = set(batch.captions) | {c for cs in batch.candidates for c in cs}
        assert not read & test_prompts
        for own, cands in zip(batch.captions, batch.candidates):
            assert cands[0] == own and len(set(cands)) == len(cands) > 1
        # the pair's other caption is among each image's negatives (one detail apart)
        for i in range(0, 12, 2):
            assert batch.captions[i + 1] in batch.candidates[i] and batch.captions[i] in batch.candidates[i + 1]
    meta = shapes.split_prompts("position", "train")[0]
    scene = shapes.scene_for(meta, rng)
    for caption in preference.negatives(meta, scene, rng, 12, split=None):
        m = next(m for tag in shapes.TAGS for m in shapes.split_prompts(tag) if m["prompt"] == caption)
        assert not shapes.satisfied(m, scene.objects)


def test_the_same_step_gets_the_same_batch_wherever_it_is_made():
    r = preference.Recipe(pairs=2, negatives=3)
    a, b = preference.batch_for(r, 7), preference.batch_for(r, 7)
    assert a.captions == b.captions and a.candidates == b.candidates and bool((a.pixels == b.pixels).all())
    assert preference.batch_for(r, 8).captions != a.captions or not bool((preference.batch_for(r, 8).pixels == a.pixels).all())


def test_the_word_tokenizer_tells_relations_apart():
    _, processor = preference.build()
    tok = processor.tokenizer
    left, right = (tok(f"a photo of a circle {r} a square").input_ids for r in ("left of", "right of"))
    assert left != right and len(left) == len(right) == 11  # bos, 9 words, eos: every word one token


def test_pretrain_command_is_resumable_and_loads_in_the_pickscore_reward(tmp_path, capfd):
    from PIL import Image

    from tpkit.rewards.registry import load_rewards, score_images

    out = tmp_path / "reward"
    argv = ["pretrain-shapes-reward", "--out", out, "--steps", "3", "--workers", "0"]
    assert cli(*argv) == 0
    model = out / "model"
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    mask = layout.umask()  # as any file a stage writes: readable by whom the umask lets read
    assert model.stat().st_mode & 0o777 == 0o777 & ~mask
    assert {p.stat().st_mode & 0o777 for p in model.iterdir()} == {0o666 & ~mask}
    state = json.loads((model / "config.json").read_text())
    assert state["vision_config"]["image_size"] == preference.SIZE
    before = (model / "model.safetensors").read_bytes()
    capfd.readouterr()
    assert cli(*argv) == 0 and "already trained" in " ".join(capfd.readouterr().err.split())
    assert (model / "model.safetensors").read_bytes() == before
    assert cli("pretrain-shapes-reward", "--out", out, "--steps", "5", "--workers", "0") == 2  # another recipe
    assert "another recipe" in " ".join(capfd.readouterr().err.split())
    assert cli("pretrain-shapes-reward", "--out", tmp_path / "x", "--steps", "0") == 2
    rewards = load_rewards({"pickscore": 1.0}, {"pickscore": {"model": str(model), "processor": str(model)}})
    image = Image.new("RGB", (64, 64), (255, 255, 255))
    scores = score_images(rewards, [image, image], ["a photo of a circle", "a photo of a square"], [{}, {}])["reward"]
    assert all(np.isfinite(scores)) and scores[0] != scores[1]


shipped = pytest.mark.skipif(not (preference.weights_dir() / "model.safetensors").is_file(),
                             reason="tiny-shapes-pickscore is not in this checkout")


@shipped
def test_the_shipped_model_judges_held_out_prompts():
    """Test-split prompts through the real reward path (fewer scenes than the bench's 200 a task, same
    seed): overall >= 0.88 and every GenEval task >= 0.65, crisp and blurred. The targets are 0.90 and
    0.80; counting and position fall short of 0.80 (docs/testbed.md), so this guards what is reached."""
    from tpkit.rewards.registry import load_rewards, score_images

    rewards = load_rewards({"pickscore": 1.0}, {"pickscore": {"model": SHAPES_PICKSCORE, "processor": SHAPES_PICKSCORE}})

    def score(images, prompts):
        return score_images(rewards, images, prompts, [{}] * len(images))["reward"]

    for blur in (0.0, 1.0):
        acc = preference.pairwise_accuracy(score, "test", per_task=60, blur=blur)
        assert acc["overall"] >= 0.88, (blur, acc)
        assert all(acc[t] >= 0.65 for t in shapes.TAGS), (blur, acc)
