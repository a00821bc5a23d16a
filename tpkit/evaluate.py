"""`tpkit eval reward` and `tpkit eval geneval`: held-out evaluation of a model (+ LoRA).

Images are generated with the eval sampler (ODE, 40 steps, CFG 4.5 by default; one stored seed
per image) into GenEval's folder layout, or read from such a folder (`--images`):

    OUT/images/00000/metadata.jsonl     the prompt's metadata (GenEval: one line)
    OUT/images/00000/samples/0000.png   its images
    OUT/images/00000/results.json       per image: seed, rewards or GenEval verdict (written last)

Work is split by generation batch: consecutive prompts fill a batch of `batch_size` images, and
batch c goes to rank c % world. A batch always holds the same images (whatever the number of ranks
or what an interrupted run finished), so results do not depend on either (matmuls are not
batch-invariant). Each prompt is finished atomically, so a rerun resumes and any number of
processes can share a run. Whoever finishes last merges everything into results.jsonl,
summary.json, grid PNGs and manifest.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

from tpkit import formulas, layout, memory, models, runtime
from tpkit.config import EvalConfig, to_dict
from tpkit.errors import ConfigError, InputError, RewardError
from tpkit.geneval import detectors
from tpkit.geneval.judge import check_meta
from tpkit.geneval.prompts import official_like_test_set
from tpkit.rewards.registry import check_inputs, load_rewards, score_images
from tpkit.rollout import derive_seed
from tpkit.runtime import png_bytes
from tpkit.timing import Phases
from tpkit.ui import track

RESULTS, SUMMARY = "results.jsonl", "summary.json"


def prompt_dir(out: Path, i: int) -> Path:
    return out / "images" / f"{i:05d}"


def sample_path(folder: Path, j: int) -> Path:
    return folder / "samples" / f"{j:04d}.png"


def prompt_batches(n_prompts: int, cfg: EvalConfig) -> list[list[int]]:
    """Prompt indices per generation batch: batch_size // images_per_prompt whole prompts (at least
    one; a prompt with more images than batch_size spans several transformer batches of its own)."""
    per = max(1, cfg.batch_size // cfg.images_per_prompt)
    return [list(range(i, min(i + per, n_prompts))) for i in range(0, n_prompts, per)]


def generate(model, prompts: list[layout.Prompt], indices: list[int], cfg: EvalConfig, out: Path,
             phases: Phases) -> None:
    """ODE-sample images_per_prompt images for each prompt of one generation batch into the GenEval
    layout. Transformer batches are cut from all the batch's images, not only the missing ones, so
    a resumed run computes every image in the same batch as an uninterrupted one."""
    import torch

    sigmas = model.sigmas(cfg.steps, cfg.resolution)
    shape = model.latent_shape(cfg.resolution)
    jobs = [(i, j) for i in indices for j in range(cfg.images_per_prompt)]
    for b in range(0, len(jobs), cfg.batch_size):
        batch = jobs[b: b + cfg.batch_size]
        missing = [not sample_path(prompt_dir(out, i), j).is_file() for i, j in batch]
        if not any(missing):
            continue
        with phases("encode"):
            emb = model.encode([prompts[i].prompt for i, _ in batch], cfg.max_sequence_length)
        seeds = [derive_seed(cfg.seed, "eval", prompts[i].prompt_id, j) for i, j in batch]
        with phases("sample"), torch.no_grad():
            x = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds]).to(model.device)
            for t in range(cfg.steps):
                v = model.velocity(x, torch.full((len(batch),), sigmas[t]), emb, cfg.guidance)
                x = formulas.ode_step(x, v, sigmas[t], sigmas[t + 1])
        with phases("decode"):
            images = model.decode(x)
        with phases("write"):
            for (i, j), image, write in zip(batch, images, missing):
                if write:
                    layout.atomic_write(sample_path(prompt_dir(out, i), j), png_bytes(image))


def read_images(folder: Path) -> tuple[list, list[Path]]:
    from PIL import Image

    paths = sorted((folder / "samples").glob("*.png"))
    return [Image.open(p).convert("RGB") for p in paths], paths


def score_prompt_rewards(rewards, prompt: layout.Prompt, images: list) -> list[dict]:
    cols = score_images(rewards, images, [prompt.prompt] * len(images), [prompt.metadata] * len(images))
    bad = sorted({j for vals in cols.values() for j, v in enumerate(vals) if not math.isfinite(v)})
    if bad:
        raise RewardError(f"prompt {prompt.prompt_id} ({prompt.prompt!r}): reward is NaN or infinite for image(s) "
                          f"{', '.join(map(str, bad))}", "fix the reward function; nothing was written for this prompt")
    return [{name: vals[j] for name, vals in cols.items()} for j in range(len(images))]


def score_prompt_geneval(judge_models, prompt: layout.Prompt, images: list) -> list[dict]:
    judgements = detectors.detect_and_judge(images, [prompt.metadata] * len(images), *judge_models)
    return [dict(correct=bool(jd.correct), strict=float(jd.strict), score=float(jd.score), reason=jd.reason,
                 detections=_jsonable(getattr(jd, "detections", None))) for jd in judgements]


def _jsonable(x):
    if x is None:
        return None
    return json.loads(json.dumps(x, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


def run(cfg: EvalConfig) -> dict | None:
    """Run (or finish) an evaluation; returns the manifest once every prompt is done."""
    cfg.validate()
    # 1. Check inputs: prompts (or an existing image folder), then build the scorers up front
    # (before --overwrite clears anything).
    prompts, folders = _load_prompts(cfg)
    if cfg.kind == "geneval":
        for p in prompts:
            try:
                check_meta(p.metadata)
            except ValueError as e:
                raise InputError(f"prompt {p.prompt_id} ({p.prompt!r}): not GenEval metadata ({e})",
                                 "pass GenEval metadata (evaluation_metadata.jsonl or `tpkit prompts geneval`)") from None
        scorer = _geneval_scorer(cfg)
        if cfg.rewards:  # rewards measured beside GenEval (the learned reward a run optimises, say)
            extra = load_rewards(cfg.rewards, {k: v for k, v in cfg.reward_options.items() if k in cfg.rewards})
            check_inputs(extra, [p.prompt for p in prompts], [p.metadata for p in prompts])
            judge_only = scorer
            scorer = lambda p, images: [j | r for j, r in zip(judge_only(p, images),  # noqa: E731
                                                              score_prompt_rewards(extra, p, images))]
    else:
        rewards = load_rewards(cfg.rewards, cfg.reward_options)
        check_inputs(rewards, [p.prompt for p in prompts], [p.metadata for p in prompts])  # before any image is made
        scorer = lambda p, images: score_prompt_rewards(rewards, p, images)  # noqa: E731
    ident = identity(cfg)
    with layout.stage_lock(Path(cfg.out), cfg.rank, cfg.overwrite, cfg.world_size, ident,
                           inputs=(cfg.prompts, cfg.images, cfg.lora)):
        return _run(cfg, ident, prompts, folders, scorer)


def identity(cfg: EvalConfig) -> dict:
    """What an eval folder holds: these options for this model, LoRA (its contents) and prompts (their
    bytes; GenEval's regenerated set when none) or judged image folder."""
    prompts = Path(cfg.prompts) if cfg.prompts else None
    # the family and a local model's content are inputs, as in rollout.identity
    return layout.stage_identity(f"eval-{cfg.kind}", to_dict(cfg), leave_out=("prompts", "lora", "grid_prompts", "family"),
                                 inputs={
        "prompts_sha256": layout.file_digest(prompts) if prompts and prompts.is_file() else None,
        "lora_sha256": layout.tree_digest(cfg.lora, "--lora"),
        "model_sha256": models.content_id(cfg.model), "family": cfg.family})


def _run(cfg: EvalConfig, ident: dict, prompts: list[layout.Prompt], folders: list[Path], scorer: Callable) -> dict | None:
    out = Path(cfg.out)

    # 2. This rank's generation batches, and their prompts that have no results yet.
    def unfinished(i: int) -> bool:
        return not (prompt_dir(out, i) / "results.json").is_file()

    batches = [c for n, c in enumerate(prompt_batches(len(prompts), cfg)) if n % cfg.world_size == cfg.rank
               and any(unfinished(i) for i in c)]
    mine = [i for c in batches for i in c if unfinished(i)]
    phases = Phases(runtime.pick_device(cfg.device), layout.read_seconds(out, cfg.rank))  # + an interrupted run's

    # 3. Generate the missing images (unless scoring an existing folder).
    if mine and not cfg.images:
        with phases("load"):
            model = models.load(cfg.model, cfg.family, device=cfg.device, dtype=cfg.dtype, text_encoders=True,
                                lora=cfg.lora, reuse=True, fuse_lora=True)
        for i in mine:
            _write_metadata(prompt_dir(out, i), prompts[i].metadata)
        with track(len(mine), f"eval: generate ({cfg.images_per_prompt} images per prompt)") as advance, \
                runtime.memory_options("eval", ("eval.batch_size", cfg.batch_size), fits=lambda key, value: memory.suggest_batch(
                    model, "velocity", value, cfg.resolution, cfg.max_sequence_length, cfg.guidance)):
            for c in batches:
                generate(model, prompts, c, cfg, out, phases)
                advance(sum(map(unfinished, c)))

    # 4. Score every image of each prompt; results.json is the prompt's completion marker.
    with track(len(mine), f"eval: {cfg.kind}") as advance:
        for i in mine:
            with phases("read"):
                images, paths = read_images(folders[i])
            if not images:
                raise InputError(f"{folders[i]}: no samples/*.png", "generate them (omit --images) or fix the folder")
            with phases("reward"):
                rows = scorer(prompts[i], images)
            seeds = _seeds(cfg, prompts[i], len(images))
            results = [{"index": i, "sample": j, "prompt_id": prompts[i].prompt_id, "prompt": prompts[i].prompt,
                        "tag": prompts[i].metadata.get("tag"), "image": str(paths[j]), "seed": seeds[j], **rows[j]}
                       for j in range(len(images))]
            layout.atomic_write_json(prompt_dir(out, i) / "results.json", results)
            advance(1)
    if mine:
        layout.atomic_write_json(out / layout.seconds_name(cfg.rank), phases.rounded())

    # 5. Whoever finds every prompt done merges: results.jsonl, summary.json, grids, manifest.
    if not all((prompt_dir(out, i) / "results.json").is_file() for i in range(len(prompts))):
        return None
    results = [r for i in range(len(prompts)) for r in json.loads((prompt_dir(out, i) / "results.json").read_text())]
    layout.atomic_write(out / RESULTS, "".join(json.dumps(r) + "\n" for r in results).encode())
    summary = reward_summary(results, cfg.rewards) if cfg.rewards else {}
    if cfg.kind == "geneval":
        summary = geneval_summary(results) | ({"reward_overall": summary["overall"]} if summary else {})
    layout.atomic_write_json(out / SUMMARY, summary)
    write_grids(out, results, cfg)
    generated = 0 if cfg.images else len(results)
    return layout.write_manifest(
        out, f"eval-{cfg.kind}", to_dict(cfg), identity=ident,
        inputs={"prompts": cfg.prompts, "images": cfg.images, "model": cfg.model, "lora": cfg.lora},
        # The protocol's model work (a CFG pair counts once; a resumed batch is recomputed whole, not counted twice).
        counts={"prompts": len(prompts), "images": len(results), "transformer_calls": generated * cfg.steps,
                "decodes": generated, "reward_calls": len(results)},
        seconds=layout.read_seconds(out), summary=summary)


def _load_prompts(cfg: EvalConfig) -> tuple[list[layout.Prompt], list[Path]]:
    """The prompts and, per prompt, the folder its images are (to be) in."""
    if cfg.images:  # GenEval's layout: one folder per prompt with metadata.jsonl and samples/
        root = Path(cfg.images)
        root = root / "images" if (root / "images").is_dir() else root
        folders = sorted(p for p in root.iterdir() if p.is_dir() and (p / "metadata.jsonl").is_file()) \
            if root.is_dir() else []
        if not folders:
            raise InputError(f"{cfg.images}: no prompt folders with metadata.jsonl",
                             "pass a folder in GenEval's layout (00000/metadata.jsonl, 00000/samples/0000.png)")
        prompts = []
        for i, f in enumerate(folders):
            meta = json.loads((f / "metadata.jsonl").read_text().splitlines()[0])
            prompts.append(layout.Prompt(f"p{i:05d}", meta["prompt"], meta))
        return prompts, folders
    if cfg.prompts:
        if cfg.kind == "geneval" and not Path(cfg.prompts).is_file():
            raise InputError(f"GenEval metadata {cfg.prompts} does not exist",
                             "pass --metadata FILE (e.g. data/shapes-test.jsonl, or `tpkit prompts geneval --split test "
                             "--out FILE` for GenEval's 553 prompts), or omit --metadata to use GenEval's own prompts")
        prompts = layout.load_prompts(Path(cfg.prompts))
    elif cfg.kind == "geneval":  # GenEval's own 553 prompts, regenerated (no file needed, nothing downloaded)
        prompts = [layout.Prompt(f"p{i:05d}", item["prompt"], item) for i, item in enumerate(official_like_test_set())]
    else:
        raise ConfigError("no prompts given", "pass --prompts FILE (.txt or .jsonl)")
    return prompts, [prompt_dir(Path(cfg.out), i) for i in range(len(prompts))]


def _write_metadata(folder: Path, meta: dict) -> None:
    layout.atomic_write(folder / "metadata.jsonl", (json.dumps(meta) + "\n").encode())


def _seeds(cfg: EvalConfig, prompt: layout.Prompt, n: int) -> list[int | None]:
    if cfg.images:
        return [None] * n
    return [derive_seed(cfg.seed, "eval", prompt.prompt_id, j) for j in range(n)]


def _geneval_scorer(cfg: EvalConfig) -> Callable:
    opts = cfg.reward_options.get("geneval", {})
    judge_models = detectors.load_models(opts.get("detector", detectors.DEFAULT_DETECTOR), opts.get("clip", detectors.DEFAULT_CLIP),
                                       fixes={"detector": "pass a local folder with --detector PATH",
                                              "clip": "pass a local folder with --clip PATH"})
    return lambda p, images: score_prompt_geneval(judge_models, p, images)


def reward_summary(results: list[dict], weights: dict[str, float]) -> dict:
    """Mean ± std over all images of every reward column, and per prompt."""
    cols = [c for c in results[0] if c == "reward" or c.startswith("reward_")]
    overall = {c: {"mean": float(np.mean([r[c] for r in results])), "std": float(np.std([r[c] for r in results]))}
               for c in cols}
    per_prompt: dict[str, list[float]] = {}
    for r in results:
        per_prompt.setdefault(r["prompt_id"], []).append(r["reward"])
    return {"rewards": weights, "images": len(results), "overall": overall,
            "per_prompt": {k: {"mean": float(np.mean(v)), "std": float(np.std(v)), "n": len(v)}
                           for k, v in per_prompt.items()}}


GENEVAL_TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


def geneval_summary(results: list[dict]) -> dict:
    """Accuracy per task and overall = unweighted mean of the task accuracies, as GenEval reports."""
    tasks = {}
    for t in GENEVAL_TASKS:
        rows = [r for r in results if r["tag"] == t]
        if rows:
            tasks[t] = {"accuracy": float(np.mean([r["correct"] for r in rows])), "images": len(rows),
                        "mean_score": float(np.mean([r["score"] for r in rows]))}
    overall = float(np.mean([v["accuracy"] for v in tasks.values()])) if tasks else math.nan
    return {"overall": overall, "tasks": tasks, "images": len(results),
            "image_accuracy": float(np.mean([r["correct"] for r in results]))}


def write_grids(out: Path, results: list[dict], cfg: EvalConfig) -> None:
    """grid.png (reward) or grid-<task>.png (geneval; failures framed red, successes green)."""
    from PIL import Image, ImageDraw

    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r.get("tag") if cfg.kind == "geneval" else "all", []).append(r)
    for name, rows in groups.items():
        by_prompt: dict[int, list[dict]] = {}
        for r in rows:
            by_prompt.setdefault(r["index"], []).append(r)
        picked = list(by_prompt.values())[: cfg.grid_prompts]
        cell = 128
        grid = Image.new("RGB", (cell * max(len(p) for p in picked), cell * len(picked)), "white")
        draw = ImageDraw.Draw(grid)
        for y, prow in enumerate(picked):
            for x, r in enumerate(prow):
                grid.paste(Image.open(r["image"]).convert("RGB").resize((cell, cell)), (x * cell, y * cell))
                if cfg.kind == "geneval":
                    colour = (40, 180, 60) if r["correct"] else (220, 30, 30)
                    draw.rectangle([x * cell, y * cell, (x + 1) * cell - 1, (y + 1) * cell - 1], outline=colour, width=4)
                else:
                    draw.text((x * cell + 3, y * cell + 3), f"{r['reward']:.3g}", fill=(255, 255, 0))
        import io

        buf = io.BytesIO()
        grid.save(buf, format="PNG")
        layout.atomic_write(out / ("grid.png" if name == "all" else f"grid-{name}.png"), buf.getvalue())


