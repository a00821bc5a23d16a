"""`tpkit run`: rounds of rollout -> score -> advantages -> train from one recipe.

Rounds are counted from 1 in everything a person reads (progress, tables, rounds.jsonl, report.png,
the tracker); the base model is round 0. Round n lives in the folder round-{n-1:04d} and samples with
round n-1's adapter, trains from it (continuing its optimizer and EMA state) and writes everything there. A stage whose manifest exists is kept, so the
same command continues a stopped run; rounds.jsonl and report.png are rebuilt after each round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

from tpkit import advantages, config, doctor, evaluate, layout, models, report, rollout, runtime, score, tracking, train
from tpkit.config import Recipe, resolve_rank
from tpkit.errors import ConfigError, TpkitError
from tpkit.formulas import round_learning_rate
from tpkit.rewards.registry import check_inputs, load_rewards
from tpkit.ui import console

def evaluate_into(recipe: Recipe, folder: Path, policy: tuple[str, str | None], what: str) -> float | None:
    """The recipe's held-out evaluation of `policy` (model, LoRA or None; `trained_policy`) into `folder`,
    unless it is already there; its seconds when it ran."""
    cfg = dataclasses.replace(recipe.eval, out=str(folder), model=policy[0], lora=policy[1])
    seconds = None
    if not done(folder, lambda: evaluate.identity(cfg.validate()), cfg):
        _, seconds = _timed(evaluate.run, cfg)  # all processes: rank-split like every stage
    layout.wait_for(folder / layout.MANIFEST, what)
    return seconds


def stage_dirs(run_dir: Path, r: int) -> dict[str, Path]:
    base = layout.round_dir(run_dir, r)
    return {s: base / s for s in ("rollout", "score", "advantages", "train")}


def trained_policy(recipe: Recipe, run_dir: Path, r: int, sampling: bool = False) -> tuple[str, str | None]:
    """(model, LoRA adapter or None) after round r's training (r = -1: the recipe's model). With EMA on,
    `sampling` takes adapter-raw/, the trained weights that the next round samples with and continues,
    else adapter/ (the EMA: what is evaluated), as in the release. finetune = full: the round's model/."""
    if r < 0:
        return recipe.rollout.model, None
    folder = stage_dirs(run_dir, r)["train"]
    if recipe.train.finetune == "full":
        return str(folder / train.MODEL), None
    adapter = folder / train.ADAPTER
    return recipe.rollout.model, str(train.policy_adapter(adapter) if sampling else adapter)


# Recipe keys a continued run may change: how far to go, where to log, what to keep, and where the run
# folder is (copied or moved, it continues: no stage identity holds a path).
FREE_ON_CONTINUE = ("rounds", "log_with", "log_images_every", "keep_rounds", "out")


def prompt_digests(recipe: dict) -> dict[str, str | None]:
    """The bytes of a recipe's prompt files by section (rollout, eval); None where a file is missing."""
    paths = {s: (recipe.get(s) or {}).get("prompts") for s in ("rollout", "eval")}
    return {s: layout.file_digest(Path(p)) if p and Path(p).is_file() else None for s, p in paths.items()}


def _fixed(recipe: dict, digests: dict | None = None) -> dict:
    """What defines a run: the recipe but for FREE_ON_CONTINUE and the stages' run-only options
    (layout.RUN_ONLY, REWARD_RUN_ONLY: a continued run may change them), its prompt files by their bytes where
    known (`digests`, default: read now), so that a checkout moved elsewhere holds the same run."""
    fixed = {k: v for k, v in recipe.items() if k not in FREE_ON_CONTINUE}
    # nor what only says how a stage runs (as the stages' own identities leave it out)
    for section, names in layout.RUN_ONLY.items():
        if isinstance(fixed.get(section), dict):
            fixed[section] = {k: v for k, v in fixed[section].items() if k not in names}
    fixed["rewards"] = {name: _result_reward(w) for name, w in (fixed.get("rewards") or {}).items()}
    if isinstance(fixed.get("eval"), dict) and fixed["eval"].get("reward_options"):
        fixed["eval"] = dict(fixed["eval"], reward_options=layout.result_reward_options(fixed["eval"]["reward_options"]))
    for section, digest in (digests or prompt_digests(recipe)).items():
        if digest and (fixed.get(section) or {}).get("prompts"):
            fixed[section] = dict(fixed[section], prompts=f"sha256:{digest}")
    return fixed


