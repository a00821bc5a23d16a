"""Stage 2, `tpkit score`: the reward R_k of the ODE completion ("branch") from every window state.

R_k = R(decode(ODE(s_k))) for k = 0..K-1; R_K is the trajectory's own final image, read from the
shard and never recomputed. Branches of all trajectories and states of a shard share transformer
batches (per-sample timesteps, longest branches first, continuous refill as branches finish), and
each branch's first step reuses the rollout's velocity v(s_k), so a trajectory costs
sum_k (T - a - k - 1) calls here (45 for T = 10, K = 9); `--branch-steps N` caps each branch at N
steps of a coarser schedule, Euler steps, (`--branch-solver heun`) second-order Heun steps, or
(`--branch-solver ab2`) second-order Adams-Bashforth steps at Euler's cost.
Decoded images are scored on a worker thread while the transformer runs. A policy LoRA is merged
into the weights here (score's numbers need not match train's).
"""

from __future__ import annotations

import io
import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from tpkit import formulas, layout, memory, models, runtime
from tpkit.config import ScoreConfig, to_dict
from tpkit.errors import InputError, RewardError
from tpkit.layout import PromptRecord, TrajectoryRecord
from tpkit.rewards.registry import Reward, check_inputs, load_rewards, score_images
from tpkit.rollout import sampling_lora
from tpkit.timing import Phases
from tpkit.ui import track

# Seconds per phase in every score file's stats (reward_wait: the stage waiting for the reward thread).
PHASES = ("read", "transformer", "decode", "reward_wait", "write")
# Settings every trajectory of a rollout must share (they define what "step k" means).
SHARED_SETTINGS = ("model", "family", "lora", "sampler", "noise_level", "guidance", "steps", "window_start", "window_size",
                   "resolution", "sigmas")


@dataclass
class Branch:
    traj: int  # index into the shard's trajectories
    k: int  # window state s_k it starts from
    x: torch.Tensor  # the latent the next velocity call is made at [C, h, w], on the model's device
    sigmas: list[float]  # the branch's own schedule, from sigma_{a+k} down to 0
    p: int  # position in it: the current step goes from sigmas[p] to sigmas[p + 1]
    calls_per_step: int = 1  # Euler and AB2 1; Heun 2 (a call at x_p, then one at the Euler predictor)
    x0: torch.Tensor | None = None  # Heun, mid-step: the step's start x_p (x is then its Euler predictor)
    v0: torch.Tensor | None = None  # Heun, mid-step: v(x_p, sigmas[p])
    v_prev: torch.Tensor | None = None  # AB2: the previous step's velocity v(x_{p-1}, sigmas[p - 1])

    @property
    def sigma(self) -> float:
        """The noise level of the next velocity call: sigmas[p], or sigmas[p + 1] at Heun's predictor."""
        return self.sigmas[self.p + (self.x0 is not None)]

    @property
    def remaining(self) -> int:
        """Velocity calls still to make."""
        return self.calls_per_step * (len(self.sigmas) - 1 - self.p) - (self.x0 is not None)

    @property
    def done(self) -> bool:
        return self.remaining <= 0


@dataclass
class Counters:
    transformer_calls: int = 0  # samples (a CFG pair counts once)
    transformer_batches: int = 0  # forward passes
    decodes: int = 0
    reward_calls: int = 0


def _pil(image_or_png):
    from PIL import Image

    if isinstance(image_or_png, bytes):
        return Image.open(io.BytesIO(image_or_png)).convert("RGB")
    return Image.fromarray(image_or_png)


