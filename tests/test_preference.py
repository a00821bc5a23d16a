"""`tiny-shapes-pickscore`: the testbed's CLIP preference model (tpkit.shapes.preference).

Its captions (one detail wrong, checked false by GenEval's judge), its train/test discipline (no test
prompt is ever read in training), its training command (resumable, refusing another recipe), and the
shipped model's quality on held-out prompts through the real `pickscore` reward path.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
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


def test_task_weights_set_the_mix_of_scene_pairs():
    """--task-weight position=3 draws position pairs three times as often as each other task's; weight 0
    drops a task; without weights a batch is drawn as the shipped model's were (tasks alike)."""
    tag_of = {m["prompt"]: tag for tag in shapes.TAGS for m in shapes.split_prompts(tag)}
    only = tuple(1.0 if t == "position" else 0.0 for t in shapes.TAGS)
    batch = preference.batch_for(preference.Recipe(pairs=6, negatives=2, task_weights=only), 3)
    assert {tag_of[c] for c in batch.captions} == {"position"}
    weighted = preference.make_batch(np.random.default_rng(0), preference.Recipe(
        pairs=300, negatives=1, blur=0.0, task_weights=tuple(3.0 if t == "position" else 1.0 for t in shapes.TAGS)))
    share = np.mean([tag_of[c] == "position" for c in weighted.captions[::2]])
    assert 0.28 < share < 0.47  # 3 / 8 = 0.375 expected
    # drawn before task weights existed: the shipped model's recipe still gets these very batches
    assert preference.batch_for(preference.Recipe(pairs=3, negatives=2), 5).captions == [
        "a photo of a square above a triangle", "a photo of a square above a circle",
        "a photo of a yellow triangle and a red diamond", "a photo of a yellow square and a red diamond",
        "a photo of a circle", "a photo of a diamond"]
    assert cli("pretrain-shapes-reward", "--out", "unused", "--task-weight", "position=-1") == 2


def test_mirror_pairs_partner_a_position_scene_with_its_mirror_under_the_flipped_relation():
    """--mirror-pairs 1: a position pair is a scene and the same objects reflected across the relation's
    axis, captioned with the opposite relation (each caption true of its own scene only, and first among the
    other's negatives); pairs of other tasks are drawn as before; a share outside [0, 1] is refused."""
    rng, checked = np.random.default_rng(0), 0
    for meta in shapes.split_prompts("position", "train")[:12]:
        pair = preference._mirrored_pair(rng, meta, "train", 2)
        if pair is None:  # the flipped prompt is a test one, or the mirror breaks a scene rule
            continue
        checked += 1
        (sp, sq), (cp, cq), (kp, kq) = pair
        axis = "x" if preference._parts(meta)["relation"] in ("left of", "right of") else "y"
        assert cq == preference.flipped_relation(meta)["prompt"] and kp[:2] == [cp, cq] and kq[:2] == [cq, cp]
        for o, m in zip(sp.objects, sq.objects):
            assert (m.shape, m.colour, m.size) == (o.shape, o.colour, o.size)
            assert (m.x, m.y) == ((shapes.CANVAS - o.x, o.y) if axis == "x" else (o.x, shapes.CANVAS - o.y))
        assert shapes.satisfied(meta, sp.objects) and shapes.satisfied(sq.metadata, sq.objects)
        assert not shapes.satisfied(meta, sq.objects) and not shapes.satisfied(sq.metadata, sp.objects)
    assert checked >= 8
    only = tuple(1.0 if t == "position" else 0.0 for t in shapes.TAGS)
    batch = preference.batch_for(preference.Recipe(pairs=6, negatives=2, task_weights=only, mirror_pairs=1.0), 3)
    flipped = [preference.flipped_relation(_meta_of(c))["prompt"] for c in batch.captions[::2]]
    assert sum(f == c for f, c in zip(flipped, batch.captions[1::2])) >= 4  # unless the flipped prompt is a test one
    assert preference.batch_for(preference.Recipe(pairs=3, negatives=2, mirror_pairs=0.0), 5).captions == \
        preference.batch_for(preference.Recipe(pairs=3, negatives=2), 5).captions
    assert cli("pretrain-shapes-reward", "--out", "unused", "--mirror-pairs", "1.5") == 2


def test_absolute_pairs_caption_one_shape_and_its_mirror_by_where_they_are():
    """--absolute-pairs: a single shape wholly in the half of the canvas its caption names ("on the left", "at the
    top", ...), its mirror wholly in the other half under the other caption; each image's candidates are its own
    caption, the mirror's, the same place with each other shape, then captions false for it, all distinct and never
    the other axis's (a shape on the left may be at the top too). Every word of them is one token of the
    tokenizer built for it."""
    rng, halves = np.random.default_rng(0), shapes.CANVAS / 2
    holds = {"on the left": lambda b: b[2] <= halves, "on the right": lambda b: b[0] >= halves,
             "at the top": lambda b: b[3] <= halves, "at the bottom": lambda b: b[1] >= halves}
    for _ in range(40):
        (scene, mirror), captions, candidates = preference._absolute_pair(rng, "train", 8)
        (box,), (mbox,) = shapes.visible_boxes(scene.objects), shapes.visible_boxes(mirror.objects)
        where, mwhere = (next(w for w in holds if c.endswith(w)) for c in captions)
        assert holds[where](box) and holds[mwhere](mbox) and not holds[mwhere](box) and not holds[where](mbox)
        assert (mirror.objects[0].shape, mirror.objects[0].colour) == (scene.objects[0].shape, scene.objects[0].colour)
        other_axis = {"on the left", "on the right"} if where in ("at the top", "at the bottom") else {"at the top",
                                                                                                        "at the bottom"}
        for i, cands in enumerate(candidates):
            assert cands[:2] == [captions[i], captions[1 - i]] and len(cands) == len(set(cands)) == 9
            assert not any(c.endswith(w) for c in cands for w in other_axis)
            own_place = [c for c in cands[2:] if c.startswith("a photo of a ") and c.endswith((where, mwhere)[i])]
            assert len(own_place) == len(shapes.SHAPES) - 1
    for axis, words in (("x", ("on the left", "on the right")), ("y", ("at the top", "at the bottom"))):
        for _ in range(5):  # an axis given (where_accuracy's) is the axis drawn
            assert all(c.endswith(w) for c, w in zip(preference._absolute_pair(rng, "test", 0, axis)[1], words))
    tok = preference.build(words=preference.WHERE_WORDS)[1].tokenizer
    assert len(tok("a photo of a triangle at the bottom").input_ids) == 10  # bos, 8 words, eos


