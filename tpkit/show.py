"""Rich views of stage outputs: the summaries the stage commands print and `tpkit inspect PATH`."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from tpkit import evaluate, layout
from tpkit.errors import InputError
from tpkit.report import geneval_tasks
from tpkit.trajectory import STORED_TOLERANCE
from tpkit.ui import out as console


def _kv_table(title: str, items: dict) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    for k, v in items.items():
        t.add_row(str(k), v if isinstance(v, str) else json.dumps(v, default=str))
    return t


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def manifest_summary(manifest: dict) -> None:
    """Counts and seconds per phase of any stage, in one table."""
    rows = dict(manifest.get("counts", {}))
    rows.update({f"per trajectory: {k}": f"{v:.4g}" for k, v in manifest.get("per_trajectory", {}).items()})
    rows.update({f"mean R_K: {k}": f"{v:.4g}" for k, v in (manifest.get("reward_by_task") or {}).items()})
    rows.update({f"seconds: {k}": f"{v:.2f}" for k, v in manifest.get("seconds", {}).items()})
    console.print(_kv_table(f"{manifest['stage']} summary", rows))


def rollout_settings(manifest: dict) -> None:
    c = {"family": "sd3", **manifest["config"]}  # rollouts from before FLUX record no family
    keys = ("model", "family", "lora", "sampler", "noise_level", "guidance", "steps", "window_size", "window_range",
            "group_size", "resolution", "seed")
    console.print(_kv_table("rollout settings", {**{k: c[k] for k in keys}, "window_start": manifest["window_start"]}))


def scores_view(table) -> None:
    """Reward statistics per branch k (R_0 .. R_K)."""
    import numpy as np

    branch = np.asarray(table["branch"].to_pylist())
    comps = [c for c in table.column_names if c == "reward" or c.startswith("reward_")]
    t = Table(title=f"rewards per branch ({len(set(table['trajectory_id'].to_pylist()))} trajectories)",
              title_justify="left")
    t.add_column("branch k", justify="right")
    for c in comps:
        t.add_column(f"{c} mean ± std", justify="right")
    t.add_column("min", justify="right")
    t.add_column("max", justify="right")
    values = {c: np.asarray(table[c].to_pylist(), dtype=float) for c in comps}
    for k in sorted(set(branch.tolist())):
        sel = branch == k
        r = values["reward"][sel]
        t.add_row(str(k), *[f"{_fmt(values[c][sel].mean())} ± {_fmt(values[c][sel].std())}" for c in comps],
                  _fmt(r.min()), _fmt(r.max()))
    console.print(t)


def advantages_view(summary: dict) -> None:
    """Turning points per step: candidates, rate, sign of agg, kept after balancing."""
    t = Table(title=(f"turning points: {summary['turning_points']} found, {summary['turning_points_kept']} kept "
                     f"({summary['trajectories']} trajectories, {summary['prompts']} prompts, K = {summary['K']})"),
              title_justify="left")
    for col in ("step", "turning points", "rate", "positive agg", "negative agg", "kept"):
        t.add_column(col, justify="right")
    for s in summary["per_step"]:
        t.add_row(str(s["step"]), str(s["candidates"]), f"{s['rate']:.1%}", str(s["positive"]), str(s["negative"]),
                  str(s["kept"]))
    console.print(t)
    console.print(f"final reward R_K: {_fmt(summary['final_reward_mean'])} ± {_fmt(summary['final_reward_std'])}")


def _advantages_summary_from_table(table) -> dict:
    import numpy as np

    step = np.asarray(table["step"].to_pylist())
    cand = np.asarray(table["turning_point_candidate"].to_pylist(), dtype=bool)
    kept = np.asarray(table["turning_point"].to_pylist(), dtype=bool)
    agg = np.asarray(table["aggregated_reward"].to_pylist(), dtype=float)
    final = np.asarray(table["final_reward"].to_pylist(), dtype=float)
    ids = table["trajectory_id"].to_pylist()
    per_step = [{"step": int(k), "candidates": int(cand[step == k].sum()), "rate": float(cand[step == k].mean()),
                 "positive": int((cand & (agg > 0))[step == k].sum()), "negative": int((cand & (agg < 0))[step == k].sum()),
                 "kept": int(kept[step == k].sum())} for k in sorted(set(step.tolist()))]
    return {"trajectories": len(set(ids)), "prompts": len(set(table["prompt_id"].to_pylist())), "K": int(step.max()),
            "turning_points": int(cand.sum()), "turning_points_kept": int(kept.sum()),
            "final_reward_mean": float(final[step == 1].mean()), "final_reward_std": float(final[step == 1].std()),
            "per_step": per_step}


def shard_view(path: Path) -> None:
    import numpy as np

    prompts, trajs = layout.read_shard(path)
    console.print(f"[bold]{path}[/]: {len(prompts)} prompts, {len(trajs)} trajectories")
    if trajs:
        m = {"family": "sd3", **trajs[0].meta}  # rollouts from before FLUX record no family
        settings = {k: m[k] for k in ("model", "family", "lora", "sampler", "noise_level", "guidance", "steps",
                                       "window_start", "window_size", "resolution")}
        settings.update({f"tensor {k}": f"{list(v.shape)} {str(v.dtype).replace('torch.', '')}"
                         for k, v in trajs[0].tensors.items()})
        console.print(_kv_table("trajectory settings and shapes", settings))
        lp = np.stack([t.tensors["log_probs"].numpy() for t in trajs])
        t = Table(title="log-prob per window step (mean ± std over trajectories)", title_justify="left")
        t.add_column("step k", justify="right")
        t.add_column("log-prob", justify="right")
        for k in range(lp.shape[1]):
            t.add_row(str(k + 1), f"{_fmt(lp[:, k].mean())} ± {_fmt(lp[:, k].std())}")
        console.print(t)
    t = Table(title="prompts", title_justify="left")
    for col in ("prompt_id", "members", "prompt"):
        t.add_column(col)
    for pid, p in prompts.items():
        t.add_row(pid, str(sum(tr.meta["prompt_id"] == pid for tr in trajs)), p.prompt[:80])
    console.print(t)


def train_view(folder: Path) -> None:
    """metrics.jsonl of a train folder, one row per optimizer step."""
    lines = layout.read_jsonl(Path(folder) / layout.METRICS_FILE)
    t = Table(title=f"train: {len(lines)} optimizer steps", title_justify="left")
    cols = ("step", "loss", "policy_loss", "kl_loss", "ratio_mean", "clipfrac", "approx_kl", "grad_norm", "samples")
    for c in cols:
        t.add_column(c, justify="right")
    for m in lines:
        t.add_row(*[str(m[c]) if isinstance(m[c], int) else _fmt(m[c]) for c in cols])
    console.print(t)


def rounds_view(lines: list[dict], base_eval: dict | None = None, change: dict | None = None) -> None:
    """rounds.jsonl: final reward, turning points and (with eval_every) the held-out evaluation per round,
    below the starting model's evaluation (`base_eval`); then the verdict on `change` (evaluate.heldout_change)."""
    evals = [x["eval"] for x in lines if x.get("eval")] + ([base_eval] if base_eval else [])
    key = evaluate.eval_key(evals[0]) if evals else None
    t = Table(title="rounds", title_justify="left")
    for c in ("round", "reward", "s.e.", "std", "n", "TP rate", "calls", "seconds") + ((f"held-out {key}",) if key else ()):
        t.add_column(c, justify="right")
    if base_eval:
        t.add_row("base", *[""] * 7, _fmt(base_eval.get(key)))
    for x in lines:
        t.add_row(str(x["round"]), _fmt(x["reward_mean"]), _fmt(x["reward_stderr"]), _fmt(x["reward_std"]),
                  str(x["n"]), f"{x['turning_point_rate']:.1%}", str(x["transformer_calls"]),
                  f"{sum(x['seconds'].values()):.1f}", *([_fmt((x.get("eval") or {}).get(key))] if key else []))
    console.print(t)
    if rows := task_rows(lines, base_eval):
        t = Table(title="per GenEval task (a round's mix of tasks varies: compare per task)", title_justify="left")
        held = [x["round"] for x in lines if x.get("eval")]
        for c in ("task", f"R_K, round {lines[0]['round']}", f"R_K, round {lines[-1]['round']}",
                  "held-out, base", f"held-out, round {held[-1]}" if held else "held-out"):
            t.add_column(c, justify="right")
        for row in rows:
            t.add_row(row[0], *map(_fmt, row[1:]))
        console.print(t)
    if change:
        console.print(heldout_verdict(change))


