"""TP-GRPO against Flow-GRPO on tiny-shapes, measured like a paper: seeds, intervals, held-out prompts.

    python bench/compare/compare_methods.py [--reward geneval|pickscore] [--seeds 0 1 2] [--rounds 6] [--jobs 2]
                                            [--no-ablations] [--runs runs/compare] [--out bench/compare]
                                            [--long-rounds 18 [--long-seeds 0 1 2]] [--recheck-steps 40]

1. Runs. pipelines/shapes-tpgrpo.toml and pipelines/shapes-flowgrpo.toml (identical but for the
   method, so both are tuned equally; --reward pickscore: the pair trained on the learned reward,
   pipelines/shapes-{tpgrpo,flowgrpo}-pickscore.toml, whose headline is the held-out learned reward
   with GenEval accuracy beside it) with every seed; the paper's ablations on TP-GRPO with the
   first seeds: window size K in {3, 6, 9} and noise level a in {0.5, 0.7, 0.9} (K = 9, a = 0.7 is
   the main run), with the first three seeds (--ablation-seeds). Each is one `tpkit run` in its own process; --jobs of them run side by side, each
   with its share of the cores (`tpkit --threads`). A finished run is kept, a stopped one resumes:
   rerunning this script recomputes nothing it has. --long-rounds N also runs Flow-GRPO for N
   rounds (continuing a copy of the seed's comparison run): 18 rounds take about TP-GRPO's time for
   6, the comparison at equal wall time.
2. The base model is evaluated by every run (`eval-base/`, the "round 0" point of its held-out
   curve; same prompts and seeds in every run, so the copies agree: a check, for about a minute each).
3. Everything is read back from the runs' rounds.jsonl: the held-out metric (GenEval accuracy, or the
   learned reward the pickscore recipes optimise, with accuracy beside it; data/shapes-test.jsonl,
   never trained on or tuned on) and train reward per round, as mean and 95 % t-interval over seeds;
   the round at which TP-GRPO's mean first reaches Flow-GRPO's final mean; final accuracy per task;
   turning points, zero step rewards and mean |d_k| per step early and late in training; seconds
   per round.
   Per run, its own verdict (`tpkit run`'s: the last evaluation against the base model's, paired over
   prompts) and minutes. --recheck-steps N: the base model and every final adapter again at N ODE
   steps (the paper's 40), 2 images a prompt, through `tpkit eval compare`.
4. bench/compare/RESULTS.md, compare.png (curves) and diagnostics.png (per-step statistics).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tpkit import evaluate, layout
from tpkit import run as tpkit_run
from tpkit.config import load_recipe

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is bench/compare/compare_methods.py)
RECIPE_PAIRS = {  # --reward -> method -> recipe (each pair identical but for the method)
    "geneval": {"tp-grpo": ROOT / "pipelines" / "shapes-tpgrpo.toml", "flow-grpo": ROOT / "pipelines" / "shapes-flowgrpo.toml"},
    "pickscore": {"tp-grpo": ROOT / "pipelines" / "shapes-tpgrpo-pickscore.toml",
                  "flow-grpo": ROOT / "pipelines" / "shapes-flowgrpo-pickscore.toml"},
}
RECIPES = RECIPE_PAIRS["geneval"]  # the methods, in report order (and the default pair)
# --reward -> the held-out metric of the headline (rounds.jsonl "eval" key) and its name
METRICS = {"geneval": ("geneval_overall", "held-out GenEval accuracy"),
           "pickscore": ("reward", "held-out learned reward (tiny-shapes-pickscore)")}
TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
ABLATIONS = {  # name -> --set overrides (TP-GRPO, --ablation-seeds); the main run is K = 9, a = 0.7
    "K3": ["rollout.window_size=3"], "K6": ["rollout.window_size=6"],
    "a0.5": ["rollout.noise_level=0.5"], "a0.9": ["rollout.noise_level=0.9"],
}


READING = "## Reading"  # RESULTS.md's hand-written part, kept when the tables are regenerated


@dataclasses.dataclass
class Job:
    name: str
    method: str
    seed: int
    overrides: list[str]
    out: Path
    rounds: int | None = None  # None: the comparison's --rounds; else a longer run (equal wall time)
    reward: str = "geneval"  # which recipe pair (RECIPE_PAIRS)

    @property
    def recipe(self) -> Path:
        return RECIPE_PAIRS[self.reward][self.method]

    @property
    def main(self) -> bool:
        """One of the comparison's own runs (not an ablation or a longer run)."""
        return not self.overrides and self.rounds is None

    def command(self, rounds: int, threads: int) -> list[str]:
        sets = [a for o in [f"seed={self.seed}", *self.overrides] for a in ("--set", o)]
        return [sys.executable, "-m", "tpkit", "--threads", str(threads), "run", str(self.recipe),
                "--out", str(self.out), "--rounds", str(self.rounds or rounds), *sets]


