"""GenEval's models: the object detector and the colour classifier, and `detect_and_judge` over both.

`Detector` wraps any transformers instance-segmentation or detection model (default Mask2Former
Swin-S COCO instance, the architecture GenEval uses); `ColourClassifier` is CLIP ViT-L/14 zero-shot
over GenEval's 10 colours and 3 templates; `load_models` builds them once per process (or the
weight-free `tpkit.shapes.detect.ShapesDetector` for detector "shapes"); `detect_and_judge` runs them
and applies `tpkit.geneval.judge.judge`.

Known differences from the reference pipelines (models, not rules): GenEval runs mmdetection's
Mask2Former and open_clip; here the transformers ports are used, with mmdetection's instance
post-processing reproduced (`mask2former_instances`) and mmdetection's test resize (`MMDET_TEST_SIZE`;
transformers' processor then rounds each side up to a multiple of 32 by resizing where mmdetection
pads, which changes nothing for square images: 512 or 1024 px both become 800 x 800). Flow-GRPO's
reward server also JPEG-compresses the images (quality 75) before scoring, and passes RGB arrays to
mmdetection's `inference_detector`, which takes arrays as BGR; neither is reproduced.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from tpkit import hub
from tpkit.errors import ModelError
from tpkit.geneval.judge import COLOURS, THRESHOLD, Judgement, check_meta, colour_requests, geneval_class, judge
from tpkit.runtime import pick_device
from tpkit.shapes.detect import ShapesDetector

COLOUR_TEMPLATES = ("a photo of a {c} {obj}", "a photo of a {c}-colored {obj}", "a photo of a {c} object")
CROP_BACKGROUND = "#999999"  # GenEval's bgcolor "#999"
DEFAULT_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
DEFAULT_CLIP = "openai/clip-vit-large-patch14"
# GenEval's mmdetection test pipeline for its Mask2Former resizes keeping the aspect ratio to a short side
# of 800 and a long side of at most 1333 (img_scale=(1333, 800)). The transformers checkpoints' own
# processor configs resize differently, so Mask2Former-style detectors are given this size.
MMDET_TEST_SIZE = {"shortest_edge": 800, "longest_edge": 1333}
_MASK_QUERY_MODELS = ("mask2former", "maskformer")

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

        fix = fix or "point tpkit at a local copy with the `detector` option (a folder saved by save_pretrained)"
        self.name = id_or_path
        self.model = hub.load(_load_detection_model, id_or_path, "GenEval detector (option `detector`)", fix)
        self.processor = hub.load(AutoImageProcessor.from_pretrained, id_or_path,
                                  "GenEval detector's image processor (option `detector`)", fix)
        self.device = torch.device(device) if device is not None else pick_device("auto")
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

        fix = fix or "point tpkit at a local copy with the `clip` option (a folder saved by save_pretrained)"
        what = "GenEval colour classifier CLIP (option `clip`)"
        self.name = id_or_path
        self.model = hub.load(AutoModel.from_pretrained, id_or_path, what, fix)
        if not (hasattr(self.model, "get_text_features") and hasattr(self.model, "get_image_features")):
            raise ModelError(f"{what} {id_or_path!r} is a {type(self.model).__name__}, not a CLIP-style model", fix)
        self.tokenizer = hub.load(AutoTokenizer.from_pretrained, id_or_path, f"{what} tokenizer", fix)
        self.processor = hub.load(AutoImageProcessor.from_pretrained, id_or_path, f"{what} image processor", fix)
        self.device = torch.device(device) if device is not None else pick_device("auto")
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


_MODELS: dict[tuple, tuple[Detector, ColourClassifier]] = {}
_MODELS_LOCK = threading.Lock()


def load_models(detector: str = DEFAULT_DETECTOR, clip: str = DEFAULT_CLIP, device=None,
                fixes: dict[str, str] | None = None, workers: int = 0) -> tuple[Callable, ColourClassifier | None]:
    """The detector and colour classifier, built once per process and (detector, clip, device), shared by
    the `geneval` and `geneval-strict` rewards and `tpkit eval geneval`. fixes: option -> what to tell
    the user when that model is missing. detector "shapes": `tpkit.shapes.detect.ShapesDetector` (with
    `workers` processes) and no colour classifier (its detections carry their colour; `clip` is not loaded)."""
    if detector == "shapes":  # tpkit.shapes.scenes scenes: a weight-free detector that reports colours itself
        with _MODELS_LOCK:  # one pool of workers per process, however many rewards use it
            return _MODELS.setdefault(("shapes", workers), (ShapesDetector(workers), None))
    device = device if device is not None else pick_device("auto")
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


