"""Cheaper branches, judged by what TP-GRPO decides with them: each branch solver and step budget
against the exact (Euler, every step) branches on the same rollouts.

    python bench/branches/branch_solvers.py [--rollouts R1[:REWARD,...] R2 ...] [--configs euler:3 heun:2 ...]
                                           [--rewards pickscore geneval] [--runs runs/branch-solvers]
                                           [--out bench/branches]

1. Rollouts: by default the first and last rounds of `bench/compare/compare_methods.py --reward
   pickscore`'s TP-GRPO seed-0 run (runs/compare-pickscore/tp-grpo-s0/round-0000 and -0005: the base
   policy and the trained one), each a real tiny-shapes rollout of 16 train prompts x 8 (T = 10, CPS
   window K = 9, the recipe's settings). Any round folder of a `tpkit run` will do, e.g. tiny-sd3's
   (`tpkit run pipelines/tiny-cpu.toml --rounds 1 --out runs/branch-tiny-sd3 --set rollout.group_size=16`),
   with its own rewards after a colon (`runs/branch-tiny-sd3/round-0000:brightness,pickscore`).
2. Per rollout and reward (the learned tiny-shapes-pickscore, GenEval's dense score with the shapes
   detector, or brightness, the tiny-cpu recipe's reward for the random tiny-sd3; --rewards, or the
   rollout's own list): `tpkit score` exact, then with every --configs SOLVER:STEPS, and `tpkit
   advantages` (TP-GRPO, the recipe's balancing) on each; resumable (finished folders are reused).
3. Against the exact branches: transformer calls per trajectory (the manifest's), score seconds,
   mean |R_k error| (k < K; R_K is the rollout's own image in every case) beside mean |d_k|, and
   what TP-GRPO decides: the sign of every d_k, turning-point candidates and kept turning points
   (agreement over all transitions, and the share of the exact ones found: recall; of the found ones
   that are exact: precision), and the advantages (Pearson correlation, sign agreement).
4. bench/branches/RESULTS.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

import numpy as np

from tpkit import advantages, layout, score
from tpkit.config import AdvantagesConfig, ScoreConfig

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ROLLOUTS = [ROOT / "runs" / "compare-pickscore" / "tp-grpo-s0" / f"round-{i:04d}" for i in (0, 5)]
# (reward name, its options): the learned reward as the pickscore recipes score it; GenEval's dense score
REWARDS = {"pickscore": {"model": "tiny-shapes-pickscore", "processor": "tiny-shapes-pickscore"},
           "geneval": {"detector": "shapes"}, "brightness": {}}
KEY = ["trajectory_id", "step"]
READING = "## Reading"  # RESULTS.md's hand-written part, kept when the tables are regenerated


def run_config(round_dir: Path, runs: Path, reward: str, solver: str, steps: int) -> tuple[dict, Path]:
    """Score (and TP-GRPO advantages of) one rollout with one solver and budget; returns (score manifest,
    advantages.parquet). The run's own score folder is reused for the exact pickscore branches."""
    settings = tomllib.loads((round_dir.parent / "run.toml").read_text())
    name = f"{round_dir.parent.name}-{round_dir.name}/{reward}-{solver}{steps}"
    own = round_dir / "score"
    folder = own if (reward in settings["rewards"] and steps == 0) else runs / name / "score"
    if not (folder / layout.MANIFEST).is_file():
        score.run(ScoreConfig(rollout=str(round_dir / "rollout"), out=str(folder), rewards={reward: 1.0},
                              reward_options={reward: REWARDS[reward]}, batch_size=settings["score"]["batch_size"],
                              decode_batch_size=settings["score"]["decode_batch_size"], branch_steps=steps,
                              branch_solver=solver))
    adv = runs / name / "advantages"
    if not (adv / layout.MANIFEST).is_file():
        advantages.run(AdvantagesConfig(scores=str(folder), out=str(adv), method="tp-grpo",
                                        balance=settings["advantages"]["balance"], std=settings["advantages"]["std"]))
    return json.loads((folder / layout.MANIFEST).read_text()), adv / "advantages.parquet"


def table(path: Path) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq

    t = pq.read_table(path).sort_by([(k, "ascending") for k in KEY])
    return {c: np.asarray(t[c].to_pylist()) for c in t.column_names}


def agreement(exact: np.ndarray, other: np.ndarray) -> dict[str, float]:
    """Boolean decisions: share equal, recall of the exact positives, precision of the found ones."""
    both = (exact & other).sum()
    return {"agree": float((exact == other).mean()), "recall": float(both / max(exact.sum(), 1)),
            "precision": float(both / max(other.sum(), 1)), "exact_rate": float(exact.mean()), "rate": float(other.mean())}


