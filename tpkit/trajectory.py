"""`tpkit trajectory ROUND`: one trajectory from noise to image, step by step.

For every cached window state s_k (k = 0..K) the image its ODE completion decodes to, which is what
`tpkit score` judged, with R_k; then per transition step k (s_{k-1} -> s_k) the step reward
d_k = R_k - R_{k-1}, whether the sign tests made it a turning point, the aggregated reward and the
advantage it was trained with. The branch images are not stored (they would be K images a
trajectory), so they are computed again with the score stage's own code and settings (45 transformer
calls for T = 10, K = 9), and the recomputed R_k are checked against the stored ones: the picture
shows what was scored, or says that it cannot. The PNG goes to --out (default
./trajectory-<id>.png): nothing is written into the run folder.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from tpkit import layout, models
from tpkit.config import ScoreConfig, field_names
from tpkit.errors import InputError
from tpkit.rewards.registry import load_rewards
from tpkit.rollout import sampling_lora
from tpkit.score import BranchScorer

STORED_TOLERANCE = 1e-4  # |recomputed R_k - stored R_k| above this is reported (batching, other hardware)


def choose(adv_rows: list[dict], score_rows: list[dict], wanted: str | None) -> str:
    """The trajectory to show: `wanted`, else the one with the most turning points (then the largest
    total |advantage|), else the first scored one."""
    ids = sorted({r["trajectory_id"] for r in score_rows})
    if wanted is not None:
        if wanted not in ids:
            raise InputError(f"no trajectory {wanted!r} in these scores ({len(ids)} trajectories, e.g. {', '.join(ids[:3])})",
                             "pass --id with a trajectory id from the scores (tpkit inspect SCORES lists them)")
        return wanted
    if not adv_rows:
        return ids[0]
    key: dict[str, tuple[int, float]] = {}
    for r in adv_rows:
        tp, mass = key.get(r["trajectory_id"], (0, 0.0))
        key[r["trajectory_id"]] = (tp + bool(r["turning_point"]), mass + abs(r["advantage"]))
    return max(sorted(key), key=lambda t: key[t])


def _find(rollout: Path, trajectory_id: str):
    """(prompts, the trajectory) from the rollout's shard that holds it."""
    for shard in layout.list_shards(rollout):
        _, trajs = layout.read_shard(shard, load_tensors=False)
        if any(t.trajectory_id == trajectory_id for t in trajs):
            prompts, trajs = layout.read_shard(shard)
            return prompts, next(t for t in trajs if t.trajectory_id == trajectory_id)
    raise InputError(f"{rollout}: no shard holds trajectory {trajectory_id}",
                     "pass the rollout these scores were computed from")