def test_where_accuracy_needs_a_score_that_sees_where_the_shape_is():
    """where_accuracy: a score that reads the drawing's centre from the pixels gets every axis right; one that
    reads only the caption's words prefers the same one for a scene and its mirror, so gets half."""
    def centre(image) -> tuple[float, float]:
        ys, xs = np.nonzero((np.asarray(image) < 245).any(-1))
        return xs.mean() / shapes.CANVAS, ys.mean() / shapes.CANVAS

    sign = {"on the left": (-1, 0), "on the right": (1, 0), "at the top": (0, -1), "at the bottom": (0, 1)}

    def seeing(images, prompts):
        return [sum(s * (c - 0.5) for s, c in zip(next(v for w, v in sign.items() if p.endswith(w)), centre(im)))
                for im, p in zip(images, prompts)]

    assert preference.where_accuracy(seeing, per_axis=10) == {"x": 1.0, "y": 1.0}
    assert preference.where_accuracy(lambda images, prompts: [len(p) for p in prompts], per_axis=10) == {"x": 0.5,
                                                                                                           "y": 0.5}


def test_relation_start_holds_position_prompts_back_and_absolute_pairs_lead_the_batch():
    """Before --relation-start no pair is of a position prompt, after it they are drawn again; the first
    --absolute-pairs pairs of a batch are absolute ones; the defaults draw the shipped recipe's batches;
    more absolute pairs than the batch holds is refused."""
    only = tuple(1.0 if t in ("position", "colors") else 0.0 for t in shapes.TAGS)
    r = preference.Recipe(pairs=8, negatives=2, sample_pairs=0, task_weights=only, absolute_pairs=2, relation_start=10)
    early, late = preference.batch_for(r, 9), preference.batch_for(r, 10)
    where = tuple(w for ws in preference.WHERE.values() for w in ws)
    assert all(c.endswith(where) for c in early.captions[:4] + late.captions[:4])
    assert all(_meta_of(c)["tag"] == "colors" for c in early.captions[4:])
    assert sum(_meta_of(c)["tag"] == "position" for c in late.captions[4:]) >= 2
    assert preference.batch_for(preference.Recipe(pairs=3, negatives=2, absolute_pairs=0, relation_start=0), 5).captions \
        == preference.batch_for(preference.Recipe(pairs=3, negatives=2), 5).captions
    assert cli("pretrain-shapes-reward", "--out", "unused", "--absolute-pairs", "40") == 2
    assert cli("pretrain-shapes-reward", "--out", "unused", "--relation-start", "-1") == 2


def test_another_seed_draws_other_batches_and_another_initialisation():
    """--seed: a rerun of the same recipe on other random draws (what a probe's difference is measured against)."""
    base, other = preference.Recipe(pairs=3, negatives=2), preference.Recipe(pairs=3, negatives=2, seed=1)
    assert preference.batch_for(base, 5).captions != preference.batch_for(other, 5).captions
    w0, w1 = (preference.build(seed=s)[0].text_projection.weight for s in (0, 1))
    assert not torch.equal(w0, w1)
    assert cli("pretrain-shapes-reward", "--out", "unused", "--seed", "-1") == 2


def _meta_of(prompt: str) -> dict:
    return next(m for tag in shapes.TAGS for m in shapes.split_prompts(tag) if m["prompt"] == prompt)


def test_the_word_tokenizer_tells_relations_apart():
    _, processor = preference.build()
    tok = processor.tokenizer
    left, right = (tok(f"a photo of a circle {r} a square").input_ids for r in ("left of", "right of"))
    assert left != right and len(left) == len(right) == 11  # bos, 9 words, eos: every word one token


def test_pretrain_command_is_resumable_and_loads_in_the_pickscore_reward(tmp_path, capfd):
    from PIL import Image

    from tpkit.rewards.registry import load_rewards, score_images

    out = tmp_path / "reward"
    argv = ["pretrain-shapes-reward", "--out", out, "--steps", "3", "--workers", "0", "--sample-pairs", "0"]
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
    assert cli("pretrain-shapes-reward", "--out", out, "--steps", "5", "--workers", "0", "--sample-pairs", "0") == 2  # another recipe
    assert "another recipe" in " ".join(capfd.readouterr().err.split())
    assert cli("pretrain-shapes-reward", "--out", tmp_path / "x", "--steps", "0") == 2
    rewards = load_rewards({"pickscore": 1.0}, {"pickscore": {"model": str(model), "processor": str(model)}})
    image = Image.new("RGB", (64, 64), (255, 255, 255))
    scores = score_images(rewards, [image, image], ["a photo of a circle", "a photo of a square"], [{}, {}])["reward"]
    assert all(np.isfinite(scores)) and scores[0] != scores[1]