def task_rows(lines: list[dict], base_eval: dict | None) -> list[tuple]:
    """(task, train R_K in the first and last round, held-out accuracy of the base model and of the
    last evaluated round) for GenEval-style runs; None where a round had no prompt of the task."""
    first, last = lines[0].get("reward_by_task") or {}, lines[-1].get("reward_by_task") or {}
    evals = [x["eval"] for x in lines if x.get("eval")]
    held = evals[-1] if evals else {}
    return [(t, first.get(t), last.get(t), (base_eval or {}).get(f"geneval_{t}"), held.get(f"geneval_{t}"))
            for t in geneval_tasks(lines, base_eval)]


def heldout_verdict(c: dict) -> str:
    """One line: the held-out change after the last evaluated round, with its 95 % interval (paired over
    prompts), and whether it is distinguishable from evaluation noise."""
    line, sign = _change_line(c)
    if sign == 0:
        line = f"[yellow]{line}: not distinguishable from evaluation noise[/]"
    else:
        line = f"[green]{line}[/]" if sign > 0 else f"[red]{line}: worse than the base model[/]"
    if "geneval" not in c:
        return line
    # A learned reward beside GenEval: does what it rewards still agree with what it stands for?
    g, g_sign = _change_line(c["geneval"])
    if sign > 0 and g_sign < 0:
        return f"{line}\n[red]{g}: the reward rose while GenEval accuracy fell (reward hacking)[/]"
    if sign > 0 and g_sign == 0:
        return f"{line}\n[yellow]{g}: not distinguishable from noise, the reward's gain is not (yet) GenEval's[/]"
    return f"{line}\n{'[green]' if g_sign > 0 else '[yellow]' if g_sign == 0 else '[red]'}{g}[/]"


