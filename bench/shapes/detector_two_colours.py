"""The shapes detector on objects drawn in two palette colours (as tiny-shapes sometimes draws them).

    python bench/shapes/detector_two_colours.py [--scenes 200]

Single-object scenes from `tpkit.shapes.scenes` (seed 0), rendered clean, then again with the right part of
the object (a share of its width) in another palette colour. Prints, per share, how often the
detector finds the object's class above GenEval's thresholds 0.3 and 0.9 and the median score of its
best detection of that class. The scene generator never draws such objects; GenEval's Mask2Former
would see one object of that class (its colour classifier then picks one colour).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from tpkit.shapes import detect as sd
from tpkit.shapes import scenes as shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenes", type=int, default=200)
    a = ap.parse_args()
    print("| second colour over the object's right | class found > 0.3 | > 0.9 | median best score |")
    print("|---|---|---|---|")
    for share in (0.0, 0.2, 0.35, 0.5):
        rng = np.random.default_rng(0)
        scores = []
        for _ in range(a.scenes):
            scene = shapes.sample_scene(rng, task="single_object")
            obj = scene.objects[0]
            image = shapes.render(scene)
            if share:
                others = [c for c in shapes.COLOURS if c != obj.colour]
                recoloured = shapes.render(replace(scene, objects=[replace(obj, colour=others[int(rng.integers(len(others)))])]))
                x0 = int(round(obj.x + obj.size / 2 - share * obj.size))
                image = image.copy()
                image[:, x0:] = recoloured[:, x0:]
            scores.append(max((d["score"] for d in sd.detect(image) if d["class"] == obj.shape), default=0.0))
        s = np.array(scores)
        print(f"| {share:.0%} of its width | {np.mean(s > 0.3):.3f} | {np.mean(s > 0.9):.3f} | {np.median(s):.2f} |")


if __name__ == "__main__":
    main()