class BranchScorer:
    """Completes branches in shared batches, decodes them, and scores images on a worker thread."""

    def __init__(self, model, rewards: list[Reward], cfg: ScoreConfig):
        self.model, self.rewards, self.cfg = model, rewards, cfg
        self.pool = ThreadPoolExecutor(max_workers=cfg.reward_workers, thread_name_prefix="tpkit-reward") \
            if cfg.reward_workers else None
        self.counters = Counters()
        self.phases = Phases(model.device if model is not None else None)
        self.images: dict | None = None  # set to {} to keep every decoded branch image by (trajectory, k)

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown(wait=True)

    def _score_async(self, keys: list[tuple[int, int]], images: list, trajs: list[TrajectoryRecord],
                     prompts: dict[str, PromptRecord]) -> Future:
        texts = [trajs[n].meta["prompt"] for n, _ in keys]
        metas = [prompts[trajs[n].meta["prompt_id"]].metadata for n, _ in keys]
        self.counters.reward_calls += len(keys)

        def work():
            return keys, score_images(self.rewards, [_pil(im) for im in images], texts, metas)

        if self.pool:
            return self.pool.submit(work)
        done: Future = Future()  # inline: the transformer waits while the reward runs
        with self.phases("reward"):
            done.set_result(work())
        return done

    def score_shard(self, prompts: dict[str, PromptRecord], trajs: list[TrajectoryRecord], branches: str,
                    advance=lambda n: None) -> dict[tuple[int, int], dict[str, float]]:
        """{(trajectory index, k): {column: value}} for k = 0..K (or only K with branches='final')."""
        cfg = self.cfg
        K = trajs[0].meta["window_size"]
        futures: list[Future] = []
        # R_K: the trajectory's own final image, already decoded by rollout.
        for b in range(0, len(trajs), cfg.decode_batch_size):
            idx = range(b, min(b + cfg.decode_batch_size, len(trajs)))
            futures.append(self._score_async([(n, K) for n in idx], [trajs[n].final_png for n in idx], trajs, prompts))
        if branches == "all":
            futures += self._complete(prompts, trajs, advance)
        results: dict[tuple[int, int], dict[str, float]] = {}
        with self.phases("reward_wait"):
            for f in futures:
                keys, cols = f.result()
                for i, key in enumerate(keys):
                    results[key] = {name: vals[i] for name, vals in cols.items()}
        return results

    def _complete(self, prompts: dict[str, PromptRecord], trajs: list[TrajectoryRecord], advance) -> list[Future]:
        """ODE-complete every branch k < K of every trajectory; returns the reward futures."""
        cfg, model, c = self.cfg, self.model, self.counters
        meta = trajs[0].meta
        sigmas, a, K, w = meta["sigmas"], meta["window_start"], meta["window_size"], meta["guidance"]
        pids = sorted(prompts)
        emb = {k: torch.cat([prompts[p].embeds[k] for p in pids]).to(model.device) for k in prompts[pids[0]].embeds}
        prompt_row = torch.tensor([pids.index(t.meta["prompt_id"]) for t in trajs])

        # First step of branch k reuses v(s_k) from the rollout: no transformer call (Heun: it is the
        # step's first velocity, and x its Euler predictor). Its schedule is the rest of the rollout's
        # (exact), or at most branch_steps steps of it (--branch-steps).
        # AB2's first step is Euler's (no earlier velocity on the branch), the later ones multistep.
        heun, ab2 = cfg.branch_solver == "heun", cfg.branch_solver == "ab2"
        branches: list[Branch] = []
        for n, t in enumerate(trajs):
            for k in range(K):
                sched = formulas.branch_schedule(sigmas, a + k, cfg.branch_steps)
                s_k = t.tensors["states"][k: k + 1].to(model.device)
                v_k = t.tensors["velocities"][k: k + 1].to(model.device)
                x = formulas.ode_step(s_k, v_k, sched[0], sched[1])[0]
                if heun:
                    branches.append(Branch(n, k, x, sched, p=0, calls_per_step=2, x0=s_k[0].float(), v0=v_k[0].float()))
                else:
                    branches.append(Branch(n, k, x, sched, 1, v_prev=v_k[0].float() if ab2 else None))
        # Longest first: the short branches left at the end drain the queue in full batches (for
        # T = 10, K = 9 and 16 trajectories at batch 32: 23 transformer batches, the minimum, not 27).
        pending = deque(sorted(branches, key=lambda b: b.remaining, reverse=True))
        active: list[Branch] = []
        finished: list[Branch] = []
        futures: list[Future] = []

        def flush(force: bool) -> None:
            while finished and (force or len(finished) >= cfg.decode_batch_size):
                batch = [finished.pop(0) for _ in range(min(cfg.decode_batch_size, len(finished)))]
                with self.phases("decode"):
                    images = model.decode(torch.stack([b.x for b in batch]))
                c.decodes += len(batch)
                if self.images is not None:
                    self.images.update({(b.traj, b.k): im for b, im in zip(batch, images)})
                futures.append(self._score_async([(b.traj, b.k) for b in batch], list(images), trajs, prompts))
                advance(len(batch))

        while pending or active:
            while len(active) < cfg.batch_size and pending:
                b = pending.popleft()
                (finished if b.done else active).append(b)
            if active:
                with self.phases("transformer"), torch.no_grad():
                    x = torch.stack([b.x for b in active])
                    rows = prompt_row[[b.traj for b in active]].to(model.device)
                    v = model.velocity(x, torch.tensor([b.sigma for b in active]), {k: e[rows] for k, e in emb.items()}, w)
                    if heun:
                        _heun_advance(active, v)
                    else:
                        sig = torch.tensor([b.sigmas[b.p] for b in active]).to(x.device)
                        sig_next = torch.tensor([b.sigmas[b.p + 1] for b in active]).to(x.device)
                        if ab2:
                            sig_prev = torch.tensor([b.sigmas[b.p - 1] for b in active]).to(x.device)
                            v_prev = torch.stack([b.v_prev for b in active])
                            new = formulas.ab2_step(x, v, v_prev, sig_prev, sig, sig_next)
                        else:
                            new = formulas.ode_step(x, v, sig, sig_next)
                        for i, (b, xn) in enumerate(zip(active, new)):
                            b.x, b.p = xn, b.p + 1
                            if ab2:
                                b.v_prev = v[i].float()
                c.transformer_calls += len(active)
                c.transformer_batches += 1
                finished += [b for b in active if b.done]
                active = [b for b in active if not b.done]
            flush(force=not pending and not active)
        return futures