def jobs(seeds: list[int], runs_dir: Path, ablation_seeds: list[int], reward: str = "geneval") -> list[Job]:
    runs = [Job(f"{m}-s{s}", m, s, [], runs_dir / f"{m}-s{s}", reward=reward) for s in seeds for m in RECIPES]
    runs += [Job(f"tp-grpo-{a}-s{s}", "tp-grpo", s, o, runs_dir / f"tp-grpo-{a}-s{s}", reward=reward)
             for s in ablation_seeds for a, o in ABLATIONS.items()]
    return runs


def long_jobs(seeds: list[int], runs_dir: Path, rounds: int, reward: str = "geneval") -> list[Job]:
    """Flow-GRPO run for `rounds` rounds: about TP-GRPO's wall time when `rounds` is ~3x the comparison's."""
    return [Job(f"flow-grpo-{rounds}r-s{s}", "flow-grpo", s, [], runs_dir / f"flow-grpo-{rounds}r-s{s}", rounds, reward)
            for s in seeds]


def reuse_short(job: Job, all_jobs: list[Job]) -> None:
    """Start a longer run from a copy of the same seed's finished comparison run (run folders may move;
    `tpkit run` continues them), so its first rounds are not computed twice."""
    import shutil

    short = next((j for j in all_jobs if j.main and j.method == job.method and j.seed == job.seed), None)
    if not job.out.exists() and short is not None and (short.out / "rounds.jsonl").is_file():
        shutil.copytree(short.out, job.out)


def finished(job: Job, rounds: int) -> bool:
    """Whether job's folder already holds its rounds, from this job's recipe and overrides: a folder of
    another recipe (an edited setting under the same name) stops the script rather than being reported."""
    path = job.out / "rounds.jsonl"
    if not path.is_file():
        return False
    recipe = load_recipe(job.recipe, [f"seed={job.seed}", *job.overrides], out=str(job.out))
    diff = tpkit_run.recipe_difference(job.out, recipe)
    if diff:
        sys.exit(f"{job.out} holds a run of another recipe (differs in: {', '.join(diff)}); "
                 "delete it or pass another --runs folder")
    return len(path.read_text().splitlines()) >= (job.rounds or rounds)


# --------------------------------------------------------------------------------------------
# 1-2. Running
# --------------------------------------------------------------------------------------------


