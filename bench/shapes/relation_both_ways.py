"""Does a preference model tell "X left of Y" from "X right of Y" for shape pairs it never saw in that relation?

    python bench/shapes/relation_both_ways.py --model NAME=FOLDER [--model ...] [--per-prompt 50] [--out DIR]

Fresh rendered scenes of every position prompt of both splits (`--per-prompt` each), each scored under its own
caption and the same shapes with the relation flipped (left of <-> right of, above <-> below). A pair of shapes
on one axis is one of three kinds by what pretraining read: both arrangements are train prompts ("trained"), one
is ("one trained"), or neither ("unseen"). Per kind, the accuracy over the scenes of *both* arrangements: a model
that prefers one caption whatever the picture (an unseen caption over a trained one, say) scores half, where
`reward_quality.py`'s per-split columns would credit it on one split and fault it on the other. Writes
OUT/results.json and OUT/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from tpkit.models.names import SHAPES_PICKSCORE
from tpkit.shapes import preference
from tpkit.shapes import scenes as shapes

sys.path.insert(0, str(Path(__file__).parent))
from reward_quality import reward, write_results  # noqa: E402

KINDS = ("trained", "one trained", "unseen")


def kind(meta: dict) -> str:
    """Which of KINDS a position prompt's pair of arrangements is."""
    trained = preference._in_split(meta, "train") + preference._in_split(preference.flipped_relation(meta), "train")
    return KINDS[2 - trained]


def scenes_by_kind(per_prompt: int, seed: int = 1234) -> dict[str, list[tuple]]:
    """{kind: [(image, own caption, flipped caption)]}: per_prompt fresh renders of every position prompt."""
    rng, out = np.random.default_rng(seed), {k: [] for k in KINDS}
    for meta in shapes.split_prompts("position"):
        flipped = preference.flipped_relation(meta)["prompt"]
        for _ in range(per_prompt):
            image = Image.fromarray(shapes.render(shapes.scene_for(meta, rng), preference.SIZE))
            out[kind(meta)].append((image, meta["prompt"], flipped))
    return out


def accuracy(score, items: list[tuple]) -> float:
    """How often the own caption scores above the flipped one."""
    images = [i for i, _, _ in items]
    own, flipped = (np.asarray(score(images, [t[k] for t in items])) for k in (1, 2))
    return float(np.mean(own > flipped))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", default=[], help="NAME=FOLDER (repeatable; default: the shipped model)")
    ap.add_argument("--per-prompt", type=int, default=50, help="rendered scenes per position prompt")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "reward" / "both-ways")
    a = ap.parse_args()
    if a.per_prompt < 1:
        ap.error("--per-prompt must be at least 1")
    named = dict(m.split("=", 1) for m in a.model) or {"shipped": SHAPES_PICKSCORE}
    t0 = time.time()
    items = scenes_by_kind(a.per_prompt)
    prompts = {k: len(v) // a.per_prompt for k, v in items.items()}
    result = {"per_prompt": a.per_prompt, "prompts": prompts, "models": {}}
    for name, folder in named.items():
        score = reward(folder)  # loaded once a model
        result["models"][name] = {k: accuracy(score, v) for k, v in items.items()}
    result["seconds"] = round(time.time() - t0, 1)
    md = ["# The relation both ways: own caption over the flipped one, on scenes of both arrangements of a pair\n",
          "`python bench/shapes/relation_both_ways.py " + " ".join(f"--model {n}={f}" for n, f in named.items())
          + f" --per-prompt {a.per_prompt}` ({result['seconds']} s). Position prompts of both splits, "
          f"{a.per_prompt} fresh renders each, grouped by what pretraining read of a pair's two arrangements "
          "(a prompt and its flipped relation): both, one, or neither. Half is chance, and also what a model that "
          "prefers one caption whatever the picture scores; a 95 % interval about it is +- 1.96 sqrt(0.25 / scenes).\n",
          "| model | " + " | ".join(f"{k} ({prompts[k]} prompts, {prompts[k] * a.per_prompt} scenes)" for k in KINDS) + " |",
          "|---" * (len(KINDS) + 1) + "|"]
    md += [f"| {name} | " + " | ".join(f"{acc[k]:.3f}" for k in KINDS) + " |" for name, acc in result["models"].items()]
    write_results(a.out, result, md)


if __name__ == "__main__":
    main()