def test_width_makes_a_wider_model_of_heads_of_32_and_the_history_keeps_the_minutes(tmp_path, capfd):
    """`--width` sets both towers' hidden size in heads of HEAD_DIM; a run of another width, patch or bank is refused on
    resume, and a width that is no multiple of a head or a patch that does not tile the image is refused before any
    work. The history times its entries."""
    out = tmp_path / "wide"
    argv = ["pretrain-shapes-reward", "--out", out, "--steps", "50", "--workers", "0", "--sample-pairs", "0"]
    assert cli(*argv, "--width", "64") == 0
    config = json.loads((out / "model" / "config.json").read_text())
    for tower in ("text_config", "vision_config"):
        assert (config[tower]["hidden_size"], config[tower]["num_attention_heads"]) == (64, 2)
    state = torch.load(out / "state.pt", weights_only=False)
    assert [h["step"] for h in state["history"]] == [50]
    assert 0 < state["history"][0]["minutes"] <= round(state["minutes"], 2)  # the history's are rounded to 2 places
    capfd.readouterr()
    assert cli(*argv) == 2 and "width 64 (now 128)" in " ".join(capfd.readouterr().err.split())
    for option, refusal in ((["--patch", "4"], "patch 8 (now 4)"), (["--bank", "branches"], "bank samples (now branches)")):
        assert cli(*argv, "--width", "64", *option) == 2 and refusal in " ".join(capfd.readouterr().err.split())
    assert cli(*argv, "--width", "64", "--patch", "5") == 2 and "--patch 5 must divide" in capfd.readouterr().err
    assert cli(*argv, "--width", "48") == 2 and "multiple of 32" in capfd.readouterr().err
    with pytest.raises(preference.InputError, match=r"heads=6\)"):  # a Python caller's own heads
        preference.Recipe(arch=preference.Arch(width=192, heads=4)).validate()
    for arch in (preference.Arch(width=True), preference.Arch(patch=True)):  # a bool is an int to Python, not here
        with pytest.raises(preference.InputError, match="True must"):
            preference.Recipe(arch=arch).validate()
    assert not (tmp_path / "x").exists() and cli("pretrain-shapes-reward", "--out", tmp_path / "x", "--width", "0") == 2
    assert not (tmp_path / "x").exists()


def test_the_sample_bank_ranks_the_generators_own_samples_of_train_prompts(tmp_path):
    """The bank holds tiny-shapes samples judged by GenEval's judge (re-judging a stored image gives its
    score); a test prompt is refused; each ranked pair is two samples of one prompt, the better first;
    training draws the bank once and a rerun with other bank settings is refused."""
    from PIL import Image

    from tpkit.errors import InputError
    from tpkit.geneval import detectors

    r = preference.Recipe(pairs=2, negatives=2, sample_pairs=4, samples_per_prompt=3, sample_steps=4, rank_start=0)
    metas = [shapes.split_prompts(t, "train")[0] for t in ("two_object", "counting", "color_attr", "position")]
    path = preference.sample_bank(tmp_path / preference.BANK, r, metas, progress=False)
    bank = preference._bank(str(path))
    assert bank["images"].shape == (12, preference.SIZE, preference.SIZE, 3) and bank["images"].dtype == np.uint8
    assert list(bank["prompts"]) == [m["prompt"] for m in metas for _ in range(3)]
    detector, colours = detectors.load_models("shapes")
    again = detectors.detect_and_judge([Image.fromarray(a) for a in bank["images"]], [m for m in metas for _ in range(3)],
                                       detector, colours)
    assert [j.score for j in again] == list(bank["dense"]) and [j.correct for j in again] == list(bank["correct"])
    with pytest.raises(ValueError, match="test-split"):
        preference.sample_bank(tmp_path / "x.npz", r, [shapes.split_prompts("counting", "test")[0]], progress=False)
    if bank["groups"]:  # 3 samples of 4 prompts: some prompt's samples differ (the generator is not that good)
        batch = preference.batch_for(r, 0, str(path))
        assert batch.ranked.shape == (8, 3, preference.SIZE, preference.SIZE)
        images = ((batch.ranked.permute(0, 2, 3, 1) * 0.5 + 0.5) * 255).round().to(torch.uint8).numpy()
        where = [int(np.flatnonzero((bank["images"] == im).all(axis=(1, 2, 3)))[0]) for im in images]
        for k, caption in enumerate(batch.ranked_captions):
            better, worse = where[2 * k], where[2 * k + 1]
            assert bank["prompts"][better] == bank["prompts"][worse] == caption
            assert bank["dense"][better] > bank["dense"][worse]
        value, info = preference.loss(*(lambda m, p: (m, p.tokenizer))(*preference.build()), batch)
        assert torch.isfinite(value) and 0 <= info["rank_acc"] <= 1
        assert preference.batch_for(dataclasses.replace(r, rank_start=1), 0, str(path)).ranked is None  # not yet

    # through train(): the bank is drawn once (all 223 train prompts: one ODE step keeps it quick)
    small = preference.Recipe(steps=2, pairs=2, negatives=2, warmup=1, sample_pairs=2, samples_per_prompt=2, sample_steps=1,
                              rank_start=1)
    preference.train(tmp_path / "run", small, progress=False, workers=0)
    drawn = (tmp_path / "run" / preference.BANK).stat().st_mtime_ns
    assert preference.bank_settings(tmp_path / "run" / preference.BANK) == preference._bank_settings(small)
    (tmp_path / "run" / "state.pt").unlink()  # a new recipe over an old bank: refused, the bank kept
    with pytest.raises(InputError, match="another recipe"):
        preference.train(tmp_path / "run", dataclasses.replace(small, samples_per_prompt=3), progress=False, workers=0)
    assert (tmp_path / "run" / preference.BANK).stat().st_mtime_ns == drawn


