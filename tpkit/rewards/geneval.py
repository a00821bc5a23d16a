"""The `geneval` and `geneval-strict` rewards: GenEval's judge (`tpkit.geneval`) as a reward.

`geneval` is Flow-GRPO's dense score (or, with options, `soft` / `top_n`, see
`tpkit.geneval.judge`); `geneval-strict` GenEval's 0/1 verdict. Options are checked and models
loaded when the reward is built, so a missing model fails before any image is scored.
"""

from __future__ import annotations

from typing import Callable

from tpkit.errors import RewardError
from tpkit.geneval.detectors import DEFAULT_CLIP, DEFAULT_DETECTOR, detect_and_judge, load_models
from tpkit.geneval.judge import Judgement, check_meta
from tpkit.rewards.options import take_options
# --------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------

_PROMPTS_FIX = ("score GenEval-style jsonl prompts whose objects carry GenEval metadata (tag, include[, exclude]), "
                "e.g. data/geneval-style.jsonl")


def check_inputs(prompts: list[str], metadata: list, reward: str = "geneval") -> None:
    """Every prompt carries GenEval metadata (a tag and include clauses, well formed): checked by the score
    stage and `tpkit run` before any image is made, and by the reward itself on every call."""
    for prompt, meta in zip(prompts, metadata):
        if not isinstance(meta, dict) or "tag" not in meta or "include" not in meta:
            raise RewardError(f"reward {reward!r}: prompt {prompt!r} has no GenEval metadata (fields 'tag' and "
                              "'include')", _PROMPTS_FIX)
        try:
            check_meta(meta)
        except ValueError as e:
            raise RewardError(f"reward {reward!r}: prompt {prompt!r} has bad GenEval metadata: {e}", _PROMPTS_FIX) from None


def _judging_reward(reward: str, options: dict, more: dict | None = None) -> Callable[[list, list, list], list[Judgement]]:
    """The judge behind a reward: options detector, clip and batch_size checked and models loaded now
    (`more`: the reward's own further options with their defaults, which it checks itself)."""
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
        check_inputs(prompts + ["?"] * (len(metadata) - len(prompts)), metadata, reward)
        # one call, as `tpkit eval geneval` makes it: the model detector batches by batch_size itself,
        # the shapes detector spreads the whole call over its workers
        return detect_and_judge(images, metadata, detector, colours, batch_size=batch_size)

    return run


def geneval_files(options: dict) -> list[tuple]:
    """What geneval and geneval-strict load (see registry.REQUIREMENTS): the detector and the colour
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