def run_jobs(todo: list[Job], rounds: int, parallel: int) -> None:
    """Start up to `parallel` runs at once, each with cores // parallel threads; logs beside the runs."""
    if parallel < 1:
        sys.exit(f"--jobs {parallel}: give at least 1 (runs side by side)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(cores // parallel, 1)
    pending, running = list(todo), []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            job.out.mkdir(parents=True, exist_ok=True)
            log = open(job.out.with_suffix(".log"), "a")
            print(f"start {job.name}: {' '.join(job.command(rounds, threads)[2:])}", flush=True)
            running.append((job, subprocess.Popen(job.command(rounds, threads), stdout=log, stderr=subprocess.STDOUT,
                                                  cwd=ROOT), log, time.time()))
        time.sleep(2)
        for item in list(running):
            job, proc, log, t0 = item
            if proc.poll() is None:
                continue
            log.close()
            running.remove(item)
            print(f"done  {job.name} in {time.time() - t0:.0f} s (exit {proc.returncode})", flush=True)
            if proc.returncode:
                raise SystemExit(f"{job.name} failed: see {job.out.with_suffix('.log')}")


def base_eval(all_jobs: list[Job]) -> dict:
    """The untrained model's held-out evaluation, as every run made it (same prompts, images and seeds)."""
    evals = [e for j in all_jobs if (e := evaluate.base_eval(j.out))]
    if any(e != evals[0] for e in evals):  # same settings and seeds: only floating-point noise can do this
        print(f"warning: the runs' base-model evaluations differ (overall {sorted({e['geneval_overall'] for e in evals})}); "
              "using their mean", flush=True)
    return {k: sum(e[k] for e in evals) / len(evals) for k in evals[0]} if evals else {}


# --------------------------------------------------------------------------------------------
# 3. Reading and aggregating
# --------------------------------------------------------------------------------------------


def rounds_of(job: Job) -> list[dict]:
    return [json.loads(line) for line in (job.out / "rounds.jsonl").read_text().splitlines() if line.strip()]


# GenEval's first reason for a failed image (tpkit/geneval/judge.py's wording) -> what went wrong
FAILURES = (("wrong colour", re.compile(r"^expected \w+ \w+>=")), ("too few of a named shape", re.compile(r"^expected \w+>=")),
            ("too many", re.compile(r"^expected \w+<")), ("wrong position", re.compile(r"^(no target for|expected \w+ \w+ of|expected \w+ (above|below) )")))


def failure_shares(folder: Path) -> dict[str, float]:
    """Share of an evaluation's images that are right, or fail first for each kind in FAILURES."""
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
    kinds = ["right" if r["correct"] else next((k for k, rx in FAILURES if rx.match(r["reason"])), "other") for r in rows]
    return {k: kinds.count(k) / len(kinds) for k in ("right", *(k for k, _ in FAILURES), "other")}


def t95(n: int) -> float:
    """Two-sided 95 % quantile of Student's t with n - 1 degrees of freedom."""
    try:
        from scipy.stats import t

        return float(t.ppf(0.975, n - 1))
    except ImportError:  # the few values a seed count needs
        return {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}.get(n, 1.96)


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of its 95 % t-interval over seeds (0 for one seed)."""
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, 0.0
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    return m, t95(n) * sd / math.sqrt(n)


def curves(runs: list[list[dict]], base: dict) -> dict:
    """Per method: train reward per round and held-out accuracy per evaluated round (0 = base)."""
    rounds = min(len(r) for r in runs)
    reward = [mean_ci([r[i]["reward_mean"] for r in runs]) for i in range(rounds)]
    evals = {0: {k: (v, 0.0) for k, v in base.items()}}
    for i in range(rounds):
        if all(r[i].get("eval") for r in runs):
            evals[i + 1] = {k: mean_ci([r[i]["eval"][k] for r in runs]) for k in runs[0][i]["eval"]}
    seconds = [mean_ci([sum(v for k, v in r[i]["seconds"].items() if k != "eval") for r in runs]) for i in range(rounds)]
    return {"reward": reward, "eval": evals, "seconds": seconds, "rounds": rounds}


def first_reaching(curve: dict[int, tuple[float, float]], target: float) -> int | None:
    return next((r for r, (m, _) in sorted(curve.items()) if m >= target), None)


def per_step(runs: list[list[dict]], key: str, which: slice) -> list[float | None]:
    """Mean over seeds and the selected rounds of a per-step list in rounds.jsonl."""
    rows = [line.get(key) for r in runs for line in r[which]]
    rows = [x for x in rows if x and all(v is not None for v in x)]
    if not rows:
        return []
    return [sum(col) / len(col) for col in zip(*rows)]


# --------------------------------------------------------------------------------------------
# 4. Report
# --------------------------------------------------------------------------------------------


def fmt(mc: tuple[float, float], digits: int = 3) -> str:
    return f"{mc[0]:.{digits}f} ± {mc[1]:.{digits}f}"


def plot(out: Path, agg: dict, diag: dict, key: str = "geneval_overall", title: str = "held-out GenEval accuracy") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for method, a in agg.items():
        xs = sorted(a["eval"])
        m = [a["eval"][x][key][0] for x in xs]
        h = [a["eval"][x][key][1] for x in xs]
        ax[0].errorbar(xs, m, yerr=h, marker="o", capsize=3, label=method)
        rs = list(range(1, a["rounds"] + 1))
        ax[1].errorbar(rs, [v[0] for v in a["reward"]], yerr=[v[1] for v in a["reward"]], marker=".", capsize=3, label=method)
        ax[2].plot(rs, [v[0] for v in a["seconds"]], marker=".", label=method)
    ax[0].set(title=f"{title} (mean, 95% CI)", xlabel="rounds trained", ylabel=key)
    ax[1].set(title="train reward (mean, 95% CI)", xlabel="round", ylabel="reward")
    ax[2].set(title="seconds per round (no eval)", xlabel="round", ylabel="s")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.savefig(out / "compare.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(1, 4, figsize=(18, 3.8))
    for label, d in diag.items():
        for i, key in enumerate(("tp_rate_per_step", "tp_kept_per_step", "zero_step_rewards_per_step",
                                 "mean_abs_step_reward_per_step")):
            if d.get(key):
                ax[i].plot(range(1, len(d[key]) + 1), d[key], marker="o", label=label)
    for a, title in zip(ax, ("turning-point candidates (rate)", "kept turning points (count)",
                             "share of zero step rewards d_k = 0", "mean |d_k|")):
        a.set(title=title, xlabel="step k")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.savefig(out / "diagnostics.png", dpi=110)
    plt.close(fig)


def run_minutes(job: Job) -> float:
    """Minutes one run's stages took, its base evaluation included (the run's own clock, whatever else ran)."""
    manifest = job.out / layout.BASE_EVAL / layout.MANIFEST
    base_s = sum(json.loads(manifest.read_text()).get("seconds", {}).values()) if manifest.is_file() else 0.0
    return (sum(v for r in rounds_of(job) for v in r["seconds"].values()) + base_s) / 60


def stage_minutes(all_jobs: list[Job]) -> float:
    """Minutes the runs' stages took (rounds.jsonl seconds, evaluations included, base evaluations not)."""
    return sum(v for j in all_jobs if finished(j, 1) for r in rounds_of(j) for v in r["seconds"].values()) / 60