def _result_reward(entry):
    """One [rewards] entry (a weight, or a table of weight and options) without REWARD_RUN_ONLY; a
    table left with only its weight is that weight, as a recipe without options writes it."""
    if not isinstance(entry, dict):
        return entry
    kept = {k: v for k, v in entry.items() if k not in layout.REWARD_RUN_ONLY}
    return kept["weight"] if set(kept) == {"weight"} else kept


def run_identity(recipe: Recipe) -> dict:
    """The run folder's stage.json. The family follows from the model, as in rollout.identity (a forced
    one is held by check_same_recipe): left out, runs started before tpkit had families keep theirs."""
    fixed = _fixed(recipe.to_dict())
    fixed["rollout"] = {k: v for k, v in fixed["rollout"].items() if k != "family"}
    return layout.stage_identity("run", dict(fixed, rounds=None), inputs={})


def recipe_difference(run_dir: Path, recipe: Recipe) -> list[str]:
    """The recipe keys in which run_dir's saved recipe differs from `recipe` (but for FREE_ON_CONTINUE);
    [] when they agree or run_dir has no saved recipe. Reads only."""
    import tomllib

    saved_path = run_dir / layout.RUN_TOML
    if not saved_path.is_file():
        return []
    saved = config.with_new_keys(tomllib.loads(saved_path.read_text()))
    if "rollout" in saved:  # written before tpkit had model families: those runs were SD3
        saved["rollout"].setdefault("family", models.recorded(saved["rollout"]))
    # the prompt files' bytes as the run recorded them (stage.json), not as the saved paths hold them now:
    # the checkout may have moved, or the file been edited; a run started by an older tpkit recorded paths
    held = (layout.folder_identity(run_dir) or {}).get("options", {})
    recorded = {s: str((held.get(s) or {}).get("prompts", "")) for s in ("rollout", "eval")}
    digests = {s: recorded[s].removeprefix("sha256:") if recorded[s].startswith("sha256:") else d
               for s, d in prompt_digests(saved).items()}
    a, b = _fixed(saved, digests), _fixed(recipe.to_dict())
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_same_recipe(run_dir: Path, recipe: Recipe) -> None:
    """A continued run must use the recipe it started with (but for FREE_ON_CONTINUE)."""
    import tomli_w

    diff = recipe_difference(run_dir, recipe)
    if diff:
        raise ConfigError(f"{run_dir} was started with a different recipe (differs in: {', '.join(diff)})",
                          "continue with the same recipe and --set options, pass a new --out, "
                          "or --overwrite to start that run again")
    layout.atomic_write(run_dir / layout.RUN_TOML, tomli_w.dumps(recipe.to_dict()).encode())


def done(folder: Path, expected, cfg) -> bool:
    """A finished stage is kept only if it holds what this run would write (expected(): its identity;
    `cfg` the stage's config: options added to tpkit since the stage ran count as the same at their
    defaults)."""
    if not (folder / layout.MANIFEST).is_file():
        return False
    if "options" in (layout.folder_identity(folder) or {}):  # not a folder of an older tpkit
        layout.check_out(folder, expected(), overwrite=False, defaults=layout.json_ready(config.defaults(type(cfg))))
    return True


def _timed(fn, cfg) -> tuple[dict | None, float]:
    t0 = time.perf_counter()
    result = fn(cfg)
    return result, time.perf_counter() - t0


