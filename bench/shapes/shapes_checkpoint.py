"""Choosing tiny-shapes' weights and sampling guidance on *train* prompts (never the test split).

    python bench/shapes/shapes_checkpoint.py --model NAME=PATH ... [--guidance 1.5 2.0 3.0] [--n 16]
        [--images-per-prompt 4] [--out bench/shapes/checkpoint]

Each model (a folder from `tpkit pretrain-shapes`: DIR/pipeline or DIR/snapshots/step-N, or a built-in
name such as tiny-shapes) is sampled like `tpkit eval geneval` (40 ODE steps, CFG, one seed per image,
the same seeds for every model) on `n` train prompts per task, at every guidance, and judged by the
shapes detector through GenEval's rules. Prints and writes (OUT/RESULTS.md, OUT/results.json) accuracy
per task and overall with 95 % intervals (Wilson per task; overall: the mean of the six tasks, its
interval from their binomial variances), and each row's paired difference from the first model at the
same guidance (same prompts and seeds).

    python bench/shapes/shapes_checkpoint.py --model tiny-shapes --grid docs/tiny-shapes-samples.png

draws the README's figure instead: GRID_PROMPTS (held-out prompts, chosen for the picture, not
scored) x seeds 0-5 from the first model at its guidance.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from tpkit.shapes import model as sm
from tpkit.shapes import scenes as shapes


GRID_PROMPTS = [f"a photo of {p}" for p in (
    "a square", "a triangle", "a triangle and a diamond", "two squares", "a blue triangle",
    "a circle left of a triangle", "a red circle and a yellow square")]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def overall_interval(acc: dict, counts: dict) -> float:
    """95 % half-width of the unweighted mean of per-task accuracies (independent binomials)."""
    var = sum(acc[t] * (1 - acc[t]) / counts[t] for t in shapes.TAGS) / len(shapes.TAGS) ** 2
    return 1.96 * math.sqrt(var)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True, help="NAME=PATH (repeatable; the first is the reference)")
    ap.add_argument("--guidance", type=float, nargs="+", default=[sm.GUIDANCE])
    ap.add_argument("--n", type=int, default=16, help="train prompts per task")
    ap.add_argument("--images-per-prompt", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/shapes/checkpoint"))
    ap.add_argument("--grid", type=Path, help="only draw GRID_PROMPTS x 6 seeds from the first model to this PNG")
    a = ap.parse_args()
    models = [m.split("=", 1) if "=" in m else (m, m) for m in a.model]
    if a.grid:
        print(sm.sample_grid(models[0][1], GRID_PROMPTS, list(range(6)), a.grid, guidance=a.guidance[0]))
        return
    meta = shapes.prompts("train", n=a.n)
    counts = {t: a.n * a.images_per_prompt for t in shapes.TAGS}
    rows = []
    for g in a.guidance:
        for name, path in models:
            t0 = time.monotonic()
            acc = sm.accuracy(path, meta, images_per_prompt=a.images_per_prompt, guidance=g, seed=a.seed)
            rows.append(dict(model=name, path=path, guidance=g, seconds=round(time.monotonic() - t0, 1), **acc))
            print(f"{name} g={g}: overall {acc['overall']:.3f}, single_object {acc['single_object']:.3f} "
                  f"({rows[-1]['seconds']} s)", flush=True)
    lines = ["# tiny-shapes checkpoints on train prompts\n",
             f"{a.n} train prompts a task x {a.images_per_prompt} images ({counts['single_object']} images a task), "
             f"40 ODE steps, seed {a.seed}. Regenerate: `python {' '.join(sys.argv)}`\n",
             "| model | guidance | overall | " + " | ".join(shapes.TAGS) + " | overall - first model |",
             "|---" * (4 + len(shapes.TAGS)) + "|"]
    for r in rows:
        ref = next(x for x in rows if x["guidance"] == r["guidance"])
        cells = []
        for t in shapes.TAGS:
            lo, hi = wilson(round(r[t] * counts[t]), counts[t])
            cells.append(f"{r[t]:.3f} [{lo:.2f}, {hi:.2f}]")
        diff = "" if r is ref else f"{r['overall'] - ref['overall']:+.3f}"
        lines.append(f"| {r['model']} | {r['guidance']} | **{r['overall']:.3f}** ± {overall_interval(r, counts):.3f} | "
                     + " | ".join(cells) + f" | {diff} |")
    text = "\n".join(lines) + "\n"
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "RESULTS.md").write_text(text)
    (a.out / "results.json").write_text(json.dumps(dict(n=a.n, images_per_prompt=a.images_per_prompt, seed=a.seed,
                                                        rows=rows), indent=1))


if __name__ == "__main__":
    main()