def run(rollout: Path, scores: Path, advantages: Path | None, trajectory_id: str | None, out: Path | None,
        device: str = "auto", dtype: str = "auto", overwrite: bool = False) -> dict:
    """Recompute, check and draw one trajectory; returns {"trajectory_id", "png", "steps" (its advantages rows),
    "stored" ({k: R_k} as scored: every k, or K alone for Flow-GRPO), "recomputed" (R_0..R_K),
    "max_difference" (over the stored ones), "images" (the branch images, uint8 [H, W, 3])}."""
    # 1. The stages' files, and which trajectory.
    rollout, scores = Path(rollout), Path(scores)
    ro = layout.read_manifest(rollout, "rollout")
    sm = layout.read_manifest(scores, "score")
    if sm["inputs"].get("rollout_config", {}) != ro["config"]:
        raise InputError(f"{scores} was not scored from {rollout}", "pass the rollout those scores were computed from")
    score_rows = layout.read_parquet_tables(scores, "score").to_pylist()
    adv_rows = layout.read_parquet_tables(Path(advantages), "advantages").to_pylist() if advantages else []
    tid = choose(adv_rows, score_rows, trajectory_id)
    stored = {r["branch"]: r["reward"] for r in score_rows if r["trajectory_id"] == tid}
    steps = sorted((r for r in adv_rows if r["trajectory_id"] == tid), key=lambda r: r["step"])
    out = Path(out) if out else Path(f"trajectory-{tid}.png")  # checked before the model loads
    if out.is_dir():
        raise InputError(f"--out {out} is a folder", "pass the PNG file to write, e.g. --out trajectory.png")
    if out.exists() and not overwrite:
        raise InputError(f"{out} already exists", "pass another --out, or --overwrite to replace it")
    prompts, traj = _find(rollout, tid)
    K = traj.meta["window_size"]  # Flow-GRPO's scores hold R_K only: the other R_k are computed here, unchecked

    # 2. The branch images again: the score stage's code and settings on this one trajectory.
    cfg = ScoreConfig(**{k: v for k, v in sm["config"].items() if k in field_names(ScoreConfig)})
    cfg.device, cfg.dtype, cfg.reward_workers = device, dtype, 0
    rc = ro["config"]
    model = models.load(rc["model"], models.recorded(rc), device=cfg.device, dtype=cfg.dtype, text_encoders=False,
                        lora=sampling_lora(ro, rollout), reuse=True, fuse_lora=True)
    scorer = BranchScorer(model, load_rewards(cfg.rewards, cfg.reward_options), cfg)
    scorer.images = {}
    try:
        results = scorer.score_shard(prompts, [traj], "all")
    finally:
        scorer.close()
    from PIL import Image

    images = [scorer.images[(0, k)] for k in range(K)] + [np.asarray(Image.open(io.BytesIO(traj.final_png)).convert("RGB"))]
    again = [results[(0, k)]["reward"] for k in range(K + 1)]

    # 3. What was drawn is what was scored?
    diff = max(abs(again[k] - r) for k, r in stored.items())
    # 4. The picture.
    sigmas = traj.meta["sigmas"][traj.meta["window_start"]: traj.meta["window_start"] + K + 1]
    layout.atomic_write(out, _png(tid, traj.meta["prompt"], images, again, sigmas, steps))
    return {"trajectory_id": tid, "png": out, "steps": steps, "stored": stored, "recomputed": again,
            "max_difference": diff, "images": images}


def _png(tid: str, prompt: str, images: list[np.ndarray], rewards: list[float], sigmas: list[float],
         steps: list[dict]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = len(images) - 1
    turning = {r["step"] for r in steps if r["turning_point"]}
    fig = plt.figure(figsize=(max(10, 1.3 * (K + 1)), 6.5))
    grid = fig.add_gridspec(2, K + 1, height_ratios=[1, 1.4], left=0.06, right=0.94, top=0.86, bottom=0.08,
                            hspace=0.35, wspace=0.08)
    for k, image in enumerate(images):
        a = fig.add_subplot(grid[0, k])
        a.imshow(image)
        a.set_xticks([]), a.set_yticks([])
        a.set_title(f"k={k}  σ={sigmas[k]:.2f}\nR={rewards[k]:.3g}", fontsize=8)
        if k in turning:  # the step into s_k is a turning point
            for side in a.spines.values():
                side.set(color="tab:orange", linewidth=3)
    a = fig.add_subplot(grid[1, :])
    ks = np.arange(K + 1)
    a.plot(ks, rewards, "o-", color="tab:blue", label="R_k (ODE branch from s_k)")
    if steps:
        sk = np.array([r["step"] for r in steps])
        a.bar(sk, [r["step_reward"] for r in steps], width=0.35, color="tab:green", alpha=0.5, label="d_k = R_k - R_(k-1)")
        b = a.twinx()
        b.plot(sk, [r["advantage"] for r in steps], "s--", color="tab:red", label="advantage A_k")
        b.axhline(0, color="tab:red", linewidth=0.5)
        b.set_ylabel("advantage", color="tab:red")
        b.legend(loc="lower right", fontsize=8)
        for k in sorted(turning):
            a.axvline(k, color="tab:orange", linewidth=2, alpha=0.6)
    a.set(xlabel="k (state s_k; step k goes from s_(k-1) to s_k)", ylabel="reward", xticks=ks)
    a.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{tid}: {prompt}" + (f"  ({len(turning)} turning point{'s' * (len(turning) != 1)}: orange)"
                                        if turning else ""))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()
