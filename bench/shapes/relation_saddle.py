"""Why does `tiny-shapes-pickscore` not learn "left of" from "right of"? A relation-only task, with and without
`--layout-aux`.

    python bench/shapes/relation_saddle.py [--steps 600] [--pairs 32] [--out bench/shapes/reward/relation]

A fresh model (the shipped architecture and seed) sees only mirrored pairs: a scene for "a photo of a X left
of a Y" (X, Y from three shape pairs) and the same scene mirrored, captioned "... X right of a Y". The loss is
the pretraining's, restricted to the pair: each image over its caption and the flipped one, each caption over
the two images. Nothing but where the shapes are tells the two apart. Printed every 25 steps: the loss
(2 ln 2 = 1.386 at chance), the image's accuracy, and the cosine between the two images' embeddings and
between the two captions' embeddings. Then the same with the layout head of `layout_aux` (weight 1). Writes
OUT/results.json and OUT/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from tpkit.shapes import preference
from tpkit.shapes import scenes as shapes

PAIRS = (("circle", "square"), ("triangle", "circle"), ("square", "triangle"))


def mirrored_batch(rng: np.random.Generator, n: int):
    """n pairs: (scene, mirror) images [2n, 3, S, S], their captions [2n], their scenes [2n]."""
    images, captions, scenes_ = [], [], []
    for _ in range(n):
        a, b = PAIRS[int(rng.integers(len(PAIRS)))]
        relation = ("left of", "right of")[int(rng.integers(2))]
        scene = shapes.scene_for(shapes.metadata("position", a, b, relation=relation), rng)
        mirror = dataclasses.replace(scene, objects=[dataclasses.replace(o, x=scene.size - o.x) for o in scene.objects])
        images += [shapes.render(scene, preference.SIZE), shapes.render(mirror, preference.SIZE)]
        captions += [shapes.metadata("position", a, b, relation=r)["prompt"]
                     for r in (relation, preference.OPPOSITE[relation])]
        scenes_ += [scene, mirror]
    return preference._to_model(np.stack(images) / 255.0), captions, scenes_


def run(steps: int, pairs: int, layout_aux: float, seed: int = 0) -> list[dict]:
    model, processor = preference.build(seed=seed)
    head = preference.layout_head(preference.Arch()) if layout_aux else None
    params = list(model.parameters()) + (list(head.parameters()) if head is not None else [])
    opt = torch.optim.AdamW(params, lr=preference.Recipe.lr, weight_decay=preference.Recipe.weight_decay)
    rng, log = np.random.default_rng(seed), []
    for step in range(steps + 1):
        pixels, captions, scenes_ = mirrored_batch(rng, pairs)
        img, txt = preference.embed(model, processor.tokenizer, pixels, captions)
        own = torch.arange(len(captions))
        other = own ^ 1  # the pair's other image, and its caption
        scale = model.logit_scale.exp()
        zero = torch.zeros(len(captions), dtype=torch.long)
        by_image = scale * torch.stack([(img * txt).sum(-1), (img * txt[other]).sum(-1)], 1)
        by_caption = scale * torch.stack([(img * txt).sum(-1), (img[other] * txt).sum(-1)], 1)
        value = torch.nn.functional.cross_entropy(by_image, zero) + torch.nn.functional.cross_entropy(by_caption, zero)
        total = value
        if head is not None:
            total = total + layout_aux * preference.layout_loss(head, img, preference.layout_targets(scenes_))
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            row = {"step": step, "loss": round(value.item(), 4),
                   "accuracy": round((by_image.argmax(1) == 0).float().mean().item(), 3),
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
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (a.out / "RESULTS.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
