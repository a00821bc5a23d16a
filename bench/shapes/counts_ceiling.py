"""How much of the shapes detector's reading of the generator's blobs can the reward's vision tower learn at all?

    python bench/shapes/counts_ceiling.py [--per-prompt 16 32] [--steps 1500] [--out DIR]

`bench/shapes/embedding_probe.py` finds that the preference model's image embedding carries a third of what the
detector finds in test prompts' samples (R^2 0.33), and 0.41 when a head teaches it those counts beside the contrastive
loss (`--detector-aux`). Is that the joint objective, or the tower and the data? Here the same vision tower
(`preference.build()`'s CLIPModel, the same width, patches and projection) trains on nothing but the detector's counts
(5 colours x 4 classes, `preference.detected_counts`) of fresh samples of the **train** prompts (`--per-prompt` each, the
rollout's 10 ODE steps, noise seed 1), with `preference.detector_head` on its embedding (squared error summed over the
counts), and is scored on the **test** prompts' samples (4 each, `reward_quality.draw_samples`): R^2 of the counts,
how often all 20 are right once rounded, and how often the count of the colour-class pairs a colour-binding prompt
asks for is right. One line per bank size: whether more judged samples would teach the tower more.

Writes OUT/results.json and OUT/RESULTS.md and prints them.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tpkit.shapes import preference

sys.path.insert(0, str(Path(__file__).parent))
from embedding_probe import exact, r2  # noqa: E402
from reward_quality import draw_samples, write_results  # noqa: E402


def pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 [N, 64, 64, 3] -> the model's input, as the reward's training feeds it."""
    return preference._to_model(images / 255.0)


def train_tower(images: np.ndarray, counts: np.ndarray, steps: int, batch: int = 64, lr: float = 1e-3):
    """The reward's vision tower and a counts head, trained on (images, counts) alone; returns a predictor."""
    torch.manual_seed(0)
    model, _ = preference.build()
    head = preference.detector_head(preference.Arch())
    params = list(model.vision_model.parameters()) + list(model.visual_projection.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.05)
    rng = np.random.default_rng(0)
    x, y = pixels(images), torch.from_numpy(counts)
    model.train(), head.train()
    for step in range(steps):
        for g in opt.param_groups:  # warm-up, then cosine, as the reward's own schedule
            g["lr"] = lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        idx = torch.from_numpy(rng.integers(len(x), size=batch))
        loss = ((head(preference.embed_images(model, x[idx])) - y[idx]) ** 2).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    model.eval(), head.eval()

    def predict(images: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return torch.cat([head(preference.embed_images(model, pixels(images[b: b + 256])))
                              for b in range(0, len(images), 256)]).numpy()
    return predict, float(loss.item())


def asked(rows: list[dict], pred: np.ndarray, truth: np.ndarray) -> float:
    """Over the colour-binding samples: how often the predicted count of each (colour, class) the prompt asks for,
    rounded, is the detector's (what its dense score is made of)."""
    right = []
    for r, p, t in zip(rows, pred, truth):
        if r["tag"] == "color_attr":
            for obj in r["meta"]["include"]:
                k = preference.DETECTED.index((obj["color"], obj["class"]))
                right.append(max(0, round(float(p[k]))) == t[k])
    return float(np.mean(right))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-prompt", type=int, nargs="+", default=[16, 32], help="bank sizes: samples of each train prompt")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.time()
    rows = draw_samples(lambda images, prompts: [0.0] * len(images), 4, steps=10, split="test")
    test_images = np.stack([np.asarray(r["image"]) for r in rows])
    test_counts = np.stack([preference.detected_counts(r["detections"]) for r in rows])
    results: dict = {"test_samples": len(rows), "steps": args.steps, "banks": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = preference.sample_bank(Path(tmp) / "bank.npz", preference.Recipe(seed=1, samples_per_prompt=max(args.per_prompt)))
        with np.load(path) as z:
            images, prompts = z["images"], z["prompts"]
        counts = preference._bank_counts(str(path))  # the detector's, as --detector-aux trains on them
    order = np.argsort(prompts, kind="stable")  # per prompt, its samples in drawing order: a smaller bank is a prefix
    for n in sorted(args.per_prompt):
        keep = np.concatenate([order[np.flatnonzero(prompts[order] == p)[:n]] for p in np.unique(prompts)])
        t = time.time()
        predict, last = train_tower(images[keep], counts[keep], args.steps)
        pred = predict(test_images)
        results["banks"].append({"per_prompt": n, "samples": int(len(keep)), "train_loss": last,
                                 "train_r2": r2(predict(images[keep]), counts[keep]), "r2": r2(pred, test_counts),
                                 "exact": exact(pred, test_counts), "asked": asked(rows, pred, test_counts),
                                 "minutes": round((time.time() - t) / 60, 1)})
    lines = [f"The reward's vision tower trained on the detector's counts alone ({args.steps} steps of 64), scored on "
             f"{len(rows)} samples of the test prompts", "",
             "| bank (samples) | counts R^2, test | all 20 counts exact | colour binding: asked counts right | train R^2 | minutes |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {b['per_prompt']} a prompt ({b['samples']}) | {b['r2']:.3f} | {b['exact']:.3f} | {b['asked']:.3f} | "
              f"{b['train_r2']:.3f} | {b['minutes']} |" for b in results["banks"]]
    results["seconds"] = round(time.time() - t0, 1)
    command = "python bench/shapes/counts_ceiling.py " + " ".join(sys.argv[1:])
    md = ["# The counts a vision tower can learn", "", f"`{command}` ({results['seconds']} s)", "", *lines]
    write_results(args.out, results, md)


if __name__ == "__main__":
    main()
