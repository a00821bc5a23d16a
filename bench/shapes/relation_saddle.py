"""Why does `tiny-shapes-pickscore` not learn "left of" from "right of"? A relation-only task, with and without
`--layout-aux`.

    python bench/shapes/relation_saddle.py [--steps 600] [--pairs 32] [--out bench/shapes/reward/relation]

A fresh model (the shipped architecture and seed) sees only mirrored pairs: a scene for "a photo of a X left
of a Y" (X, Y from three shape pairs) and the same scene mirrored, captioned "... X right of a Y". The loss is
the pretraining's own (`preference.loss`) on batches of such pairs: each image over its caption and the flipped
one, each caption over the two images. Nothing but where the shapes are tells the two apart. Printed every 25 steps: the loss
(2 ln 2 = 1.386 at chance), the image's accuracy, and the cosine between the two images' embeddings and
between the two captions' embeddings. Then the same with the layout head of `layout_aux` (weight 1). Writes
OUT/results.json and OUT/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tpkit.shapes import preference
from tpkit.shapes import scenes as shapes

sys.path.insert(0, str(Path(__file__).parent))
from reward_quality import write_results  # noqa: E402

PAIRS = (("circle", "square"), ("triangle", "circle"), ("square", "triangle"))


def mirrored_batch(rng: np.random.Generator, n: int, layout: bool) -> preference.Batch:
    """n pairs (images 2i and 2i + 1: a scene and its mirror), each image's candidates its own caption and the
    flipped one; the layout targets when `layout`."""
    images, captions, scenes_ = [], [], []
    for _ in range(n):
        a, b = PAIRS[int(rng.integers(len(PAIRS)))]
        relation = ("left of", "right of")[int(rng.integers(2))]
        scene = shapes.scene_for(shapes.metadata("position", a, b, relation=relation), rng)
        mirror = shapes.mirrored(scene, shapes.metadata("position", a, b, relation=preference.OPPOSITE[relation]), "x")
        images += [shapes.render(scene, preference.SIZE), shapes.render(mirror, preference.SIZE)]
        captions += [scene.prompt, mirror.prompt]
        scenes_ += [scene, mirror]
    candidates = [[c, captions[i ^ 1]] for i, c in enumerate(captions)]  # the pair's other caption: the flipped one
    return preference.Batch(preference._to_model(np.stack(images) / 255.0), captions, candidates,
                            layout=preference.layout_targets(scenes_) if layout else None)


def run(steps: int, pairs: int, layout_aux: float, seed: int = 0) -> list[dict]:
    """The pretraining's own loss (`preference.loss`) on mirrored batches only."""
    model, processor = preference.build(seed=seed)
    head = preference.layout_head(preference.Arch()) if layout_aux else None
    params = list(model.parameters()) + (list(head.parameters()) if head is not None else [])
    opt = torch.optim.AdamW(params, lr=preference.Recipe.lr, weight_decay=preference.Recipe.weight_decay)
    rng, log = np.random.default_rng(seed), []
    for step in range(steps + 1):
        batch = mirrored_batch(rng, pairs, layout=head is not None)
        if step % 25 == 0:
            with torch.no_grad():  # the embeddings the loss below sees, before this step's update
                img, txt = preference.embed(model, processor.tokenizer, batch.pixels, batch.captions)
        total, info = preference.loss(model, processor.tokenizer, batch, head=head, layout_weight=layout_aux)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            other = torch.arange(len(batch.captions)) ^ 1
            row = {"step": step, "loss": round(info["loss"] - layout_aux * info.get("layout_loss", 0.0), 4),
                   "accuracy": round(info["caption_acc"], 3),
                   "cos_images": round((img * img[other]).sum(-1).mean().item(), 5),
                   "cos_captions": round((txt * txt[other]).sum(-1).mean().item(), 5)}
            log.append(row)
            print(f"layout_aux {layout_aux}: " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--pairs", type=int, default=32, help="mirrored pairs per batch")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "reward" / "relation")
    a = ap.parse_args()
    t0 = time.time()
    result = {"steps": a.steps, "pairs": a.pairs, "runs": {str(w): run(a.steps, a.pairs, w) for w in (0.0, 1.0)}}
    result["seconds"] = round(time.time() - t0, 1)
    md = ["# A relation alone: mirrored pairs, without and with the layout head\n",
          f"`python bench/shapes/relation_saddle.py --steps {a.steps} --pairs {a.pairs}` ({result['seconds']} s). "
          "Loss at chance: 2 ln 2 = 1.386. Cosines: between a scene's and its mirror's image embeddings, and "
          "between the two captions' embeddings.\n",
          "| step | loss | accuracy | cos images | cos captions | loss, layout head | accuracy | cos images | cos captions |",
          "|---|---|---|---|---|---|---|---|---|"]
    for off, on in zip(result["runs"]["0.0"], result["runs"]["1.0"]):
        md.append(f"| {off['step']} | " + " | ".join(str(r[k]) for r in (off, on)
                                                      for k in ("loss", "accuracy", "cos_images", "cos_captions")) + " |")
    write_results(a.out, result, md)


if __name__ == "__main__":
    main()