def test_a_branches_bank_ranks_the_completions_along_one_sde_trajectory(tmp_path):
    """--bank branches: each trajectory gives the ODE completion of every state s_0..s_{T-1}, the first being the
    plain ODE sample of its noise; every image is judged as stored; a ranked pair is two states of one trajectory,
    the better first; the bank's settings name it, so a samples recipe over a branches bank is refused."""
    from PIL import Image

    from tpkit import models
    from tpkit.errors import InputError
    from tpkit.geneval import detectors
    from tpkit.models.names import SHAPES_MODEL
    from tpkit.shapes import model as shapes_model

    m = models.load(SHAPES_MODEL, device="cpu")
    emb = m.encode(["a photo of a red circle", "a photo of two squares"], shapes_model.TEXT_LENGTH)
    x = torch.randn(2, *m.latent_shape(shapes_model.RESOLUTION), generator=torch.Generator().manual_seed(0))
    along = shapes_model.branch_images(m, emb, x, 3, shapes_model.GUIDANCE, "cps", 0.7, torch.Generator().manual_seed(1))
    assert along.shape == (2, 3, preference.SIZE, preference.SIZE, 3) and along.dtype == np.uint8
    assert np.array_equal(along[:, 0], shapes_model.ode_images(m, emb, x, 3, shapes_model.GUIDANCE))
    assert not np.array_equal(along[:, 0], along[:, 2])  # the noise moved the last states' completions

    r = preference.Recipe(pairs=2, negatives=2, sample_pairs=4, samples_per_prompt=2, sample_steps=3, rank_start=0,
                          bank="branches")
    metas = [shapes.split_prompts(t, "train")[0] for t in ("two_object", "counting", "color_attr", "position")]
    path = preference.sample_bank(tmp_path / preference.BANK, r, metas, progress=False)
    bank = preference._bank(str(path))
    assert bank["images"].shape == (24, preference.SIZE, preference.SIZE, 3)
    assert list(bank["prompts"]) == [m["prompt"] for m in metas for _ in range(6)]
    assert list(bank["trajectory"]) == [t for t in range(8) for _ in range(3)] and list(bank["step"]) == [0, 1, 2] * 8
    detector, colours = detectors.load_models("shapes")
    again = detectors.detect_and_judge([Image.fromarray(a) for a in bank["images"]], [m for m in metas for _ in range(6)],
                                       detector, colours)
    assert [j.score for j in again] == list(bank["dense"])
    for groups in bank["groups"].values():
        for idx in groups:
            assert len(set(bank["trajectory"][idx])) == 1 and len(idx) == 3
    assert bank["groups"]  # (seeded: some trajectories' completions differ)
    batch = preference.batch_for(r, 0, str(path))
    images = ((batch.ranked.permute(0, 2, 3, 1) * 0.5 + 0.5) * 255).round().to(torch.uint8).numpy()
    where = [np.flatnonzero((bank["images"] == im).all(axis=(1, 2, 3))) for im in images]  # (empty canvases repeat)
    for k in range(len(batch.ranked_captions)):
        assert any(bank["trajectory"][b] == bank["trajectory"][w] and bank["dense"][b] > bank["dense"][w]
                   for b in where[2 * k] for w in where[2 * k + 1])
    assert "bank=branches" in preference.bank_settings(path)
    assert preference.bank_settings(path) != preference._bank_settings(dataclasses.replace(r, bank="samples"))
    with pytest.raises(InputError, match="--bank"):
        dataclasses.replace(r, bank="sde").validate()
    with pytest.raises(InputError, match="--sample-steps 1"):
        dataclasses.replace(r, sample_steps=1).validate()


def test_pixel_shifts_move_a_drawing_by_whole_pixels_and_never_off_the_canvas():
    """shift_consistency's moves: never (0, 0) where there is room, at most `most` px each way, several drawn,
    never across an edge the drawing touches (a roll would wrap it round to the other side); none for an empty
    canvas."""
    a = np.full((preference.SIZE, preference.SIZE, 3), 255, np.uint8)
    a[54:, :10] = (20, 60, 220)  # a block in the bottom-left corner: it can only go up and right
    a[20:30, 30:40] = (220, 20, 20)
    blank = np.full_like(a, 255)
    moves = preference.pixel_shifts(np.stack([a] * 40 + [blank]), np.random.default_rng(0), 3)
    assert all(-3 <= dy <= 0 <= dx <= 3 and (dy, dx) != (0, 0) for dy, dx in moves[:40]), moves
    assert len({tuple(m) for m in moves[:40]}) >= 6 and tuple(moves[40]) == (0, 0)
    rolled = np.roll(a, tuple(moves[0]), (0, 1))
    assert (rolled < 245).any(-1).sum() == (a < 245).any(-1).sum() and not (rolled[:, :1] < 245).any()


