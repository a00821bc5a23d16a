"""`tpkit eval compare`: several models or adapters x several metrics, on the same prompts and seeds,
as one table (the base-vs-trained table every paper in the field prints).

Each entry is an ordinary evaluation with one shared protocol (EvalConfig: prompts, rewards, sampler,
seeds), so it resumes per prompt and splits across ranks like `tpkit eval reward`:

    OUT/entries/NAME/      the entry's images (GenEval layout), rewards, summary, grids, manifest
    OUT/geneval/NAME/      with --geneval: GenEval's verdict on those same images
    OUT/compare.md|csv|json, OUT/grid.png (row: a prompt; column: an entry, same seed), manifest.json

Cells are mean ± standard error with the prompt as the unit (images of one prompt are not
independent): a reward's mean over all images, its s.e. over the per-prompt means; GenEval's overall
accuracy is the mean of its task accuracies, its s.e. sqrt(sum_t se_t^2) / T. Each entry after the
first also gets its difference from the first, paired over prompts (same prompts, same seeds).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path

import numpy as np

from tpkit import evaluate, layout
from tpkit.config import CompareConfig, EvalConfig, to_dict
from tpkit.evaluate import GENEVAL_TASKS, RESULTS, paired_cell
from tpkit.ui import console

MANIFEST_STAGE = "eval-compare"
OUTPUTS = ("compare.md", "compare.csv", "compare.json", "grid.png")


def entry_configs(cfg: CompareConfig) -> list[tuple[str, EvalConfig, EvalConfig | None]]:
    """(name, its evaluation, its GenEval judging of the same images or None) per entry."""
    out = []
    for name, model, lora in cfg.parsed():
        folder = Path(cfg.out) / "entries" / name
        geneval = {"geneval": dict(cfg.geneval_options)}
        ev = dataclasses.replace(cfg.protocol, model=model, lora=lora, out=str(folder), images=None, kind="reward")
        if not cfg.protocol.rewards:  # GenEval alone: generate and judge in one evaluation
            ev = dataclasses.replace(ev, kind="geneval", reward_options=geneval)
        judge = None
        if cfg.geneval and ev.kind == "reward":
            judge = dataclasses.replace(ev, kind="geneval", out=str(Path(cfg.out) / "geneval" / name), images=str(folder),
                                        rewards={}, reward_options=geneval)
        out.append((name, ev.validate(), judge.validate() if judge else None))
    return out


def run(cfg: CompareConfig) -> dict | None:
    # 1. Every entry's configuration, checked before any work.
    cfg.validate()
    entries = entry_configs(cfg)
    # 2. Evaluate each entry (resumable, rank-split), then judge its images with GenEval if asked.
    for name, ev, judge in entries:
        console.rule(f"[bold]{name}[/]: {ev.model}" + (f" + {ev.lora}" if ev.lora else ""))
        evaluate.run(ev)
        layout.wait_for(Path(ev.out) / layout.MANIFEST, f"the evaluation of {name}")
        if judge:
            evaluate.run(judge)
            layout.wait_for(Path(judge.out) / layout.MANIFEST, f"GenEval of {name}")
    if entries[0][1].rank != 0:
        return None
    # 3. The table, the grid and the manifest (main process).
    results = {name: _results(ev, judge) for name, ev, judge in entries}
    table = build_table(results)
    out = Path(cfg.out)
    layout.atomic_write(out / "compare.json", json.dumps(table, indent=1).encode())
    layout.atomic_write(out / "compare.csv", to_csv(table).encode())
    layout.atomic_write(out / "compare.md", to_markdown(table, entries).encode())
    layout.atomic_write(out / "grid.png", grid_png(results, cfg.protocol.grid_prompts))
    return layout.write_manifest(out, MANIFEST_STAGE, {"entries": cfg.entries, "geneval": cfg.geneval,
                                                        "geneval_options": cfg.geneval_options,
                                                        "protocol": to_dict(cfg.protocol)},
                                 inputs={name: {"model": ev.model, "lora": ev.lora} for name, ev, _ in entries},
                                 counts={"entries": len(entries), "images": sum(len(r) for r in results.values())},
                                 summary=table)


def _read(folder: str) -> list[dict]:
    return layout.read_jsonl(Path(folder) / RESULTS)


def _results(ev: EvalConfig, judge: EvalConfig | None) -> list[dict]:
    """One row per image: prompt, sample, image path, reward columns and (with GenEval) correct/tag."""
    rows = _read(ev.out)
    if judge:
        verdicts = {(r["index"], r["sample"]): r for r in _read(judge.out)}
        rows = [dict(r, correct=verdicts[(r["index"], r["sample"])]["correct"],
                     tag=verdicts[(r["index"], r["sample"])]["tag"]) for r in rows]
    return rows


def build_table(results: dict[str, list[dict]]) -> dict:
    """{"metrics": [...], "entries": [...], "cells": {entry: {metric: cell}}}; the first entry is the base."""
    first = next(iter(results.values()))
    metrics = [c for c in first[0] if c.startswith("reward_")]
    if "correct" in first[0]:
        tags = [t for t in GENEVAL_TASKS if any(r["tag"] == t for r in first)]
        metrics += ["geneval_overall"] + [f"geneval_{t}" for t in tags]
    names = list(results)
    base = results[names[0]]
    cells = {n: {m: paired_cell(rows, None if n == names[0] else base, m) for m in metrics} for n, rows in results.items()}
    return {"metrics": metrics, "entries": names, "base": names[0], "cells": cells,
            "unit": "mean ± standard error over prompts; delta: paired difference from the base over prompts"}


def _fmt(mean: float, se: float, sign: str = "") -> str:
    """mean ± se; the s.e. is left out where it does not exist (a single prompt)."""
    return f"{mean:{sign}.4g} ± {se:.2g}" if np.isfinite(se) else f"{mean:{sign}.4g}"


def to_markdown(table: dict, entries) -> str:
    heads = [m.removeprefix("reward_") for m in table["metrics"]]
    lines = [f"| entry | model + LoRA | {' | '.join(heads)} |", "|" + " --- |" * (len(heads) + 2)]
    what = {name: ev.model + (f" + {ev.lora}" if ev.lora else "") for name, ev, _ in entries}
    for n in table["entries"]:
        c = table["cells"][n]
        lines.append(f"| {n} | {what[n]} | " + " | ".join(_fmt(c[m]["mean"], c[m]["se"]) for m in table["metrics"]) + " |")
    if len(table["entries"]) > 1:
        lines += ["", f"Difference from `{table['base']}` (paired over prompts):", "",
                  f"| entry | {' | '.join(heads)} |", "|" + " --- |" * (len(heads) + 1)]
        for n in table["entries"][1:]:
            c = table["cells"][n]
            lines.append(f"| {n} | " + " | ".join(_fmt(c[m]["delta"], c[m]["delta_se"], "+") for m in table["metrics"]) + " |")
    n_prompts = table["cells"][table["base"]][table["metrics"][0]]["n"]
    lines += ["", f"{table['unit']} ({n_prompts} prompts)."]
    return "\n".join(lines) + "\n"


def to_csv(table: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["entry", "metric", "mean", "se", "n_prompts", "delta", "delta_se"])
    for n in table["entries"]:
        for m in table["metrics"]:
            c = table["cells"][n][m]
            w.writerow([n, m, c["mean"], c["se"], c["n"], c.get("delta", ""), c.get("delta_se", "")])
    return buf.getvalue()


def grid_png(results: dict[str, list[dict]], n_prompts: int) -> bytes:
    """Rows: the first n prompts; columns: the entries; each cell the prompt's first image (same seed)."""
    from PIL import Image, ImageDraw

    names = list(results)
    first = {n: {r["index"]: r for r in rows if r["sample"] == 0} for n, rows in results.items()}
    indices = sorted(first[names[0]])[:n_prompts]
    cell, label, head = 128, 220, 18
    grid = Image.new("RGB", (label + cell * len(names), head + cell * len(indices)), "white")
    draw = ImageDraw.Draw(grid)
    for x, n in enumerate(names):
        draw.text((label + x * cell + 4, 3), n[:20], fill="black")
    for y, i in enumerate(indices):
        draw.text((4, head + y * cell + 4), first[names[0]][i]["prompt"][:34], fill="black")
        for x, n in enumerate(names):
            im = Image.open(first[n][i]["image"]).convert("RGB").resize((cell, cell))
            grid.paste(im, (label + x * cell, head + y * cell))
    buf = io.BytesIO()
    grid.save(buf, format="PNG")
    return buf.getvalue()