# --------------------------------------------------------------------------------------------
# Reading an evaluation back: headline numbers, paired differences (run, report, compare)
# --------------------------------------------------------------------------------------------


def eval_key(summary: dict) -> str:
    """The headline of a held-out evaluation: the rewards' weighted sum where measured (what a run optimises),
    else GenEval overall accuracy, else the first number."""
    return next((k for k in ("reward", "geneval_overall") if k in summary), next(iter(summary)))


def _per_prompt(rows: list[dict], column: str) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for r in rows:
        by.setdefault(r["index"], []).append(float(r[column]))
    return {i: float(np.mean(v)) for i, v in by.items()}


def _se(values) -> float:
    v = np.asarray(list(values), dtype=float)
    return float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan


def paired_cell(rows: list[dict], base: list[dict] | None, metric: str) -> dict:
    """mean, se, n (prompts) of one metric over evaluation results rows; with `base` (the same prompts and
    seeds), the paired difference and its se."""
    if metric.startswith("geneval"):
        return _geneval_cell(rows, base, metric)
    mine = _per_prompt(rows, metric)
    cell = {"mean": float(np.mean([r[metric] for r in rows])), "se": _se(mine.values()), "n": len(mine)}
    if base is not None:
        theirs = _per_prompt(base, metric)
        d = [mine[i] - theirs[i] for i in mine]
        cell |= {"delta": float(np.mean(d)), "delta_se": _se(d)}
    return cell