def test_shift_consistency_moves_the_first_renders_and_holds_their_reward(tmp_path):
    """With shift_consistency the batch holds its first CONSISTENT_IMAGES augmented renders again, each moved by
    whole pixels; the loss adds the squared reward gap of their own captions (zero only for a model that does not
    see the move). Without it the batch is the shipped recipe's."""
    from tpkit.errors import InputError

    r = preference.Recipe(pairs=10, negatives=2, sample_pairs=0)
    plain = preference.batch_for(r, 0)
    batch = preference.batch_for(dataclasses.replace(r, shift_consistency=1.0), 0)
    assert plain.moved is None and torch.equal(plain.pixels, batch.pixels) and plain.candidates == batch.candidates
    k = preference.CONSISTENT_IMAGES
    assert batch.moved.shape == (k, 3, preference.SIZE, preference.SIZE)
    most = preference.SHIFT_MOST
    for i in range(k):
        rolls = [(dy, dx) for dy in range(-most, most + 1) for dx in range(-most, most + 1)
                 if torch.equal(torch.roll(batch.pixels[i], (dy, dx), (1, 2)), batch.moved[i])]
        assert rolls and (0, 0) not in rolls, i
    model, processor = preference.build()
    base, _ = preference.loss(model, processor.tokenizer, batch)
    value, info = preference.loss(model, processor.tokenizer, batch, shift_weight=2.0)
    # the term is 2 * mean(gap^2), at least 2 * mean(|gap|)^2
    assert info["shift_gap"] > 0 and (value - base).item() >= 2.0 * info["shift_gap"] ** 2 * (1 - 1e-4)
    with pytest.raises(InputError, match="shift_consistency"):
        preference.Recipe(shift_consistency=-1.0).validate()
    preference.train(tmp_path, dataclasses.replace(r, steps=1, warmup=1, shift_consistency=1.0), progress=False, workers=0)
    assert torch.load(tmp_path / "state.pt", weights_only=False)["history"] == [] and (tmp_path / "model").is_dir()


@pytest.mark.parametrize("tag", shapes.TAGS)
def test_graded_pairs_are_near_misses_of_their_prompt_the_better_first(tag):
    """Each pair's scenes keep the layout rules, at most MAX_OBJECTS objects, and their dense scores for the
    prompt (perfect detections) differ, the higher first; over a few pairs the grades take several values."""
    rng = np.random.default_rng(0)
    grades = set()
    for meta in shapes.split_prompts(tag, "train")[:8]:
        for _ in range(4):
            better, worse = preference._graded_pair(rng, meta)
            high, low = (shapes.truth_score(meta, s.objects) for s in (better, worse))
            assert high > low, meta["prompt"]
            assert all(len(s.objects) <= shapes.MAX_OBJECTS and shapes.valid_layout(s.objects) for s in (better, worse))
            grades |= {high, low}
    assert len(grades) >= 3, grades


def test_blob_pairs_are_ordered_by_what_the_detector_sees():
    """Detector-graded pairs: re-detecting and re-judging the two returned images gives the first the higher
    dense score; blobs keep the image's shape and saturate like the generator's decoder."""
    from PIL import Image

    from tpkit.geneval import detectors

    rng = np.random.default_rng(0)
    detector, colours = detectors.load_models("shapes")
    for tag in shapes.TAGS:
        meta = shapes.split_prompts(tag, "train")[0]
        images = preference._blob_pair(rng, meta)
        assert all(a.shape == (preference.SIZE, preference.SIZE, 3) and a.dtype == np.uint8 for a in images)
        high, low = (j.score for j in detectors.detect_and_judge([Image.fromarray(a) for a in images], [meta, meta],
                                                                  detector, colours))
        assert high > low, meta["prompt"]
    scene = shapes.scene_for(shapes.split_prompts("two_object", "train")[0], rng)
    blob = preference.blobs(shapes.render(scene, preference.SIZE), np.random.default_rng(3))
    assert np.isin(blob, (0, 255)).mean() > 0.5


def test_the_flipped_relation_column_needs_a_judge_that_sees_where_things_are():
    """pairwise_accuracy's "relation": the shapes detector and GenEval's judge as the score get the position
    scenes' relation right; the same judge on every image turned by 180 degrees (left <-> right, above <->
    below, the shapes unchanged) gets it wrong, while the tasks without a relation stay where they were."""
    from tpkit.geneval import detectors

    detector, colours = detectors.load_models("shapes")
    meta = {m["prompt"]: m for tag in shapes.TAGS for m in shapes.split_prompts(tag)}

    def judged(turn: bool):
        def score(images, prompts):
            metas = [meta[p] for p in prompts]
            images = [im.rotate(180) for im in images] if turn else images
            return [j.score for j in detectors.detect_and_judge(images, metas, detector, colours)]
        return score

    seeing, turned = (preference.pairwise_accuracy(judged(turn), "test", per_task=16) for turn in (False, True))
    assert seeing["relation"] >= 0.9 and turned["relation"] <= 0.1, (seeing, turned)
    assert seeing["relation_flipped_train"] >= 0.9 and seeing["relation_flipped_test"] >= 0.9, seeing
    assert all(turned[t] == seeing[t] for t in ("single_object", "counting", "colors")), (seeing, turned)

    # a memoriser: it knows whether a caption it trained on is true and nothing of the others (all alike), so it
    # tells a test scene from its mirror only where the mirror's caption is a train prompt
    train = {m["prompt"] for m in preference.train_prompts()}

    def memoriser(images, prompts):
        judged = detectors.detect_and_judge(images, [meta[p] for p in prompts], detector, colours)
        return [float(j.correct) if p in train else 0.5 for j, p in zip(judged, prompts)]
    memorised = preference.pairwise_accuracy(memoriser, "test", per_task=16)
    assert memorised["relation_flipped_train"] == 1.0 and memorised["relation_flipped_test"] == 0.0, memorised