def _heun_advance(active: list[Branch], v: torch.Tensor) -> None:
    """One velocity call's worth of Heun for each branch: at x_p the call gives v0 and x moves to the
    Euler predictor; at the predictor it completes the step, x_{p+1} = formulas.heun_step(x_p, v0, v,
    sigma_p, sigma_{p+1}). Every step is a full Heun step, the last one (to sigma = 0) included.
    Batched per phase (element-wise, so each branch gets what it would alone)."""
    sig = torch.tensor([b.sigmas[b.p] for b in active], device=v.device)
    sig_next = torch.tensor([b.sigmas[b.p + 1] for b in active], device=v.device)
    pred = [i for i, b in enumerate(active) if b.x0 is None]  # at x_p: the predictor
    corr = [i for i, b in enumerate(active) if b.x0 is not None]  # at the predictor: the corrected step
    if pred:
        x = torch.stack([active[i].x for i in pred])
        for i, xn in zip(pred, formulas.ode_step(x, v[pred], sig[pred], sig_next[pred])):
            b = active[i]
            b.x0, b.v0, b.x = b.x, v[i].float(), xn
    if corr:
        x0, v0 = torch.stack([active[i].x0 for i in corr]), torch.stack([active[i].v0 for i in corr])
        for i, xn in zip(corr, formulas.heun_step(x0, v0, v[corr], sig[corr], sig_next[corr])):
            b = active[i]
            b.x, b.x0, b.v0, b.p = xn, None, None, b.p + 1


def check_rollout(trajs: list[TrajectoryRecord], reference: dict, shard: Path) -> None:
    """Every trajectory must share the rollout's settings; a mixed folder would make "step k" meaningless."""
    for t in trajs:
        for key in SHARED_SETTINGS:
            if t.meta.get(key) != reference.get(key):
                raise InputError(
                    f"{shard}: trajectory {t.trajectory_id} has {key} = {t.meta.get(key)!r}, other shards {reference.get(key)!r}",
                    "score one rollout at a time: do not mix shards from different rollouts in one folder")