def _geneval_cell(rows: list[dict], base: list[dict] | None, metric: str) -> dict:
    """geneval_overall (mean of task accuracies) or geneval_<task>."""
    tasks = [t for t in GENEVAL_TASKS if any(r["tag"] == t for r in rows)]
    if metric != "geneval_overall":
        tasks = [metric.removeprefix("geneval_")]
    parts = []
    for t in tasks:
        mine = _per_prompt([r for r in rows if r["tag"] == t], "correct")
        theirs = _per_prompt([r for r in base if r["tag"] == t], "correct") if base is not None else None
        d = [mine[i] - theirs[i] for i in mine] if theirs is not None else None
        parts.append((np.mean(list(mine.values())), _se(mine.values()), len(mine),
                      np.mean(d) if d else None, _se(d) if d else None))
    k = len(parts)
    cell = {"mean": float(np.mean([p[0] for p in parts])), "se": math.sqrt(sum(p[1] ** 2 for p in parts)) / k,
            "n": sum(p[2] for p in parts)}
    if base is not None:
        cell |= {"delta": float(np.mean([p[3] for p in parts])), "delta_se": math.sqrt(sum(p[4] ** 2 for p in parts)) / k}
    return cell


def summary(folder: Path) -> dict | None:
    """The headline numbers of a finished evaluation folder (None if it has no manifest): GenEval's
    overall and per-task accuracy, or each reward's mean, and the headline's standard error over prompts."""
    if not (folder / layout.MANIFEST).is_file():
        return None
    m = json.loads((folder / layout.MANIFEST).read_text())
    s = m["summary"]
    if m["stage"] == "eval-geneval":  # rewards measured beside it first: the headline is what a run optimises
        out = {c: v["mean"] for c, v in s.get("reward_overall", {}).items()}
        out |= {"geneval_overall": s["overall"], **{f"geneval_{t}": v["accuracy"] for t, v in s["tasks"].items()}}
    else:
        out = {c: v["mean"] for c, v in s["overall"].items()}
    key = eval_key(out)  # the headline's standard error over prompts, for report.png's error bars
    rows = layout.read_jsonl(folder / RESULTS) if (folder / RESULTS).is_file() else []
    return out | ({f"{key}_se": paired_cell(rows, None, key)["se"]} if rows else {})