def test_layout_targets_say_where_each_shape_is_and_the_head_is_not_saved(tmp_path, capfd):
    """layout_targets: presence and mean centre in [-1, 1] per shape class, mirrored with the scene. With
    --layout-aux the head trains beside the model and resumes from state.pt, and the saved model is the
    same plain CLIPModel as without it; another weight is another recipe."""
    from transformers import CLIPModel

    meta = shapes.metadata("position", "circle", "square", relation="left of")
    scene = shapes.Scene([shapes.Obj("square", "red", 48, 32, 10), shapes.Obj("circle", "blue", 16, 8, 10),
                          shapes.Obj("circle", "blue", 16, 24, 10)], meta["prompt"], meta)
    mirror = shapes.mirrored(scene, meta, "x")
    t = preference.layout_targets([scene, mirror])
    k = {s: shapes.SHAPES.index(s) for s in ("circle", "square", "triangle")}
    assert t[0, k["circle"]].tolist() == [1.0, -0.5, -0.5] and t[0, k["square"]].tolist() == [1.0, 0.5, 0.0]
    assert t[0, k["triangle"]].tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(t[1, :, 1], -t[0, :, 1]) and torch.equal(t[1, :, 2], t[0, :, 2])

    argv = ["pretrain-shapes-reward", "--out", tmp_path, "--steps", "2", "--workers", "0", "--sample-pairs", "0"]
    assert cli(*argv, "--layout-aux", "1") == 0
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    assert state["step"] == 2 and state["recipe"]["layout_aux"] == 1.0
    assert state["layout_head"]["1.weight"].shape == (3 * len(shapes.SHAPES), preference.Arch().projection)
    saved = CLIPModel.from_pretrained(tmp_path / "model")
    assert set(saved.state_dict()) == set(preference.build()[0].state_dict())
    capfd.readouterr()
    assert cli(*argv, "--layout-aux", "0.5") == 2 and "layout_aux 1.0 (now 0.5)" in " ".join(capfd.readouterr().err.split())
    assert cli(*argv, "--layout-aux", "-1") == 2

    # a state whose head had another shape (before it read the standardised embedding: a bare Linear), or a
    # file that is no state at all: refused by name, the file kept as it was
    old = {k.removeprefix("1."): v for k, v in state["layout_head"].items()}
    torch.save({**state, "layout_head": old}, tmp_path / "state.pt")
    capfd.readouterr()
    assert cli(*argv, "--layout-aux", "1") == 2
    err = " ".join(capfd.readouterr().err.split())
    assert "state.pt cannot be resumed: written by another version" in err and "Traceback" not in err, err
    assert set(torch.load(tmp_path / "state.pt", weights_only=False)["layout_head"]) == set(old)
    (tmp_path / "state.pt").write_bytes(b"not a checkpoint")
    assert cli(*argv, "--layout-aux", "1") == 2 and "not a training state" in " ".join(capfd.readouterr().err.split())


def test_truth_score_is_the_dense_score_of_what_a_scene_holds():
    rng = np.random.default_rng(1)
    meta = shapes.metadata("color_attr", "circle", "square", colour="red", colour_b="blue")
    scene = shapes.scene_for(meta, rng)
    assert shapes.truth_score(meta, scene.objects) == 1.0
    assert shapes.truth_score(meta, scene.objects[:1]) == 0.5  # one object missing: (1 + 1 + 0 + 0) / 4
    recoloured = [dataclasses.replace(o, colour="green" if o.colour == "blue" else o.colour) for o in scene.objects]
    assert shapes.truth_score(meta, recoloured) == 0.75  # the square's colour wrong
    assert shapes.truth_score(meta, []) == 0.0  # the empty canvas
    assert [o.shape for o in shapes.edited_scene(meta, rng, 0).objects] == [o.shape for o in scene.objects]


def test_graded_pairs_join_the_ranking_term_and_old_runs_still_resume(tmp_path):
    """With graded_pairs (no sample bank) each batch from rank_start holds them as ranked pairs of train
    prompts; a run saved before the option existed resumes (the option takes its default), another value
    of it is another recipe."""
    from tpkit.errors import InputError

    r = preference.Recipe(steps=1, pairs=2, negatives=2, warmup=1, sample_pairs=0, graded_pairs=3, rank_start=0)
    train = {m["prompt"] for m in preference.train_prompts()}
    for by in preference.GRADED_BY:
        batch = preference.batch_for(dataclasses.replace(r, graded_by=by), 0)
        assert batch.ranked.shape == (6, 3, preference.SIZE, preference.SIZE) and len(batch.ranked_captions) == 3
        assert set(batch.ranked_captions) <= train
    with pytest.raises(InputError, match="--graded-by"):
        dataclasses.replace(r, graded_by="eye").validate()
    assert preference.batch_for(dataclasses.replace(r, rank_start=1), 0).ranked is None
    value, info = preference.loss(*(lambda m, p: (m, p.tokenizer))(*preference.build()), batch)
    assert torch.isfinite(value) and "rank_acc" in info

    plain = dataclasses.replace(r, graded_pairs=0)
    preference.train(tmp_path, plain, progress=False, workers=0)
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    del state["recipe"]["graded_pairs"]  # as saved before the option existed
    torch.save(state, tmp_path / "state.pt")
    assert preference.train(tmp_path, plain, progress=False, workers=0) == tmp_path / "model"  # already trained
    with pytest.raises(InputError, match=r"another recipe: graded_pairs 0 \(now 3\)"):
        preference.train(tmp_path, r, progress=False, workers=0)


