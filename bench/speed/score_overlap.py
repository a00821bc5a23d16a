"""Benchmark: does reward scoring overlap with the score stage's transformer work?

Runs `tpkit score` twice on the same tiny-sd3 rollout, side by side in one process: rewards on a
worker thread (the default) vs inline (--reward-workers 0), for a cheap CPU reward
(jpeg-compressibility) and for a slow one that waits like a GPU or remote reward model does
(`sleep`, milliseconds per image, releasing the GIL). Prints seconds, trajectories per second and
the speed-up; numbers vary with the machine, the ratio is the point.

    python bench/speed/score_overlap.py [--prompts 4] [--group-size 8] [--sleep-ms 15]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for sleepy_reward (bench/speed/sleepy_reward.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--sleep-ms", type=float, default=15.0)
    args = ap.parse_args()

    from tpkit import rollout, score
    from tpkit.config import RolloutConfig, ScoreConfig

    import sleepy_reward

    sleepy_reward.SECONDS_PER_IMAGE = args.sleep_ms / 1000
    tmp = Path(tempfile.mkdtemp(prefix="tpkit-bench-"))
    prompts = tmp / "prompts.txt"
    prompts.write_text("".join(f"benchmark prompt number {i}\n" for i in range(args.prompts)))
    rollout.run(RolloutConfig(prompts=str(prompts), out=str(tmp / "rollout"), group_size=args.group_size))
    n = args.prompts * args.group_size

    rows = []
    for reward in ("jpeg-compressibility", "sleepy_reward:sleepy"):
        secs = {}
        for workers in (0, 1):
            out = tmp / f"score-{reward.replace(':', '_')}-{workers}"
            t0 = time.perf_counter()
            m = score.run(ScoreConfig(rollout=str(tmp / "rollout"), out=str(out), rewards={reward: 1.0},
                                      reward_workers=workers))
            secs[workers] = time.perf_counter() - t0
            rows.append((reward, "worker thread" if workers else "inline", secs[workers], n / secs[workers],
                         m["seconds"].get("reward_wait", 0.0)))
        rows.append((reward, "speed-up (inline / thread)", secs[0] / secs[1], None, None))

    t = Table(title=f"score stage, {n} trajectories x 10 branches, tiny-sd3, reward sleep {args.sleep_ms} ms/image")
    for c in ("reward", "scoring", "seconds / ratio", "trajectories/s", "waiting for rewards (s)"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r[0], r[1], f"{r[2]:.2f}", "" if r[3] is None else f"{r[3]:.2f}", "" if r[4] is None else f"{r[4]:.2f}")
    Console().print(t)


if __name__ == "__main__":
    main()