def round_stages(recipe: Recipe, run_dir: Path, r: int) -> dict[str, tuple]:
    """Round r's four stages: name -> (config, its expected identity as a function: what done() checks a
    finished folder against). Configs refer to the folders; identities read the earlier stages' outputs."""
    d = stage_dirs(run_dir, r)
    rollout_manifest = lambda: layout.read_manifest(d["rollout"], "rollout", pruned_ok=True)  # noqa: E731 (kept rounds are pruned)
    # The previous round's trained weights: its LoRA (adapter-raw/ with EMA) or its fully trained model/.
    model, lora = trained_policy(recipe, run_dir, r - 1, sampling=True)
    ro = dataclasses.replace(recipe.rollout, out=str(d["rollout"]), seed=recipe.seed + r,  # a fresh seed every round
                             model=model, lora=lora)
    sc = dataclasses.replace(recipe.score, rollout=str(d["rollout"]), out=str(d["score"]))
    ad = dataclasses.replace(recipe.advantages, scores=str(d["score"]), out=str(d["advantages"]))
    tr = dataclasses.replace(recipe.train, rollout=str(d["rollout"]), advantages=str(d["advantages"]),
                             out=str(d["train"]), seed=recipe.seed + r,
                             learning_rate=round_learning_rate(recipe.train.learning_rate, r, recipe.lr_half_life),
                             init_lora=lora,
                             init_state=str(stage_dirs(run_dir, r - 1)["train"] / train.STATE) if r > 0 else None)
    return {
        "rollout": (ro, lambda: rollout.identity(ro.validate())),
        "score": (sc, lambda: score.identity(sc.validate(), rollout_manifest())),
        "advantages": (ad, lambda: advantages.identity(ad.validate(), layout.parquet_files(d["score"], "score"))),
        "train": (tr, lambda: train.identity(tr.validate(), rollout_manifest(),
                                             layout.parquet_files(d["advantages"], "advantages"))),
    }


def check_finished_round(recipe: Recipe, run_dir: Path, r: int) -> None:
    """A finished round is kept only if every stage folder still holds what this round would write (its
    identity, as for a half-finished round): a stage redone or edited by hand since is refused, naming it."""
    for name, (cfg, expected) in round_stages(recipe, run_dir, r).items():
        done(stage_dirs(run_dir, r)[name], expected, cfg)


def run_round(recipe: Recipe, run_dir: Path, r: int, rewards: list) -> dict | None:
    """Run (or finish) round r with the already built rewards; returns its summary line (main process)."""
    rank, world = resolve_rank(None, None)
    d = stage_dirs(run_dir, r)
    stages = round_stages(recipe, run_dir, r)
    seconds = {}

    # 1. Rollout with the previous round's policy.
    cfg, expected = stages["rollout"]
    if not done(d["rollout"], expected, cfg):
        _, seconds["rollout"] = _timed(rollout.run, cfg)
        layout.wait_for(d["rollout"] / layout.MANIFEST, "rollout")
    # 2. Score every branch (or only R_K for flow-grpo).
    cfg, expected = stages["score"]
    if not done(d["score"], expected, cfg):
        _, seconds["score"] = _timed(lambda c: score.run(c, rewards), cfg)
        layout.wait_for(d["score"] / layout.MANIFEST, "score")
    # 3. Advantages (one process; it is cheap).
    cfg, expected = stages["advantages"]
    if not done(d["advantages"], expected, cfg):
        if rank == 0:
            _, seconds["advantages"] = _timed(advantages.run, cfg)
        layout.wait_for(d["advantages"] / layout.MANIFEST, "advantages")
    # 4. Train, continuing the previous round's adapter and optimizer state, at the round's learning rate.
    cfg, expected = stages["train"]
    if not done(d["train"], expected, cfg):
        _, seconds["train"] = _timed(train.run, cfg)  # all processes: data-parallel under accelerate
        layout.wait_for(d["train"] / layout.MANIFEST, "train")
    # 5. Every eval_every rounds: held-out evaluation of this round's adapter.
    if recipe.eval_every and (r + 1) % recipe.eval_every == 0:
        if (t := evaluate_into(recipe, layout.eval_dir(run_dir, r), trained_policy(recipe, run_dir, r), "eval")) is not None:
            seconds["eval"] = t
    if rank != 0:
        return None

    line = round_summary(run_dir, r, seconds)
    layout.atomic_write_json(layout.round_dir(run_dir, r) / layout.ROUND_JSON, line)
    console.print(f"round {r + 1}: final reward {line['reward_mean']:.4g} ± {line['reward_std']:.4g} "
                  f"(n = {line['n']}), turning-point rate {line['turning_point_rate']:.1%}")
    return line


def round_done(run_dir: Path, r: int) -> bool:
    return (layout.round_dir(run_dir, r) / layout.ROUND_JSON).is_file() and (stage_dirs(run_dir, r)["train"] / layout.MANIFEST).is_file()