def report(out: Path, all_jobs: list[Job], seeds: list[int], base: dict, elapsed: float, reward: str = "geneval",
           extra: list[str] = ()) -> str:
    key, title = METRICS[reward]
    by_method = {m: [rounds_of(j) for j in all_jobs if j.method == m and j.main] for m in RECIPES}
    agg = {m: curves(runs, base) for m, runs in by_method.items()}
    tp, fl = agg["tp-grpo"], agg["flow-grpo"]
    last = max(fl["eval"])
    fl_final, tp_final = fl["eval"][last][key], tp["eval"][last][key]
    reach = first_reaching({r: v[key] for r, v in tp["eval"].items()}, fl_final[0])
    reach_reward = next((i + 1 for i, (m, _) in enumerate(tp["reward"]) if m >= fl["reward"][-1][0]), None)
    third = max(1, tp["rounds"] // 3)
    diag = {f"{m} rounds 1-{third}": {k: per_step(by_method[m], k, slice(0, third)) for k in (
        "tp_rate_per_step", "tp_kept_per_step", "zero_step_rewards_per_step", "mean_abs_step_reward_per_step")}
        for m in ("tp-grpo",)}
    diag.update({f"tp-grpo rounds {tp['rounds'] - third + 1}-{tp['rounds']}": {k: per_step(
        by_method["tp-grpo"], k, slice(-third, None)) for k in (
        "tp_rate_per_step", "tp_kept_per_step", "zero_step_rewards_per_step", "mean_abs_step_reward_per_step")}})
    plot(out, agg, diag, key, title)
    recipes = [j.recipe.relative_to(ROOT).as_posix() for j in all_jobs if j.main][:2]

    L = [f"# TP-GRPO vs Flow-GRPO on tiny-shapes: {title}", "",
         f"Regenerate: `python bench/compare/compare_methods.py {' '.join(sys.argv[1:])}` "
         f"(this call: {elapsed / 60:.0f} min of wall time on {os.cpu_count()} cores; finished runs are reused; the "
         f"{len([j for j in all_jobs if finished(j, 1)])} runs' stages took {stage_minutes(all_jobs):.0f} min in all, "
         "one run at a time).",
         f"Recipes: `{recipes[0]}` and `{recipes[1]}`, identical but for the method. "
         + ("Held-out reward: the learned reward the runs optimise, on the same images as GenEval accuracy (beside it). "
            if key != "geneval_overall" else "") + "Held-out accuracy: GenEval's protocol with the shapes detector on `data/shapes-test.jsonl` "
         "(no prompt in common with the train prompts; never used for a choice). Intervals: 95 % t-intervals over "
         f"{len(seeds)} seeds (seed = rollout noise and LoRA init; evaluation images use the same seeds for every run).", "",
         "![curves](compare.png)", "", f"## {title[0].upper() + title[1:]} per evaluated round", ""]
    beside = ["geneval_overall"] if key != "geneval_overall" else []  # a learned reward: did accuracy follow?
    L += ["| rounds trained | " + " | ".join(RECIPES) + "".join(f" | {m} GenEval accuracy" for _ in beside for m in RECIPES)
          + " |", "|" + " --- |" * (1 + len(RECIPES) * (1 + len(beside)))]
    for r in sorted(tp["eval"]):
        L.append(f"| {r} | " + " | ".join(fmt(agg[m]["eval"][r][k]) if r in agg[m]["eval"] else ""
                                         for k in (key, *beside) for m in RECIPES) + " |")
    # Paired by seed (same seed = same first rollout noise and evaluation images): TP - Flow at the last evaluation.
    pairs = [(t, f) for t, f in zip(by_method["tp-grpo"], by_method["flow-grpo"])]
    final_eval = [next(r["eval"] for r in reversed(run) if r.get("eval")) for pair in pairs for run in pair]
    diffs = {k: mean_ci([a[k] - b[k] for a, b in zip(final_eval[::2], final_eval[1::2])]) for k in (key, *beside)}
    diff = diffs[key]
    gains = {m: mean_ci([run[last - 1]["eval"][key] - base[key] for run in by_method[m]]) for m in RECIPES}
    L += ["", f"- Flow-GRPO's final {title} (round {last}): **{fmt(fl_final)}**; TP-GRPO's: **{fmt(tp_final)}**; "
          f"paired difference TP - Flow over seeds: **{diff[0]:+.3f} ± {diff[1]:.3f}**"
          + "".join(f" (GenEval accuracy beside: {diffs[k][0]:+.3f} ± {diffs[k][1]:.3f})" for k in beside) + ".",
          "- Gain over the base model (" + f"{base[key]:.3f}" + ") at the last evaluation, over seeds: "
          + "; ".join(f"{m} **{g[0]:+.3f} ± {g[1]:.3f}**" for m, g in gains.items()) + ".",
          f"- TP-GRPO's mean first reaches Flow-GRPO's final mean at round **{reach if reach is not None else 'never (within the run)'}**"
          f" of {last} (evaluated every few rounds; round 0 is the base model).",
          f"- Train reward: TP-GRPO's mean first reaches Flow-GRPO's final mean ({fl['reward'][-1][0]:.3f}) at round "
          f"**{reach_reward if reach_reward is not None else 'never'}** of {fl['rounds']}.", "",
          "## Final accuracy per GenEval task", "", "| task | base | " + " | ".join(RECIPES) + " |",
          "| --- | --- | " + " | ".join("---" for _ in RECIPES) + " |"]
    for t in TASKS:
        task = f"geneval_{t}"
        L.append(f"| {t} | {base.get(task, float('nan')):.3f} | " + " | ".join(fmt(agg[m]['eval'][last][task]) for m in RECIPES) + " |")
    L += ["", "## Train reward and time per round", "", "| round | " + " | ".join(f"{m} reward" for m in RECIPES)
          + " | " + " | ".join(f"{m} s/round" for m in RECIPES) + " |", "|" + " --- |" * (1 + 2 * len(RECIPES))]
    for i in range(tp["rounds"]):
        L.append(f"| {i + 1} | " + " | ".join(fmt(agg[m]["reward"][i]) for m in RECIPES) + " | "
                 + " | ".join(f"{agg[m]['seconds'][i][0]:.1f}" for m in RECIPES) + " |")
    ratio = sum(v[0] for v in tp["seconds"]) / max(sum(v[0] for v in fl["seconds"]), 1e-9)
    L += ["", f"TP-GRPO / Flow-GRPO wall time per round (all rounds, evaluation excluded): **{ratio:.2f}x**.", "",
          "## Turning-point diagnostics (TP-GRPO, mean over seeds)", "", "![diagnostics](diagnostics.png)", ""]
    for label, d in diag.items():
        L.append(f"**{label}**")
        L.append("")
        L.append("| step k | " + " | ".join(str(k + 1) for k in range(len(d["tp_rate_per_step"]))) + " |")
        L.append("|" + " --- |" * (1 + len(d["tp_rate_per_step"])))
        for stat, name in (("tp_rate_per_step", "candidate rate"), ("tp_kept_per_step", "kept (count)"),
                           ("zero_step_rewards_per_step", "d_k = 0 share"), ("mean_abs_step_reward_per_step", "mean abs(d_k)")):
            if d[stat]:
                L.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in d[stat]) + " |")
        L.append("")
    # ties kill the sign tests: the worst step of any TP-GRPO round of any seed, not only the mean
    tie_rounds = [line["zero_step_rewards_per_step"] for run in by_method["tp-grpo"] for line in run
                  if line.get("zero_step_rewards_per_step") and None not in line["zero_step_rewards_per_step"]]
    if tie_rounds:
        calm = sum(max(shares) < 0.01 for shares in tie_rounds)
        L += [f"Largest share of d_k = 0 at any step of any TP-GRPO round (all seeds): **{max(map(max, tie_rounds)):.3f}**; "
              f"rounds with every step under 1 %: {calm} of {len(tie_rounds)}.", ""]
    L += ["## What held-out images get wrong (share of all images; first failure reason; mean over seeds)", "",
          "| outcome | base | " + " | ".join(f"{m} after {last}" for m in RECIPES) + " |",
          "| --- | --- | " + " | ".join("---" for _ in RECIPES) + " |"]
    jobs_of = {m: [j for j in all_jobs if j.method == m and j.main] for m in RECIPES}
    shares = {m: [failure_shares(layout.eval_dir(j.out, last - 1)) for j in jobs_of[m]] for m in RECIPES}
    base_shares = failure_shares(jobs_of["tp-grpo"][0].out / layout.BASE_EVAL)
    for k in base_shares:
        L.append(f"| {k} | {base_shares[k]:.3f} | " + " | ".join(fmt(mean_ci([s[k] for s in shares[m]])) for m in RECIPES) + " |")
    L.append("")
    evaluated = sorted(r for r in tp["eval"] if r)
    # One run's own verdict, as `tpkit run` prints it: the last evaluation against the base model's, paired over
    # the held-out prompts (95 %): does a single run's gain clear the evaluation's noise?
    L += [f"## Per seed ({title}; base {base.get(key, float('nan')):.3f})", "",
          "Each run's last evaluation minus the base model's, paired over prompts (95 %; the verdict of `tpkit run`), "
          "and its minutes (every stage and evaluation, base evaluation included).", "",
          "| run | " + " | ".join(f"after {r} rounds" for r in evaluated) + " | change (paired over prompts) | "
          + "".join("GenEval change | " for _ in beside) + "clears noise | minutes |",
          "|" + " --- |" * (4 + len(evaluated) + len(beside))]
    for m in RECIPES:
        for j in (j for j in all_jobs if j.method == m and j.main):
            rs = rounds_of(j)
            ev = {i + 1: r["eval"][key] for i, r in enumerate(rs) if r.get("eval")}
            c = evaluate.heldout_change(j.out, rs)
            changes = [c, *(c.get("geneval") for _ in beside)] if c else []
            cells = " | ".join(f"{x['delta']:+.3f} ± {1.96 * x['delta_se']:.3f}" if x else "" for x in changes)
            clears = "yes" if c and c["delta"] > 1.96 * c["delta_se"] else "no"
            L.append(f"| {m} seed {j.seed} | " + " | ".join(f"{ev[r]:.3f}" if r in ev else "" for r in evaluated)
                     + f" | {cells} | {clears} | {run_minutes(j):.1f} |")
    L.append("")
    L += equal_time(all_jobs, base, key)
    L += extra
    L += ablations(all_jobs, base, key, title, beside)
    text = "\n".join(L) + "\n"
    old = (out / "RESULTS.md").read_text() if (out / "RESULTS.md").is_file() else ""
    if READING in old:  # the hand-written reading survives a regeneration (check it against the new numbers)
        text += "\n" + old[old.index(READING):]
    (out / "RESULTS.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"base": base, "curves": {m: {**a, "eval": {str(k): v for k, v in a["eval"].items()}}
                                                                         for m, a in agg.items()}, "diagnostics": diag},
                                                 indent=1))
    return text


