"""tpkit.geneval.prompts: GenEval's prompt procedure, redone without NumPy; train/test sets."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tpkit.errors import ConfigError
from tpkit.geneval import prompts as gp

from conftest import OFFICIAL_GENEVAL

OFFICIAL = OFFICIAL_GENEVAL


@pytest.fixture(scope="module")
def test_set():
    return gp.official_like_test_set()


@pytest.fixture(scope="module")
def train():
    return gp.train_set(seed=0, n_per_tag=300)


def test_vocabulary():
    assert len(gp.CLASSES) == 80 and len(set(gp.CLASSES)) == 80
    for name in ("computer mouse", "tv remote", "computer keyboard", "tv", "hair drier", "cell phone",
                 "motorcycle", "airplane", "couch", "dining table", "potted plant"):
        assert name in gp.CLASSES
    for coco_name in ("mouse", "remote", "keyboard", "motorbike", "sofa", "diningtable"):
        assert coco_name not in gp.CLASSES
    assert gp.CLASSES[0] == "person" and gp.CLASSES[-1] == "toothbrush"
    assert len(gp.COLORS) == 10 and gp.RELATIONS == ("left of", "right of", "above", "below")


def test_naive_plurals_and_articles():
    assert gp.make_plural("skis") == "skises"
    assert gp.make_plural("bus") == "buses"
    assert gp.make_plural("wine glass") == "wine glasses"
    assert gp.make_plural("sheep") == "sheeps"
    assert gp.make_plural("knife") == "knifes"
    assert gp.make_plural("bench") == "benchs"
    assert gp.make_plural("computer mouse") == "computer mouses"
    assert gp.make_plural("person") == "persons"
    assert gp.with_article("umbrella") == "an umbrella"
    assert gp.with_article("orange") == "an orange"
    assert gp.with_article("hair drier") == "a hair drier"


def _check_set(items):
    for it in items:
        gp.validate(it)
        if it["tag"] == "counting":
            c = it["include"][0]
            assert 2 <= c["count"] <= 4 and it["exclude"] == [{"class": c["class"], "count": c["count"] + 1}]
            assert it["prompt"] == f"a photo of {gp.NUMBERS[c['count']]} {gp.make_plural(c['class'])}"
        if it["tag"] == "position":
            assert "position" not in it["include"][0]
            rel, group = it["include"][1]["position"]
            assert rel in gp.RELATIONS and group == 0
        if it["tag"] in ("colors", "color_attr"):
            assert all(c["class"] != "person" and c["color"] in gp.COLORS for c in it["include"])
        assert list(it)[:2] == ["tag", "include"] and list(it)[-1] == "prompt"


def test_test_set_is_valid_geneval_metadata(test_set):
    _check_set(test_set)
    tags = Counter(it["tag"] for it in test_set)
    assert len(test_set) == 553
    assert tags == {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100,
                    "color_attr": 100}
    assert sorted(it["include"][0]["class"] for it in test_set if it["tag"] == "single_object") == sorted(gp.CLASSES)
    assert len({json.dumps(it, sort_keys=True) for it in test_set}) == len(test_set)


def test_validate_rejects_bad_items():
    good = {"tag": "counting", "include": [{"class": "skis", "count": 3}],
            "exclude": [{"class": "skis", "count": 4}], "prompt": "a photo of three skises"}
    gp.validate(good)
    bad = [
        {**good, "prompt": "a photo of three skis"},
        {**good, "exclude": [{"class": "skis", "count": 3}]},
        {k: v for k, v in good.items() if k != "exclude"},
        {**good, "tag": "counted"},
        {"tag": "single_object", "include": [{"class": "mouse", "count": 1}], "prompt": "a photo of a mouse"},
        {"tag": "colors", "include": [{"class": "person", "count": 1, "color": "red"}],
         "prompt": "a photo of a red person"},
        {"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1,
                                                                      "position": ["next to", 0]}],
         "prompt": "a photo of a dog next to a cat"},
    ]
    for item in bad:
        with pytest.raises(ValueError):
            gp.validate(item)


def test_deterministic_per_seed_and_different_across_seeds():
    a, b, c = gp.generate(7, 20), gp.generate(7, 20), gp.generate(8, 20)
    assert a == b and a != c
    _check_set(a + c)
    assert gp.train_set(5, 30) == gp.train_set(5, 30) != gp.train_set(6, 30)
    assert gp.generate(43, 100) == gp.official_like_test_set()


def test_counts_per_tag():
    items = gp.generate(1, counts={"single_object": 5, "two_object": 0, "counting": 7, "colors": 0,
                                   "position": 3, "color_attr": 0}, dedupe=False)
    assert Counter(it["tag"] for it in items) == {"single_object": 5, "counting": 7, "position": 3}
    with pytest.raises(ConfigError):
        gp.generate(1, counts={"faces": 3})
    with pytest.raises(ConfigError):
        gp.generate(-1)


def test_train_set_disjoint_from_test_and_valid(test_set, train):
    _check_set(train)
    tags = Counter(it["tag"] for it in train)
    # every single_object prompt is in the test set; counting has 240 - 80 = 160 prompts left
    assert tags == {"two_object": 300, "counting": 160, "colors": 300, "position": 300, "color_attr": 300}
    test_keys = {gp.prompt_key(it) for it in test_set}
    train_keys = [gp.prompt_key(it) for it in train]
    assert len(set(train_keys)) == len(train) and not test_keys & set(train_keys)
    assert not {it["prompt"] for it in test_set} & {it["prompt"] for it in train}
    assert gp.train_capacity("counting", test_set) == 160
    assert gp.train_capacity("colors", test_set) == 790 - 94


def test_prompt_key_ignores_object_order_and_mirrors_positions():
    two = gp.generate(3, counts={"single_object": 0, "two_object": 1, "counting": 0, "colors": 0,
                                 "position": 1, "color_attr": 1})
    for it in two:
        swapped = {**it, "include": it["include"][::-1]}
        if it["tag"] == "position":
            ref, obj = it["include"]
            rel = obj["position"][0]
            inverse = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}[rel]
            swapped = {**it, "include": [{k: v for k, v in obj.items() if k != "position"},
                                         {**ref, "position": [inverse, 0]}]}
            moved = {**it, "include": [ref, {**obj, "position": [inverse, 0]}]}
            assert gp.prompt_key(moved) != gp.prompt_key(it)
        assert gp.prompt_key(swapped) == gp.prompt_key(it)


def test_run_writes_jsonl_atomically(tmp_path, test_set):
    out = gp.run(tmp_path / "sub" / "test.jsonl", None, "test", None)
    lines = out.read_text().splitlines()
    assert [json.loads(x) for x in lines] == test_set
    tr = gp.run(tmp_path / "train.jsonl", 1, "train", 10)
    assert len(tr.read_text().splitlines()) == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub", "train.jsonl"]  # no temp files left
    with pytest.raises(ConfigError):
        gp.run(tmp_path / "x.jsonl", 0, "val", 1)


def test_rng_matches_numpy():
    np = pytest.importorskip("numpy")
    for seed in (0, 1, 43, 2**32 + 7, 987654321987654321):
        ours, ref = gp._NumpyPCG64(seed), np.random.default_rng(seed)
        for _ in range(50):
            assert ours.below(80) == ref.choice(80)
            assert ours.integers(2, 4, endpoint=True) == ref.integers(2, 4, endpoint=True)
            assert ours.sample(79, 2) == ref.choice(79, size=2, replace=False).tolist()
            assert ours.sample(10, 2) == ref.choice(10, size=2, replace=False).tolist()
        assert ours.sample(80, 80) == ref.choice(80, size=80, replace=False).tolist()
        assert ours.below(2**31 + 11) == ref.choice(2**31 + 11)


def test_reproduces_official_geneval_file_line_by_line(test_set):
    if not OFFICIAL.is_file():
        pytest.skip(f"official GenEval metadata not found at {OFFICIAL}")
    official = OFFICIAL.read_text().splitlines()
    ours = [json.dumps(it) for it in test_set]
    assert len(ours) == len(official) == 553
    for i, (a, b) in enumerate(zip(ours, official)):
        assert a == b, f"line {i + 1} differs"


def test_geneval_recipes_train_on_prompts_outside_the_test_set(test_set):
    """`tpkit eval geneval` scores GenEval's test prompts: a recipe training on any of them would
    leak. The shipped train file is exactly `tpkit prompts geneval --split train --n 200`."""
    from tpkit.config import load_recipe

    root = Path(__file__).resolve().parents[1]
    shipped = [json.loads(line) for line in (root / "data" / "geneval-train.jsonl").read_text().splitlines()]
    assert shipped == gp.train_set(seed=0, n_per_tag=200)
    test_prompts = {it["prompt"] for it in test_set}
    recipes = sorted((root / "pipelines").glob("*geneval*.toml"))
    assert recipes
    for recipe in recipes:
        path = Path(load_recipe(recipe).rollout.prompts)
        prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
        assert not test_prompts & set(prompts), recipe.name
