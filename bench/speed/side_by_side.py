"""Benchmark: two `tpkit run`s side by side on one machine against one alone.

Seeds of a comparison run in parallel, and so do `accelerate launch --num_processes N` ranks on
CPU. With torch's default (one thread per core in every process) N processes oversubscribe the
cores; tpkit gives each process its share (cores / LOCAL_WORLD_SIZE, or `tpkit --threads N`).
Measured here, on the same recipe, in fresh processes, in this order:

  alone      one run, default threads (all cores)
  pair-old   two runs started together, each with all cores (torch's default: what tpkit did before)
  pair       two runs started together, each with cores / 2 threads (`tpkit --threads`)

Per variant: seconds per round (rollout + score + advantages + train, from rounds.jsonl; model
loading and process start are in the wall time only) and wall time. Ideal for `pair` is about 2x
`alone` per round (twice the work on the same cores) and 1x in throughput.

    python bench/speed/side_by_side.py [--recipe pipelines/tiny-cpu.toml] [--rounds 2] [--out runs/side-by-side]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is bench/speed/side_by_side.py)


def start(recipe: Path, out: Path, rounds: int, threads: int | None) -> subprocess.Popen:
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tpkit", *(["--threads", str(threads)] if threads else []), "run", str(recipe),
           "--out", str(out), "--rounds", str(rounds)]
    env = {k: v for k, v in os.environ.items() if k not in ("TPKIT_THREADS", "OMP_NUM_THREADS")}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".log"), "w"), env=env, cwd=ROOT)


def per_round(out: Path) -> float:
    """Mean stage seconds per round (everything but evaluation)."""
    lines = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines() if x.strip()]
    return sum(sum(v for k, v in r["seconds"].items() if k != "eval") for r in lines) / len(lines)


def variant(name: str, recipe: Path, base: Path, rounds: int, n: int, threads: int | None) -> dict:
    t0 = time.perf_counter()
    procs = [start(recipe, base / f"{name}-{i}", rounds, threads) for i in range(n)]
    codes = [p.wait() for p in procs]
    wall = time.perf_counter() - t0
    if any(codes):
        raise SystemExit(f"{name}: a run failed (see {base}/{name}-*.log)")
    rounds_s = [per_round(base / f"{name}-{i}") for i in range(n)]
    return {"variant": name, "processes": n, "threads": threads or "default", "s_per_round": rounds_s, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", type=Path, default=ROOT / "pipelines" / "tiny-cpu.toml")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "side-by-side")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    start(args.recipe, args.out / "warmup", 1, None).wait()  # builds tiny-sd3 once, warms the file cache
    rows = [variant("alone", args.recipe, args.out, args.rounds, 1, None),
            variant("pair-old", args.recipe, args.out, args.rounds, 2, cores),
            variant("pair", args.recipe, args.out, args.rounds, 2, max(cores // 2, 1))]
    alone = rows[0]["s_per_round"][0]
    print(f"{args.recipe.name}, {args.rounds} rounds per run, {cores} cores\n")
    print("| variant | processes x threads | s/round (each) | vs alone | wall s | throughput vs alone |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        each = ", ".join(f"{s:.1f}" for s in r["s_per_round"])
        slow = max(r["s_per_round"]) / alone
        thr = r["processes"] * rows[0]["wall_s"] / r["wall_s"]
        print(f"| {r['variant']} | {r['processes']} x {r['threads']} | {each} | {slow:.2f}x | {r['wall_s']:.0f} | {thr:.2f}x |")


if __name__ == "__main__":
    main()