def prune_rounds(run_dir: Path, keep: int, full: bool = False) -> dict[int, int]:
    """keep_rounds: delete the rollout shards of finished rounds but round 0 and the last `keep` (0: keep
    all). Shards are nearly all of a LoRA round's bytes (SD3.5-Medium: ~5 MB of cached latents a
    trajectory) and nothing reads them once the round has trained; manifests, Parquet tables, adapters,
    optimizer state and evaluations stay, and rerunning that rollout writes the same shards again.
    full (finetune = full): also those rounds' weights, 12 bytes a parameter a round (9 GB on
    SD3.5-Medium): the optimizer moments in state/, and model/'s transformer unless the round was
    evaluated (its weights are the checkpoint an evaluation judged). Their digests stay behind
    (`layout.prune_weights`), so continuing the run still recognises the rounds that used them.
    Returns {round: bytes freed} for the rounds pruned now."""
    if not keep:
        return {}
    finished = sorted(int(p.name.removeprefix("round-")) for p in Path(run_dir).glob("round-[0-9][0-9][0-9][0-9]")
                      if round_done(run_dir, int(p.name.removeprefix("round-"))))
    why = f"keep_rounds = {keep}"
    freed = {}
    for r in finished[:-keep]:
        d = stage_dirs(run_dir, r)
        freed[r] = layout.prune_shards(d["rollout"], why) if r else 0
        if full:
            state, model = d["train"] / train.STATE, d["train"] / train.MODEL
            freed[r] += layout.prune_weights(state, lambda: layout.tree_digest(state), why)
            if not (layout.eval_dir(run_dir, r) / layout.MANIFEST).is_file():
                freed[r] += layout.prune_weights(model, lambda: models.content_id(str(model)), why)
    return {r: b for r, b in freed.items() if b}


def _prune(run_dir: Path, recipe: Recipe) -> None:
    if freed := prune_rounds(run_dir, recipe.keep_rounds, recipe.train.finetune == "full"):
        what = "rollout shards" + (" and trained weights" if recipe.train.finetune == "full" else "")
        console.print(f"keep_rounds = {recipe.keep_rounds}: deleted the {what} of round(s) "
                      f"{', '.join(str(r + 1) for r in freed)} ({sum(freed.values()) / 2**20:.1f} MiB)")


def round_summary(run_dir: Path, r: int, seconds: dict) -> dict:
    """One rounds.jsonl line from the round's manifests."""
    d = stage_dirs(run_dir, r)
    m = {s: json.loads((p / layout.MANIFEST).read_text()) for s, p in d.items()}
    summ = m["advantages"]["summary"]
    old_path = layout.round_dir(run_dir, r) / layout.ROUND_JSON
    old_seconds = json.loads(old_path.read_text()).get("seconds", {}) if old_path.is_file() else {}
    n = summ["trajectories"]
    return {
        "round": r + 1, "folder": layout.round_dir(run_dir, r).name, "reward_mean": summ["final_reward_mean"], "reward_std": summ["final_reward_std"], "n": n,
        "reward_stderr": summ["final_reward_std"] / max(n - 1, 1) ** 0.5,
        "reward_by_task": m["score"].get("reward_by_task"),  # GenEval-style prompts: the round's mix of tasks varies
        "turning_point_rate": summ["turning_point_rate"], "turning_points": summ["turning_points"],
        "turning_points_kept": summ["turning_points_kept"],
        "tp_rate_per_step": [s["rate"] for s in summ["per_step"]],
        "tp_kept_per_step": [s["kept"] for s in summ["per_step"]],
        "zero_step_rewards_per_step": [s.get("zero_step_rewards") for s in summ["per_step"]],
        "mean_abs_step_reward_per_step": [s.get("mean_abs_step_reward") for s in summ["per_step"]],
        "transformer_calls": m["rollout"]["counts"].get("transformer_calls", 0) + m["score"]["counts"].get("transformer_calls", 0),
        "decodes": m["rollout"]["counts"].get("decodes", 0) + m["score"]["counts"].get("decodes", 0),
        "reward_calls": m["score"]["counts"].get("reward_calls", 0),
        "seconds": {**old_seconds, **{k: round(v, 2) for k, v in seconds.items()}},
        "train": {k: m["train"].get("last_metrics", {}).get(k) for k in ("loss", "ratio_mean", "clipfrac", "grad_norm", "lr")},
        "eval": evaluate.summary(layout.eval_dir(run_dir, r)),
    }


