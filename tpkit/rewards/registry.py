"""Rewards: plain callables `(images, prompts, metadata) -> list[float]`.

`images` are PIL RGB images, `prompts` strings, `metadata` the prompt-file objects (dicts) they
came from. Built-ins are a dict of factories `options -> callable`; anything else named as
`module:function` is imported and called as is (the only user code a recipe can run).
"""

from __future__ import annotations

import importlib
import io
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from tpkit.errors import RewardError
from tpkit.rewards.options import RewardFn



def _jpeg_kb(image) -> float:
    """Size in kB of the image saved as JPEG at quality 95 (DDPO's compressibility measure)."""
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=95)
    return buf.tell() / 1000.0


def jpeg_compressibility(options: dict) -> RewardFn:
    def score(images, prompts, metadata):
        return [-_jpeg_kb(im) for im in images]

    return score


def jpeg_incompressibility(options: dict) -> RewardFn:
    def score(images, prompts, metadata):
        return [_jpeg_kb(im) for im in images]

    return score


def brightness(options: dict) -> RewardFn:
    """Mean luma (PIL "L", ITU-R 601) in [0, 1]. Learnable in minutes even by a random tiny model,
    whose textures JPEG size barely tracks: the built-in CPU recipe's reward."""

    def score(images, prompts, metadata):
        import numpy as np

        return [float(np.asarray(im.convert("L"), dtype=np.float64).mean() / 255.0) for im in images]

    return score


