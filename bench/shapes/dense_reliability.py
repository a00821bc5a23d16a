"""How reliable is GenEval's dense score on `tiny-shapes` samples, the criterion the preference model is held to?

    python bench/shapes/dense_reliability.py [--model tiny-shapes-pickscore] [--samples 4] [--steps 40]
                                             [--out bench/shapes/reward/reliability]

The samples of `reward_quality.py` (every test prompt, `--samples` each, noise seed 0), then each changed
in ways no one would call a different picture: moved 1 px right, blurred (Gaussian sigma 0.5 px), pixel
noise (std 2 of 255). Each changed image is detected and judged again, and scored by the reward again.
Per change: how many samples' dense score (and correct/incorrect verdict) moves, and the Spearman
correlation of the dense score with itself across the change (its test-retest reliability), over all
samples and within a prompt; beside it the reward's own test-retest correlation and the reward's
correlation with the dense score. Then the reward's agreement with itself on fresh renders moved by 1 px
(no image the model trained on), and per task the mean reward at each dense score of the unchanged samples. A criterion that correlates only r with itself under such changes
bounds what any judge of the picture can reach against it (about sqrt(r) for a judge that reads the
picture perfectly, if the changes are a fair model of the detector's noise).

Writes OUT/results.json and OUT/RESULTS.md and prints the table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from tpkit.geneval import detectors
from tpkit.geneval.judge import judge
from tpkit.models.names import SHAPES_PICKSCORE
from tpkit.shapes import preference
from tpkit.shapes import scenes as shapes

sys.path.insert(0, str(Path(__file__).parent))
from reward_quality import draw_samples, num, reward, spearman, within_prompt, write_results  # noqa: E402


def shifted(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One pixel to the right, the left column repeated (the background)."""
    return np.concatenate([a[:, :1], a[:, :-1]], axis=1)


