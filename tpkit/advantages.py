"""Stage 3, `tpkit advantages`: step rewards, turning points, aggregated and shaped rewards, advantages.

Input: any table with `trajectory_id`, `prompt_id`, `branch` (k = 0..K) and `reward` (R_k),
from `tpkit score` or elsewhere; row order does not matter. Output: one row per (trajectory,
step k = 1..K), float64 throughout, computed by the pure functions of `tpkit.formulas`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tpkit import formulas, layout
from tpkit.config import AdvantagesConfig, to_dict
from tpkit.errors import InputError
from tpkit.timing import Phases


@dataclass
class RewardMatrix:
    """R_k per trajectory: R [N, K+1] (NaN where a branch was not scored), sorted by trajectory id."""

    trajectory_ids: np.ndarray  # [N] str
    prompt_ids: np.ndarray  # [N] str
    R: np.ndarray  # [N, K+1] float64
    complete: bool  # every branch 0..K present (else some trajectories have only R_K: Flow-GRPO baseline)

    @property
    def K(self) -> int:
        return self.R.shape[1] - 1


def reward_matrix(table, source: str, method: str) -> RewardMatrix:
    """Validate a scores table and arrange it as R [N, K+1]."""
    import pyarrow as pa
    import pyarrow.compute as pc

    missing = [c for c in layout.SCORE_KEY_COLUMNS if c not in table.column_names]
    if missing:
        raise InputError(f"{source}: scores table lacks column(s) {', '.join(missing)}",
                         "it needs trajectory_id, prompt_id, branch (k = 0..K) and reward (R_k); pass `tpkit score` output")
    try:
        tid = np.asarray(table["trajectory_id"].cast(pa.string()).to_pylist(), dtype=object)
        pid = np.asarray(table["prompt_id"].cast(pa.string()).to_pylist(), dtype=object)
        branch_col = table["branch"]
        if not pa.types.is_integer(branch_col.type):
            raise pa.ArrowInvalid(f"branch has type {branch_col.type}")
        branch = np.asarray(branch_col.to_pylist(), dtype=np.int64)
        reward = np.asarray(pc.cast(table["reward"], pa.float64()).to_pylist(), dtype=np.float64)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, TypeError, ValueError) as e:
        raise InputError(f"{source}: mistyped column ({e})",
                         "trajectory_id and prompt_id must be strings, branch an integer, reward a number") from None
    if len(tid) == 0:
        raise InputError(f"{source}: the scores table is empty", "score a rollout first (`tpkit score`)")
    if any(x is None for x in tid) or any(x is None for x in pid):
        raise InputError(f"{source}: null trajectory_id or prompt_id", "every row needs both ids")
    bad = sorted(set(tid[~np.isfinite(reward)]))
    if bad:
        raise InputError(f"{source}: NaN or infinite reward for {len(bad)} trajectories: {', '.join(bad[:8])}",
                         "fix the reward, or rescore; advantages cannot be computed from them")

    ids, inv = np.unique(tid.astype(str), return_inverse=True)
    if (branch < 0).any():
        raise InputError(f"{source}: negative branch index", "branches are k = 0..K")
    K = int(branch.max())
    R = np.full((len(ids), K + 1), np.nan)
    seen = np.zeros_like(R, dtype=bool)
    counts = np.bincount(inv * (K + 1) + branch, minlength=R.size)
    if counts.max() > 1:
        dup = ids[int(np.argmax(counts)) // (K + 1)]
        raise InputError(f"{source}: trajectory {dup} has a branch twice", "pass each (trajectory, branch) once")
    R[inv, branch] = reward
    seen[inv, branch] = True

    prompt_of = np.empty(len(ids), dtype=object)
    for i, p in zip(inv, pid):
        if prompt_of[i] is not None and prompt_of[i] != p:
            raise InputError(f"{source}: trajectory {ids[i]} has two prompt ids ({prompt_of[i]}, {p})",
                             "a trajectory belongs to one prompt")
        prompt_of[i] = p

    if K == 0:
        raise InputError(f"{source}: only branch 0 in the table, so there are no steps",
                         "score every window state: branches 0..K with K >= 1 (`tpkit score --branches all`)")
    full = seen.all(1)
    final_only = seen[:, -1] & (seen.sum(1) == 1)
    accepted = full if method == "tp-grpo" else full | final_only  # flow-grpo needs only R_K
    if not accepted.all():
        bad_i = np.flatnonzero(~accepted)[0]
        have = np.flatnonzero(seen[bad_i]).tolist()
        raise InputError(
            f"{source}: trajectory {ids[bad_i]} has branches {have}, expected 0..{K} (K = largest branch in the table)",
            "score with --branches all (every trajectory needs the same K); flow-grpo also accepts only the final branch")
    return RewardMatrix(ids, prompt_of.astype(str), R, bool(full.all()))


@dataclass
class Advantages:
    """Every per-(trajectory, step) quantity of docs/design.md section 2, each [N, K]."""

    d: np.ndarray
    agg: np.ndarray
    candidate: np.ndarray
    tp: np.ndarray
    shaped: np.ndarray
    advantage: np.ndarray


def compute(m: RewardMatrix, method: str, balance: str, std: str) -> Advantages:
    N, K = m.R.shape[0], m.K
    d, agg = formulas.step_rewards(m.R), formulas.aggregated_rewards(m.R)
    candidate = formulas.turning_points(m.R)  # NaN rows (only R_K scored) fail every sign test
    if method == "flow-grpo":
        tp = np.zeros((N, K), dtype=bool)
        shaped = np.repeat(m.R[:, -1:], K, axis=1)
    else:
        tp = candidate
        if balance == "all":
            steps = np.tile(np.arange(1, K + 1), N)
            tp = formulas.balance_turning_points(candidate.ravel(), agg.ravel(), np.repeat(m.trajectory_ids, K),
                                                 steps).reshape(N, K)
        shaped = formulas.shaped_rewards(d, agg, tp)
    advantage = formulas.group_advantages(shaped, m.prompt_ids, std=std)
    return Advantages(d, agg, candidate, tp, shaped, advantage)


def to_table(m: RewardMatrix, a: Advantages, method: str):
    """One row per (trajectory, step k = 1..K), ordered by (prompt_id, trajectory_id, step)."""
    import pyarrow as pa

    N, K = m.R.shape[0], m.K
    order = np.lexsort((m.trajectory_ids, m.prompt_ids))
    rows = np.repeat(order, K)
    steps = np.tile(np.arange(1, K + 1), N)

    def f64(x: np.ndarray) -> pa.Array:  # null where a value is unknown (final-only scores)
        vals = x[rows, steps - 1] if x.ndim == 2 else x
        return pa.array(vals, type=pa.float64(), mask=np.isnan(vals))

    cols = {
        "trajectory_id": pa.array(m.trajectory_ids[rows], pa.string()),
        "prompt_id": pa.array(m.prompt_ids[rows], pa.string()),
        "step": pa.array(steps, pa.int32()),
        "reward_before": f64(m.R[rows, steps - 1]),
        "reward_after": f64(m.R[rows, steps]),
        "final_reward": f64(m.R[rows, K]),
        "step_reward": f64(a.d),
        "aggregated_reward": f64(a.agg),
        "turning_point_candidate": pa.array(a.candidate[rows, steps - 1]),
        "turning_point": pa.array(a.tp[rows, steps - 1]),
        "shaped_reward": f64(a.shaped),
        "advantage": f64(a.advantage),
        "method": pa.array([method] * len(rows), pa.string()),
    }
    assert tuple(cols) == layout.ADVANTAGE_COLUMNS
    return pa.table(cols)


def summary(m: RewardMatrix, a: Advantages) -> dict:
    """Turning-point rate per step, positive vs negative, kept after balancing; and what drives the
    sign tests: the share of zero step rewards d_k = 0 (which kill them: discrete rewards) and the
    mean |d_k| (both None where only R_K was scored)."""
    per_step = []
    for k in range(m.K):
        cand, d = a.candidate[:, k], a.d[:, k]
        known = np.isfinite(d)
        per_step.append({
            "step": k + 1, "candidates": int(cand.sum()), "rate": float(cand.mean()),
            "positive": int((cand & (a.agg[:, k] > 0)).sum()), "negative": int((cand & (a.agg[:, k] < 0)).sum()),
            "kept": int(a.tp[:, k].sum()),
            "zero_step_rewards": float((d[known] == 0).mean()) if known.any() else None,
            "mean_abs_step_reward": float(np.abs(d[known]).mean()) if known.any() else None,
        })
    return {
        "trajectories": int(m.R.shape[0]), "prompts": int(len(np.unique(m.prompt_ids))), "K": m.K,
        "rows": int(m.R.shape[0] * m.K), "complete_branches": m.complete,
        "turning_points": int(a.candidate.sum()), "turning_points_kept": int(a.tp.sum()),
        "turning_point_rate": float(a.candidate.mean()),
        "final_reward_mean": float(m.R[:, -1].mean()), "final_reward_std": float(m.R[:, -1].std()),
        "per_step": per_step,
    }


def run(cfg: AdvantagesConfig) -> dict:
    cfg.validate()
    phases = Phases()
    # 1. Read the scores (a folder of Parquet files, one file or a glob) and the rollout they belong to.
    with phases("read"):
        files = layout.parquet_files(Path(cfg.scores), "score")
        check_scores_folder(Path(cfg.scores), files)
        table = layout.read_parquet_tables(Path(cfg.scores), "score")
        rollout_id = layout.rollout_of(files, table) or _from_score_manifest(Path(cfg.scores)).get("rollout_id")
        dropped = sorted({t for f in files for t in layout.parquet_meta(f).get("dropped_trajectories", [])}
                         | set(_from_score_manifest(Path(cfg.scores)).get("dropped_trajectories", [])))

    with phases("compute"):
        # 2. Arrange R_k per trajectory, refusing gaps, duplicates, NaN.
        m = reward_matrix(table, str(cfg.scores), cfg.method)

        # 3. Step rewards, turning points, balancing, shaped rewards, group-normalised advantages.
        a = compute(m, cfg.method, cfg.balance, cfg.std)

    # 4. Only now (every input checked) claim the output folder, write the table, then the manifest.
    ident = identity(cfg, files)
    with layout.stage_lock(Path(cfg.out), 0, cfg.overwrite, identity=ident, inputs=(cfg.scores,)):
        return _write(cfg, m, a, rollout_id, dropped, ident, phases)


def identity(cfg: AdvantagesConfig, files: list[Path]) -> dict:
    """What an advantages folder holds: these options applied to these scores files (their bytes)."""
    return layout.stage_identity("advantages", to_dict(cfg), leave_out=("scores",), inputs={
        "scores_sha256": layout.digests(files)})


def check_scores_folder(scores: Path, files: list[Path]) -> None:
    """A `tpkit score` folder must be finished, and hold exactly the files its manifest lists."""
    held = layout.folder_identity(scores) if scores.is_dir() else None
    if not held or held.get("stage") != "score":
        return  # a single file, a glob, or a folder of tables from elsewhere
    manifest = layout.read_manifest(scores, "score")
    listed = manifest.get("files")
    if listed is not None and sorted(f.name for f in files) != sorted(listed):
        extra = sorted({f.name for f in files} - set(listed))
        raise InputError(f"{scores}: its Parquet files are not the ones its manifest lists"
                         + (f" (extra: {', '.join(extra[:4])})" if extra else ""),
                         "remove files you added, or rerun `tpkit score` with --overwrite")
    layout.check_files(scores, manifest, files, "score")


def _write(cfg: AdvantagesConfig, m: RewardMatrix, a: Advantages, rollout_id: str | None, dropped: list[str],
           ident: dict, phases: Phases) -> dict:
    # The table says which rollout it belongs to; the manifest has the summary the CLI shows.
    out = Path(cfg.out)
    with phases("write"):
        layout.write_parquet(out / layout.ADVANTAGES_FILE, to_table(m, a, cfg.method), {
            "stage": "advantages", "rollout_id": rollout_id, "scores_sha256": ident["inputs"]["scores_sha256"],
            "dropped_trajectories": dropped})
    info = summary(m, a)
    return layout.write_manifest(out, "advantages", to_dict(cfg), inputs={"scores": str(cfg.scores)},
                                 counts={"rows": info["rows"], "trajectories": info["trajectories"]},
                                 seconds=phases.rounded(), summary=info, identity=ident, rollout_id=rollout_id,
                                 dropped_trajectories=dropped,
                                 files_sha256=layout.digests([out / layout.ADVANTAGES_FILE]))


def _from_score_manifest(scores: Path) -> dict:
    """What a `tpkit score` folder's manifest says (written by an older tpkit, its files carry no
    metadata): the trajectories it dropped on purpose (--on-nan drop). {} for other tables."""
    import json

    manifest = scores / layout.MANIFEST if scores.is_dir() else None
    if manifest is None or not manifest.is_file():
        return {}
    try:
        m = json.loads(manifest.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return {"rollout_id": m.get("rollout_id"), "dropped_trajectories": m.get("dropped_trajectories", [])}