def ablations(all_jobs: list[Job], base: dict, key: str, title: str, beside: list[str]) -> list[str]:
    """The paper's ablations (window K, noise level a) beside the main TP-GRPO runs of the same seeds: held-out
    metric after 3 and after the last round as mean and 95 % interval over seeds, the paired difference from the
    main run (same seed: same first rollout noise, LoRA init and evaluation images), train reward, turning-point
    rate, ties and transformer calls."""
    main = {j.seed: j for j in all_jobs if j.main and j.method == "tp-grpo"}
    settings: dict[str, list[Job]] = {}
    for j in all_jobs:  # finished ablation runs only (as many rounds as the main run of their seed)
        if j.overrides and j.rounds is None and j.seed in main and (j.out / "rounds.jsonl").is_file() \
                and len(rounds_of(j)) >= len(rounds_of(main[j.seed])):
            settings.setdefault(", ".join(j.overrides), []).append(j)
    if not settings:
        return []
    seeds = sorted({j.seed for js in settings.values() for j in js if j.seed in main})
    settings = {"K = 9, a = 0.7 (main)": [main[s] for s in seeds],
                **{k: [j for j in js if j.seed in main] for k, js in settings.items()}}

    def final(j: Job, k: str) -> float:
        return next(r["eval"][k] for r in reversed(rounds_of(j)) if r.get("eval"))

    L = [f"## Ablations (TP-GRPO, seeds {', '.join(map(str, seeds))})", "",
         f"{title[0].upper() + title[1:]} (base {base.get(key, float('nan')):.3f}) after 3 rounds and after the last, "
         "mean and 95 % interval over seeds; the change against the main run of the same seed, paired over seeds"
         + (", with GenEval accuracy's beside it" if beside else "") + "; train reward as the mean over all rounds "
         "(less noisy than one round's); cost as transformer calls a round (deterministic: seconds depend on what "
         "else shares the cores).", "",
         "| setting | seeds | held-out after 3 | held-out at the end | vs main (paired) | "
         + "".join("GenEval accuracy vs main | " for _ in beside)
         + "train reward (mean) | TP rate | d_k = 0 share | calls/round |",
         "|" + " --- |" * (9 + len(beside))]
    for label, js in settings.items():
        runs = [rounds_of(j) for j in js]
        after3 = [next((r["eval"][key] for i, r in enumerate(rs) if r.get("eval") and i + 1 == 3), float("nan")) for rs in runs]
        vs = [("{:+.3f} ± {:.3f}".format(*mean_ci([final(j, k) - final(main[j.seed], k) for j in js])))
              if "main" not in label else "" for k in (key, *beside)]
        zero = [v for rs in runs for r in rs for v in (r.get("zero_step_rewards_per_step") or []) if v is not None]
        mean = lambda k: sum(r[k] for rs in runs for r in rs) / sum(len(rs) for rs in runs)  # noqa: E731
        L.append(f"| {label} | {len(js)} | {fmt(mean_ci(after3))} | {fmt(mean_ci([final(j, key) for j in js]))} | "
                 + " | ".join(vs) + f" | {mean('reward_mean'):.3f} | {mean('turning_point_rate'):.3f} | "
                 f"{sum(zero) / max(len(zero), 1):.3f} | {mean('transformer_calls'):.0f} |")
    return L + [""]


