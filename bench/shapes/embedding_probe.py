"""Does the preference model's image tower see what the shapes detector sees on the generator's blobs?

    python bench/shapes/embedding_probe.py [--model NAME=FOLDER ...] [--per-prompt 8] [--out DIR]

The learned reward's Spearman correlation with GenEval's dense score stays near 0.3 whatever it is trained on
(docs/testbed.md). Either its image tower does not carry the detector's verdict on a blob (a rounded red blob:
circle or square?), or it carries it and the cosine with the caption does not read it. Linear probes on frozen
features tell the two apart. Ridge regressions, fitted on fresh `tiny-shapes` samples of the **train** prompts
(`--per-prompt` each, the rollout's 10 ODE steps, noise seed 1: not any training bank's), their penalty chosen on a
fifth of those prompts held out, scored on samples of the **test** prompts (4 each, `reward_quality.draw_samples`):

1. what the detector found: how many objects of each colour and class (5 x 4 counts; R^2 over all 20 counts, and
   how often every count, rounded, is exact), from (a) the reward's image embedding (the projection its cosine
   uses), (b) the vision tower's last hidden states (every patch token, before pooling) and (c) the pixels
   themselves (16 x 16 average-pooled, and all 64 x 64), which bound what a linear read of the image can do;
2. GenEval's dense score under the sample's own prompt, from the image embedding with the caption's (both, and
   their product: a reweighted cosine), and from the image's tokens with the prompt as one-hot words: the
   Spearman correlation a linear read of the frozen towers reaches, beside the reward's own.

Writes OUT/results.json and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tpkit.models.names import SHAPES_PICKSCORE
from tpkit.rewards.clip import ClipEmbedder
from tpkit.shapes import preference

sys.path.insert(0, str(Path(__file__).parent))
from reward_quality import draw_samples, reward, spearman, write_results  # noqa: E402

PENALTIES = 10.0 ** np.arange(-3, 5)


def ridge(x: np.ndarray, y: np.ndarray, penalty: float):
    """Ridge regression in its dual form (features may outnumber samples); returns a predictor."""
    mx, my, sx = x.mean(0), y.mean(0), x.std(0) + 1e-8
    z = (x - mx) / sx
    alpha = np.linalg.solve(z @ z.T + penalty * len(z) * np.eye(len(z)), y - my)
    w = z.T @ alpha
    return lambda q: ((q - mx) / sx) @ w + my


def fit(x: np.ndarray, y: np.ndarray, groups: np.ndarray, score) -> tuple:
    """The penalty that scores best on a fifth of the groups (prompts) held out, refitted on all."""
    held = np.isin(groups, np.unique(groups)[::5])
    best = max(PENALTIES, key=lambda p: score(ridge(x[~held], y[~held], p)(x[held]), y[held]))
    return ridge(x, y, best), float(best)


def r2(pred: np.ndarray, y: np.ndarray) -> float:
    return float(1 - ((pred - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())


def exact(pred: np.ndarray, y: np.ndarray) -> float:
    return float((np.clip(np.rint(pred), 0, None) == y).all(1).mean())


def features(clip: ClipEmbedder, images: list, prompts: list[str], vocab: list[str]) -> dict[str, np.ndarray]:
    emb = clip.images(images).numpy()
    txt = clip.texts(prompts).numpy()
    tokens = []
    with torch.no_grad():
        for b in range(0, len(images), 256):
            pixels = clip.processor(images=images[b: b + 256], return_tensors="pt")["pixel_values"]
            hidden = clip.model.vision_model(pixel_values=pixels).last_hidden_state
            tokens.append(hidden.flatten(1).numpy())
    arrays = np.stack([np.asarray(im, np.float64) / 255 for im in images])
    pooled = arrays.reshape(len(arrays), 16, 4, 16, 4, 3).mean((2, 4))
    words = np.array([[w in p.split() for w in vocab] for p in prompts], np.float64)
    return {"embedding": emb, "tokens": np.concatenate(tokens), "pixels 16x16": pooled.reshape(len(arrays), -1),
            "pixels 64x64": arrays.reshape(len(arrays), -1),
            "embedding + caption": np.concatenate([emb, txt, emb * txt], 1),
            "tokens + prompt words": np.concatenate([np.concatenate(tokens), words], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", default=[], help="NAME=FOLDER (repeatable; default: the shipped model)")
    ap.add_argument("--per-prompt", type=int, default=8, help="fresh samples of each train prompt to fit on")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    named = dict(m.split("=", 1) for m in args.model) or {"shipped": SHAPES_PICKSCORE}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        path = preference.sample_bank(Path(tmp) / "fresh.npz", preference.Recipe(seed=1, samples_per_prompt=args.per_prompt))
        with np.load(path) as z:
            bank = {k: z[k] for k in z.files}
        counts = preference._bank_counts(str(path))  # the detector's, as --detector-aux trains on them
    train_images = [Image.fromarray(a) for a in bank["images"]]
    train = {"images": train_images, "prompts": [str(p) for p in bank["prompts"]], "dense": bank["dense"], "counts": counts}
    results: dict = {"train_samples": len(train_images), "models": {}}
    for name, folder in named.items():
        rows = draw_samples(reward(folder), 4, steps=10, split="test")
        test = {"images": [r["image"] for r in rows], "prompts": [r["prompt"] for r in rows],
                "dense": np.array([r["dense"] for r in rows]), "counts": np.stack([preference.detected_counts(r["detections"]) for r in rows]),
                "reward": np.array([r["reward"] for r in rows])}
        clip = ClipEmbedder("pickscore", folder, None, 256, "float32")
        vocab = sorted({w for p in train["prompts"] + test["prompts"] for w in p.split()})
        f_train = features(clip, train["images"], train["prompts"], vocab)
        f_test = features(clip, test["images"], test["prompts"], vocab)
        groups = np.array(train["prompts"])
        out = {"test_samples": len(rows), "reward_spearman": spearman(test["reward"], test["dense"]), "counts": {}, "dense": {}}
        for feat in ("embedding", "tokens", "pixels 16x16", "pixels 64x64"):
            predict, penalty = fit(f_train[feat], train["counts"], groups, r2)
            pred = predict(f_test[feat])
            out["counts"][feat] = {"r2": r2(pred, test["counts"]), "exact": exact(pred, test["counts"]), "penalty": penalty,
                                   "train_r2": r2(predict(f_train[feat]), train["counts"])}
        for feat in ("embedding + caption", "tokens + prompt words"):
            predict, penalty = fit(f_train[feat], train["dense"], groups, spearman)
            out["dense"][feat] = {"spearman": spearman(predict(f_test[feat]), test["dense"]), "penalty": penalty}
        results["models"][name] = out
    lines = [f"fit on {results['train_samples']} fresh samples of the train prompts, scored on the test prompts' samples", "",
             "| model | features | counts R^2 | all 20 counts exact | (train R^2) |", "|---|---|---|---|---|"]
    for name, out in results["models"].items():
        lines += [f"| {name} | {f} | {c['r2']:.3f} | {c['exact']:.3f} | {c['train_r2']:.3f} |" for f, c in out["counts"].items()]
    lines += ["", "| model | the reward's own Spearman | " + " | ".join(next(iter(results["models"].values()))["dense"]) + " |",
              "|---|---|---|---|"]
    lines += [f"| {name} | {out['reward_spearman']:.3f} | " + " | ".join(f"{d['spearman']:.3f}" for d in out["dense"].values()) + " |"
              for name, out in results["models"].items()]
    results["seconds"] = round(time.time() - t0, 1)
    command = "python bench/shapes/embedding_probe.py " + " ".join(sys.argv[1:])
    md = ["# Linear probes of frozen features", "", f"`{command}` ({results['seconds']} s)", "", *lines]
    write_results(args.out, results, md)


if __name__ == "__main__":
    main()