def test_caption_pairs_rank_a_samples_captions_by_what_the_detector_sees(tmp_path, monkeypatch):
    """Each bank sample's caption pairs put the caption the detector's verdict on it scores higher first: a
    scene of its own prompt above every one-detail-wrong caption, a scene of a wrong prompt filed under the
    right one (a sample that drew the wrong thing) with that wrong caption above its own. The verdicts are
    detected once and kept beside the bank, for that bank's pixels only."""
    from tpkit.errors import InputError
    from tpkit.geneval import detectors

    rng = np.random.default_rng(0)
    meta = shapes.split_prompts("two_object", "train")[0]
    wrong = next(m for m in preference.one_detail_wrong(meta) if preference._in_split(m, "train"))
    path = tmp_path / preference.BANK
    np.savez(path, images=np.stack([shapes.render(shapes.scene_for(m, rng), preference.SIZE) for m in (meta, wrong)]),
             prompts=np.array([meta["prompt"]] * 2), dense=np.array([1.0, 0.5]), correct=np.array([True, False]),
             settings=np.array("test"))
    entries = preference._caption_verdicts(str(path))["two_object"]
    own = [(better, worse) for i, better, worse in entries if i == 0]
    assert own and all(better == meta["prompt"] for better, _ in own)
    assert (1, wrong["prompt"], meta["prompt"]) in entries
    verdicts = preference._caption_verdicts(str(path))
    preference._caption_verdicts.cache_clear()  # another process: it reads them, the detector unused
    with monkeypatch.context() as m:
        m.setattr(detectors, "load_models", lambda *a, **k: pytest.fail("the bank was detected again"))
        assert preference._caption_verdicts(str(path)) == verdicts
    swapped = dict(np.load(path))  # another bank at the same path (the samples swapped): detected afresh
    np.savez(path, **{**swapped, "images": swapped["images"][::-1]})
    preference._bank.cache_clear()
    preference._caption_verdicts.cache_clear()
    assert (0, wrong["prompt"], meta["prompt"]) in preference._caption_verdicts(str(path))["two_object"]
    np.savez(path, **swapped)
    preference._bank.cache_clear()
    preference._caption_verdicts.cache_clear()

    r = preference.Recipe(pairs=2, negatives=2, sample_pairs=0, caption_pairs=3, rank_start=0)
    batch = preference.batch_for(r, 0, str(path))
    assert batch.captioned.shape == (3, 3, preference.SIZE, preference.SIZE) and batch.ranked is None
    images = ((batch.captioned.permute(0, 2, 3, 1) * 0.5 + 0.5) * 255).round().to(torch.uint8).numpy()
    bank = preference._bank(str(path))
    where = [int(np.flatnonzero((bank["images"] == im).all(axis=(1, 2, 3)))[0]) for im in images]
    assert all((i, *pair) in entries for i, pair in zip(where, batch.caption_pairs))
    value, info = preference.loss(*(lambda m, p: (m, p.tokenizer))(*preference.build()), batch)
    assert torch.isfinite(value) and 0 <= info["caption_rank_acc"] <= 1 and "rank_acc" not in info
    assert preference.batch_for(dataclasses.replace(r, rank_start=1), 0, str(path)).captioned is None  # not yet
    with pytest.raises(InputError, match="--caption-pairs"):
        dataclasses.replace(r, caption_pairs=-1).validate()