def equal_time(all_jobs: list[Job], base: dict, key: str = "geneval_overall") -> list[str]:
    """Held-out accuracy against minutes of training (stage seconds, evaluations excluded) for the
    longer Flow-GRPO runs and TP-GRPO's comparison runs of the same seeds, and the paired difference
    at about TP-GRPO's final time."""
    long = [j for j in all_jobs if j.rounds and finished(j, 1)]
    if not long:
        return []
    seeds = [j.seed for j in long]
    tp = [j for j in all_jobs if j.main and j.method == "tp-grpo" and j.seed in seeds]

    def points(jobs: list[Job]) -> dict[int, tuple[float, float, list[float]]]:
        """rounds trained -> (mean minutes so far, mean accuracy, accuracies per seed), at rounds all evaluated."""
        runs = [rounds_of(j) for j in jobs]
        out = {}
        for i in range(min(len(r) for r in runs)):
            if all(r[i].get("eval") for r in runs):
                minutes = [sum(v for line in r[: i + 1] for k, v in line["seconds"].items() if k != "eval") / 60 for r in runs]
                acc = [r[i]["eval"][key] for r in runs]
                out[i + 1] = (sum(minutes) / len(minutes), sum(acc) / len(acc), acc)
        return out

    pt, pf = points(tp), points(long)
    L = [f"## Equal wall time: Flow-GRPO for {long[0].rounds} rounds (seeds {', '.join(map(str, seeds))})", "",
         "A Flow-GRPO round costs about a third of a TP-GRPO round (no branch completions to score), so at equal "
         "wall time Flow-GRPO trains about three times as many rounds. Minutes of training: the runs' own stage "
         "seconds, evaluations excluded, mean over seeds.", "",
         f"| method | rounds trained | minutes of training | {key} |", "| --- | --- | --- | --- |",
         f"| base model | 0 | 0 | {base.get(key, float('nan')):.3f} |"]
    for name, pts in (("tp-grpo", pt), ("flow-grpo", pf)):
        for r, (minutes, _, acc) in sorted(pts.items()):
            L.append(f"| {name} | {r} | {minutes:.1f} | {fmt(mean_ci(acc))} |")
    if pt and pf:
        r_tp = max(pt)
        r_fl = min(pf, key=lambda r: abs(pf[r][0] - pt[r_tp][0]))
        diff = mean_ci([a - b for a, b in zip(pt[r_tp][2], pf[r_fl][2])])
        L += ["", f"- At about equal time: TP-GRPO after {r_tp} rounds ({pt[r_tp][0]:.1f} min) - Flow-GRPO after {r_fl} "
              f"rounds ({pf[r_fl][0]:.1f} min), paired over seeds: **{diff[0]:+.3f} ± {diff[1]:.3f}**."]
    return L + [""]