def log_round(tracker: tracking.Tracker, recipe: Recipe, run_dir: Path, line: dict) -> None:
    """One finished round to the tracker: its train metrics at their optimizer steps; reward, turning
    points, calls, seconds and evaluation at its last step; every log_images_every rounds a grid of
    its samples (the first prompts' groups)."""
    r = line["round"] - 1  # its folder's index
    d = stage_dirs(run_dir, r)
    metrics = layout.read_jsonl(d["train"] / layout.METRICS_FILE)
    for m in metrics:
        tracker.scalars(tracking.train_scalars(m), m["step"])
    step = layout.read_manifest(d["train"], "train")["counts"]["global_step"]
    values = {"round": line["round"], "reward/mean": line["reward_mean"], "reward/std": line["reward_std"],
              "reward/stderr": line["reward_stderr"], "turning_points/rate": line["turning_point_rate"],
              "turning_points/kept": line["turning_points_kept"], "calls/transformer": line["transformer_calls"],
              "calls/decodes": line["decodes"], "calls/reward": line["reward_calls"],
              **{f"seconds/{k}": v for k, v in line["seconds"].items()},
              **{f"turning_points/rate_step_{k}": v for k, v in enumerate(line["tp_rate_per_step"])},
              **{f"reward/task/{t}": v for t, v in (line.get("reward_by_task") or {}).items()}}
    tracker.scalars(values, step)
    if line["eval"] is not None:
        log_eval(tracker, layout.eval_dir(run_dir, r), "eval", step)
    if recipe.log_images_every and r % recipe.log_images_every == 0:
        images = report.final_images(d["rollout"], 2 * recipe.rollout.group_size)
        if images:
            tracker.images({"samples": tracking.tile(images, recipe.rollout.group_size)}, step)


def log_eval(tracker: tracking.Tracker, folder: Path, prefix: str, step: int) -> None:
    """A held-out evaluation's headline numbers and its grid PNGs."""
    import numpy as np
    from PIL import Image

    tracker.scalars({f"{prefix}/{k}": v for k, v in (evaluate.summary(folder) or {}).items()}, step)
    tracker.images({f"{prefix}/{p.stem}": np.asarray(Image.open(p).convert("RGB"))
                    for p in sorted(folder.glob("grid*.png"))}, step)


def write_rounds(run_dir: Path, rounds: int) -> list[dict]:
    """rounds.jsonl rebuilt from every finished round (no duplicates after a restart)."""
    lines = []
    for r in range(rounds):
        p = layout.round_dir(run_dir, r) / layout.ROUND_JSON
        if p.is_file():  # numbered by its folder: a round.json of a tpkit before 0.2 counted from 0
            lines.append({**json.loads(p.read_text()), "round": r + 1, "folder": p.parent.name})
    layout.atomic_write(run_dir / layout.ROUNDS_FILE, "".join(json.dumps(x) + "\n" for x in lines).encode())
    return lines


def claim_run_folder(run_dir: Path, recipe: Recipe, overwrite: bool, world: int) -> None:
    """The run folder holds this recipe's run (any number of rounds) and nothing else; --overwrite
    starts it again from an empty folder."""
    ident = run_identity(recipe)
    if not overwrite and (run_dir / layout.RUN_TOML).is_file():
        check_same_recipe(run_dir, recipe)  # refuses another recipe, naming the keys that differ
        # the same run: its identity as this tpkit writes it (older ones held paths, or no stage.json)
        layout.atomic_write_json(run_dir / layout.STAGE_FILE, ident)
    with layout.stage_lock(run_dir, 0, overwrite, world, ident):
        check_same_recipe(run_dir, recipe)


