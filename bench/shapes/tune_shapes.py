"""Choosing the shapes recipes' RL settings without the test prompts: a validation split inside the
train split, and the candidate settings run on it with several seeds.

    python bench/shapes/tune_shapes.py [--seeds 0 1] [--rounds 6] [--settings NAME ...] [--runs /tmp/tune/runs]
                                       [--out bench/shapes/tune] [--jobs 1] [--set KEY=VALUE ...] [--method flow-grpo|tp-grpo]
                                       [--reward geneval|pickscore] [--report-only]

1. Split. Per task, the train split's prompt groups (GenEval's order-free `prompt_key`, the same
   unit as the train/test rule in `tpkit.shapes.scenes`) are ordered by a salted SHA-256 of the key and the
   first third (rounded up) become validation; RL trains on the rest ("fit"). Validation, like the
   test split, holds combinations RL never trained on, and nothing here reads a test prompt.
   Written to RUNS/fit.jsonl and RUNS/val.jsonl (80 and 16 lines a task, `tpkit.shapes.scenes.prompts`' order).
2. Runs. pipelines/shapes-flowgrpo.toml (the cheaper method; the chosen setting is applied to both
   recipes, so both are tuned equally) with rollout prompts = fit, held-out evaluation = validation,
   once per setting in SETTINGS (or those named by --settings) and seed, seed by seed (a sweep cut
   short holds every setting at its first seeds), --jobs of them side by side; --set adds overrides
   to every run (e.g. `rollout.dtype=float32` on a GPU); --method tp-grpo runs the settings on
   pipelines/shapes-tpgrpo.toml instead (for a setting meant for TP-GRPO's step rewards, such as
   `soft`); --reward pickscore runs the learned-reward recipes (pipelines/shapes-*-pickscore.toml) and
   reads their held-out learned reward (GenEval accuracy beside). Finished runs are kept: rerunning
   recomputes nothing it has.
3. bench/shapes/tune/RESULTS.md: validation accuracy at every evaluated round per setting (mean and 95 %
   t-interval over seeds, per seed), the train reward of the last round, the ratio clip fraction.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tomllib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compare"))  # bench/compare/compare_methods.py
import compare_methods as cm  # (the runner and interval helpers of the method comparison)

from tpkit.geneval import prompts as gp
from tpkit.shapes import scenes as shapes
from tpkit.models import sd3

SALT = "tpkit-shapes-validation-v1"
SETTINGS = {  # name -> --set overrides of the recipe (its own values: one optimizer step a round at lr 3e-3)
    "recipe": [],
    "steps4": ["train.optimizer_steps=4"],
    "steps8": ["train.optimizer_steps=8"],
    "lr5e-3": ["train.learning_rate=5e-3"],
    # does a decaying rate hold the gains that a constant 3e-3 stops making after ~6 rounds (bench/compare/RESULTS.md)?
    "halflife6": ["lr_half_life=6"],
    "lr5e-3-halflife3": ["train.learning_rate=5e-3", "lr_half_life=3"],
    # one optimizer step a round: are 6 steps too few? The same samples in twice the steps (and
    # about the same time): half the prompts a round, twice the rounds, evaluated at the same samples seen
    "half-batch-x2": ["rollout.prompts_per_round=8", "eval_every=6"],
    # ... and does a KL to the base model (Flow-GRPO's SD3 weights: 0.04, 0.01) let those extra steps help?
    "half-batch-x2-kl0.04": ["rollout.prompts_per_round=8", "eval_every=6", "train.beta=0.04"],
    "half-batch-x2-kl0.01": ["rollout.prompts_per_round=8", "eval_every=6", "train.beta=0.01"],
    # fewer ties / a reward closer to the metric: GenEval's verdict (0/1) added to the dense score
    "strict-mix": ["rewards.geneval-strict.weight=1.0", "rewards.geneval-strict.detector=shapes"],
    # the group std gives a group whose rewards barely differ advantages as large as one whose rewards
    # differ widely; the std over all groups keeps small differences small (the mean still centres each group)
    "std-global": ["advantages.std=global"],
    "strict-mix-std-global": ["rewards.geneval-strict.weight=1.0", "rewards.geneval-strict.detector=shapes",
                              "advantages.std=global"],
    # the same trajectories a round in fewer, larger groups (better group baselines)
    "group16": ["rollout.group_size=16", "rollout.prompts_per_round=8"],
    # more exploration in the SDE steps (more reward spread inside a group)
    "noise1.0": ["rollout.noise_level=1.0"],
    # a less noisy step: twice the prompts a round (twice the time a round)
    "prompts32": ["rollout.prompts_per_round=32"],
    # a smaller step, for longer runs
    "lr2e-3": ["train.learning_rate=2e-3"],
    # Room to move: the feed-forward layers adapted too, or a rank-32 adapter (alpha / rank kept at 2).
    "lora-ff": ["train.lora_targets=" + json.dumps(list(sd3.LORA_TARGETS + sd3.LORA_TARGETS_FF))],
    "lora-r32": ["train.lora_rank=32", "train.lora_alpha=64"],
    # a continuous reward: the dense score averaged over detection thresholds (`tpkit.geneval.judge.soft_score`),
    # so the ODE completions from neighbouring states tie less (TP-GRPO's step rewards are mostly 0)
    "soft": ["rewards.geneval.soft=true"],
    # ... whose late steps differ by ~0.001 (detector confidence): the group std would blow those up to
    # unit advantages, the std over all groups keeps them small
    "soft-std-global": ["rewards.geneval.soft=true", "advantages.std=global"],
    # the dense score on GenEval's view (each clause's top-n detections; extras cost nothing but in
    # counting's exclude clause): Flow-GRPO's charges every extra shape, and held-out images mostly fail
    # by drawing too few
    "top-n": ["rewards.geneval.top_n=true"],
    # Adam's first steps are sign steps: every LoRA coordinate moves by the learning rate, whatever its
    # gradient (nonzero |g| spans 3e-8 .. 1.3e-5 in round 0, median 4e-7), so the many near-zero, noisy
    # coordinates move as far as the few with signal. A larger epsilon weights the step by |g| (SGD-like
    # below eps); the rate is set so the first step is as long (L2) as the recipe's sign step.
    "eps1e-6": ["train.adam_epsilon=1e-6", "train.learning_rate=6.5e-3"],
    "eps1e-5": ["train.adam_epsilon=1e-5", "train.learning_rate=1.85e-2"],
    # Is the flattening after ~6 Adam steps a ceiling of what this model can learn, or of the step? Half
    # the step for twice the rounds, with the reward that moved two_object (run with --rounds 12)
    "top-n-lr1.5e-3": ["rewards.geneval.top_n=true", "train.learning_rate=1.5e-3"],
    # The learned reward (--reward pickscore) is continuous and smooth where GenEval's score is a staircase:
    # does it take more, or larger, steps before held-out quality turns down?
    "steps2": ["train.optimizer_steps=2"],
    "lr6e-3": ["train.learning_rate=6e-3"],
}
# settings run for this many times --rounds
METHODS = {"flow-grpo": "Flow-GRPO", "tp-grpo": "TP-GRPO"}
ROUNDS_FACTOR = {"half-batch-x2": 2, "half-batch-x2-kl0.04": 2, "half-batch-x2-kl0.01": 2}


def _rank(key: tuple) -> str:
    return hashlib.sha256(f"{SALT}|{key!r}".encode()).hexdigest()


def split(n_fit: int = 80, n_val: int = 16, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(fit, validation) GenEval metadata lines, both from the train split, no prompt group in common."""
    fit: list[dict] = []
    val: list[dict] = []
    for t, tag in enumerate(shapes.TAGS):
        groups: dict[tuple, list[dict]] = {}
        for m in shapes.split_prompts(tag, "train"):
            groups.setdefault(gp.prompt_key(m), []).append(m)
        keys = sorted(groups, key=_rank)
        cut = math.ceil(len(keys) * shapes.TEST_FRACTION)
        for part, n, out in ((keys[cut:], n_fit, fit), (keys[:cut], n_val, val)):
            order = np.random.default_rng([seed, t]).permutation(len(part))
            ordered = [groups[part[i]] for i in order]
            for i in range(n):
                group = ordered[i % len(ordered)]
                out.append(dict(group[(i // len(ordered)) % len(group)]))
    assert not {gp.prompt_key(m) for m in fit} & {gp.prompt_key(m) for m in val}
    return fit, val


def evaluation(jobs: dict[str, list[cm.Job]]) -> str:
    """How the runs evaluate, as their recipe says (run.toml of the first run): "96 prompts x 8 images, 10 ODE steps"."""
    first = next(j for js in jobs.values() for j in js)
    ev = tomllib.loads((first.out / "run.toml").read_text())["eval"]
    prompts = sum(1 for line in Path(ev["prompts"]).read_text().splitlines() if line.strip())
    return f"{prompts} prompts x {ev['images_per_prompt']} images, {ev['steps']} ODE steps"


def report(jobs: dict[str, list[cm.Job]], base: dict, rounds: int, method: str = "flow-grpo", reward: str = "geneval") -> str:
    """Columns are the k-th evaluation of each run, "after N rounds" of --rounds: a setting with
    ROUNDS_FACTOR evaluates less often, so its k-th evaluation comes after as many samples."""
    key, title = cm.METRICS[reward]
    beside = ["geneval_overall"] if key != "geneval_overall" else []  # a learned reward: did accuracy follow?
    runs_of = {name: [cm.rounds_of(j)[:j.rounds or rounds] for j in js] for name, js in jobs.items()}
    at_rounds = [name for name in runs_of if name not in ROUNDS_FACTOR]
    if not at_rounds:
        sys.exit("tune_shapes: the columns come from a setting run for --rounds; add one, e.g. --settings recipe ...")
    evaluated = [i + 1 for i, r in enumerate(runs_of[at_rounds[0]][0]) if r.get("eval")]
    lines = ["# Choosing the shapes recipes' RL settings on a validation split", "",
             f"Regenerate: `python {' '.join(sys.argv)}`. {METHODS[method]} recipe "
             f"(`{cm.RECIPE_PAIRS[reward][method].relative_to(cm.ROOT).as_posix()}`), rollout prompts = the fit part of the train "
             "split, evaluation = its validation part (a third of the train split's prompt groups, never trained on; "
             f"no test prompt is read). {evaluation(jobs)}; 95 % t-intervals over seeds.", "",
             f"Base model on validation: **{base[key]:.3f}** ({title.replace('held-out ', '')})"
             + "".join(f", GenEval accuracy {base[k]:.3f}" for k in beside) + "."
             + (" A setting run for Nx the rounds is shown at its k-th evaluation, after as many trajectories as the"
                " column's rounds of the recipe." if set(jobs) & set(ROUNDS_FACTOR) else ""), "",
             "| setting | overrides | " + " | ".join(f"after {n} rounds" for n in evaluated)
             + f" | per seed (after {rounds})" + "".join(f" | GenEval accuracy after {n}" for _ in beside for n in evaluated)
             + " | train reward, last round | clip fraction |",
             "|" + " --- |" * (len(evaluated) * (1 + len(beside)) + 5)]
    for name, rs in runs_of.items():
        def at_evals(metric: str) -> dict[int, list[float]]:
            evals = [[r["eval"][metric] for r in run if r.get("eval")] for run in rs]
            return {n: [e[k] for e in evals] for k, n in enumerate(evaluated)}

        at, extra = at_evals(key), [at_evals(k) for k in beside]
        clip = np.mean([r["train"]["clipfrac"] for run in rs for r in run])
        longer = [f"{ROUNDS_FACTOR[name]}x the rounds"] if name in ROUNDS_FACTOR else []
        lines.append(f"| {name} | {', '.join(SETTINGS[name] + longer) or '(the recipe)'} | "
                     + " | ".join(cm.fmt(cm.mean_ci(at[n])) for n in evaluated)
                     + f" | {' / '.join(f'{v:.3f}' for v in at[evaluated[-1]])}"
                     + "".join(f" | {cm.fmt(cm.mean_ci(e[n]))}" for e in extra for n in evaluated)
                     + f" | {cm.fmt(cm.mean_ci([run[-1]['reward_mean'] for run in rs]))} | {clip:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), help="which of SETTINGS")
    p.add_argument("--runs", type=Path, help="where the runs go (large; default runs/tune[-pickscore])")
    p.add_argument("--out", type=Path, help="RESULTS.md (default bench/shapes/tune[/pickscore])")
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (each gets cores / jobs threads)")
    p.add_argument("--method", choices=list(METHODS), default="flow-grpo",
                   help="whose recipe the settings change (flow-grpo: the cheaper, used to choose the recipes' settings)")
    p.add_argument("--reward", choices=list(cm.RECIPE_PAIRS), default="geneval",
                   help="which recipe pair: the dense GenEval score, or the learned reward (pickscore)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every run (repeatable), e.g. rollout.dtype=float32")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: report the runs that finished (a setting holds the seeds it finished)")
    args = p.parse_args()
    pick = args.reward != "geneval"
    args.runs = args.runs or cm.ROOT / "runs" / ("tune-" + args.reward if pick else "tune")
    args.out = args.out or cm.ROOT / "bench" / "shapes" / "tune" / (args.reward if pick else "")

    # 1. Split.
    cm.make_folders(args.runs, args.out)
    files = {}
    for name, items in zip(("fit", "val"), split()):
        files[name] = args.runs / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(m) + "\n" for m in items))

    # 2. Runs, seed by seed.
    sets = [f"rollout.prompts={files['fit'].resolve()}", f"eval.prompts={files['val'].resolve()}", *args.sets]
    jobs = {name: [cm.Job(f"{name}-s{s}", args.method, s, sets + o, args.runs / f"{name}-s{s}",
                          args.rounds * ROUNDS_FACTOR[name] if name in ROUNDS_FACTOR else None, args.reward)
                   for s in args.seeds]
            for name, o in SETTINGS.items() if name in args.settings}
    by_seed = [js[i] for i in range(len(args.seeds)) for js in jobs.values()]
    if args.report_only:
        jobs = {name: kept for name, js in jobs.items() if (kept := [j for j in js if cm.finished(j, args.rounds)])}
    else:
        cm.run_jobs([j for j in by_seed if not cm.finished(j, args.rounds)], args.rounds, args.jobs)

    # 3. Table.
    base = cm.base_eval([j for js in jobs.values() for j in js])
    if not base:
        sys.exit(f"tune_shapes: no run under {args.runs} holds its base-model evaluation (eval-base/manifest.json); "
                 "rerun into a fresh --runs folder")
    text = report(jobs, base, args.rounds, args.method, args.reward)
    old = (args.out / "RESULTS.md").read_text() if (args.out / "RESULTS.md").is_file() else ""
    if cm.READING in old:  # the hand-written reading survives a regeneration (check it against the new numbers)
        text += "\n" + old[old.index(cm.READING):]
    (args.out / "RESULTS.md").write_text(text)
    print((args.out / "RESULTS.md").read_text())


if __name__ == "__main__":
    main()