def test_detector_aux_regresses_what_the_detector_finds_in_bank_samples(tmp_path, monkeypatch, capfd):
    """detected_counts counts a crisp scene's objects by colour and class as they are drawn. With --detector-aux
    each batch from rank_start holds bank samples and the counts the detector found in them (detected once and
    kept beside the bank), the head trains beside the model, resumes from state.pt and is not saved with it; another
    weight is another recipe."""
    from transformers import CLIPModel

    from tpkit.geneval import detectors

    rng = np.random.default_rng(0)
    metas = [shapes.split_prompts(t, "train")[0] for t in ("counting", "color_attr")]
    scenes_ = [shapes.scene_for(m, rng) for m in metas]
    images = np.stack([shapes.render(s, preference.SIZE) for s in scenes_])
    path = tmp_path / "bank" / preference.BANK
    path.parent.mkdir()
    np.savez(path, images=images, prompts=np.array([m["prompt"] for m in metas]), dense=np.array([1.0, 1.0]),
             correct=np.array([True, True]), settings=np.array("test"))
    counts = preference._bank_counts(str(path))
    for scene, row in zip(scenes_, counts):
        drawn = np.zeros(len(preference.DETECTED))
        for o in scene.objects:
            drawn[preference.DETECTED.index((o.colour, o.shape))] += 1
        assert row.tolist() == drawn.tolist(), (scene, row)
    preference._bank_counts.cache_clear()  # another process: it reads them, the detector unused
    with monkeypatch.context() as m:
        m.setattr(detectors, "load_models", lambda *a, **k: pytest.fail("the bank was detected again"))
        assert np.array_equal(preference._bank_counts(str(path)), counts)

    r = preference.Recipe(pairs=2, negatives=2, sample_pairs=0, detector_aux=1.0, rank_start=0)
    batch = preference.batch_for(r, 0, str(path))
    assert batch.detected.shape == (preference.DETECTED_IMAGES, 3, preference.SIZE, preference.SIZE)
    pixels = ((batch.detected.permute(0, 2, 3, 1) * 0.5 + 0.5) * 255).round().to(torch.uint8).numpy()
    where = [int(np.flatnonzero((images == im).all(axis=(1, 2, 3)))[0]) for im in pixels]
    assert torch.equal(batch.counts, torch.from_numpy(counts[where]))
    model, processor = preference.build()
    head = preference.detector_head(preference.Arch())
    value, info = preference.loss(model, processor.tokenizer, batch, counts_head=head, detector_weight=1.0)
    assert torch.isfinite(value) and info["detector_loss"] > 0
    assert preference.batch_for(dataclasses.replace(r, detector_aux=0.0), 0, str(path)).detected is None
    assert preference.batch_for(dataclasses.replace(r, rank_start=1), 0, str(path)).detected is None  # not yet

    out = tmp_path / "run"
    out.mkdir()
    np.savez(out / preference.BANK, **dict(np.load(path)))
    monkeypatch.setattr(preference, "bank_settings", lambda p: preference._bank_settings(preference.Recipe()))
    argv = ["pretrain-shapes-reward", "--out", out, "--steps", "2", "--workers", "0", "--sample-pairs", "0"]
    assert cli(*argv, "--detector-aux", "1") == 0
    state = torch.load(out / "state.pt", weights_only=False)
    assert state["step"] == 2 and state["recipe"]["detector_aux"] == 1.0
    assert state["detector_head"]["1.weight"].shape == (len(preference.DETECTED), preference.Arch().projection)
    assert set(CLIPModel.from_pretrained(out / "model").state_dict()) == set(model.state_dict())
    assert (out / preference.COUNTS).is_file()
    capfd.readouterr()
    assert cli(*argv, "--detector-aux", "0.5") == 2
    assert "detector_aux 1.0 (now 0.5)" in " ".join(capfd.readouterr().err.split())
    assert cli(*argv, "--detector-aux", "-1") == 2 and "detector_aux = -1.0" in " ".join(capfd.readouterr().err.split())
    # the head learns from rank_start (here the first step), and not before it (rank_start 5: as initialised)
    heads = {}
    for start in (0, 5):
        run = tmp_path / f"start{start}"
        run.mkdir()
        np.savez(run / preference.BANK, **dict(np.load(path)))
        r = preference.Recipe(steps=2, sample_pairs=0, detector_aux=1.0, rank_start=start)
        preference.train(run, r, progress=False, workers=0)
        heads[start] = torch.load(run / "state.pt", weights_only=False)["detector_head"]["1.weight"]
    preference.build()  # (the heads are built right after the model, from the same random state)
    untrained = preference.detector_head(preference.Arch()).state_dict()["1.weight"]
    assert torch.equal(heads[5], untrained) and not torch.equal(heads[0], untrained)


def test_a_bank_with_nothing_to_rank_is_refused_not_skipped(tmp_path):
    """Blank samples of one prompt, all scored alike: neither ranking term has a pair, so asking for one is an
    error naming the option (silently dropping the term would train a different model than asked). The
    error keeps its fix line when it crosses back from a batch-making process."""
    import pickle

    from tpkit.errors import InputError

    meta = shapes.split_prompts("two_object", "train")[0]
    path = tmp_path / preference.BANK
    np.savez(path, images=np.full((2, preference.SIZE, preference.SIZE, 3), 255, np.uint8),
             prompts=np.array([meta["prompt"]] * 2), dense=np.array([0.0, 0.0]), correct=np.array([False, False]),
             settings=np.array("test"))
    r = preference.Recipe(pairs=2, negatives=2, sample_pairs=2, caption_pairs=0, rank_start=0)
    with pytest.raises(InputError, match="--sample-pairs has nothing to rank"):
        preference.batch_for(r, 0, str(path))
    with pytest.raises(InputError, match="--caption-pairs has nothing to rank"):
        preference.batch_for(dataclasses.replace(r, sample_pairs=0, caption_pairs=2), 0, str(path))
    assert preference.batch_for(dataclasses.replace(r, sample_pairs=0), 0, str(path)).ranked is None
    crossed = pickle.loads(pickle.dumps(InputError("a bank", "a fix")))
    assert type(crossed) is InputError and str(crossed) == "a bank\n  fix: a fix"


shipped = pytest.mark.skipif(not (preference.weights_dir() / "model.safetensors").is_file(),
                             reason="tiny-shapes-pickscore is not in this checkout")


@shipped
def test_the_shipped_model_judges_held_out_prompts():
    """Test-split prompts through the real reward path (fewer scenes than the bench's 200 a task, same
    seed): overall >= 0.88 and every GenEval task >= 0.65, crisp and blurred. The targets are 0.90 and
    0.80; position falls short of 0.80 (docs/testbed.md), so this guards what is reached."""
    from tpkit.rewards.registry import load_rewards, score_images

    rewards = load_rewards({"pickscore": 1.0}, {"pickscore": {"model": SHAPES_PICKSCORE, "processor": SHAPES_PICKSCORE}})

    def score(images, prompts):
        return score_images(rewards, images, prompts, [{}] * len(images))["reward"]

    for blur in (0.0, 1.0):
        acc = preference.pairwise_accuracy(score, "test", per_task=60, blur=blur)
        assert acc["overall"] >= 0.88, (blur, acc)
        assert all(acc[t] >= 0.65 for t in shapes.TAGS), (blur, acc)
