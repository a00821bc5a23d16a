"""Benchmark: ms per image of the weight-free shapes detector (`tpkit.shapes.detect.detect`).

The `geneval` reward with detector=shapes runs it on every image of the `tiny-shapes` RL score
stage, where it cost about as much CPU as the diffusion transformer. Timed on
  (a) clean renders of random scenes (`tpkit.shapes.scenes.render`), like final, sharp images;
  (b) model-like images: such renders blurred (Gaussian, sigma 1-1.8 px) and noised (sigma 6), deterministically;
  (c) with --pngs DIR, a model's own samples (the PNGs under DIR but grid-*.png): their objects touch
      other colours more often than in (b), so more candidate boxes are fitted per object.
Each kind is timed on a first set (cold template caches, where a detector keeps them), then on a
second, different one (warm, as in a long run); --module times another copy (e.g. an older one)
instead, --against times one beside tpkit's, interleaved in this process, and prints the ratio.
--workers N then times `ShapesDetector(workers=N)` (the reward option `workers`) against the
detector in this thread on the model-like images, in calls of 64 images (the shapes recipes'
decode batch: one reward call each in the score stage) after one call that starts the processes,
and prints the speed-up.

    python bench/shapes/detector_speed.py [--images 80] [--module PATH | --against PATH] [--pngs DIR] [--workers N]
    git show baba483:tpkit/shapes_detect.py > /tmp/old.py && python bench/shapes/detector_speed.py --against /tmp/old.py --pngs runs/X
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import numpy as np

from tpkit.shapes import scenes as shapes


def load_detector(path: str | None):
    """`detect` of tpkit.shapes.detect, or of the module file at `path`."""
    if path is None:
        from tpkit.shapes.detect import detect

        return detect
    spec = importlib.util.spec_from_file_location("detector_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.detect


def pngs(folder: str, n: int, skip: int) -> list[np.ndarray]:
    """n of the PNGs under `folder` (sorted, after the first `skip`), as uint8 RGB arrays."""
    from PIL import Image

    files = sorted(p for p in Path(folder).rglob("*.png") if not p.name.startswith("grid-"))
    return [np.asarray(Image.open(p).convert("RGB")) for p in files[skip:skip + n]]


def images(kind: str, n: int, seed: int) -> list[np.ndarray]:
    """n images of random scenes: clean renders, or ("blurry") blurred and noised ones."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        image = shapes.render(shapes.sample_scene(rng))
        if kind == "blurry":
            a = shapes.blur(image, float(rng.uniform(1.0, 1.8))) + rng.normal(0, 6.0, image.shape)
            image = np.clip(np.round(a), 0, 255).astype(np.uint8)
        out.append(image)
    return out


def ms_per_image(detect, batch: list[np.ndarray]) -> float:
    start = time.perf_counter()
    for image in batch:
        detect(image)
    return 1000 * (time.perf_counter() - start) / len(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=80, help="images per set (each kind has two sets)")
    parser.add_argument("--module", default=None, help="a detector module file (like tpkit/shapes/detect.py) to time instead of tpkit's")
    parser.add_argument("--pngs", default=None, help="a folder of a model's samples (PNGs) to time too")
    parser.add_argument("--against", default=None, help="a detector module file (like tpkit/shapes/detect.py) to time beside tpkit's (ratio)")
    parser.add_argument("--workers", type=int, default=0, help="also time the detector spread over N processes")
    args = parser.parse_args()
    detectors = {args.module or "tpkit.shapes.detect": load_detector(args.module)}
    if args.against:
        detectors[args.against] = load_detector(args.against)
    print(f"detectors: {', '.join(detectors)}; {args.images} images per set")
    sets = {kind: (images(kind, args.images, 1), images(kind, args.images, 2)) for kind in ("clean", "blurry")}
    if args.pngs:
        sets["model"] = (pngs(args.pngs, args.images, 0), pngs(args.pngs, args.images, args.images))
    for kind, (first, second) in sets.items():
        times = {name: [] for name in detectors}
        for batch in (first, second):  # cold caches, then warm; the detectors interleaved
            for name, detect in detectors.items():
                times[name].append(ms_per_image(detect, batch))
        for name, (cold, warm) in times.items():
            print(f"  {kind:6s}  {cold:6.2f} ms/image (cold caches)  {warm:6.2f} ms/image (warm caches)  {name}")
        if args.against:
            ours, theirs = times.values()
            print(f"  {kind:6s}  ratio {args.against} / tpkit: {theirs[0] / ours[0]:.2f}x cold, {theirs[1] / ours[1]:.2f}x warm")
    if args.workers >= 2:
        workers_speedup(args.workers, sets["blurry"][0] + sets["blurry"][1])


def workers_speedup(workers: int, batch: list[np.ndarray], call: int = 64) -> None:
    from tpkit.shapes.detect import ShapesDetector

    alone, pooled = ShapesDetector(), ShapesDetector(workers)
    pooled(batch[:call])  # starts the processes (once per run)
    times = {}
    for name, detector in (("in this thread", alone), (f"{workers} processes", pooled), ("in this thread", alone)):
        start = time.perf_counter()
        for i in range(0, len(batch), call):
            detector(batch[i:i + call])
        times.setdefault(name, []).append(1000 * (time.perf_counter() - start) / len(batch))
    pooled._pool.shutdown()
    base = float(np.mean(times["in this thread"]))  # timed before and after the processes
    ms = times[f"{workers} processes"][0]
    print(f"  blurry  {base:6.2f} ms/image in this thread, {ms:6.2f} ms/image over {workers} processes "
          f"(calls of {call}): {base / ms:.2f}x")


if __name__ == "__main__":
    main()
