"""How much of tiny-shapes' GenEval accuracy is the detector's confidence: the verdict at GenEval's
detection thresholds (0.3; 0.9 for `counting`) against one threshold for every task.

    python bench/shapes/detection_thresholds.py [--prompts FILE] [--lora NAME=ADAPTER ...] [--thresholds 0.3 0.9]
        [--images-per-prompt 4] [--out bench/shapes/tune/task-mix/thresholds.json]

The base model (and each adapter from `tpkit train`, e.g. a tuning run's RUNS/recipe-s0/round-0005/train/adapter)
is sampled like `bench/shapes/shapes_checkpoint.py` (40 ODE steps, CFG, the same seeds for every row) on the
prompts (default: 16 train prompts a task; give tune_shapes.py's RUNS/val.jsonl for the validation
split; never the test split for a choice) once, then detected and judged by GenEval's rules with the
detections kept above each threshold. Prints a table, writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tpkit.shapes import model as sm
from tpkit.shapes import scenes as shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=Path, help="GenEval-style .jsonl (default: 16 train prompts a task)")
    ap.add_argument("--lora", action="append", default=[], help="NAME=ADAPTER (repeatable): rows after the base model")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.9])
    ap.add_argument("--images-per-prompt", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("bench/shapes/tune/task-mix/thresholds.json"))
    a = ap.parse_args()
    meta = ([json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()] if a.prompts
            else shapes.prompts("train", n=16))
    rows = []
    for name, lora in [("base", None)] + [tuple(x.split("=", 1)) for x in a.lora]:
        thresholds = (None, *a.thresholds)
        accs = sm.accuracies("tiny-shapes", meta, thresholds, images_per_prompt=a.images_per_prompt, lora=lora)
        for th, acc in zip(thresholds, accs):
            rows.append(dict(model=name, lora=lora, threshold=th, **acc))
            print(f"{name} threshold {th or 'GenEval'}: overall {acc['overall']:.3f}, counting {acc['counting']:.3f}",
                  flush=True)
    tags = [t for t in shapes.TAGS if t in rows[0]]
    n = {t: sum(m["tag"] == t for m in meta) * a.images_per_prompt for t in tags}
    print(f"\n{len(meta)} prompts x {a.images_per_prompt} images ({', '.join(f'{t} {n[t]}' for t in tags)}). "
          f"Regenerate: `python {' '.join(sys.argv)}`\n")
    print("| model | detection threshold | overall | " + " | ".join(tags) + " |")
    print("|---" * (3 + len(tags)) + "|")
    for r in rows:
        th = "GenEval's (0.3; counting 0.9)" if r["threshold"] is None else f"{r['threshold']} for every task"
        print(f"| {r['model']} | {th} | {r['overall']:.3f} | " + " | ".join(f"{r[t]:.3f}" for t in tags) + " |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(dict(prompts=str(a.prompts or "train, n=16"), images_per_prompt=a.images_per_prompt,
                                     images=n, rows=rows), indent=1))


if __name__ == "__main__":
    main()