def rows_for_shard(trajs: list[TrajectoryRecord], results: dict, branches: str) -> list[dict]:
    rows = []
    for n, t in enumerate(trajs):
        m = t.meta
        for k in (range(m["window_size"] + 1) if branches == "all" else [m["window_size"]]):
            j = m["window_start"] + k
            rows.append({"trajectory_id": m["trajectory_id"], "prompt_id": m["prompt_id"], "branch": k,
                         **results[(n, k)], "member": m["member"], "step_index": j, "sigma": m["sigmas"][j],
                         "prompt": m["prompt"]})
    return rows


def task_rewards(rows: list[dict], prompts: dict) -> dict[str, dict[str, float]]:
    """Sum and count of the final reward R_K per GenEval task (the prompt metadata's "tag"), for the
    shard's stats sidecar (empty when no prompt has a tag; present, so `mean_by_task` knows the shard
    was summed).

    Why: a round draws its prompts at random, so its tasks' mix changes from round to round, and on a
    GenEval-style prompt file the mean R_K moves with the mix (tiny-shapes: 8 to 40 of 128 trajectories
    of one task a round) as much as with learning. Per task, the rounds compare.
    rows: one shard's score rows (`rows_for_shard`); prompts: prompt_id -> PromptRecord.
    """
    final = {}
    for r in rows:  # the last branch k of each trajectory is R_K (the only one when branches = "final")
        if r["trajectory_id"] not in final or r["branch"] > final[r["trajectory_id"]]["branch"]:
            final[r["trajectory_id"]] = r
    sums, counts = {}, {}
    for r in final.values():
        tag = prompts[r["prompt_id"]].metadata.get("tag") if r["prompt_id"] in prompts else None
        if isinstance(tag, str):
            sums[tag] = sums.get(tag, 0.0) + float(r["reward"])
            counts[tag] = counts.get(tag, 0) + 1
    return {"task_reward_sum": sums, "task_trajectories": counts}


def mean_by_task(sidecars: list[dict]) -> dict[str, float] | None:
    """Mean R_K per task over the shards' stats sidecars (`task_rewards` of each). None without tags,
    and None if a shard was scored by a tpkit that did not sum them (a resumed stage): a mean over
    some shards only would be mislabelled as the round's."""
    if not sidecars or not all("task_trajectories" in s for s in sidecars):
        return None
    sums, counts = {}, {}
    for s in sidecars:
        for t, n in s["task_trajectories"].items():
            counts[t] = counts.get(t, 0) + n
            sums[t] = sums.get(t, 0.0) + s["task_reward_sum"][t]
    return {t: round(sums[t] / counts[t], 4) for t in sorted(counts)} or None


def check_finite(rows: list[dict], shard: Path, on_nan: str) -> tuple[list[dict], list[str]]:
    """Rows of trajectories whose every reward is finite, and the ids dropped (on_nan = drop);
    on_nan = stop raises instead, naming them (nothing is written for the shard)."""
    bad = sorted({r["trajectory_id"] for r in rows
                  if not all(math.isfinite(v) for k, v in r.items() if k == "reward" or k.startswith("reward_"))})
    if bad and on_nan == "stop":
        raise RewardError(f"{shard}: reward is NaN or infinite for {len(bad)} trajectories: {', '.join(bad[:8])}"
                          + (" ..." if len(bad) > 8 else ""),
                          "fix the reward function, or pass --on-nan drop to leave those trajectories out; "
                          "nothing was written for this shard")
    return [r for r in rows if r["trajectory_id"] not in set(bad)], bad