def recheck(all_jobs: list[Job], rounds: int, steps: int, runs_dir: Path, reward: str) -> list[str]:
    """Every main run's final adapter and the base model at another sampler (e.g. the paper's 40 ODE steps,
    2 images a prompt) on the recipe's held-out prompts, through `tpkit eval compare` (resumable; one
    table, every entry paired with the base over prompts): does the gain measured at the recipe's own
    evaluation survive a change of sampler?"""
    main = [j for j in all_jobs if j.main and finished(j, rounds)]
    if not main:
        return []
    r = load_recipe(main[0].recipe)
    out = runs_dir / f"recheck-steps{steps}"
    entries = [f"base={r.rollout.model}"] + [
        f"{j.name}={r.rollout.model}+{layout.round_dir(j.out, rounds - 1) / 'train' / 'adapter'}" for j in main]
    cmd = [sys.executable, "-m", "tpkit", "eval", "compare", "--out", str(out), "--prompts", r.eval.prompts,
           "--steps", str(steps), "--images-per-prompt", "2", "--batch-size", str(r.eval.batch_size),
           "--seed", str(r.eval.seed), "--geneval", "--detector", "shapes"]
    for name in r.eval.rewards:
        cmd += ["--reward", name] + [a for k, v in r.eval.reward_options.get(name, {}).items()
                                     for a in ("--reward-opt", f"{name}.{k}={v}")]
    for e in entries:
        cmd += ["--entry", e]
    print(f"recheck at {steps} steps: {' '.join(cmd[2:])}", flush=True)
    with open(out.with_suffix(".log"), "a") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode:
            raise SystemExit(f"the recheck failed: see {out.with_suffix('.log')}")
    table = json.loads((out / "compare.json").read_text())
    metrics = [m for m in (f"reward_{reward}", "geneval_overall") if m in table["metrics"]]
    L = [f"## The final adapters at {steps} ODE steps (2 images a prompt)", "",
         f"Regenerated with the table above (`--recheck-steps {steps}`; `tpkit eval compare`, folder "
         f"`{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}`): each run's adapter after {rounds} rounds minus "
         "the base model, paired over the held-out prompts (95 %).", "",
         "| run | " + " | ".join(f"{m} change" for m in metrics) + " | clears noise |", "|" + " --- |" * (2 + len(metrics))]
    base_cell = table["cells"]["base"]
    L.append("| base | " + " | ".join(f"{base_cell[m]['mean']:.3f}" for m in metrics) + " | |")
    for j in main:
        c = table["cells"][j.name]
        first = c[metrics[0]]
        L.append(f"| {j.name} | " + " | ".join(f"{c[m]['delta']:+.3f} ± {1.96 * c[m]['delta_se']:.3f}" for m in metrics)
                 + f" | {'yes' if first['delta'] > 1.96 * first['delta_se'] else 'no'} |")
    return L + [""]