def compare(exact: dict, other: dict) -> dict:
    assert (exact["trajectory_id"] == other["trajectory_id"]).all() and (exact["step"] == other["step"]).all()
    err = np.abs(other["reward_before"] - exact["reward_before"])  # R_{k-1}, k = 1..K: every branch state s_0..s_{K-1}
    a, b = exact["advantage"], other["advantage"]
    return {
        "r_error": float(err.mean()), "mean_abs_d": float(np.abs(exact["step_reward"]).mean()),
        "d_sign": float((np.sign(exact["step_reward"]) == np.sign(other["step_reward"])).mean()),
        "candidates": agreement(exact["turning_point_candidate"], other["turning_point_candidate"]),
        "kept": agreement(exact["turning_point"], other["turning_point"]),
        "adv_corr": float(np.corrcoef(a, b)[0, 1]) if a.std() and b.std() else float("nan"),
        "adv_sign": float((np.sign(a) == np.sign(b)).mean()),
    }


def rollout_and_rewards(arg: str, default: list[str]) -> tuple[Path, list[str]]:
    """`DIR` or `DIR:reward,reward`: a round folder and the rewards to compare the solvers on."""
    folder, _, names = arg.partition(":")
    rewards = names.split(",") if names else default
    if unknown := [r for r in rewards if r not in REWARDS]:
        sys.exit(f"{arg}: unknown reward {unknown[0]!r}; use {', '.join(REWARDS)}")
    return Path(folder), rewards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", nargs="+", default=[str(r) for r in DEFAULT_ROLLOUTS],
                   help="round folders of a tpkit run, each with its own rewards after a colon if given (DIR:r1,r2)")
    p.add_argument("--configs", nargs="+", default=["euler:2", "euler:3", "euler:5", "heun:2", "heun:3"])
    p.add_argument("--rewards", nargs="+", default=list(REWARDS), choices=list(REWARDS))
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "branch-solvers")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "branches")
    args = p.parse_args()
    rollouts = [rollout_and_rewards(r, args.rewards) for r in args.rollouts]
    missing = [r for r, _ in rollouts if not (r / "rollout" / layout.MANIFEST).is_file()]
    if missing:
        sys.exit(f"no finished rollout in {missing[0]}: run `python bench/compare/compare_methods.py --reward pickscore` "
                 "first, or pass --rollouts ROUND_DIR ...")
    configs = [(c.split(":")[0], int(c.split(":")[1])) for c in args.configs]
    results = []
    for round_dir, rewards in rollouts:
        for reward in rewards:
            m0, a0 = run_config(round_dir, args.runs, reward, "euler", 0)
            exact = table(a0)
            for solver, steps in configs:
                m, a = run_config(round_dir, args.runs, reward, solver, steps)
                results.append({"rollout": round_dir.relative_to(ROOT).as_posix() if round_dir.is_relative_to(ROOT) else str(round_dir),
                                "reward": reward, "solver": solver, "steps": steps,
                                "calls": m["per_trajectory"]["transformer_calls"],
                                "exact_calls": m0["per_trajectory"]["transformer_calls"],
                                "seconds": m["seconds"].get("transformer", 0.0), "exact_seconds": m0["seconds"].get("transformer", 0.0),
                                **compare(exact, table(a))})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    L = ["# Branch solvers against exact branches: what TP-GRPO decides with them", "",
         f"Regenerate: `python bench/branches/branch_solvers.py {' '.join(sys.argv[1:])}`. Every number compares one "
         "solver and step budget with the exact branches (Euler on every remaining step of the rollout's schedule) "
         "on the same rollouts. Calls: transformer calls per trajectory in score; seconds: score's transformer time "
         "(one process, 2 cores). R_k error: mean |R_k - exact R_k| over the branch states, beside mean |d_k| of the exact "
         "branches. Agreement: share of all transitions where the decision is the same; recall: share of the exact "
         "turning points also found; precision: share of the found ones that are exact.", ""]
    for (rollout, reward) in dict.fromkeys((r["rollout"], r["reward"]) for r in results):
        rows = [r for r in results if r["rollout"] == rollout and r["reward"] == reward]
        L += [f"## `{rollout}`, reward {reward}", "",
              f"Exact: {rows[0]['exact_calls']:.0f} calls per trajectory, {rows[0]['exact_seconds']:.1f} s; mean |d_k| "
              f"{rows[0]['mean_abs_d']:.3f}; candidates on {rows[0]['candidates']['exact_rate']:.3f} of transitions, "
              f"kept {rows[0]['kept']['exact_rate']:.3f}.", "",
              "| solver | steps | calls | seconds | R_k error | d_k sign agree | candidates agree (recall / precision) "
              "| kept TP agree (recall / precision) | advantage corr | advantage sign agree |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            c, k = r["candidates"], r["kept"]
            L.append(f"| {r['solver']} | {r['steps']} | {r['calls']:.0f} | {r['seconds']:.1f} | {r['r_error']:.3f} | "
                     f"{r['d_sign']:.3f} | {c['agree']:.3f} ({c['recall']:.2f} / {c['precision']:.2f}) | "
                     f"{k['agree']:.3f} ({k['recall']:.2f} / {k['precision']:.2f}) | {r['adv_corr']:.3f} | {r['adv_sign']:.3f} |")
        L.append("")
    text = "\n".join(L) + "\n"
    old = (args.out / "RESULTS.md").read_text() if (args.out / "RESULTS.md").is_file() else ""
    if READING in old:  # check it against the new numbers
        text += "\n" + old[old.index(READING):]
    (args.out / "RESULTS.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