def blurred(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.clip(shapes.blur(a, 0.5), 0, 255).round().astype(np.uint8)


def noisy(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.clip(a + rng.normal(0, 2.0, a.shape), 0, 255).round().astype(np.uint8)


CHANGES = {"moved 1 px": shifted, "blurred 0.5 px": blurred, "noise std 2/255": noisy}


def renders_moved(score, per_prompt: int, seed: int = 0) -> dict:
    """The reward's own agreement under a 1 px move on fresh renders (`per_prompt` scenes of every test prompt,
    blurred by 1 px like samples), where no training image was ever seen: is the shift noise the model's, or
    its memory of the bank's images at one offset?"""
    rng = np.random.default_rng(seed)
    rows = []
    for meta in (m for tag in shapes.TAGS for m in shapes.split_prompts(tag, "test")):
        for _ in range(per_prompt):
            a = np.clip(shapes.blur(shapes.render(shapes.scene_for(meta, rng), preference.SIZE), 1.0), 0, 255)
            rows.append({"prompt": meta["prompt"], "image": a.round().astype(np.uint8)})
    caps = [r["prompt"] for r in rows]
    for key, images in (("reward", [r["image"] for r in rows]), ("reward2", [shifted(r["image"], rng) for r in rows])):
        for r, s in zip(rows, score([Image.fromarray(a) for a in images], caps)):
            r[key] = s
    within, _ = within_prompt(rows, "reward", "reward2")
    spread = np.mean([np.std([r["reward"] for r in rows if r["prompt"] == p]) for p in set(caps)])
    return {"renders": len(rows), "mean_change": float(np.mean([abs(r["reward"] - r["reward2"]) for r in rows])),
            "spread_within_prompt": float(spread), "reward_retest_within_prompt": within,
            "reward_retest": spearman([r["reward"] for r in rows], [r["reward2"] for r in rows])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=SHAPES_PICKSCORE, help="CLIP preference model (built-in name or folder).")
    ap.add_argument("--samples", type=int, default=4, help="tiny-shapes samples per test prompt.")
    ap.add_argument("--steps", type=int, default=40, help="ODE steps (40: the eval sampler's, as reward_quality's headline).")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "reward" / "reliability")
    a = ap.parse_args()
    if a.samples < 2:
        ap.error(f"--samples {a.samples}: a correlation within a prompt needs at least 2 samples of it")
    t0 = time.time()
    score = reward(a.model)
    rows = draw_samples(score, a.samples, a.steps)
    detector, _ = detectors.load_models("shapes")
    rng = np.random.default_rng(0)
    base_within, spread = within_prompt(rows, "reward", "dense")
    result = {"model": a.model, "samples": len(rows), "steps": a.steps,
              "reward_vs_dense": {"all": spearman([r["reward"] for r in rows], [r["dense"] for r in rows]),
                                  "within_prompt": base_within, "prompts": spread},
              "changes": {}}
    for name, change in CHANGES.items():
        images = [Image.fromarray(change(np.asarray(r["image"]), rng)) for r in rows]
        dets = detector(images)
        rewards = score(images, [r["prompt"] for r in rows])
        verdicts = [judge(r["meta"], d) for r, d in zip(rows, dets)]
        changed = [{**r, "dense2": j.score, "correct2": j.correct, "reward2": s} for r, j, s in zip(rows, verdicts, rewards)]
        dense_within, dense_prompts = within_prompt(changed, "dense", "dense2")
        reward_within, _ = within_prompt(changed, "reward", "reward2")
        result["changes"][name] = {
            "dense_moved": float(np.mean([c["dense"] != c["dense2"] for c in changed])),
            "verdict_flipped": float(np.mean([c["correct"] != c["correct2"] for c in changed])),
            "dense_retest": spearman([c["dense"] for c in changed], [c["dense2"] for c in changed]),
            "dense_retest_within_prompt": dense_within, "dense_retest_prompts": dense_prompts,
            "reward_retest": spearman([c["reward"] for c in changed], [c["reward2"] for c in changed]),
            "reward_retest_within_prompt": reward_within,
            "reward_vs_changed_dense": spearman([c["reward"] for c in changed], [c["dense2"] for c in changed]),
        }
    result["renders_moved"] = renders_moved(score, a.samples)
    # what the reward pays for each grade of a task's samples: partial credit is most of the dense score's ranks
    result["reward_by_dense"] = {t: {f"{d:g}": {"n": int(sum(r["dense"] == d for r in rs)),
                                                "reward": float(np.mean([r["reward"] for r in rs if r["dense"] == d]))}
                                     for d in sorted({r["dense"] for r in rs})}
                                 for t in shapes.TAGS if (rs := [r for r in rows if r["tag"] == t])}
    result["seconds"] = round(time.time() - t0, 1)
    b = result["reward_vs_dense"]
    md = ["# GenEval's dense score on tiny-shapes samples: how much it moves when the picture does not\n",
          f"`python bench/shapes/dense_reliability.py --model {a.model} --samples {a.samples} --steps {a.steps}` "
          f"({result['seconds']} s): {len(rows)} samples of the test prompts, {a.steps} ODE steps. The reward against "
          f"the dense score: Spearman {b['all']:.3f} over all, {num(b['within_prompt'])} within a prompt "
          f"(mean over {b['prompts']} prompts whose samples differ).\n",
          "| change | dense score moved | verdict flipped | dense vs itself | ... within a prompt | reward vs itself "
          "| ... within a prompt | reward vs changed dense |", "|---|---|---|---|---|---|---|---|"]
    for name, c in result["changes"].items():
        md.append(f"| {name} | {c['dense_moved']:.1%} | {c['verdict_flipped']:.1%} | {c['dense_retest']:.3f} | "
                  f"{num(c['dense_retest_within_prompt'])} ({c['dense_retest_prompts']}) | {c['reward_retest']:.3f} | "
                  f"{num(c['reward_retest_within_prompt'])} | {c['reward_vs_changed_dense']:.3f} |")
    m = result["renders_moved"]
    md += ["", f"Fresh renders of the test prompts ({m['renders']}, blurred 1 px), moved by 1 px: the reward changes by "
           f"{m['mean_change']:.3f} on average, where a prompt's renders spread by {m['spread_within_prompt']:.3f} (sd); "
           f"its ranks agree with themselves at {num(m['reward_retest_within_prompt'])} within a prompt, "
           f"{m['reward_retest']:.3f} over all."]
    md += ["", "Mean reward of the samples at each dense score (how many in brackets):", ""]
    md += [f"- {t}: " + ", ".join(f"{float(d):.3g}: {v['reward']:.2f} ({v['n']})" for d, v in levels.items())
           for t, levels in result["reward_by_dense"].items()]
    write_results(a.out, result, md)


if __name__ == "__main__":
    main()
