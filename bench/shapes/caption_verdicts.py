"""Does a preference model read the shapes detector's verdict on the generator's own blobs?

    python bench/shapes/caption_verdicts.py --model NAME=FOLDER [--model ...] [--bank RUN/samples.npz] [--out DIR]

Fresh `tiny-shapes` samples of every train prompt (2 each, the rollout's 10 ODE steps, noise seed 1: other
noise than any training bank's seed 0), each paired with every one-detail-wrong train prompt whose dense
score on the sample's detections differs from its own prompt's (`preference._caption_verdicts`, the pairs
`--caption-pairs` trains on). Per model: how often the reward puts the caption the detector's verdict
scores higher first, over all pairs, over the pairs where the own prompt wins (the sample drew it), and
over those where the wrong prompt wins (the sample drew that instead: the detector saw a circle where a
square was asked). Always preferring the own prompt scores 1 and 0 on those two; a model that reads the
verdict scores high on both. --bank: a training run's own sample bank instead (did the model fit the
verdicts it was trained on?). Writes OUT/results.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from tpkit.models.names import SHAPES_PICKSCORE
from tpkit.shapes import preference

sys.path.insert(0, str(Path(__file__).parent))
from reward_quality import reward  # noqa: E402  (the pickscore reward, as `tpkit score` builds it)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", default=[], help="NAME=FOLDER (repeatable; default: the shipped model)")
    ap.add_argument("--bank", type=Path, default=None, help="a run's samples.npz instead of fresh samples")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    named = dict(m.split("=", 1) for m in args.model) or {"shipped": SHAPES_PICKSCORE}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.bank or preference.sample_bank(Path(tmp) / "fresh.npz", preference.Recipe(seed=1, samples_per_prompt=2))
        bank = preference._bank(str(path))
        verdicts = preference._caption_verdicts(str(path))
    entries = [e for es in verdicts.values() for e in es]
    tags = np.array([t for t, es in verdicts.items() for _ in es])
    own = np.array([better == str(bank["prompts"][i]) for i, better, _ in entries])
    images = [Image.fromarray(bank["images"][i]) for i, _, _ in entries]
    results = {"pairs": len(entries), "own_wins": int(own.sum()), "models": {},
               "wrong_wins_by_task": {t: int((~own & (tags == t)).sum()) for t in verdicts}}
    for name, folder in named.items():
        score = reward(folder)
        s_better = np.asarray(score(images, [b for _, b, _ in entries]))
        s_worse = np.asarray(score(images, [w for _, _, w in entries]))
        right = s_better > s_worse
        results["models"][name] = {"all": float(right.mean()), "own_wins": float(right[own].mean()),
                                   "wrong_wins": float(right[~own].mean()),
                                   "wrong_wins_by_task": {t: float(right[~own & (tags == t)].mean())
                                                          for t in verdicts if (~own & (tags == t)).any()}}
    where = f"the bank {args.bank}" if args.bank else "fresh samples of the train prompts"
    lines = [f"{len(entries)} caption pairs on {len(bank['images'])} samples ({where}); "
             f"the own prompt wins {own.sum()}, a one-detail-wrong one {(~own).sum()}", "",
             "| model | all pairs | own prompt wins | wrong prompt wins |", "|---|---|---|---|"]
    lines += [f"| {n} | {r['all']:.3f} | {r['own_wins']:.3f} | {r['wrong_wins']:.3f} |" for n, r in results["models"].items()]
    by_task = [t for t, n in results["wrong_wins_by_task"].items() if n]
    lines += ["", "Wrong prompt wins, by task (pairs in brackets):", "",
              "| model | " + " | ".join(f"{t} ({results['wrong_wins_by_task'][t]})" for t in by_task) + " |",
              "|---|" + "---|" * len(by_task)]
    lines += [f"| {n} | " + " | ".join(f"{r['wrong_wins_by_task'][t]:.3f}" for t in by_task) + " |"
              for n, r in results["models"].items()]
    results["seconds"] = round(time.time() - t0, 1)
    print("\n".join(lines) + f"\n\n({results['seconds']} s)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