def make_folders(*folders: Path) -> None:
    """--runs and --out up front, so that a file given for one stops the script before any run, not after."""
    for folder in folders:
        if folder.exists() and not folder.is_dir():
            sys.exit(f"{folder} is a file, not a folder: pass a folder (new or an earlier run's) for --runs and --out")
        folder.mkdir(parents=True, exist_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reward", choices=list(RECIPE_PAIRS), default="geneval",
                   help="which recipe pair: the dense GenEval score, or the learned reward (its own --runs/--out defaults)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=6, help="rounds per run (the recipes' 6)")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (each gets cores / jobs threads)")
    p.add_argument("--no-ablations", dest="ablations", action="store_false")
    p.add_argument("--ablation-seeds", type=int, nargs="+", help="seeds of the ablations (default: the first three)")
    p.add_argument("--runs", type=Path, help="where the runs go (large; default runs/compare[-pickscore])")
    p.add_argument("--out", type=Path, help="RESULTS.md and plots (default bench/compare[/pickscore])")
    p.add_argument("--long-rounds", type=int, default=0, help="also Flow-GRPO for this many rounds (18: about TP-GRPO's "
                                                                "time for 6), continued from a copy of the comparison's run")
    p.add_argument("--long-seeds", type=int, nargs="+", help="seeds of those (default: the first three)")
    p.add_argument("--report-only", action="store_true", help="run nothing: report the runs that finished")
    p.add_argument("--recheck-steps", type=int, default=0, help="also evaluate every final adapter and the base model "
                                                                  "at this many ODE steps (40: the paper's), 2 images a prompt")
    args = p.parse_args()
    pick = args.reward != "geneval"
    args.runs = args.runs or ROOT / "runs" / ("compare-" + args.reward if pick else "compare")
    args.out = args.out or ROOT / "bench" / "compare" / (args.reward if pick else "")
    make_folders(args.runs, args.out)
    t0 = time.time()
    all_jobs = jobs(args.seeds, args.runs, (args.ablation_seeds or args.seeds[:3]) if args.ablations else [], args.reward)
    if not args.report_only:
        run_jobs([j for j in all_jobs if not finished(j, args.rounds)], args.rounds, args.jobs)
    if args.long_rounds:  # after the comparison's runs, which they continue
        long = long_jobs(args.long_seeds or args.seeds[:3], args.runs, args.long_rounds, args.reward)
        all_jobs += long
        if not args.report_only:
            for j in long:
                if not finished(j, args.rounds):
                    reuse_short(j, all_jobs)
            run_jobs([j for j in long if not finished(j, args.rounds)], args.rounds, args.jobs)
    base = base_eval(all_jobs)
    extra = recheck(all_jobs, args.rounds, args.recheck_steps, args.runs, args.reward) if args.recheck_steps else []
    print(report(args.out, all_jobs, args.seeds, base, time.time() - t0, args.reward, extra))


if __name__ == "__main__":
    main()
