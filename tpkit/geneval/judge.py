"""GenEval's judge: an image's detections against its prompt's metadata. Pure logic, no models.

`judge(meta, detections) -> Judgement`. `meta` is one GenEval metadata object (`tag`, `prompt`,
`include`, optional `exclude`; an include clause has `class`, `count` and optionally `color` or
`position: [relation, group_index]`); `detections` are dicts `{"class", "score", "box": [x0, y0, x1,
y1] (pixels, y down), "color": str | None}`. `Judgement.correct` is GenEval's verdict
(djghosh13/geneval, evaluation/evaluate_images.py, `evaluate_image` + `evaluate` +
`relative_position`), `strict` is that verdict as 0/1, and `score` is the dense training reward of
Flow-GRPO (yifan123/reward-server, reward_server/gen_eval.py, `evaluate_reward`, whose `score` column
Flow-GRPO's `geneval` reward trains on). The models that produce detections are in
`tpkit.geneval.detectors`; the rewards built on both in `tpkit.rewards.geneval`.

GenEval's rules, as `judge` applies them
----------------------------------------
1. Keep detections with score > 0.3 (> 0.9 when the tag is `counting`), per class most confident
   first, at most 16 per class (`THRESHOLD`, `COUNTING_THRESHOLD`, `MAX_OBJECTS`; GenEval's NMS option
   is off by default, `max_overlap=1.0`, so there is none). Equal scores keep their input order
   (GenEval's order for ties is whatever `np.argsort` gives on mmdet's unsorted top-k: undefined).
2. Include clauses are ANDed. A clause takes the top-`count` kept detections of its class; fewer than
   `count` fails it, extra instances do not.
3. Colour: all `count` of those detections must have the requested colour (GenEval counts matches
   `< count` as failure). A detection whose colour is None never matches.
4. Position `[relation, i]` (checked only if the clause has not already failed): every one of the
   clause's `count` objects against every object of include clause `i`'s group; if clause `i` failed,
   this one fails ("no target"). `relation(a, b)`: centres are box midpoints, offset = centre_a -
   centre_b, each axis shrunk toward 0 (not past it) by 0.1 x (sum of the two boxes' sizes on that
   axis); if both shrunk components are below 1e-3 there is no relation, else divide the shrunk offset
   by the length of the unshrunk one: x < -0.5 "left of", x > 0.5 "right of", y < -0.5 "above",
   y > 0.5 "below" (y grows downward; two relations can hold at once, e.g. diagonal).
5. Exclude clauses fail the image when the class has at least `count` kept detections.

Flow-GRPO's dense score, with the quirks reproduced on purpose
--------------------------------------------------------------
A list of terms, averaged (0.0 when there are none); per include clause, in order:

* count term `1 - |n - found| / n`, where `found` is ALL kept detections of the class (up to 16), not
  the top `n`: extra instances lower the score although GenEval counts them correct, and the term is
  not clamped, so it goes negative when more than 2n are found (n = 1 with 3 found gives -1; 16 found
  gives -14). Flow-GRPO's `rewards.append(1-abs(req['count'] - len(found_objects))/req['count'])`.
* if found != n: one 0.0 term when the clause has a colour or a position (one term even if it had
  both), and no colour/position check; the clause counts as failed (a later clause that refers to it
  gets the "no target" 0.0).
* else colour (if any): term = matches / n (`1 - |n - matches| / n`); fewer than n matches fails the
  clause.
* then position (if any, and only if the colour check did not fail, so a clause with both a failed
  colour and a position gets no position term): target failed -> one 0.0 term; otherwise the first
  failing pair appends 0.0 and stops, and then 1.0 is appended unconditionally (Flow-GRPO's
  `rewards.append(1.0)` after the loop): success adds [1.0], failure adds [0.0, 1.0]. So a wrong
  relation in a standard position prompt scores (1 + 1 + 0 + 1) / 4 = 0.75, not 0.667.
* exclude clauses are ignored by the score (only the GenEval verdict uses them).
* the thresholds of rule 1 apply as in GenEval (0.9 for `counting`).

`soft` (the `geneval` reward's option `soft = true`; tpkit's, in neither reference) is that dense score
averaged over the detection threshold of rule 1, uniform on [0.3, 1) for every tag (`soft_score`):
continuous in each detection's confidence where the dense score is a ratio of small counts.
`top_n` (option `top_n = true`; tpkit's, in neither reference) is that dense score on GenEval's view:
each include clause sees only its class's n most confident detections (so an extra instance costs
nothing, where Flow-GRPO's count term charges it and zeroes the clause's colour or position term),
and each exclude clause adds a 0/1 term; 1.0 exactly when GenEval's verdict is correct.

`strict` here is GenEval's own verdict (1.0 iff `correct`), the number GenEval reports. It is NOT
Flow-GRPO's `strict_correct` (which demands exactly n instances and ignores exclude clauses).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

# --------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------

THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
POSITION_THRESHOLD = 0.1
SOFT_THRESHOLDS = (THRESHOLD, 1.0)  # the range of detection thresholds `soft_score` averages over

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")

# The 80 COCO thing classes in COCO order, as COCO / mmdetection / detectron2 / transformers spell them.
COCO_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard",
    "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase",
    "scissors", "teddy bear", "hair drier", "toothbrush",
)
# GenEval's spelling (its object_names.txt): three COCO names made unambiguous for text-to-image prompts.
_GENEVAL_RENAMES = {"mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard"}
COCO_TO_GENEVAL: dict[str, str] = {c: _GENEVAL_RENAMES.get(c, c) for c in COCO_CLASSES}
GENEVAL_CLASSES = tuple(COCO_TO_GENEVAL.values())
# Other spellings detectors use for the same classes (VOC-style names, dataset variants).
LABEL_ALIASES = {
    "motorbike": "motorcycle", "aeroplane": "airplane", "sofa": "couch", "pottedplant": "potted plant",
    "diningtable": "dining table", "tvmonitor": "tv", "tv monitor": "tv", "television": "tv",
    "hair dryer": "hair drier", "cellphone": "cell phone", "mobile phone": "cell phone", "doughnut": "donut",
    "remote control": "tv remote", "computer monitor": "tv", "trafficlight": "traffic light",
    "firehydrant": "fire hydrant", "stopsign": "stop sign", "teddybear": "teddy bear",
}


def geneval_class(label: str) -> str | None:
    """A detector's label in GenEval's spelling ('mouse' -> 'computer mouse'), None if not a COCO thing."""
    key = re.sub(r"[\s_\-]+", " ", str(label).strip().lower())
    if key in _GENEVAL_SET:
        return key
    return COCO_TO_GENEVAL.get(key) or LABEL_ALIASES.get(key)


_GENEVAL_SET = frozenset(GENEVAL_CLASSES)


# --------------------------------------------------------------------------------------------
# Pure logic
# --------------------------------------------------------------------------------------------


@dataclass
class Judgement:
    correct: bool  # GenEval's verdict
    strict: float  # 1.0 iff correct
    score: float  # Flow-GRPO's dense reward
    soft: float  # the dense reward averaged over detection thresholds (`soft_score`)
    top_n: float  # the dense reward on GenEval's view of the detections (`_flow_grpo_score(top_n=True)`)
    reason: str  # GenEval's reasons for a failure, "; "-joined ("" when correct)
    detections: list = field(default_factory=list)  # kept detections (class, score, box, color), most confident first


def check_meta(meta: Any) -> None:
    """Raise ValueError (saying what is wrong) unless `meta` is usable GenEval metadata."""
    if not isinstance(meta, dict):
        raise ValueError(f"metadata must be an object, got {type(meta).__name__}")
    include = meta.get("include")
    if not isinstance(include, list) or not include:
        raise ValueError("metadata needs a non-empty 'include' list")
    if "tag" in meta and not isinstance(meta["tag"], str):
        raise ValueError("'tag' must be a string")
    for kind, clauses in (("include", include), ("exclude", meta.get("exclude", []))):
        if not isinstance(clauses, list):
            raise ValueError(f"'{kind}' must be a list")
        for i, req in enumerate(clauses):
            where = f"{kind}[{i}]"
            if not isinstance(req, dict) or not isinstance(req.get("class"), str):
                raise ValueError(f"{where} needs a 'class' string")
            count = req.get("count")
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"{where} needs an integer 'count' >= 1, got {count!r}")
            if kind == "exclude":
                continue
            if "color" in req and req["color"] not in COLOURS:
                raise ValueError(f"{where}: colour {req['color']!r} is not one of GenEval's: {', '.join(COLOURS)}")
            if "position" in req:
                pos = req["position"]
                if not isinstance(pos, (list, tuple)) or len(pos) != 2 or pos[0] not in RELATIONS:
                    raise ValueError(f"{where}: 'position' must be [relation, include index], relation one of {RELATIONS}")
                target = pos[1]
                if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < i:
                    raise ValueError(f"{where}: position target {target!r} must be the index of an earlier include clause")


def kept_objects(meta: dict, detections: Sequence[dict], threshold: float | None = None) -> dict[str, list[dict]]:
    """Detections GenEval keeps, by class: score > 0.3 (> 0.9 for `counting`; > `threshold` when given),
    most confident first, <= 16."""
    if threshold is None:
        threshold = COUNTING_THRESHOLD if meta.get("tag") == "counting" else THRESHOLD
    by_class: dict[str, list[dict]] = {}
    for det in sorted(detections, key=lambda d: -float(d["score"])):  # stable: ties keep input order
        if float(det["score"]) > threshold:
            by_class.setdefault(det["class"], []).append(det)
    return {name: dets[:MAX_OBJECTS] for name, dets in by_class.items()}


def relation(box_a: Sequence[float], box_b: Sequence[float]) -> set[str]:
    """Where A is relative to B (GenEval's `relative_position`): a subset of RELATIONS, maybe empty."""
    ax0, ay0, ax1, ay1 = (float(v) for v in box_a[:4])
    bx0, by0, bx1, by1 = (float(v) for v in box_b[:4])
    offset = ((ax0 + ax1) / 2 - (bx0 + bx1) / 2, (ay0 + ay1) / 2 - (by0 + by1) / 2)
    dims = (abs(ax1 - ax0) + abs(bx1 - bx0), abs(ay1 - ay0) + abs(by1 - by0))
    revised = [max(abs(o) - POSITION_THRESHOLD * d, 0.0) * _sign(o) for o, d in zip(offset, dims)]
    if all(abs(r) < 1e-3 for r in revised):
        return set()
    norm = math.sqrt(offset[0] * offset[0] + offset[1] * offset[1])
    dx, dy = revised[0] / norm, revised[1] / norm
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def _sign(x: float) -> float:
    return 1.0 if x > 0 else -1.0 if x < 0 else 0.0


def _relations_text(rels: set[str]) -> str:
    return " and ".join(r for r in RELATIONS if r in rels)


def _colour_counts(colours: list) -> str:
    return ", ".join(f"{colours.count(c)} {c}" for c in COLOURS if c in colours)


def _geneval_verdict(meta: dict, objects: dict[str, list[dict]]) -> tuple[bool, list[str]]:
    """GenEval's `evaluate`: include clauses ANDed over their top-`count` objects, then exclude clauses."""
    correct, reason, groups = True, [], []
    for req in meta["include"]:
        name, n = req["class"], req["count"]
        found = objects.get(name, [])[:n]
        matched = True
        if len(found) < n:
            matched = False
            reason.append(f"expected {name}>={n}, found {len(found)}")
        else:
            if "color" in req:
                colours = [d.get("color") for d in found]
                if colours.count(req["color"]) < n:
                    matched = False
                    reason.append(f"expected {req['color']} {name}>={n}, found {colours.count(req['color'])} "
                                  f"{req['color']}; and {_colour_counts(colours)}")
            if "position" in req and matched:
                rel, target = req["position"]
                if groups[target] is None:
                    matched = False
                    reason.append(f"no target for {name} to be {rel}")
                else:
                    for obj in found:
                        for other in groups[target]:
                            rels = relation(obj["box"], other["box"])
                            if rel not in rels:
                                matched = False
                                reason.append(f"expected {name} {rel} target, found {_relations_text(rels)} target")
                                break
                        if not matched:
                            break
        correct = correct and matched
        groups.append(found if matched else None)
    for req in meta.get("exclude", []):
        n_found = len(objects.get(req["class"], []))
        if n_found >= req["count"]:
            correct = False
            reason.append(f"expected {req['class']}<{req['count']}, found {n_found}")
    return correct, reason


def _flow_grpo_score(meta: dict, objects: dict[str, list[dict]], top_n: bool = False) -> float:
    """Flow-GRPO's `evaluate_reward` score (see the module docstring for its quirks).

    top_n: each include clause judged on its class's n most confident detections, as GenEval's verdict
    judges it (extra instances cost nothing), and one 0/1 term per exclude clause (how GenEval's
    counting prompts refuse too many); the score is then 1.0 exactly when the verdict is correct.
    """
    terms: list[float] = []
    groups: list = []
    for req in meta["include"]:
        name, n = req["class"], req["count"]
        found = objects.get(name, [])[:n] if top_n else objects.get(name, [])  # Flow-GRPO: all kept
        matched = True
        terms.append(1 - abs(n - len(found)) / n)
        if len(found) != n:
            matched = False
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                hits = sum(d.get("color") == req["color"] for d in found)
                terms.append(1 - abs(n - hits) / n)
                if hits != n:
                    matched = False
            if "position" in req and matched:
                rel, target = req["position"]
                if groups[target] is None:
                    matched = False
                    terms.append(0.0)
                else:
                    for obj in found:
                        for other in groups[target]:
                            if rel not in relation(obj["box"], other["box"]):
                                matched = False
                                terms.append(0.0)
                                break
                        if not matched:
                            break
                    terms.append(1.0)  # unconditional, as in Flow-GRPO
        groups.append(found if matched else None)
    if top_n:
        terms += [float(len(objects.get(req["class"], [])) < req["count"]) for req in meta.get("exclude", [])]
    return sum(terms) / len(terms) if terms else 0.0


def soft_score(meta: dict, detections: Sequence[dict]) -> float:
    """Flow-GRPO's dense score averaged over the detection threshold tau, uniform on [0.3, 1) for every tag.

    Exact: the dense score at threshold tau keeps the detections with score > tau, so it is constant
    between consecutive detection scores; the average is the sum of those pieces, each weighted by its
    length. It moves continuously with every detection's confidence (the dense score jumps when one
    crosses 0.3, or 0.9 for `counting`): a named object drawn with confidence s earns (s - 0.3) / 0.7
    of its count term, an extra blob costs in proportion to its confidence. Equal to the dense score
    (non-counting tags) when every detection scores 1.0 or at most 0.3. Why: the dense score is a
    ratio of small counts, so the ODE completions from neighbouring states of one trajectory mostly
    tie (TP-GRPO's step reward d_k = 0 for 44-48 % at step 1 and > 99 % at step 9, bench/compare).
    Measured on tiny-shapes (bench/shapes/tune/tp): turning points 7-8x as frequent, held-out accuracy the
    same; so it is an option, off by default.
    """
    lo, hi = SOFT_THRESHOLDS
    cuts = sorted({lo} | {float(d["score"]) for d in detections if lo < float(d["score"]) < hi})
    total = sum((b - a) * _flow_grpo_score(meta, kept_objects(meta, detections, threshold=a))
                for a, b in zip(cuts, cuts[1:] + [hi]))
    return total / (hi - lo)


def judge(meta: dict, detections: Sequence[dict], threshold: float | None = None) -> Judgement:
    """GenEval's verdict and Flow-GRPO's dense score for one image (rules in the module docstring).

    detections: dicts with "class" (GenEval spelling), "score", "box" [x0, y0, x1, y1] in pixels and
    "color" (the colour classifier's answer for that detection, or None). threshold: None keeps
    GenEval's detection thresholds (rule 1); a number replaces them for every tag (for diagnosis: how
    much of a verdict is the detector's confidence). Raises ValueError on malformed metadata.
    """
    check_meta(meta)
    objects = kept_objects(meta, detections, threshold)
    correct, reason = _geneval_verdict(meta, objects)
    score = _flow_grpo_score(meta, objects)
    kept = sorted((d for dets in objects.values() for d in dets), key=lambda d: -float(d["score"]))
    public = [{"class": d["class"], "score": float(d["score"]), "box": [float(v) for v in d["box"][:4]],
               "color": d.get("color")} for d in kept]
    return Judgement(correct=correct, strict=1.0 if correct else 0.0, score=float(score),
                     soft=soft_score(meta, detections), top_n=_flow_grpo_score(meta, objects, top_n=True),
                     reason="; ".join(reason), detections=public)


def colour_requests(meta: dict, detections: Sequence[dict], threshold: float | None = None) -> list[dict]:
    """The detections whose colour the judgement needs: the top-`count` kept ones of each colour clause."""
    objects = kept_objects(meta, detections, threshold)
    out, seen = [], set()
    for req in meta["include"]:
        if "color" in req:
            for det in objects.get(req["class"], [])[: req["count"]]:
                if id(det) not in seen:
                    seen.add(id(det))
                    out.append(det)
    return out
