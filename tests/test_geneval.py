"""GenEval judgement (pure rules, hand-made detections) and the geneval rewards on tiny random models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import OFFICIAL_GENEVAL, build_tiny_clip
from tpkit.geneval import detectors as det
from tpkit.geneval import judge as G
from tpkit.rewards import geneval as rg
from tpkit.errors import ModelError, RewardError

ROOT = Path(__file__).resolve().parents[1]
OFFICIAL = OFFICIAL_GENEVAL


def D(cls, box=(0, 0, 10, 10), score=0.95, color=None):
    return {"class": cls, "score": score, "box": list(box), "color": color}


def single(cls="cat"):
    return {"tag": "single_object", "include": [{"class": cls, "count": 1}], "prompt": f"a photo of a {cls}"}


def counting(cls="apple", n=3):
    return {"tag": "counting", "include": [{"class": cls, "count": n}], "exclude": [{"class": cls, "count": n + 1}],
            "prompt": f"a photo of {n} {cls}s"}


def colors(cls="car", color="red", n=1):
    return {"tag": "colors", "include": [{"class": cls, "count": n, "color": color}], "prompt": f"a photo of a {color} {cls}"}


def position(rel, a="dog", b="teddy bear"):
    return {"tag": "position", "include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [rel, 0]}],
            "prompt": f"a photo of a {a} {rel} a {b}"}


def check(j, correct, score):
    assert j.correct is correct, j.reason
    assert j.strict == (1.0 if correct else 0.0)
    assert j.score == pytest.approx(score), (j.score, j.reason)


# --------------------------------------------------------------------------------------------
# single object, thresholds, extra instances
# --------------------------------------------------------------------------------------------


def test_single_object():
    check(G.judge(single(), [D("cat")]), True, 1.0)
    j = G.judge(single(), [])
    check(j, False, 0.0)
    assert j.reason == "expected cat>=1, found 0"
    check(G.judge(single(), [D("dog")]), False, 0.0)  # other classes do not count


def test_threshold_edges():
    check(G.judge(single(), [D("cat", score=0.3)]), False, 0.0)  # kept only when score > 0.3
    check(G.judge(single(), [D("cat", score=0.30001)]), True, 1.0)
    check(G.judge(counting(n=2), [D("apple", score=0.9)] * 2), False, 0.0)  # counting: > 0.9
    check(G.judge(counting(n=2), [D("apple", score=0.90001)] * 2), True, 1.0)
    # a 0.5 detection counts for other tags but not for counting
    two = [D("apple", score=0.95), D("apple", (20, 0, 30, 10), score=0.5)]
    check(G.judge(counting(n=2), two), False, 0.5)
    meta = {"tag": "two_object", "include": [{"class": "apple", "count": 2}], "prompt": "p"}
    check(G.judge(meta, two), True, 1.0)


def test_extra_instances_pass_geneval_but_lower_the_dense_score():
    boxes = [(20 * k, 0, 20 * k + 10, 10) for k in range(4)]
    check(G.judge(single(), [D("cat", b) for b in boxes[:2]]), True, 0.0)  # 1 - |1 - 2| / 1
    check(G.judge(single(), [D("cat", b) for b in boxes[:3]]), True, -1.0)  # not clamped (Flow-GRPO)


def test_soft_score_averages_the_dense_score_over_detection_thresholds():
    # a named object drawn with confidence s earns (s - 0.3) / 0.7 of its count term
    assert G.judge(single(), [D("cat", score=0.65)]).soft == pytest.approx(0.5)
    # an extra blob costs in proportion to its confidence: 2 cats for 1 score 0 below 0.65, 1 above
    two = [D("cat", score=1.0), D("cat", (20, 0, 30, 10), score=0.65)]
    assert G.judge(single(), two).soft == pytest.approx(0.5)
    # every tag averages over [0.3, 1), counting too (its dense score keeps only > 0.9)
    apples = [D("apple", (20 * k, 0, 20 * k + 10, 10), score=s) for k, s in enumerate((1.0, 1.0, 0.8))]
    j = G.judge(counting(n=3), apples)
    assert j.score == pytest.approx(2 / 3)  # 2 of 3 kept
    assert j.soft == pytest.approx((0.5 * 1.0 + 0.2 * 2 / 3) / 0.7)  # 3 found for tau < 0.8, 2 above
    # equal to the dense score when every detection scores 1.0 or at most 0.3
    sure = [D("teddy bear", (0, 0, 10, 10), 1.0), D("dog", (30, 0, 40, 10), 1.0), D("cat", score=0.2)]
    for rel in G.RELATIONS:
        j = G.judge(position(rel), sure)
        assert j.soft == pytest.approx(j.score)
    assert G.judge(single(), []).soft == 0.0


def test_soft_score_matches_a_fine_grid_of_thresholds():
    import random

    rng = random.Random(0)
    metas = [single("cat"), counting("cat", 2), colors("cat", "red", 2), position("left of", "cat", "dog")]
    for _ in range(40):
        dets = [D(rng.choice(["cat", "dog"]), (x := rng.uniform(0, 90), 0, x + 10, 10), rng.uniform(0.1, 1.0),
                  rng.choice(["red", "blue"])) for _ in range(rng.randint(0, 5))]
        for meta in metas:
            n = 2000  # midpoints of n equal bins of [0.3, 1)
            grid = sum(G._flow_grpo_score(meta, G.kept_objects(meta, dets, threshold=0.3 + 0.7 * (i + 0.5) / n))
                       for i in range(n)) / n
            assert G.soft_score(meta, dets) == pytest.approx(grid, abs=5e-3)


def test_top_n_scores_geneval_s_view_of_the_detections():
    boxes = [(20 * k, 0, 20 * k + 10, 10) for k in range(4)]
    # an extra cat costs nothing: GenEval judges the most confident one
    j = G.judge(single(), [D("cat", b) for b in boxes[:3]])
    assert (j.correct, j.score, j.top_n) == (True, -1.0, 1.0)
    # two_object with an extra cat: Flow-GRPO (1 - |1 - 2| / 1 + 1) / 2 = 0.5; top_n 1.0
    meta = {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}], "prompt": "p"}
    j = G.judge(meta, [D("cat", boxes[0]), D("cat", boxes[1]), D("dog", boxes[2])])
    assert (j.correct, j.score, j.top_n) == (True, 0.5, 1.0)
    # an extra red car in blue: Flow-GRPO's count term 0 and its colour term 0; top_n sees the surer blue one
    j = G.judge(colors("car", "blue"), [D("car", boxes[0], 0.99, "blue"), D("car", boxes[1], 0.8, "red")])
    assert (j.correct, j.score, j.top_n) == (True, 0.0, 1.0)
    # counting 3 with 4 found: the exclude clause's term is 0 -> (1 + 0) / 2
    j = G.judge(counting(n=3), [D("apple", b) for b in boxes])
    assert (j.correct, j.score, j.top_n) == (False, pytest.approx(2 / 3), 0.5)
    # too few keeps partial credit: 2 of 3 apples, exclude satisfied -> (2/3 + 1) / 2
    assert G.judge(counting(n=3), [D("apple", b) for b in boxes[:2]]).top_n == pytest.approx(5 / 6)


def test_top_n_is_one_exactly_when_geneval_says_correct():
    import random

    rng = random.Random(1)
    metas = [single("cat"), counting("cat", 2), colors("cat", "red", 2), position("left of", "cat", "dog"),
             {"tag": "color_attr", "include": [{"class": "cat", "count": 1, "color": "red"},
                                                {"class": "dog", "count": 1, "color": "blue"}], "prompt": "p"}]
    seen = set()
    for _ in range(400):
        dets = [D(rng.choice(["cat", "dog"]), (x := rng.uniform(0, 90), 0, x + 10, 10), rng.uniform(0.1, 1.0),
                  rng.choice(["red", "blue"])) for _ in range(rng.randint(0, 5))]
        for meta in metas:
            j = G.judge(meta, dets)
            assert (j.top_n == 1.0) is j.correct, (meta, dets)
            seen.add(j.correct)
    assert seen == {True, False}


def test_more_than_16_detections_keeps_the_16_most_confident():
    dets = [D("cat", (20 * k, 0, 20 * k + 10, 10), score=0.4 + 0.01 * k) for k in range(20)]
    j = G.judge(single(), dets)
    check(j, True, 1 - 15)
    assert len(j.detections) == 16
    assert min(d["score"] for d in j.detections) == pytest.approx(0.44)  # the 4 least confident dropped
    assert [d["score"] for d in j.detections] == sorted((d["score"] for d in j.detections), reverse=True)
    # the cap also hides instances from exclude: 20 detections, exclude at 17, only 16 kept
    meta = {"tag": "two_object", "include": [{"class": "cat", "count": 16}], "exclude": [{"class": "cat", "count": 17}],
            "prompt": "p"}
    check(G.judge(meta, dets), True, 1.0)


# --------------------------------------------------------------------------------------------
# two objects, counting, exclude
# --------------------------------------------------------------------------------------------


def test_two_object():
    meta = {"tag": "two_object", "include": [{"class": "bench", "count": 1}, {"class": "sports ball", "count": 1}],
            "prompt": "a photo of a bench and a sports ball"}
    check(G.judge(meta, [D("bench"), D("sports ball", (50, 50, 60, 60))]), True, 1.0)
    j = G.judge(meta, [D("bench")])
    check(j, False, 0.5)
    assert j.reason == "expected sports ball>=1, found 0"
    check(G.judge(meta, []), False, 0.0)


def test_counting_and_exclude():
    boxes = [(20 * k, 0, 20 * k + 10, 10) for k in range(5)]
    check(G.judge(counting(n=3), [D("apple", b) for b in boxes[:3]]), True, 1.0)
    j = G.judge(counting(n=3), [D("apple", b) for b in boxes[:2]])
    check(j, False, 1 - 1 / 3)
    assert j.reason == "expected apple>=3, found 2"
    j = G.judge(counting(n=3), [D("apple", b) for b in boxes[:4]])  # 4 >= exclude count 4
    check(j, False, 1 - 1 / 3)  # the dense score ignores exclude clauses, only counts
    assert j.reason == "expected apple<4, found 4"
    # a fourth, less confident instance under the counting threshold is not counted
    check(G.judge(counting(n=3), [D("apple", b) for b in boxes[:3]] + [D("apple", boxes[3], score=0.85)]), True, 1.0)
    # exclude on a tag with the 0.3 threshold
    meta = {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "exclude": [{"class": "dog", "count": 1}],
            "prompt": "p"}
    check(G.judge(meta, [D("cat"), D("dog", score=0.31)]), False, 1.0)
    check(G.judge(meta, [D("cat"), D("dog", score=0.3)]), True, 1.0)


def test_a_threshold_given_replaces_genevals_for_every_tag():
    """For diagnosis only: threshold=x keeps the detections scoring > x, whatever the tag."""
    boxes = [(20 * k, 0, 20 * k + 10, 10) for k in range(4)]
    three = [D("apple", b, score=s) for b, s in zip(boxes, (0.95, 0.95, 0.8))]
    check(G.judge(counting(n=3), three), False, 1 - 1 / 3)  # GenEval's 0.9 for counting keeps 2
    check(G.judge(counting(n=3), three, threshold=0.3), True, 1.0)
    check(G.judge(single(), [D("cat", score=0.5)]), True, 1.0)
    check(G.judge(single(), [D("cat", score=0.5)], threshold=0.9), False, 0.0)
    # what a colour classifier is asked for follows the threshold too
    dets = [D("car", score=0.95, color="red"), D("car", (50, 0, 60, 10), score=0.5)]
    assert len(G.colour_requests(colors(n=2), dets)) == 2 and len(G.colour_requests(colors(n=2), dets, 0.9)) == 1


# --------------------------------------------------------------------------------------------
# colours
# --------------------------------------------------------------------------------------------


def test_colors():
    check(G.judge(colors(), [D("car", color="red")]), True, 1.0)
    j = G.judge(colors(), [D("car", color="blue")])
    check(j, False, 0.5)  # count term 1, colour term 0
    assert j.reason == "expected red car>=1, found 0 red; and 1 blue"
    check(G.judge(colors(), [D("car", color=None)]), False, 0.5)
    check(G.judge(colors(), []), False, 0.0)  # count term 0 and one 0 for the colour


def test_colour_is_judged_on_the_most_confident_instances():
    dets = [D("car", (50, 0, 60, 10), score=0.5, color="blue"), D("car", score=0.9, color="red")]
    check(G.judge(colors(), dets), True, 0.0)  # top-1 is red; 2 found for 1: count term 0, then a 0
    dets = [D("car", (50, 0, 60, 10), score=0.9, color="blue"), D("car", score=0.5, color="red")]
    check(G.judge(colors(), dets), False, 0.0)


def test_colour_mismatch_on_one_of_count():
    meta = colors(n=2)
    check(G.judge(meta, [D("car", color="red"), D("car", (20, 0, 30, 10), color="red")]), True, 1.0)
    j = G.judge(meta, [D("car", color="red"), D("car", (20, 0, 30, 10), color="blue")])
    check(j, False, (1 + 0.5) / 2)  # colour term = 1 of 2
    assert j.reason == "expected red car>=2, found 1 red; and 1 red, 1 blue"
    # three found, the top two red: GenEval correct; dense: count term 0.5, then a 0 for the mismatch
    dets = [D("car", color="red"), D("car", (20, 0, 30, 10), color="red"), D("car", (40, 0, 50, 10), 0.5, "blue")]
    check(G.judge(meta, dets), True, 0.25)


def test_color_attr():
    meta = {"tag": "color_attr", "include": [{"class": "wine glass", "count": 1, "color": "purple"},
                                             {"class": "apple", "count": 1, "color": "black"}],
            "prompt": "a photo of a purple wine glass and a black apple"}
    check(G.judge(meta, [D("wine glass", color="purple"), D("apple", (50, 0, 60, 10), color="black")]), True, 1.0)
    check(G.judge(meta, [D("wine glass", color="purple"), D("apple", (50, 0, 60, 10), color="red")]), False, 0.75)
    check(G.judge(meta, [D("wine glass", color="black"), D("apple", (50, 0, 60, 10), color="purple")]), False, 0.5)
    check(G.judge(meta, [D("wine glass", color="purple")]), False, 0.5)


# --------------------------------------------------------------------------------------------
# positions
# --------------------------------------------------------------------------------------------

TARGET = (100, 100, 120, 120)
PLACED = {"left of": (40, 100, 60, 120), "right of": (160, 100, 180, 120),
          "above": (100, 40, 120, 60), "below": (100, 160, 120, 180)}
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


@pytest.mark.parametrize("rel", G.RELATIONS)
def test_every_relation(rel):
    dets = [D("teddy bear", TARGET), D("dog", PLACED[rel])]
    check(G.judge(position(rel), dets), True, 1.0)
    j = G.judge(position(OPPOSITE[rel]), dets)
    check(j, False, 0.75)  # Flow-GRPO: [1] + [1, 0, 1]: a failed relation adds 0 then 1
    assert j.reason == f"expected dog {OPPOSITE[rel]} target, found {rel} target"
    assert G.relation(PLACED[rel], TARGET) == {rel}


def test_diagonal_holds_two_relations():
    dog = (40, 40, 60, 60)  # up-left of the target
    assert G.relation(dog, TARGET) == {"left of", "above"}
    dets = [D("teddy bear", TARGET), D("dog", dog)]
    check(G.judge(position("left of"), dets), True, 1.0)
    check(G.judge(position("above"), dets), True, 1.0)
    j = G.judge(position("below"), dets)
    check(j, False, 0.75)
    assert j.reason == "expected dog below target, found left of and above target"
    # mostly left, a little up: only "left of"
    assert G.relation((40, 90, 60, 110), TARGET) == {"left of"}


def test_overlapping_and_nested_boxes_have_no_relation():
    nested = (105, 105, 115, 115)  # same centre
    overlapping = (103, 100, 123, 120)  # offset 3 <= the shrink 0.1 x (20 + 20) on x, 0 on y
    shifted = (107.9, 100, 127.9, 120)  # offset 7.9, shrunk to 3.9: 3.9 / 7.9 < 0.5
    for box in (nested, overlapping, shifted, TARGET):
        assert G.relation(box, TARGET) == set()
        for rel in G.RELATIONS:
            j = G.judge(position(rel), [D("teddy bear", TARGET), D("dog", box)])
            check(j, False, 0.75)
            assert j.reason == f"expected dog {rel} target, found  target"
    # offset 8.1, shrunk to 4.1: 4.1 / 8.1 > 0.5
    assert G.relation((108.1, 100, 128.1, 120), TARGET) == {"right of"}


def test_relation_thresholds():
    # shrink 0.1 x (4 + 6) = 1 on x: revised x = -5 of an offset of length 10 -> exactly -0.5: not "left of"
    a, b = (0, 0, 4, 0), (5, 8, 11, 8)
    assert G.relation(a, b) == {"above"}
    assert G.relation((0, 0, 4, 0), (5.2, 8, 11.2, 8)) == {"left of", "above"}
    # points (zero-size boxes): below 1e-3 on both axes is no relation, at 1e-3 it is one
    assert G.relation((0, 0, 0, 0), (0.0009, 0, 0.0009, 0)) == set()
    assert G.relation((0, 0, 0, 0), (0.0011, 0, 0.0011, 0)) == {"left of"}
    # y grows downward
    assert G.relation((0, 0, 10, 10), (0, 50, 10, 60)) == {"above"}


def test_position_with_missing_target_or_object():
    j = G.judge(position("right of"), [D("dog", PLACED["right of"])])
    check(j, False, 1 / 3)  # [0] for the bear, [1, 0] for the dog (count ok, no target)
    assert j.reason == "expected teddy bear>=1, found 0; no target for dog to be right of"
    j = G.judge(position("right of"), [D("teddy bear", TARGET)])
    check(j, False, 1 / 3)  # [1] + [0 (count), 0 (one term for the position it could not check)]
    assert j.reason == "expected dog>=1, found 0"


def test_position_checks_every_pair():
    meta = {"tag": "position", "include": [{"class": "bench", "count": 2},
                                           {"class": "cat", "count": 1, "position": ["above", 0]}], "prompt": "p"}
    benches = [D("bench", (0, 100, 20, 120)), D("bench", (100, 100, 120, 120))]
    check(G.judge(meta, benches + [D("cat", (50, 0, 70, 20))]), True, 1.0)  # above both
    j = G.judge(meta, benches + [D("cat", (0, 0, 20, 20))])  # right above one, diagonal (left, above) of the other
    check(j, True, 1.0)
    j = G.judge(meta, benches + [D("cat", (0, 80, 20, 100))])  # above the first, left of the second only
    check(j, False, 0.75)


# --------------------------------------------------------------------------------------------
# metadata validation, label map, official metadata
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("meta, words", [
    ({"tag": "colors"}, "include"),
    ({"tag": "colors", "include": [{"class": "car"}]}, "count"),
    ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "teal"}]}, "teal"),
    ({"tag": "position", "include": [{"class": "car", "count": 1, "position": ["left of", 0]}]}, "earlier"),
    ({"tag": "position", "include": [{"class": "car", "count": 1}, {"class": "dog", "count": 1, "position": ["near", 0]}]},
     "relation"),
])
def test_bad_metadata(meta, words):
    with pytest.raises(ValueError, match=words):
        G.judge(meta, [])


def test_label_map():
    assert G.geneval_class("mouse") == "computer mouse"
    assert G.geneval_class("remote") == "tv remote"
    assert G.geneval_class("keyboard") == "computer keyboard"
    assert G.geneval_class("tv") == "tv"
    assert G.geneval_class("TV") == "tv"
    assert G.geneval_class("hair drier") == "hair drier"
    assert G.geneval_class("motorbike") == "motorcycle"
    assert G.geneval_class("dining_table") == "dining table"
    assert G.geneval_class("computer mouse") == "computer mouse"
    assert G.geneval_class("LABEL_3") is None and G.geneval_class("sky-other-merged") is None
    assert len(G.COCO_TO_GENEVAL) == 80 and len(set(G.GENEVAL_CLASSES)) == 80
    assert len(G.COLOURS) == 10 and len(det.COLOUR_TEMPLATES) == 3


def _official():
    if not OFFICIAL.is_file():
        pytest.skip(f"GenEval's official metadata is not at {OFFICIAL} (set GENEVAL_METADATA)")
    return [json.loads(line) for line in OFFICIAL.read_text().splitlines() if line.strip()]


def test_official_metadata_judges_with_empty_detections():
    metas = _official()
    assert len(metas) == 553
    assert {c["class"] for m in metas for c in m["include"]} == set(G.GENEVAL_CLASSES)
    for meta in metas:
        j = G.judge(meta, [])
        assert j.correct is False and j.strict == 0.0 and j.score == 0.0 and j.reason


def _perfect(meta):
    """Detections that satisfy a metadata object: n spaced instances per clause, placed and coloured as asked."""
    dets, groups = [], []
    step = {"left of": (-100, 0), "right of": (100, 0), "above": (0, -100), "below": (0, 100)}
    for i, req in enumerate(meta["include"]):
        if "position" in req:
            rel, t = req["position"]
            x, y = groups[t][0] + step[rel][0], groups[t][1] + step[rel][1]
        else:
            x, y = 1000 + 400 * i, 1000
        groups.append((x, y))
        dets += [D(req["class"], (x + 15 * k, y, x + 15 * k + 10, y + 10), color=req.get("color"))
                 for k in range(req["count"])]
    return dets


def test_official_metadata_judges_perfect_detections_correct():
    for meta in _official():
        j = G.judge(meta, _perfect(meta))
        check(j, True, 1.0)


# --------------------------------------------------------------------------------------------
# model pieces
# --------------------------------------------------------------------------------------------


def test_mask2former_instances_follow_mmdet():
    import torch

    cls = torch.tensor([[10.0, 0.0, 0.0]])  # class 0, 2 classes + no-object
    masks = torch.full((1, 4, 4), -10.0)
    masks[0, 1:3, 1:3] = 10.0
    p0 = torch.softmax(cls, -1)[0, 0].item()
    [(label, score, box, mask)] = det.mask2former_instances(cls, masks, (4, 4), (4, 4), (4, 4))
    assert label == 0 and box == [1.0, 1.0, 3.0, 3.0] and mask.sum() == 4
    assert score == pytest.approx(p0 / (1 + math.exp(-10)), rel=1e-5)
    # only the top half of the input is the image: crop, then stretch to the original size
    [(label, score, box, mask)] = det.mask2former_instances(cls, masks, (4, 4), (2, 4), (4, 4))
    assert box == [1.0, 2.0, 3.0, 4.0]
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    assert score == pytest.approx(p0 * (sig(5) + sig(10)) / 2, rel=1e-5)
    # a class probability <= min_score cannot make a detection
    assert det.mask2former_instances(torch.tensor([[0.0, 0.0, 5.0]]), masks, (4, 4), (4, 4), (4, 4)) == []


def test_object_crop_on_grey():
    import numpy as np
    from PIL import Image

    image = Image.new("RGB", (8, 6), (255, 0, 0))
    mask = np.zeros((6, 8), dtype=bool)
    mask[2:4, 2:4] = True
    crop = det.object_crop(image, [1, 1, 5, 5], mask)
    assert crop.size == (4, 4)
    assert crop.getpixel((0, 0)) == (0x99, 0x99, 0x99) and crop.getpixel((1, 1)) == (255, 0, 0)
    assert det.object_crop(image, [1, 1, 5, 5], None).getpixel((0, 0)) == (255, 0, 0)


# --------------------------------------------------------------------------------------------
# tiny random models end to end
# --------------------------------------------------------------------------------------------


def _tiny_mask2former(path: Path, num_queries: int = 8, confident: str | None = None, coco_labels: bool = True) -> Path:
    import torch
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessorPil, SwinConfig

    swin = SwinConfig(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4, image_size=64,
                      out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(backbone_config=swin, feature_size=32, mask_feature_size=32, hidden_dim=32,
                               encoder_feedforward_dim=32, encoder_layers=1, decoder_layers=2, num_attention_heads=2,
                               dim_feedforward=32, num_queries=num_queries, num_labels=80)
    if coco_labels:  # the real checkpoint's COCO names ('mouse', 'remote', ...), mapped to GenEval's by the Detector
        config.id2label = dict(enumerate(G.COCO_CLASSES))
        config.label2id = {c: i for i, c in enumerate(G.COCO_CLASSES)}
    torch.manual_seed(0)
    model = Mask2FormerForUniversalSegmentation(config)
    if confident:  # every query says `confident` with probability ~1
        with torch.no_grad():
            model.class_predictor.weight.zero_()
            model.class_predictor.bias.fill_(-20.0)
            model.class_predictor.bias[G.COCO_CLASSES.index(confident)] = 20.0
    model.save_pretrained(path)
    Mask2FormerImageProcessorPil(size={"shortest_edge": 64, "longest_edge": 96}).save_pretrained(path)
    return path


def _tiny_clip(path: Path) -> Path:
    return build_tiny_clip(path)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("geneval-models")
    return {"detector": str(_tiny_mask2former(root / "m2f")), "clip": str(_tiny_clip(root / "clip")),
            "confident": str(_tiny_mask2former(root / "m2f-car", num_queries=1, confident="car"))}


def _images(n=2):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (64 + 16 * i, 80, 3), dtype=np.uint8)) for i in range(n)]


def _style_metadata():
    metas = [json.loads(line) for line in (ROOT / "data" / "geneval-style.jsonl").read_text().splitlines() if line.strip()]
    by_tag = {}
    for m in metas:
        by_tag.setdefault(m["tag"], m)
    return [by_tag["colors"], by_tag["position"]]


def test_geneval_reward_end_to_end(tiny_models):
    metas = _style_metadata()
    opts = {"detector": tiny_models["detector"], "clip": tiny_models["clip"], "batch_size": 1}
    images, prompts = _images(), [m["prompt"] for m in metas]
    scores = rg.geneval_reward(opts)(images, prompts, metas)
    strict = rg.geneval_strict(opts)(images, prompts, metas)
    assert len(scores) == 2 and all(math.isfinite(s) and 0.0 <= s <= 1.0 for s in scores)
    assert all(s in (0.0, 1.0) for s in strict)
    # the same models, built once, serve both rewards
    assert det.load_models(opts["detector"], opts["clip"]) is det.load_models(opts["detector"], opts["clip"])


def test_builtin_reward_registry_reaches_geneval(tiny_models):
    from tpkit.rewards.registry import load_rewards, score_images

    metas = _style_metadata()
    rewards = load_rewards({"geneval": 1.0}, {"geneval": {"detector": tiny_models["detector"], "clip": tiny_models["clip"]}})
    cols = score_images(rewards, _images(), [m["prompt"] for m in metas], metas)
    assert all(math.isfinite(v) for v in cols["reward_geneval"])


def test_detections_and_colours_with_a_confident_detector(tiny_models):
    from tpkit.geneval.detectors import ColourClassifier, Detector

    detector = Detector(tiny_models["confident"], device="cpu")
    colours = ColourClassifier(tiny_models["clip"], device="cpu")
    images = _images()
    found = detector(images)
    assert any(found), "the biased tiny detector should find a car"
    for image, dets in zip(images, found):
        for d in dets:
            assert d["class"] == "car" and 0.3 < d["score"] <= 1.0
            assert d["mask"].shape == (image.height, image.width) and d["mask"].any()
            x0, y0, x1, y1 = d["box"]
            assert 0 <= x0 < x1 <= image.width and 0 <= y0 < y1 <= image.height
    metas = [colors("car", "red"), colors("car", "blue")]
    judgements = det.detect_and_judge(images, metas, detector, colours)
    for j, dets in zip(judgements, found):
        assert len(j.detections) == len(dets)
        assert all(d["color"] in G.COLOURS for d in j.detections)
        assert math.isfinite(j.score) and j.strict in (0.0, 1.0)


def test_colour_classifier_matches_a_direct_clip_computation(tiny_models):
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    path = tiny_models["clip"]
    clf = det.ColourClassifier(path, device="cpu")
    crops = [Image.new("RGB", (20, 12), c) for c in ("red", "blue", "white")]
    got = clf(crops, ["car", "car", "bus"], batch_size=2)
    model, tok, proc = CLIPModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    want = []
    with torch.no_grad():
        for crop, obj in zip(crops, ["car", "car", "bus"]):
            weights = []
            for c in G.COLOURS:
                texts = [f"a photo of a {c} {obj}", f"a photo of a {c}-colored {obj}", f"a photo of a {c} object"]
                t = model.get_text_features(**tok(texts, padding=True, return_tensors="pt")).pooler_output
                t = (t / t.norm(dim=-1, keepdim=True)).mean(0)
                weights.append(t / t.norm())
            i = model.get_image_features(**proc(images=[crop], return_tensors="pt")).pooler_output[0]
            want.append(G.COLOURS[int((torch.stack(weights) @ (i / i.norm())).argmax())])
    assert got == want


def test_missing_models_fail_at_factory_time_naming_the_option(tiny_models, tmp_path, monkeypatch):
    with pytest.raises(ModelError, match="detector"):
        rg.geneval_reward({"detector": str(tmp_path / "no-such-detector"), "clip": tiny_models["clip"]})
    with pytest.raises(ModelError, match="clip"):
        rg.geneval_strict({"detector": tiny_models["detector"], "clip": str(tmp_path / "no-such-clip")})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError) as e:
        rg.geneval_reward({"detector": "nobody/no-such-detector", "clip": tiny_models["clip"]})
    assert "detector" in str(e.value) and "geneval.detector" in str(e.value)
    with pytest.raises(ModelError, match="neither an instance-segmentation nor an object-detection"):
        rg.geneval_reward({"detector": tiny_models["clip"], "clip": tiny_models["clip"]})
    with pytest.raises(ModelError, match="no COCO class"):  # labels LABEL_0, LABEL_1, ...
        det.Detector(str(_tiny_mask2former(tmp_path / "unlabelled", coco_labels=False)), device="cpu")


def test_reward_rejects_prompts_without_geneval_metadata(tiny_models):
    opts = {"detector": tiny_models["detector"], "clip": tiny_models["clip"]}
    score = rg.geneval_reward(opts)
    with pytest.raises(RewardError, match="a red cube") as e:
        score(_images(1), ["a red cube"], [{"prompt": "a red cube"}])
    assert "geneval-style.jsonl" in str(e.value)
    with pytest.raises(RewardError, match="bad GenEval metadata"):
        score(_images(1), ["p"], [{"tag": "colors", "include": [{"class": "car", "count": 0}]}])
    with pytest.raises(RewardError, match="no option"):
        rg.geneval_reward({"detectr": "x"})
    with pytest.raises(RewardError, match="batch_size"):
        rg.geneval_reward({**opts, "batch_size": 0})


def test_a_box_detector_works_too(tiny_models, tmp_path):
    """Any transformers detection model: a tiny DETR whose one query says 'mouse' (GenEval: 'computer mouse')."""
    import torch
    from transformers import DetrConfig, DetrForObjectDetection, DetrImageProcessorPil, ResNetConfig

    backbone = ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1], out_features=["stage4"])
    config = DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone, d_model=16,
                        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=16, decoder_ffn_dim=16, num_queries=1, num_labels=80,
                        id2label=dict(enumerate(G.COCO_CLASSES)))
    torch.manual_seed(0)
    model = DetrForObjectDetection(config)
    with torch.no_grad():
        model.class_labels_classifier.weight.zero_()
        model.class_labels_classifier.bias.fill_(-20.0)
        model.class_labels_classifier.bias[G.COCO_CLASSES.index("mouse")] = 20.0
    model.save_pretrained(tmp_path / "detr")
    DetrImageProcessorPil(size={"shortest_edge": 64, "longest_edge": 96}).save_pretrained(tmp_path / "detr")

    detector = det.Detector(str(tmp_path / "detr"), device="cpu")
    [dets] = detector(_images(1))
    assert [d["class"] for d in dets] == ["computer mouse"] and dets[0]["mask"] is None
    meta = {"tag": "colors", "include": [{"class": "computer mouse", "count": 1, "color": "black"}], "prompt": "p"}
    [j] = det.detect_and_judge(_images(1), [meta], detector, det.ColourClassifier(tiny_models["clip"], device="cpu"))
    assert j.detections[0]["color"] in G.COLOURS
    assert j.score == (1.0 if j.correct else 0.5)