def _change_line(c: dict) -> tuple[str, int]:
    """The held-out change as one line, and +1 / -1 where its 95 % interval excludes zero, else 0 (NaN se
    from one prompt counts as indistinguishable too)."""
    half = 1.96 * c["delta_se"]
    line = (f"held-out {c['metric']}: {c['base']:.3f} (base) -> {c['last']:.3f} after {c['round']} rounds, "
            f"{c['delta']:+.3f} ± {half:.3f} (95 %, paired over prompts)")
    return line, (0 if not abs(c["delta"]) > half else 1 if c["delta"] > 0 else -1)


def trajectory_view(result: dict) -> None:
    """The table of `tpkit trajectory`: R_k per state, then per step d_k, turning point and advantage."""
    steps = {r["step"]: r for r in result["steps"]}
    t = Table(title=f"trajectory {result['trajectory_id']}", title_justify="left")
    for c in ("k", "R_k", "d_k", "candidate", "turning point", "aggregated", "advantage"):
        t.add_column(c, justify="right")
    for k, reward in enumerate(result["recomputed"]):
        s = steps.get(k)
        t.add_row(str(k), _fmt(reward) + ("" if k in result["stored"] else " *"), *([_fmt(s["step_reward"]), "yes" if s["turning_point_candidate"] else "",
                                           "[bold]yes[/]" if s["turning_point"] else "", _fmt(s["aggregated_reward"]),
                                           _fmt(s["advantage"])] if s else [""] * 5))
    console.print(t)
    if len(result["stored"]) < len(result["recomputed"]):
        console.print("* not in the scores (Flow-GRPO scores R_K only): computed now, nothing to check it against")
    diff = result["max_difference"]
    if diff > STORED_TOLERANCE:
        console.print(f"[yellow]warning: the recomputed R_k differ from the stored ones by up to {diff:.3g} (other "
                      "hardware, dtype or batching): the images are close to, not exactly, what was scored[/]")
    else:
        console.print(f"recomputed R_k = stored R_k (max difference {diff:.2g}): the images are what was scored")
    console.print(f"[green]wrote[/] {result['png']}")