def run(cfg: ScoreConfig, rewards: list[Reward] | None = None) -> dict | None:
    """Score (or finish scoring) a rollout folder. Returns the manifest once every shard is scored.

    `rewards`: already built rewards (`tpkit run` builds them once for all rounds), else built
    here from cfg.rewards / cfg.reward_options."""
    cfg.validate()
    # 1. Check inputs and build every reward up front (a missing reward model fails here, not halfway,
    # and before --overwrite clears anything).
    rollout = layout.read_manifest(Path(cfg.rollout), "rollout")
    shards = layout.list_shards(Path(cfg.rollout))
    if [s.name for s in shards] != rollout.get("shards", [s.name for s in shards]) or \
            len(shards) != rollout["counts"]["shards"]:
        raise InputError(f"{cfg.rollout}: {len(shards)} shards, the manifest lists {rollout['counts']['shards']}",
                         "rerun `tpkit rollout` with the same options to restore the missing shards")
    rewards = rewards or load_rewards(cfg.rewards, cfg.reward_options)
    asked = [pm for shard in shards for pm in layout.shard_prompts(shard)]  # before any transformer work
    check_inputs(rewards, [p for p, _ in asked], [m for _, m in asked])
    ident = identity(cfg, rollout)
    with layout.stage_lock(Path(cfg.out), cfg.rank, cfg.overwrite, cfg.world_size, ident, inputs=(cfg.rollout,)):
        return _run(cfg, rewards, rollout, shards, ident)


def identity(cfg: ScoreConfig, rollout: dict) -> dict:
    """What a score folder holds: these options applied to this rollout (its id and shard digests).
    Not part of it: how it runs (layout.RUN_ONLY: the reward threads, --on-nan; REWARD_RUN_ONLY: the
    shapes detector's processes), so a rerun with other values resumes."""
    return layout.stage_identity("score", to_dict(cfg), leave_out=("rollout",), inputs={
        "rollout_id": rollout.get("rollout_id"), "shard_sha256": rollout.get("shard_sha256")})