@contextlib.contextmanager
def _disk_full_in_numbers(recipe: Recipe, run_dir: Path):
    """A full disk during the run becomes an error that says how much is free and how much a round writes
    (the doctor's estimate); a rerun continues (every file is written under a temporary name first)."""
    try:
        yield
    except OSError as e:
        if e.errno not in layout.DISK_FULL:
            raise
        free = layout.free_bytes(run_dir)
        estimate = doctor.estimate_round_bytes(recipe, runtime.pick_device(recipe.rollout.device).type == "cuda")
        need = f"; a round writes about {layout.human_bytes(estimate[0])} ({estimate[2]})" if estimate else ""
        raise TpkitError(f"{e.strerror or 'no space left on the device'} in {run_dir}: "
                         f"{layout.human_bytes(free) if free is not None else 'unknown'} free{need}",
                         "free space there, or move the run folder to a bigger disk and pass it as --out (keep_rounds "
                         "= N deletes old rounds' shards); then rerun the same command: it continues") from e


def run(recipe: Recipe, overwrite: bool = False) -> list[dict]:
    # 1. The run folder and its recipe (refusing a different recipe for an existing run).
    rank, world = resolve_rank(None, None)
    tracking.check_kind(recipe.log_with)
    rewards = load_rewards(recipe.score.rewards, recipe.score.reward_options)  # once, and before any rollout
    prompts = layout.load_prompts(Path(recipe.rollout.prompts))  # that the rewards can score them, before any work
    check_inputs(rewards, [p.prompt for p in prompts], [p.metadata for p in prompts])
    run_dir = Path(recipe.out)
    if rank == 0:
        claim_run_folder(run_dir, recipe, overwrite, world)
    run_dir.mkdir(parents=True, exist_ok=True)
    tracker = tracking.open_tracker(recipe.log_with, run_dir, recipe.name, recipe.to_dict(), recipe.train.device)
    with tracking.closing(tracker), _disk_full_in_numbers(recipe, run_dir):
        # 2. With a held-out evaluation: the starting model's, the point the rounds' are measured from.
        if recipe.eval_every:
            if not (run_dir / layout.BASE_EVAL / layout.MANIFEST).is_file():
                console.rule(f"[bold]held-out evaluation of the base model[/] ({run_dir / layout.BASE_EVAL})")
            if evaluate_into(recipe, run_dir / layout.BASE_EVAL, trained_policy(recipe, run_dir, -1), "the base model's evaluation") is not None and tracker:
                log_eval(tracker, run_dir / layout.BASE_EVAL, "eval_base", 0)

        # 3. Rounds; finished ones are skipped, a half-finished one resumes at its first missing stage.
        t0 = time.perf_counter()
        for r in range(recipe.rounds):
            if round_done(run_dir, r):
                try:
                    check_finished_round(recipe, run_dir, r)
                except TpkitError as e:
                    raise type(e)(f"round {r + 1}: {e.message}", e.fix) from e
                continue
            elapsed = time.perf_counter() - t0
            console.rule(f"[bold]round {r + 1}/{recipe.rounds}[/] ({recipe.method}, {run_dir})"
                         + (f"  elapsed {elapsed:.0f}s" if elapsed > 1 else ""))
            try:
                line = run_round(recipe, run_dir, r, rewards)
            except TpkitError as e:  # a broken round stops the run, saying which round
                raise type(e)(f"round {r + 1}: {e.message}", e.fix) from e
            if line is None:
                layout.wait_for(layout.round_dir(run_dir, r) / layout.ROUND_JSON, f"round {r + 1}")
                continue
            # 4. After every round (main process): rounds.jsonl, report.png, the tracker, old rounds' shards.
            report.write(run_dir, write_rounds(run_dir, recipe.rounds))
            if tracker:
                log_round(tracker, recipe, run_dir, line)
            _prune(run_dir, recipe)
    if rank != 0:
        return []
    _prune(run_dir, recipe)  # keep_rounds may have been lowered for a finished run
    rounds_file = run_dir / layout.ROUNDS_FILE
    before = rounds_file.read_bytes() if rounds_file.is_file() else None
    lines = write_rounds(run_dir, recipe.rounds)
    # report.png is drawn from rounds.jsonl: again if it is missing or the lines changed (a run folder of
    # a tpkit before 0.2 counted its rounds from 0)
    if lines and (not (run_dir / report.REPORT).is_file() or rounds_file.read_bytes() != before):
        report.write(run_dir, lines)
    return lines