def eval_view(manifest: dict) -> None:
    """The summary of `tpkit eval reward|geneval`."""
    summ = manifest["summary"]
    if manifest["stage"] == "eval-geneval":
        t = Table(title=f"GenEval: overall {summ['overall']:.1%} ({summ['images']} images)", title_justify="left")
        for c in ("task", "accuracy", "images", "mean dense score"):
            t.add_column(c, justify="right")
        for task, v in summ["tasks"].items():
            t.add_row(task, f"{v['accuracy']:.1%}", str(v["images"]), _fmt(v["mean_score"]))
    else:
        t = Table(title=f"rewards over {summ['images']} images", title_justify="left")
        for c in ("column", "mean", "std"):
            t.add_column(c, justify="right")
        for c, v in summ["overall"].items():
            t.add_row(c, _fmt(v["mean"]), _fmt(v["std"]))
    console.print(t)


def inspect(path: Path) -> None:
    """Summarise a stage folder, a shard or a Parquet file."""
    path = Path(path)
    if path.is_dir() and (path / layout.ROUNDS_FILE).is_file():  # a `tpkit run` folder
        lines = layout.read_jsonl(path / layout.ROUNDS_FILE)
        console.print(f"[bold]{path}[/]: run with {len(lines)} finished rounds")
        rounds_view(lines, evaluate.base_eval(path), evaluate.heldout_change(path, lines))
        return
    if path.is_dir():
        manifest_path = path / layout.MANIFEST
        if not manifest_path.is_file():
            raise InputError(f"{path}: no {layout.MANIFEST} (not a finished stage folder)",
                             "pass a stage folder (rollout/, score/, advantages/, train/), a .tar shard or a .parquet file")
        manifest = json.loads(manifest_path.read_text())
        stage = manifest.get("stage")
        console.print(f"[bold]{path}[/]: {stage} stage, schema {manifest.get('schema_version')}, "
                      f"tpkit {manifest.get('tpkit_version')}")
        if stage == "rollout":
            rollout_settings(manifest)
            shards = layout.list_shards(path)
            if shards:
                shard_view(shards[0])
            elif (path / layout.PRUNED).is_file():
                why = json.loads((path / layout.PRUNED).read_text()).get("why", "")
                console.print(f"its shards were deleted by `tpkit run` ({why}) once the round was trained; rerun "
                              f"`tpkit rollout` into it with the options above to write the same shards again")
        elif stage == "score":
            scores_view(layout.read_parquet_tables(path, "score"))
        elif stage == "advantages":
            advantages_view(manifest["summary"])
        elif stage == "train":
            train_view(path)
        manifest_summary(manifest)
    elif path.suffix == ".tar":
        shard_view(path)
    elif path.suffix == ".parquet":
        table = layout.read_parquet_tables(path, "score")
        console.print(f"[bold]{path}[/]: {table.num_rows} rows; columns: {', '.join(table.column_names)}")
        if "advantage" in table.column_names and "turning_point_candidate" in table.column_names:
            advantages_view(_advantages_summary_from_table(table))
        elif {"branch", "reward"} <= set(table.column_names):
            scores_view(table)
    else:
        raise InputError(f"{path}: not a folder, .tar or .parquet", "pass a stage folder, a shard or a Parquet file")