def _run(cfg: ScoreConfig, rewards: list[Reward], rollout: dict, shards: list[Path], ident: dict) -> dict | None:

    rollout_dir, out = Path(cfg.rollout), Path(cfg.out)

    # 2. This rank's shards that have no scores yet.
    def target(shard: Path) -> Path:
        return out / layout.scores_name(shard)

    todo = [s for s in shards if layout.shard_index(s) % cfg.world_size == cfg.rank and not target(s).is_file()]

    # 3. Load transformer and VAE only (no text encoders), with the rollout's policy (LoRA merged).
    if todo:
        models.check_unchanged(rollout, rollout_dir)
        rc = rollout["config"]
        model = None
        if cfg.branches == "all":
            model = models.load(rc["model"], models.recorded(rc), device=cfg.device, dtype=cfg.dtype, text_encoders=False,
                                lora=sampling_lora(rollout, rollout_dir), reuse=True, fuse_lora=True)
        scorer = BranchScorer(model, rewards, cfg)
        reference = None
        per_traj = rc["window_size"] if cfg.branches == "all" else 0
        total = per_traj * layout.sum_stats(todo).get("counts", {}).get("trajectories", 0)
        try:
            # 4. Per shard: complete branches, decode, score; write Parquet + stats atomically.
            with track(total, "score branches") as advance, runtime.memory_options(
                    "score", ("score.batch_size", cfg.batch_size), ("score.decode_batch_size", cfg.decode_batch_size),
                    fits=lambda key, value: memory.suggest_batch(
                        scorer.model, "decode" if key.endswith("decode_batch_size") else "velocity", value,
                        rc["resolution"], rc["max_sequence_length"], rc["guidance"]) if scorer.model else None):
                for shard in todo:
                    counts_before, seconds_before = vars(scorer.counters).copy(), dict(scorer.phases.seconds)
                    with scorer.phases("read"):
                        prompts, trajs = layout.read_shard(shard)  # what is wrong with it, if anything
                        layout.check_shard(shard, rollout)  # a valid shard, but is it the rollout's?
                        reference = reference or {k: trajs[0].meta.get(k) for k in SHARED_SETTINGS}
                        check_rollout(trajs, reference, shard)
                    results = scorer.score_shard(prompts, trajs, cfg.branches, advance)
                    rows, dropped = check_finite(rows_for_shard(trajs, results, cfg.branches), shard, cfg.on_nan)
                    with scorer.phases("write"):
                        data = layout.parquet_bytes(scores_table(rows, rewards), {
                            "stage": "score", "rollout_id": rollout.get("rollout_id"), "shard": shard.name,
                            "shard_sha256": (rollout.get("shard_sha256") or {}).get(shard.name),
                            "dropped_trajectories": dropped})
                    stats = {"counts": {"trajectories": len(trajs) - len(dropped), "dropped_nan": len(dropped),
                                        "rows": len(rows),
                                        **{k: v - counts_before[k] for k, v in vars(scorer.counters).items()}},
                             "seconds": {k: scorer.phases.seconds.get(k, 0.0) - seconds_before.get(k, 0.0)
                                         for k in PHASES},
                             "dropped_trajectories": dropped, **task_rewards(rows, prompts)}
                    layout.write_output(target(shard), data, stats)
        finally:
            scorer.close()

    # 5. The last rank to finish writes the manifest.
    if not all(target(s).is_file() for s in shards):
        return None
    files = [target(s) for s in shards]
    stats, sidecars = layout.sum_stats(files), [_sidecar(f) for f in files]
    if not stats.get("counts", {}).get("trajectories"):
        dropped = stats.get("counts", {}).get("dropped_nan", 0)
        raise RewardError(f"every trajectory's reward is NaN or infinite ({dropped} dropped): nothing to score",
                          "fix the reward function (no manifest was written; rerun with --overwrite after the fix)")
    return layout.write_manifest(
        out, "score", to_dict(cfg), inputs={"rollout": str(rollout_dir), "rollout_config": rollout["config"]},
        identity=ident, rollout_id=rollout.get("rollout_id"),
        counts=stats.get("counts", {}), seconds=stats.get("seconds", {}),
        per_trajectory=per_trajectory_cost(stats.get("counts", {}), rollout["counts"]),
        reward_columns=["reward"] + [r.column for r in rewards], files=[f.name for f in files],
        files_sha256=layout.digests(files),
        reward_by_task=mean_by_task(sidecars),
        dropped_trajectories=sorted(t for s in sidecars for t in s.get("dropped_trajectories", [])),
    )


def scores_table(rows: list[dict], rewards: list[Reward]):
    """The rows as a table; with its columns even when --on-nan drop left no row of a shard."""
    import pyarrow as pa

    if rows:
        return pa.Table.from_pylist(rows)
    f64, i64, text = pa.float64(), pa.int64(), pa.string()
    cols = [("trajectory_id", text), ("prompt_id", text), ("branch", i64), ("reward", f64),
            *((r.column, f64) for r in rewards), ("member", i64), ("step_index", i64), ("sigma", f64), ("prompt", text)]
    return pa.schema(cols).empty_table()


def per_trajectory_cost(score_counts: dict, rollout_counts: dict) -> dict[str, float]:
    """Model work per trajectory, this stage's and with the rollout's (docs/design.md section 2, "Cost"): for T = 10,
    K = 9, 45 transformer calls here (55 with the rollout's 10), 10 decodes (9 here; R_K's image is
    the rollout's own) and 10 reward calls. Averaged over every trajectory of the rollout."""
    n = max(1, rollout_counts.get("trajectories", 0))
    here = {k: score_counts.get(k, 0) / n for k in ("transformer_calls", "decodes", "reward_calls")}
    return {"transformer_calls": here["transformer_calls"],
            "transformer_calls_with_rollout": here["transformer_calls"] + rollout_counts.get("transformer_calls", 0) / n,
            "decodes": here["decodes"] + rollout_counts.get("decodes", 0) / n, "decodes_in_score": here["decodes"],
            "reward_calls": here["reward_calls"]}


def _sidecar(output: Path) -> dict:
    import json

    side = output.with_name(layout.stats_name(output))
    return json.loads(side.read_text()) if side.is_file() else {}