def base_eval(run_dir: Path) -> dict | None:
    """The headline numbers of a run's evaluation of its starting model (what every round's is compared with)."""
    return summary(Path(run_dir) / layout.BASE_EVAL)


def heldout_change(run_dir: Path, lines: list[dict]) -> dict | None:
    """The latest held-out evaluation against the base model's, paired over prompts (both use the same
    prompts and seeds): {"metric", "round" (counted from 1, as in rounds.jsonl), "base", "last", "delta",
    "delta_se"}; None without both."""
    evaluated = [x for x in lines if x.get("eval")]
    base_dir = Path(run_dir) / layout.BASE_EVAL
    if not evaluated or not (base_dir / layout.MANIFEST).is_file():
        return None
    last = evaluated[-1]
    rows, base = layout.read_jsonl(layout.eval_dir(run_dir, last["round"] - 1) / RESULTS), layout.read_jsonl(base_dir / RESULTS)

    def change(metric: str) -> dict:
        cell = paired_cell(rows, base, metric)
        return {"metric": metric, "round": last["round"], "base": cell["mean"] - cell["delta"], "last": cell["mean"],
                "delta": cell["delta"], "delta_se": cell["delta_se"]}

    out = change(eval_key(last["eval"]))
    if out["metric"] != "geneval_overall" and "geneval_overall" in last["eval"]:
        out["geneval"] = change("geneval_overall")  # beside a learned reward: did it track what it stands for?
    return out
