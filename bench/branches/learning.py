"""Does TP-GRPO still learn when its branches are cheap? Truncated Euler branches against the exact ones,
on the learned reward, by rounds and by wall time, with Flow-GRPO beside them (issue #37, item 3).

    python bench/branches/learning.py [--branch-steps 3] [--seeds 0 1 2] [--runs runs/compare-pickscore]

Runs `pipelines/shapes-tpgrpo-pickscore.toml --set score.branch_steps=N` for each seed (into
RUNS/tp-grpo-euler{N}-s{seed}; a finished run is kept, a stopped one resumes) and reads the exact
TP-GRPO and Flow-GRPO runs of the same seeds from the comparison (`bench/compare/compare_methods.py
--reward pickscore`, same recipe, same seeds). Per run: the held-out change of the learned reward and
of GenEval accuracy after the last round, paired over prompts against the base model (`tpkit run`'s
verdict), the transformer calls and seconds per round (stages only, evaluations excluded), and the
kept turning points per round. Prints a Markdown section; --write appends it to bench/branches/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tpkit import evaluate, layout  # noqa: E402

RECIPE = ROOT / "pipelines" / "shapes-tpgrpo-pickscore.toml"


def run(out: Path, seed: int, branch_steps: int) -> None:
    """One `tpkit run` (resumes a stopped one, keeps a finished one)."""
    if (out / layout.ROUNDS_FILE).is_file() and len(layout.read_jsonl(out / layout.ROUNDS_FILE)) >= 6:
        return
    cmd = [sys.executable, "-m", "tpkit", "run", str(RECIPE), "--out", str(out), "--set", f"seed={seed}",
           "--set", f"score.branch_steps={branch_steps}"]
    print(" ".join(cmd[2:]), flush=True)
    with open(out.with_suffix(".log"), "a") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode:
            sys.exit(f"{out} failed: see {out.with_suffix('.log')}")


def summary(run_dir: Path) -> dict | None:
    """The run's verdict on the learned reward and GenEval accuracy, calls and seconds per round."""
    if not (run_dir / layout.ROUNDS_FILE).is_file():
        return None
    lines = layout.read_jsonl(run_dir / layout.ROUNDS_FILE)
    change = evaluate.heldout_change(run_dir, lines)
    seconds = [sum(v for k, v in x["seconds"].items() if k != "eval") for x in lines]
    return {"reward": change["delta"], "reward_half": 1.96 * change["delta_se"],
            "geneval": change["geneval"]["delta"], "geneval_half": 1.96 * change["geneval"]["delta_se"],
            "calls": statistics.mean(x["transformer_calls"] for x in lines), "seconds": statistics.mean(seconds),
            "kept": statistics.mean(x["turning_points_kept"] for x in lines), "rounds": len(lines)}


def mean_ci(values: list[float]) -> str:
    """Mean ± the 95 % t-interval half-width over seeds."""
    from scipy import stats

    if len(values) < 2:
        return f"{values[0]:+.3f}" if values else "n/a"
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return f"{statistics.mean(values):+.3f} ± {half:.3f}"


def table(runs: dict[str, dict[int, dict]], branch_steps: int) -> str:
    L = [f"## Learning with Euler branches of {branch_steps} steps (learned reward, 6 rounds)", "",
         f"Regenerate: `python bench/branches/learning.py --branch-steps {branch_steps} --seeds "
         f"{' '.join(str(s) for s in sorted(next(iter(runs.values()))))}`. Each row is one run's held-out change after "
         "its last round against the base model, paired over the 96 test prompts (95 % interval), as `tpkit run`'s "
         "verdict; calls and seconds are per round (stages only, evaluations excluded; seconds are wall time on 2 "
         "cores and move with what else ran); kept: turning points kept per round.", "",
         "| run | seed | reward change | GenEval change | calls / round | s / round | kept TPs / round |",
         "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, by_seed in runs.items():
        for seed, s in sorted(by_seed.items()):
            L.append(f"| {name} | {seed} | {s['reward']:+.3f} ± {s['reward_half']:.3f} | {s['geneval']:+.3f} ± "
                     f"{s['geneval_half']:.3f} | {s['calls']:.0f} | {s['seconds']:.0f} | {s['kept']:.1f} |")
    L += ["", "| run | reward change (mean over seeds, 95 % t) | GenEval change | s / round |", "| --- | --- | --- | --- |"]
    for name, by_seed in runs.items():
        v = list(by_seed.values())
        L.append(f"| {name} | {mean_ci([s['reward'] for s in v])} | {mean_ci([s['geneval'] for s in v])} | "
                 f"{statistics.mean(s['seconds'] for s in v):.0f} |")
    return "\n".join(L) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--branch-steps", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "compare-pickscore")
    p.add_argument("--write", action="store_true", help="append the section to bench/branches/RESULTS.md")
    args = p.parse_args()
    for seed in args.seeds:
        run(args.runs / f"tp-grpo-euler{args.branch_steps}-s{seed}", seed, args.branch_steps)
    runs = {name: {s: x for s in args.seeds if (x := summary(args.runs / f"{name}-s{s}"))}
            for name in (f"tp-grpo-euler{args.branch_steps}", "tp-grpo", "flow-grpo")}
    text = table(runs, args.branch_steps)
    print(text)
    if args.write:
        with open(ROOT / "bench" / "branches" / "RESULTS.md", "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
