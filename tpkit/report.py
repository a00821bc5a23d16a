"""report.png of a run: reward per round (and held-out evaluation, when the recipe has one),
turning-point rate per step, reward along the trajectory (mean R_k per branch), per GenEval task
(GenEval-style prompts) the train reward and held-out accuracy per round, and final images of the
first and the latest round."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from tpkit import evaluate, layout

REPORT = "report.png"
GRID_IMAGES = 8


def final_images(rollout_dir: Path, n: int = GRID_IMAGES, with_prompts: bool = False) -> list:
    """The first n trajectories' final images (by trajectory id, so rounds line up); with_prompts:
    (image, prompt text) pairs."""
    from PIL import Image

    images = []
    for shard in layout.list_shards(rollout_dir):
        prompts, trajs = layout.read_shard(shard, load_tensors=False)
        for t in sorted(trajs, key=lambda t: t.trajectory_id):
            image = np.asarray(Image.open(io.BytesIO(t.final_png)).convert("RGB"))
            images.append((image, prompts[t.meta["prompt_id"]].prompt) if with_prompts else image)
            if len(images) == n:
                return images
    return images


Cell = tuple[np.ndarray, str, "bool | None"]  # an image, its caption, and GenEval's verdict (None: no verdict)


def eval_cells(eval_dir: Path, n: int = GRID_IMAGES) -> list[Cell]:
    """The first image of n prompts spread evenly over a held-out evaluation (GenEval's files are
    ordered by task, so every task shows), captioned with the prompt (and the reward, if no verdict)."""
    from PIL import Image

    rows = [r for r in layout.read_jsonl(eval_dir / evaluate.RESULTS) if r["sample"] == 0]
    rows.sort(key=lambda r: r["index"])
    picked = [rows[i * len(rows) // n] for i in range(min(n, len(rows)))]
    cells = []
    for r in picked:
        path = evaluate.sample_path(evaluate.prompt_dir(eval_dir, r["index"]), 0)
        caption = r["prompt"] if "correct" in r else f"{r['prompt']} ({r['reward']:.3g})"
        cells.append((np.asarray(Image.open(path).convert("RGB")), caption, r.get("correct")))
    return cells


def image_rows(rows: list[list[Cell]], cell: int = 128) -> np.ndarray:
    """Rows of images side by side, each framed green/red by its verdict (if any), with its caption
    wrapped below it."""
    import textwrap

    from PIL import Image, ImageDraw

    width = min(len(r) for r in rows)
    lines, line_h = 3, 12
    h = cell + lines * line_h + 4
    canvas = Image.new("RGB", (width * cell, len(rows) * h), "white")
    draw = ImageDraw.Draw(canvas)
    for y, row in enumerate(rows):
        for x, (image, caption, correct) in enumerate(row[:width]):
            canvas.paste(Image.fromarray(image).resize((cell, cell)), (x * cell, y * h))
            if correct is not None:
                colour = (40, 180, 60) if correct else (220, 30, 30)
                draw.rectangle([x * cell, y * h, (x + 1) * cell - 1, y * h + cell - 1], outline=colour, width=3)
            for i, text in enumerate(textwrap.wrap(caption.removeprefix("a photo of "), 21)[:lines]):
                draw.text((x * cell + 3, y * h + cell + 2 + i * line_h), text, fill=(0, 0, 0))
    return np.asarray(canvas)


def reward_by_branch(score_dir: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(branch k, mean R_k) of a scores folder, or None if only R_K was scored."""
    table = layout.read_parquet_tables(score_dir, "score")
    k = np.asarray(table["branch"].to_pylist())
    r = np.asarray(table["reward"].to_pylist(), dtype=float)
    ks = np.unique(k)
    if len(ks) < 2:
        return None
    return ks, np.array([r[k == b].mean() for b in ks])


def geneval_tasks(lines: list[dict], base: dict | None = None) -> list[str]:
    """The GenEval tasks that rounds.jsonl lines (and the base model's evaluation) report on: train
    reward per task (`reward_by_task`) or held-out accuracy per task (`geneval_<task>`)."""
    evals = [x.get("eval") or {} for x in lines] + [base or {}]
    return sorted({t for x in lines for t in (x.get("reward_by_task") or {})}
                  | {k.removeprefix("geneval_") for e in evals for k in e
                     if k.startswith("geneval_") and k not in ("geneval_overall", "geneval_overall_se")})


