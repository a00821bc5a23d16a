"""GenEval: judging an image against its prompt's metadata, and the `geneval` reward built on it.

Two layers:

* **Pure logic** (no models): `judge(meta, detections) -> Judgement`. `meta` is one GenEval metadata
  object (`tag`, `prompt`, `include`, optional `exclude`; an include clause has `class`, `count` and
  optionally `color` or `position: [relation, group_index]`); `detections` are dicts
  `{"class", "score", "box": [x0, y0, x1, y1] (pixels, y down), "color": str | None}`.
  `Judgement.correct` is GenEval's verdict (djghosh13/geneval, evaluation/evaluate_images.py,
  `evaluate_image` + `evaluate` + `relative_position`), `strict` is that verdict as 0/1, and `score`
  is the dense training reward of Flow-GRPO (yifan123/reward-server, reward_server/gen_eval.py,
  `evaluate_reward`, whose `score` column Flow-GRPO's `geneval` reward trains on).
* **Models**: `Detector` (any transformers instance-segmentation or detection model, default
  Mask2Former Swin-S COCO instance, the architecture GenEval uses) and `ColourClassifier` (CLIP ViT-L/14
  zero-shot over GenEval's 10 colours and 3 templates); `detect_and_judge` runs both and judges;
  `geneval_reward` / `geneval_strict` are the reward factories.

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

Known differences from the reference pipelines (models, not rules): GenEval runs mmdetection's
Mask2Former and open_clip; here the transformers ports are used, with mmdetection's instance
post-processing reproduced (`mask2former_instances`) and mmdetection's test resize (`MMDET_TEST_SIZE`;
transformers' processor then rounds each side up to a multiple of 32 by resizing where mmdetection
pads, which changes nothing for square images: 512 or 1024 px both become 800 x 800). Flow-GRPO's
reward server also JPEG-compresses the images (quality 75) before scoring, and passes RGB arrays to
mmdetection's `inference_detector`, which takes arrays as BGR; neither is reproduced.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tpkit.errors import ModelError, RewardError

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
COLOUR_TEMPLATES = ("a photo of a {c} {obj}", "a photo of a {c}-colored {obj}", "a photo of a {c} object")
RELATIONS = ("left of", "right of", "above", "below")
CROP_BACKGROUND = "#999999"  # GenEval's bgcolor "#999"

DEFAULT_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
DEFAULT_CLIP = "openai/clip-vit-large-patch14"
# GenEval's mmdetection test pipeline for its Mask2Former resizes keeping the aspect ratio to a short side
# of 800 and a long side of at most 1333 (img_scale=(1333, 800)). The transformers checkpoints' own
# processor configs resize differently, so Mask2Former-style detectors are given this size.
MMDET_TEST_SIZE = {"shortest_edge": 800, "longest_edge": 1333}
_MASK_QUERY_MODELS = ("mask2former", "maskformer")

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
    Measured on tiny-shapes (bench/tune/tp): turning points 7-8x as frequent, held-out accuracy the
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


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def mask2former_instances(class_logits, mask_logits, input_hw: tuple[int, int], valid_hw: tuple[int, int],
                          image_hw: tuple[int, int], min_score: float = THRESHOLD) -> list[tuple[int, float, list[float], Any]]:
    """mmdetection's Mask2Former instance post-processing for one image (what GenEval's detector does).

    class_logits (Q, C + 1) with the no-object class last; mask_logits (Q, h, w) at a fraction of the
    padded input (`input_hw`). Top-Q (query, class) pairs by class probability; their masks upsampled
    bilinearly to the padded input, cropped to the resized image inside it (`valid_hw`), upsampled to
    the original image (`image_hw`) and binarised at logit 0; score = class probability x mean sigmoid
    inside the mask; box = the mask's extent [x_first, y_first, x_last + 1, y_last + 1] (mmdet's
    `mask2bbox`). Pairs whose class probability is <= min_score are dropped before the upsampling
    (their score cannot exceed it). Returns [(label_id, score, box, bool mask (H, W) numpy)] with
    score > min_score.
    """
    import torch
    import torch.nn.functional as F

    num_queries, num_classes = class_logits.shape[0], class_logits.shape[1] - 1
    probs = class_logits.float().softmax(-1)[:, :-1]
    scores, flat = probs.flatten().topk(min(num_queries, probs.numel()))
    keep = scores > min_score
    scores, flat = scores[keep], flat[keep]
    if not len(scores):
        return []
    labels, queries = flat % num_classes, torch.div(flat, num_classes, rounding_mode="floor")
    masks = mask_logits[queries].float()[None]
    masks = F.interpolate(masks, size=tuple(input_hw), mode="bilinear", align_corners=False)
    masks = masks[:, :, : valid_hw[0], : valid_hw[1]]
    masks = F.interpolate(masks, size=tuple(image_hw), mode="bilinear", align_corners=False)[0]
    binary = masks > 0
    mask_scores = (masks.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
    det_scores = scores * mask_scores
    out = []
    for label, score, mask in zip(labels.tolist(), det_scores.tolist(), binary):
        if score <= min_score:
            continue
        xs = torch.nonzero(mask.any(0)).flatten()
        ys = torch.nonzero(mask.any(1)).flatten()
        box = [float(xs[0]), float(ys[0]), float(xs[-1] + 1), float(ys[-1] + 1)] if len(xs) and len(ys) else [0.0] * 4
        out.append((int(label), float(score), box, mask.cpu().numpy()))
    return out


def _load_detection_model(id_or_path: str, **kwargs):
    """An instance-segmentation model (Mask2Former, MaskFormer, ...) or a box detector (DETR, ...)."""
    from transformers import AutoConfig, AutoModelForObjectDetection, AutoModelForUniversalSegmentation

    config = AutoConfig.from_pretrained(id_or_path, **kwargs)
    segmentation = any("Segmentation" in a for a in (config.architectures or []))
    order = (AutoModelForUniversalSegmentation, AutoModelForObjectDetection)
    for auto in order if segmentation else order[::-1]:
        if type(config) in auto._model_mapping:
            return auto.from_pretrained(id_or_path, **kwargs)
    raise ValueError(f"a {config.model_type!r} model is neither an instance-segmentation nor an object-detection model")


def _batches(items: Sequence, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


class Detector:
    """Objects in images, as GenEval's detector reports them, with labels in GenEval's spelling.

    Any transformers model loaded by from_pretrained(id_or_local_folder): Mask2Former-style models
    (class + mask query logits) get mmdetection's instance post-processing (`mask2former_instances`);
    box detectors (DETR, ...) their image processor's `post_process_object_detection` (no masks).
    Mask2Former/MaskFormer inputs are resized as GenEval's mmdetection pipeline does (MMDET_TEST_SIZE),
    other models' as their processor config says.
    Calling it on PIL images returns, per image, dicts {"class", "score", "box": [x0, y0, x1, y1]
    pixels, "mask": bool (H, W) array or None}, most confident first, score > min_score, classes
    outside COCO dropped.
    """

    def __init__(self, id_or_path: str = DEFAULT_DETECTOR, device=None, fix: str | None = None,
                 batch_size: int = 8, min_score: float = THRESHOLD):
        import torch
        from transformers import AutoImageProcessor

        from tpkit import hub

        fix = fix or "point tpkit at a local copy with the `detector` option (a folder saved by save_pretrained)"
        self.name = id_or_path
        self.model = hub.load(_load_detection_model, id_or_path, "GenEval detector (option `detector`)", fix)
        self.processor = hub.load(AutoImageProcessor.from_pretrained, id_or_path,
                                  "GenEval detector's image processor (option `detector`)", fix)
        self.device = torch.device(device) if device is not None else _device()
        self.model.to(self.device).eval()
        self.labels = {int(i): geneval_class(name) for i, name in (self.model.config.id2label or {}).items()}
        if not any(self.labels.values()):
            raise ModelError(f"GenEval detector {id_or_path!r} predicts no COCO class (its labels: "
                             f"{', '.join(list(map(str, self.model.config.id2label.values()))[:5])}, ...)",
                             "use a COCO detector (its config's id2label must name COCO classes), via the `detector` option")
        self.batch_size = batch_size
        self.min_score = min_score
        self.size = MMDET_TEST_SIZE if self.model.config.model_type in _MASK_QUERY_MODELS else None

    def __call__(self, images: Sequence, batch_size: int | None = None) -> list[list[dict]]:
        import torch

        out: list[list[dict]] = []
        for chunk in _batches([im.convert("RGB") for im in images], batch_size or self.batch_size):
            kwargs = {"size": self.size} if self.size else {}
            inputs = self.processor(images=chunk, return_tensors="pt", **kwargs)
            inputs = {k: v.to(self.device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            with torch.no_grad():
                outputs = self.model(**inputs)
                if getattr(outputs, "masks_queries_logits", None) is not None:
                    found = self._instances(outputs, inputs, chunk)
                else:
                    found = self._boxes(outputs, chunk)
            for dets in found:
                dets = [d for d in dets if d["class"] is not None]
                dets.sort(key=lambda d: -d["score"])
                out.append(dets)
        return out

    def _instances(self, outputs, inputs, chunk) -> list[list[dict]]:
        input_hw = tuple(inputs["pixel_values"].shape[-2:])
        pixel_mask = inputs.get("pixel_mask")
        found = []
        for i, image in enumerate(chunk):
            if pixel_mask is not None:
                valid = (int(pixel_mask[i].any(1).sum()), int(pixel_mask[i].any(0).sum()))
            else:
                valid = input_hw
            instances = mask2former_instances(outputs.class_queries_logits[i], outputs.masks_queries_logits[i],
                                              input_hw, valid, (image.height, image.width), self.min_score)
            found.append([{"class": self.labels.get(label), "score": score, "box": box, "mask": mask}
                          for label, score, box, mask in instances])
        return found

    def _boxes(self, outputs, chunk) -> list[list[dict]]:
        results = self.processor.post_process_object_detection(
            outputs, threshold=self.min_score, target_sizes=[(im.height, im.width) for im in chunk])
        return [[{"class": self.labels.get(int(label)), "score": float(score),
                  "box": [float(v) for v in box.tolist()], "mask": None}
                 for score, label, box in zip(r["scores"], r["labels"], r["boxes"]) if float(score) > self.min_score]
                for r in results]


def object_crop(image, box: Sequence[float], mask=None):
    """GenEval's colour-classifier input: the object pasted through its mask onto #999999 grey (when
    there is a mask), cropped to its box."""
    import numpy as np
    from PIL import Image

    image = image.convert("RGB")
    if mask is not None:
        grey = Image.new("RGB", image.size, CROP_BACKGROUND)
        image = Image.composite(image, grey, Image.fromarray(np.asarray(mask, dtype=bool)))
    x0, y0, x1, y1 = (int(round(float(v))) for v in box[:4])
    return image.crop((x0, y0, max(x1, x0 + 1), max(y1, y0 + 1)))  # at least one pixel


def _features(output):
    """transformers 5 returns a model output from get_*_features (projection in pooler_output); 4.x a tensor."""
    import torch

    return output if isinstance(output, torch.Tensor) else output.pooler_output


class ColourClassifier:
    """GenEval's colour classifier: CLIP zero-shot over its 10 colours, the classifier of each colour the
    normalised mean of its 3 templates' normalised text embeddings (clip_benchmark's
    `zero_shot_classifier`), the answer the colour of highest cosine similarity to the crop."""

    def __init__(self, id_or_path: str = DEFAULT_CLIP, device=None, fix: str | None = None, batch_size: int = 32):
        import torch
        from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

        from tpkit import hub

        fix = fix or "point tpkit at a local copy with the `clip` option (a folder saved by save_pretrained)"
        what = "GenEval colour classifier CLIP (option `clip`)"
        self.name = id_or_path
        self.model = hub.load(AutoModel.from_pretrained, id_or_path, what, fix)
        if not (hasattr(self.model, "get_text_features") and hasattr(self.model, "get_image_features")):
            raise ModelError(f"{what} {id_or_path!r} is a {type(self.model).__name__}, not a CLIP-style model", fix)
        self.tokenizer = hub.load(AutoTokenizer.from_pretrained, id_or_path, f"{what} tokenizer", fix)
        self.processor = hub.load(AutoImageProcessor.from_pretrained, id_or_path, f"{what} image processor", fix)
        self.device = torch.device(device) if device is not None else _device()
        self.model.to(self.device).eval()
        self.batch_size = batch_size
        self._classifiers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def classifier(self, obj: str):
        """(10, D) normalised text classifier for objects of class `obj`."""
        import torch

        with self._lock:
            if obj not in self._classifiers:
                texts = [t.format(c=c, obj=obj) for c in COLOURS for t in COLOUR_TEMPLATES]
                tokens = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt").to(self.device)
                with torch.no_grad():
                    emb = _features(self.model.get_text_features(**tokens)).float()
                emb = torch.nn.functional.normalize(emb, dim=-1).view(len(COLOURS), len(COLOUR_TEMPLATES), -1).mean(1)
                self._classifiers[obj] = torch.nn.functional.normalize(emb, dim=-1)
            return self._classifiers[obj]

    def __call__(self, crops: Sequence, classes: Sequence[str], batch_size: int | None = None) -> list[str]:
        """The colour (one of COLOURS) of each crop, crop i being an object of class classes[i]."""
        import torch

        answers: list[str] = []
        size = batch_size or self.batch_size
        for start in range(0, len(crops), size):
            pixels = self.processor(images=list(crops[start:start + size]), return_tensors="pt")["pixel_values"]
            with torch.no_grad():
                feats = _features(self.model.get_image_features(pixel_values=pixels.to(self.device))).float()
            feats = torch.nn.functional.normalize(feats, dim=-1)
            for feat, obj in zip(feats, classes[start:start + size]):
                answers.append(COLOURS[int((self.classifier(obj) @ feat).argmax())])
        return answers


def _device():
    from tpkit.rewards import reward_device

    return reward_device()


_MODELS: dict[tuple, tuple[Detector, ColourClassifier]] = {}
_MODELS_LOCK = threading.Lock()


def load_models(detector: str = DEFAULT_DETECTOR, clip: str = DEFAULT_CLIP, device=None,
                fixes: dict[str, str] | None = None, workers: int = 0) -> tuple[Callable, ColourClassifier | None]:
    """The detector and colour classifier, built once per process and (detector, clip, device), shared by
    the `geneval` and `geneval-strict` rewards and `tpkit eval geneval`. fixes: option -> what to tell
    the user when that model is missing. detector "shapes": `tpkit.shapes_detect.ShapesDetector` (with
    `workers` processes) and no colour classifier (its detections carry their colour; `clip` is not loaded)."""
    if detector == "shapes":  # tpkit.shapes scenes: a weight-free detector that reports colours itself
        from tpkit.shapes_detect import ShapesDetector

        with _MODELS_LOCK:  # one pool of workers per process, however many rewards use it
            return _MODELS.setdefault(("shapes", workers), (ShapesDetector(workers), None))
    device = device if device is not None else _device()
    key = (detector, clip, str(device))
    with _MODELS_LOCK:
        if key not in _MODELS:
            fixes = fixes or {}
            _MODELS[key] = (Detector(detector, device, fix=fixes.get("detector")),
                            ColourClassifier(clip, device, fix=fixes.get("clip")))
        return _MODELS[key]


def detect_and_judge(images: Sequence, metadata: Sequence[dict], detector: Callable, colours: Callable | None,
                     batch_size: int | None = None, threshold: float | None = None) -> list[Judgement]:
    """Detect objects, classify the colours the prompts ask about, judge each image (GenEval's protocol).

    detector(images) -> per image [{"class", "score", "box", "mask"[, "color"]}] (a `Detector`); colours(crops,
    classes) -> colour names (a `ColourClassifier`; only called when a prompt asks for the colour of a
    detection that has none); threshold: see `judge`.
    Raises ValueError on malformed metadata, before running any model.
    """
    from PIL import ImageOps

    if len(images) != len(metadata):
        raise ValueError(f"{len(images)} images but {len(metadata)} metadata objects")
    for meta in metadata:
        check_meta(meta)
    images = [ImageOps.exif_transpose(im).convert("RGB") for im in images]  # as GenEval reads its files
    found = detector(images, batch_size=batch_size) if batch_size else detector(images)
    per_image, asks = [], []
    for i, (meta, dets) in enumerate(zip(metadata, found)):
        dets = [dict(d, color=d.get("color")) for d in dets]
        per_image.append(dets)
        asks += [(i, d) for d in colour_requests(meta, dets, threshold) if d["color"] is None]
    if asks:
        if colours is None:
            raise ValueError("these prompts ask for colours but no colour classifier was given")
        crops = [object_crop(images[i], d["box"], d.get("mask")) for i, d in asks]
        names = colours(crops, [d["class"] for _, d in asks])
        for (_, d), name in zip(asks, names):
            d["color"] = name
    return [judge(meta, dets, threshold) for meta, dets in zip(metadata, per_image)]


# --------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------

_PROMPTS_FIX = ("score GenEval-style jsonl prompts whose objects carry GenEval metadata (tag, include[, exclude]), "
                "e.g. data/geneval-style.jsonl")


def _judging_reward(reward: str, options: dict, more: dict | None = None) -> Callable[[list, list, list], list[Judgement]]:
    """The judge behind a reward: options detector, clip and batch_size checked and models loaded now
    (`more`: the reward's own further options with their defaults, which it checks itself)."""
    from tpkit.rewards import take_options

    opts = take_options(reward, options, {"detector": DEFAULT_DETECTOR, "clip": DEFAULT_CLIP, "batch_size": 16,
                                          "workers": 0, **(more or {})})
    batch_size, workers = opts["batch_size"], opts["workers"]
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise RewardError(f"reward {reward!r}: batch_size must be a positive integer, got {batch_size!r}",
                          f"e.g. --reward-opt {reward}.batch_size=16")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise RewardError(f"reward {reward!r}: workers must be an integer >= 0, got {workers!r}",
                          f"e.g. --reward-opt {reward}.workers=8 (processes for detector=shapes; 0: none)")
    if workers and opts["detector"] != "shapes":
        raise RewardError(f"reward {reward!r}: workers applies to detector=shapes only (the model detectors batch "
                          "on their device)", f"drop --reward-opt {reward}.workers")
    for name in ("detector", "clip"):
        if not isinstance(opts[name], str) or not opts[name]:
            raise RewardError(f"reward {reward!r}: option {name!r} must be a hub id or a folder, got {opts[name]!r}",
                              f"e.g. --reward-opt {reward}.{name}=PATH")
    fixes = {
        "detector": f"give a local copy with --reward-opt {reward}.detector=PATH (or `detector = PATH` in the "
                    f"recipe's [rewards.{reward}] table)",
        "clip": f"give a local copy with --reward-opt {reward}.clip=PATH (or `clip = PATH` in the recipe's "
                f"[rewards.{reward}] table)",
    }
    detector, colours = load_models(str(opts["detector"]), str(opts["clip"]), fixes=fixes, workers=workers)

    def run(images, prompts, metadata) -> list[Judgement]:
        metadata = list(metadata) if metadata is not None else [None] * len(images)
        prompts = list(prompts)
        if len(metadata) != len(images):
            raise RewardError(f"reward {reward!r} got {len(images)} images but {len(metadata)} metadata objects",
                              "pass one metadata object per image")
        for i, meta in enumerate(metadata):
            prompt = prompts[i] if i < len(prompts) else "?"
            if not isinstance(meta, dict) or "tag" not in meta or "include" not in meta:
                raise RewardError(f"reward {reward!r}: prompt {prompt!r} has no GenEval metadata (fields 'tag' and "
                                  "'include')", _PROMPTS_FIX)
            try:
                check_meta(meta)
            except ValueError as e:
                raise RewardError(f"reward {reward!r}: prompt {prompt!r} has bad GenEval metadata: {e}", _PROMPTS_FIX) from None
        # one call, as `tpkit eval geneval` makes it: the model detector batches by batch_size itself,
        # the shapes detector spreads the whole call over its workers
        return detect_and_judge(images, metadata, detector, colours, batch_size=batch_size)

    return run


def geneval_files(options: dict) -> list[tuple]:
    """What geneval and geneval-strict load (see rewards.REQUIREMENTS): the detector and the colour
    classifier's CLIP; neither for detector "shapes" (weight-free, it reports colours itself)."""
    detector = str(options.get("detector", DEFAULT_DETECTOR))
    if detector == "shapes":
        return []
    return [("detector", detector, "detector", "detector"),
            ("clip", str(options.get("clip", DEFAULT_CLIP)), "clip", "clip")]


def geneval_reward(options: dict):
    """The `geneval` reward: Flow-GRPO's dense GenEval score per image (see the module docstring).

    Options: detector (default facebook/mask2former-swin-small-coco-instance), clip (default
    openai/clip-vit-large-patch14), batch_size (images per detector batch, default 16), workers
    (processes for detector=shapes, default 0: in the calling thread), soft (default false: true scores
    `soft_score`, the dense score averaged over detection thresholds), top_n (default false: true scores
    each clause on GenEval's top-n detections, see `_flow_grpo_score`). Models load now, so a missing
    one fails before any image is scored.
    """
    for name in ("soft", "top_n"):
        if not isinstance(options.get(name, False), bool):
            raise RewardError(f"reward 'geneval': option {name!r} must be true or false, got {options[name]!r}",
                              f"e.g. --reward-opt geneval.{name}=true")
    soft, top_n = options.get("soft", False), options.get("top_n", False)
    if soft and top_n:
        raise RewardError("reward 'geneval': options soft and top_n are two different scores",
                          "choose one of --reward-opt geneval.soft=true and geneval.top_n=true")
    run = _judging_reward("geneval", options, {"soft": False, "top_n": False})
    pick = "soft" if soft else "top_n" if top_n else "score"

    def score(images, prompts, metadata):
        return [getattr(j, pick) for j in run(images, prompts, metadata)]

    return score


def geneval_strict(options: dict):
    """The `geneval-strict` reward: GenEval's verdict as 0/1 (options and models as `geneval`, but soft)."""
    run = _judging_reward("geneval-strict", options)

    def score(images, prompts, metadata):
        return [j.strict for j in run(images, prompts, metadata)]

    return score