def _lazy(module: str, function: str, *last: Any) -> Callable[..., Any]:
    """`module.function(*args, *last)`, imported only when called: the rewards' modules import their
    models' libraries when built, and `tpkit rewards` / `--help` need none of them."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), function)(*args, *last)

    return call


# name -> (factory, what it needs). A factory takes the reward's options (dict) and returns the
# callable; it loads its models at once, so a missing model fails before any work starts.
BUILTIN: dict[str, tuple[Callable[[dict], RewardFn], str]] = {
    "jpeg-compressibility": (jpeg_compressibility, "nothing: minus the JPEG size in kB (quality 95), as in DDPO"),
    "jpeg-incompressibility": (jpeg_incompressibility, "nothing: the JPEG size in kB (quality 95), as in DDPO"),
    "brightness": (brightness, "nothing: mean luma in [0, 1] (a smoke-test reward a tiny model can learn fast)"),
    "pickscore": (_lazy("tpkit.rewards.clip", "pickscore"),
                  "PickScore: yuvalkirstain/PickScore_v1 + processor laion/CLIP-ViT-H-14-laion2B-s32B-b79K "
                  "(options: model, processor, scale = 1/26 for the reference's training scale, batch_size, dtype)"),
    "clipscore": (_lazy("tpkit.rewards.clip", "clipscore"),
                  "CLIP ViT-L/14: openai/clip-vit-large-patch14 (options: model, weight, batch_size, dtype)"),
    "aesthetic": (_lazy("tpkit.rewards.clip", "aesthetic"),
                  "LAION aesthetic predictor v2: CLIP ViT-L/14 + its MLP head weights "
                  "(options: model, head = file path or repo_id:filename, batch_size, dtype)"),
    "imagereward": (_lazy("tpkit.rewards.image_reward", "imagereward"),
                    "ImageReward-v1.0: THUDM/ImageReward:ImageReward.pt + tokenizer google-bert/bert-base-uncased, on transformers' "
                    "BLIP modules (options: checkpoint = file path or repo_id:filename, tokenizer, batch_size, dtype)"),
    "ocr": (_lazy("tpkit.rewards.ocr", "ocr"),
            "nothing to download: rapidocr + onnxruntime (PP-OCR weights ship in the wheel), rapidfuzz"),
    "geneval": (_lazy("tpkit.rewards.geneval", "geneval_reward"),
                "a Mask2Former COCO instance detector + CLIP ViT-L/14 colour classifier; prompts need GenEval "
                "metadata; the dense Flow-GRPO score (options: detector (detector=shapes: the weight-free detector of "
                "tpkit.shapes.scenes, no CLIP; workers: processes for it), clip, batch_size, soft (true: averaged "
                "over detection thresholds, continuous in the detections' confidences))"),
    "geneval-strict": (_lazy("tpkit.rewards.geneval", "geneval_strict"),
                       "as geneval, but GenEval's 0/1 verdict (options: detector, clip, batch_size, workers)"),
}


# What a built-in needs besides tpkit's own requirements, for `tpkit doctor` (not listed: nothing):
# (the pip extra installing its packages, as pyproject.toml names it; its model files). The model
# files are declared by the reward's module next to the code that loads them: options -> a list of
# (role, id or path, kind, option). kind is what loads it: "clip" (CLIPModel with its processor),
# "clip-model" (CLIPModel only), "processor" (CLIPProcessor only), "detector" (a detector with its
# image processor), "bert-tokenizer", or "file" (one weight file: a path or repo_id:filename);
# option is the reward option that points elsewhere (None: no option does).
REQUIREMENTS: dict[str, tuple[str | None, Callable[[dict], list[tuple]]]] = {
    "pickscore": (None, _lazy("tpkit.rewards.clip", "pickscore_files")),
    "clipscore": (None, _lazy("tpkit.rewards.clip", "clipscore_files")),
    "aesthetic": (None, _lazy("tpkit.rewards.clip", "aesthetic_files")),
    "imagereward": (None, _lazy("tpkit.rewards.image_reward", "imagereward_files")),
    "ocr": ("ocr", _lazy("tpkit.rewards.ocr", "ocr_files")),
    "geneval": ("geneval", _lazy("tpkit.rewards.geneval", "geneval_files")),
    "geneval-strict": ("geneval", _lazy("tpkit.rewards.geneval", "geneval_files")),
}


# What a built-in needs of its prompts (not listed: nothing): name -> (prompts, metadata) -> None, raising a
# RewardError that names the fix. Checked before any image is made (`check_inputs`), so that prompts a
# reward cannot score fail before the rollout or the branches, not after hours of transformer work.
INPUTS: dict[str, Callable[[list, list], None]] = {
    "ocr": _lazy("tpkit.rewards.ocr", "check_inputs"),
    "geneval": _lazy("tpkit.rewards.geneval", "check_inputs"),
    "geneval-strict": _lazy("tpkit.rewards.geneval", "check_inputs", "geneval-strict"),
}


def check_inputs(rewards: list, prompts: list[str], metadata: list) -> None:
    """Fail now if a reward in use cannot score these prompts (`INPUTS`). rewards: `Reward`s or names."""
    for r in rewards:
        name = getattr(r, "name", r)
        if name in INPUTS:
            INPUTS[name](list(prompts), list(metadata))


@dataclass
class Reward:
    name: str
    weight: float
    fn: RewardFn

    @property
    def column(self) -> str:
        return component_column(self.name)


def component_column(name: str) -> str:
    """The scores column of one reward component: 'jpeg-compressibility' -> 'reward_jpeg_compressibility'."""
    return "reward_" + re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_").lower()


def _import_callable(spec: str) -> RewardFn:
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"cannot import reward {spec!r} ({e})",
                          "check that the module is importable (on PYTHONPATH) and defines that function") from None
    if not callable(fn):
        raise RewardError(f"reward {spec!r} is not callable", "point --reward at a function (images, prompts, metadata) -> list[float]")
    return fn


def check_names(weights: dict[str, float]) -> None:
    """Fail fast on an unknown reward name (before hours of rollout), without building any model."""
    for name in weights:
        if name not in BUILTIN and ":" not in name:
            raise RewardError(f"unknown reward {name!r}",
                              f"use one of {', '.join(BUILTIN)} (see `tpkit rewards`) or module:function for your own")


def load_rewards(weights: dict[str, float], options: dict[str, dict[str, Any]] | None = None) -> list[Reward]:
    """Build every reward up front, so a missing model fails at start-up, not halfway through."""
    options = options or {}
    unknown = set(options) - set(weights)
    if unknown:
        raise RewardError(f"options given for reward(s) not in use: {', '.join(sorted(unknown))}",
                          "add the reward with --reward NAME or drop its options")
    out = []
    for name, weight in weights.items():
        if not math.isfinite(weight):
            raise RewardError(f"reward {name!r} has weight {weight}", "use a finite weight, e.g. --reward NAME=1")
        check_names({name: weight})
        fn = BUILTIN[name][0](options.get(name, {})) if name in BUILTIN else _import_callable(name)
        out.append(Reward(name, weight, fn))
    return out


def score_images(rewards: list[Reward], images: list, prompts: list[str], metadata: list[dict]) -> dict[str, list[float]]:
    """Each component's scores (by column name) plus their weighted sum under 'reward'."""
    cols: dict[str, list[float]] = {}
    for r in rewards:
        try:
            values = [float(x) for x in r.fn(images, prompts, metadata)]
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward {r.name!r} failed: {type(e).__name__}: {e}",
                              "fix the reward (rerun with --debug for the traceback)") from e
        if len(values) != len(images):
            raise RewardError(f"reward {r.name!r} returned {len(values)} values for {len(images)} images",
                              "a reward must return one float per image")
        cols[r.column] = values
    cols["reward"] = [sum(r.weight * cols[r.column][i] for r in rewards) for i in range(len(images))]
    return cols