def _per_task(ax, lines: list[dict], tasks: list[str], held_out: list[tuple[int, dict]]) -> None:
    """GenEval-style prompts: train reward R_K per task per round (a round draws its prompts at
    random, so the overall mean moves with the mix of tasks too), and held-out accuracy per task
    (`held_out`: (round, evaluation summary), the base model at round 0)."""
    a = ax[0]
    for t in tasks:
        a.plot([x["round"] for x in lines], [(x.get("reward_by_task") or {}).get(t, np.nan) for x in lines], "o-",
               ms=3, label=t)
    a.set(title="final reward R_K per round, per GenEval task", xlabel="round", ylabel="reward")
    if any(x.get("reward_by_task") for x in lines):
        a.legend(fontsize="small", ncol=2)
    a = ax[1]
    keys = [t for t in tasks if any(f"geneval_{t}" in e for _, e in held_out)]
    for t in keys:
        a.plot([r for r, _ in held_out], [e.get(f"geneval_{t}", np.nan) for _, e in held_out], "s--", ms=4, label=t)
    a.set(title="held-out accuracy per GenEval task (round 0: base model)", xlabel="round", ylabel="accuracy")
    if keys:
        a.legend(fontsize="small", ncol=2)


def _heldout_half_widths(run_dir: Path, held_out: list[tuple[int, dict]], key: str) -> tuple[list[float], str]:
    """95 % half-widths of the held-out points: of each round's change from the base model, paired over
    prompts (the same prompts and seeds: what the run's verdict tests), the base point without one; where
    the base was not evaluated, each evaluation's own interval over prompts. Returns (widths, what)."""
    base_dir = run_dir / layout.BASE_EVAL
    if not held_out or held_out[0][0] != 0 or not (base_dir / evaluate.RESULTS).is_file():
        return ([1.96 * e[f"{key}_se"] if np.isfinite(e.get(f"{key}_se", np.nan)) else 0.0 for _, e in held_out],
                "95 % over prompts")
    base = layout.read_jsonl(base_dir / evaluate.RESULTS)
    widths = [0.0]
    for r, _ in held_out[1:]:
        cell = evaluate.paired_cell(layout.read_jsonl(layout.eval_dir(run_dir, r - 1) / evaluate.RESULTS), base, key)
        widths.append(1.96 * cell["delta_se"] if cell.get("delta_se") is not None else 0.0)
    return widths, "95 % of the change from the base, paired over prompts"


def _reward_panel(a, run_dir: Path, lines: list[dict], held_out: list[tuple[int, dict]]) -> None:
    """Final reward per round: mean ± std (bars) and ± standard error (shaded); the held-out evaluation
    (eval_every: GenEval overall accuracy, else the first reward's mean) on a second axis, its bars the
    paired 95 % interval of the change from the base model (`_heldout_half_widths`)."""
    rounds = [x["round"] for x in lines]
    mean = np.array([x["reward_mean"] for x in lines])
    std = np.array([x["reward_std"] for x in lines])
    se = np.array([x["reward_stderr"] for x in lines])
    a.errorbar(rounds, mean, yerr=std, fmt="o-", capsize=3, label="mean ± std")
    a.fill_between(rounds, mean - se, mean + se, alpha=0.3, label="± s.e.")
    a.set(title="final reward R_K per round", xlabel="round (0: base model)", ylabel="reward")
    if any(r for r, _ in held_out):
        key = evaluate.eval_key(next(e for r, e in held_out if r))
        b = a.twinx()
        half, what = _heldout_half_widths(run_dir, held_out, key)
        b.errorbar([r for r, _ in held_out], [e.get(key) for _, e in held_out], yerr=half, fmt="s--", capsize=3,
                   color="tab:red", label=f"held-out {key} ({what})")
        b.set_ylabel(f"held-out {key}", color="tab:red")
        b.legend(loc="lower right")
    a.legend(loc="upper left")


def _turning_point_rate_panel(a, first: dict, last: dict) -> None:
    """Turning-point rate per step, first vs latest round."""
    for x in {first["round"]: first, last["round"]: last}.values():
        rates = x["tp_rate_per_step"]
        a.plot(range(1, len(rates) + 1), rates, "o-", label=f"round {x['round']}")
    a.set(title="turning-point rate per step", xlabel="step k", ylabel="fraction of trajectories")
    a.legend()


def _trajectory_panel(a, run_dir: Path, first: int, last: int) -> None:
    """Reward along the trajectory: mean R_k per window state, first vs latest round."""
    for r in sorted({first, last}):
        curve = reward_by_branch(layout.round_dir(run_dir, r - 1) / "score")
        if curve is not None:
            a.plot(*curve, "o-", label=f"round {r}")
    a.set(title="reward along the trajectory (mean R_k of the ODE branch from s_k)", xlabel="branch k",
          ylabel="reward")
    if a.lines:
        a.legend()


def _turning_points_panel(a, lines: list[dict]) -> None:
    """Turning points found by the sign tests and kept after balancing, per round."""
    rounds = [x["round"] for x in lines]
    a.plot(rounds, [x["turning_points"] for x in lines], "o-", label="found (sign tests)")
    a.plot(rounds, [x["turning_points_kept"] for x in lines], "s--", label="kept after balancing")
    a.set(title="turning points per round", xlabel="round", ylabel="count")
    a.legend()


def _images_panel(a, run_dir: Path, lines: list[dict]) -> None:
    """With a held-out evaluation, the base model's images against the latest evaluated adapter's (same
    prompts, same seeds: the change is the training's); else the first and latest round's samples."""
    first, last = lines[0]["round"], lines[-1]["round"]
    evaluated = [x["round"] for x in lines if x.get("eval")]
    if evaluated and (run_dir / layout.BASE_EVAL / layout.MANIFEST).is_file():
        rows = [eval_cells(run_dir / layout.BASE_EVAL), eval_cells(layout.eval_dir(run_dir, evaluated[-1] - 1))]
        title = f"held-out prompts, same seeds: base model (top) vs after round {evaluated[-1]} (bottom)"
    else:
        rows = [[(im, text, None) for im, text in final_images(layout.round_dir(run_dir, r - 1) / "rollout", with_prompts=True)]
                for r in sorted({first, last})]
        title = f"final images: round {first} (top) vs round {last} (bottom)"
        if len(rows) == 2 and [c[1] for c in rows[0]] != [c[1] for c in rows[1]]:
            title += ", other prompts"
    rows = [r for r in rows if r]
    if rows:
        a.imshow(image_rows(rows))
    a.set(title=title)
    a.axis("off")


def write(run_dir: Path, lines: list[dict]) -> Path:
    """report.png from rounds.jsonl's lines (rounds counted from 1; the base model is round 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not lines:
        return run_dir / REPORT
    # 1. The layout: a row per pair of panels, a fourth with GenEval-style prompts, the images below.
    tasks = geneval_tasks(lines)
    rows = 4 if tasks else 3
    fig = plt.figure(figsize=(12, 11 + 3.2 * (rows - 3)))
    # Fixed margins instead of tight_layout, which draws the figure twice (0.6 s of 2 s a round).
    grid = fig.add_gridspec(rows, 2, height_ratios=[1] * (rows - 1) + [0.8], left=0.07, right=0.98,
                            top=0.93 if rows == 3 else 0.95, bottom=0.02, hspace=0.32 if rows == 3 else 0.35, wspace=0.3)
    ax = np.array([[fig.add_subplot(grid[i, 0]), fig.add_subplot(grid[i, 1])] for i in range(rows - 1)])
    # 2. The held-out evaluations: the starting model at round 0, then every evaluated round.
    base = evaluate.base_eval(run_dir)
    held_out = ([(0, base)] if base else []) + [(x["round"], x["eval"]) for x in lines if x.get("eval")]
    # 3. The panels.
    _reward_panel(ax[0, 0], run_dir, lines, held_out)
    _turning_point_rate_panel(ax[0, 1], lines[0], lines[-1])
    _trajectory_panel(ax[1, 0], run_dir, lines[0]["round"], lines[-1]["round"])
    _turning_points_panel(ax[1, 1], lines)
    if tasks:
        _per_task(ax[2], lines, tasks, held_out)
    for a in (ax[0, 0], ax[1, 1], *(ax[2] if tasks else ())):  # rounds are whole numbers
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    _images_panel(fig.add_subplot(grid[rows - 1, :]), run_dir, lines)
    # 4. The PNG, written atomically.
    fig.suptitle(f"{run_dir.name}: {len(lines)} rounds")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    layout.atomic_write(run_dir / REPORT, buf.getvalue())
    return run_dir / REPORT
