"""Stage 4, `tpkit train`: clipped GRPO updates of a LoRA (or of every weight) on the cached transitions.

For every (trajectory, step k) row of the advantages table, the stored transition s_{k-1} -> s_k
is re-scored under the current policy (CFG, stored prompt embeddings, no text encoder, no VAE):
l_new, ratio = exp(l_new - l_old), loss = max(-A ratio, -A clip(ratio)) + beta KL(policy || base).

Micro-batches replay the rollout's own transformer batches (the same trajectories at the same
step, in the same order), so on unchanged weights the recomputed log-probs equal the stored ones
bit for bit and the first ratio is exactly 1. The round's micro-batches are shuffled (seeded) and
split evenly into `optimizer_steps` optimizer steps. Runs under `accelerate` (DDP with
`accelerate launch`): each rank takes every world-th micro-batch of a step. With fsdp = true the
weights, gradients and optimizer state are sharded over the ranks instead (`tpkit.sharding`); the
files written are the same.

As in the release, trajectories whose advantage is 0 at every step are left out of the loss (they
carry no policy gradient; kept, they would only dilute the loss average and, with beta > 0, add KL).
They stay in their micro-batches with weight 0, so the others are recomputed in the rollout's batch
(bit for bit). With EMA on, adapter/ holds the EMA weights (what to evaluate and load) and
adapter-raw/ the trained ones (what the next round samples with and continues from).

finetune = "full" trains every weight of the transformer instead, in float32 (mixed precision
computes from them), and saves model/, a diffusers pipeline folder holding the trained transformer
and links to the other components: the next round samples with it as its model and continues its
weights exactly. The KL reference is then a frozen copy of the base model (the run's first model),
loaded in train.dtype beside the trained one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tpkit import formulas, layout, memory, models, runtime, sharding, tracking
from tpkit.config import TrainConfig, lora_targets, to_dict
from tpkit.errors import InputError, TpkitError
from tpkit.models import base as model_base
from tpkit.models.base import lora_state
from tpkit.timing import Phases
from tpkit.ui import track

ADAPTER, ADAPTER_RAW, MODEL, STATE, CHECKPOINT = "adapter", "adapter-raw", "model", "state", "checkpoint"


def policy_adapter(adapter: str | Path) -> Path:
    """The weights a round trained (to sample with and continue from), given its adapter/ folder:
    adapter-raw/ beside it when it was trained with EMA (adapter/ then holds the EMA), else itself."""
    adapter = Path(adapter)
    raw = adapter.parent / ADAPTER_RAW
    return raw if adapter.name == ADAPTER and raw.is_dir() else adapter


def state_in(cfg: TrainConfig) -> Path | None:
    """The state/ folder this train continues (optimizer moments, EMA, global step): --init-state, else
    the one beside --init-lora; None for a first round."""
    if cfg.init_state:
        return Path(cfg.init_state)
    return Path(cfg.init_lora).parent / STATE if cfg.init_lora else None


class TrainError(TpkitError):
    """Training cannot go on (e.g. non-finite losses in a row)."""


@dataclass
class MicroBatch:
    """Transitions s_{k-1} -> s_k of the trajectories of one rollout batch at one step k."""

    key: tuple[str, int]  # (rollout_batch, k)
    x: torch.Tensor  # [B, C, h, w]  s_{k-1}
    x_next: torch.Tensor  # [B, C, h, w]  s_k
    sigma: torch.Tensor  # [B]  sigma_{a+k-1}
    sigma_next: torch.Tensor  # [B]
    old_log_prob: torch.Tensor  # [B]
    advantage: torch.Tensor  # [B]
    weight: torch.Tensor  # [B] 1, or 0 for a trajectory left out of the loss (zero advantage at every step)
    prompt_ids: list[str]

    @property
    def samples(self) -> int:
        """Transitions that count in the loss."""
        return int(self.weight.sum())

    def has_gradient(self, beta: float) -> bool:
        """Whether the loss of this micro-batch depends on the weights (else it need not be computed)."""
        counted = self.weight > 0
        return bool(counted.any()) and (beta > 0 or bool((self.advantage[counted] != 0).any()))


def read_advantages(folder: Path) -> dict[tuple[str, int], float]:
    table = layout.read_parquet_tables(folder, "advantages")
    missing = [c for c in ("trajectory_id", "step", "advantage") if c not in table.column_names]
    if missing:
        raise InputError(f"{folder}: advantages table lacks {', '.join(missing)}", "pass the folder written by `tpkit advantages`")
    adv = np.asarray([np.nan if a is None else a for a in table["advantage"].to_pylist()], dtype=np.float64)
    tids = table["trajectory_id"].to_pylist()
    if not np.isfinite(adv).all():
        bad = sorted({tids[i] for i in np.flatnonzero(~np.isfinite(adv))})
        raise InputError(f"{folder}: NaN, infinite or missing advantage for {len(bad)} trajectories: {', '.join(bad[:8])}",
                         "recompute them with `tpkit advantages` from finite scores")
    return dict(zip(zip(tids, table["step"].to_pylist()), adv.tolist()))


def identity(cfg: TrainConfig, rollout: dict, adv_files: list[Path]) -> dict:
    """What a train folder holds: these options applied to this rollout, these advantages (their bytes)
    and the adapter and state it continues (their contents). Options that only say when to save,
    when to stop or where to log (layout.RUN_ONLY["train"]: checkpoint_every, max_bad_steps, allow_no_op,
    log_with) are left out by stage_identity, so they may change on a resume."""
    state = state_in(cfg)
    return layout.stage_identity("train", to_dict(cfg), inputs={
        "rollout_id": rollout.get("rollout_id"),
        "advantages_sha256": layout.digests(adv_files),
        "init_lora_sha256": layout.tree_digest(policy_adapter(cfg.init_lora)) if cfg.init_lora else None,
        "init_state_sha256": (layout.pruned_digest(state) or layout.tree_digest(state)) if state and state.is_dir() else None},
        leave_out=("rollout", "advantages", "init_lora", "init_state"))


def check_advantages_belong(rollout: dict, rollout_dir: Path, advantages: Path, adv_files: list[Path]) -> dict:
    """The advantages must have been computed from this very rollout (whatever their form: folder or
    file). Returns the advantages' metadata (dropped trajectories ...)."""
    meta: dict = {}
    for f in adv_files:
        meta.update(layout.parquet_meta(f))
    manifest = layout.read_manifest(advantages, "advantages") if Path(advantages).is_dir() else {}
    layout.check_files(advantages, manifest, adv_files, "advantages")
    source = layout.rollout_of(adv_files) or manifest.get("rollout_id")
    if source is None:
        raise InputError(f"{advantages}: these advantages do not say which rollout they were computed from",
                         "compute them with `tpkit score` + `tpkit advantages` from this rollout (or give the "
                         "scores table a rollout_id column with the rollout's id from its manifest.json)")
    if source != rollout.get("rollout_id"):
        raise InputError(f"{advantages} were computed from another rollout (id {source}) than {rollout_dir} "
                         f"(id {rollout.get('rollout_id')})",
                         "pass the rollout folder that was scored for these advantages (same round)")
    return {"dropped_trajectories": meta.get("dropped_trajectories", manifest.get("dropped_trajectories", []))}


def check_init_lora(cfg: TrainConfig) -> None:
    """A previous round's adapter must have this train's LoRA shape (rank, alpha, targets)."""
    if not cfg.init_lora:
        return
    adapter = policy_adapter(cfg.init_lora)
    if not adapter.is_dir():
        raise InputError(f"--init-lora {cfg.init_lora}: no such folder", "pass the adapter/ folder of a previous `tpkit train`")
    rank = None
    for f in sorted(adapter.glob("*.safetensors")):
        from safetensors import safe_open

        try:
            with safe_open(str(f), framework="pt") as st:
                key = next((k for k in st.keys() if "lora_A" in k), None)
                rank = st.get_slice(key).get_shape()[0] if key else None
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise InputError(f"{f}: not a readable LoRA adapter ({e})", "pass the adapter/ folder of a previous `tpkit train`") from None
        break
    if rank is None:
        raise InputError(f"--init-lora {cfg.init_lora}: no LoRA weights (*.safetensors with lora_A) in {adapter}",
                         "pass the adapter/ folder of a previous `tpkit train`")
    if rank != cfg.lora_rank:
        raise InputError(f"--init-lora {cfg.init_lora} is a LoRA of rank {rank}, this train uses --lora-rank {cfg.lora_rank}",
                         f"pass --lora-rank {rank} (and that round's --lora-alpha), or train without --init-lora")


def zero_advantage_trajectories(adv: dict[tuple[str, int], float]) -> set[str]:
    """Trajectories whose advantage is exactly 0 at every step (the release drops them before training)."""
    nonzero = {tid for (tid, _), a in adv.items() if a != 0}
    return {tid for tid, _ in adv} - nonzero


def load_micro_batches(rollout_dir: Path, adv: dict, cfg: TrainConfig, dropped: set[str] = frozenset(),
                       zero: set[str] = frozenset(), manifest: dict | None = None) -> tuple[list[MicroBatch], dict, dict]:
    """All transitions of the rollout with their advantages, grouped as the rollout batched them.

    Trajectories that score dropped on purpose (`dropped`, from --on-nan drop) are left out; any
    other trajectory without advantages is an error. Trajectories in `zero` get weight 0.

    Returns (micro-batches, prompt embeddings by prompt_id, rollout settings of the first trajectory).
    """
    groups: dict[tuple[str, int], list] = {}
    embeds: dict[str, dict] = {}
    with_rows = {tid for tid, _ in adv}
    seen: set[str] = set()
    meta0 = None
    for shard in layout.list_shards(rollout_dir):
        prompts, trajs = layout.read_shard(shard)
        if manifest is not None:
            layout.check_shard(shard, manifest)
        embeds.update({pid: p.embeds for pid, p in prompts.items()})
        for t in trajs:
            m, tens = t.meta, t.tensors
            meta0 = meta0 or m
            seen.add(m["trajectory_id"])
            if m["trajectory_id"] in dropped and m["trajectory_id"] not in with_rows:
                continue  # left out by `tpkit score --on-nan drop`
            a, sig = m["window_start"], m["sigmas"]
            for k in range(1, m["window_size"] + 1):
                if (m["trajectory_id"], k) not in adv:
                    raise InputError(f"advantages have no row for trajectory {m['trajectory_id']} step {k}",
                                     "compute advantages from this rollout's scores (`tpkit score` then `tpkit advantages`)")
                groups.setdefault((m["rollout_batch"], k), []).append(
                    (m["batch_slot"], tens["states"][k - 1], tens["states"][k], sig[a + k - 1], sig[a + k],
                     tens["log_probs"][k - 1], adv[(m["trajectory_id"], k)], m["prompt_id"],
                     0.0 if m["trajectory_id"] in zero else 1.0))
    extra = {tid for tid, _ in adv} - seen
    if extra:
        raise InputError(f"advantages reference {len(extra)} trajectories the rollout does not have "
                         f"(e.g. {sorted(extra)[0]})", "pass the rollout folder these advantages were computed from")
    if meta0 is None:
        raise InputError(f"{rollout_dir}: no trajectories", "run `tpkit rollout` first")
    out = []
    for key in sorted(groups):
        rows = sorted(groups[key], key=lambda r: r[0])
        for i in range(0, len(rows), cfg.micro_batch_size or len(rows)):
            part = rows[i: i + (cfg.micro_batch_size or len(rows))]
            out.append(MicroBatch(
                key=key, x=torch.stack([r[1] for r in part]), x_next=torch.stack([r[2] for r in part]),
                sigma=torch.tensor([r[3] for r in part], dtype=torch.float32),
                sigma_next=torch.tensor([r[4] for r in part], dtype=torch.float32),
                old_log_prob=torch.stack([r[5] for r in part]).float(),
                advantage=torch.tensor([r[6] for r in part], dtype=torch.float64),
                weight=torch.tensor([r[8] for r in part], dtype=torch.float32), prompt_ids=[r[7] for r in part]))
    return out, embeds, meta0


def plan_steps(batches: list[MicroBatch], cfg: TrainConfig, global_step: int) -> list[list[MicroBatch]]:
    """Shuffle (seeded by the run seed and the global step) and split into optimizer steps.

    Micro-batches with nothing to learn from (every trajectory left out, or A = 0 with beta = 0) are
    not computed; the loss of a step is its sum over the transitions that count, divided by their
    number in the step (`MicroBatch.samples`, before that filter: as the release averages).
    """
    useful = [b for b in batches if b.samples > 0]
    order = np.random.default_rng([cfg.seed, global_step]).permutation(len(useful))
    steps = [list(part) for part in np.array_split(np.asarray(useful, dtype=object)[order], cfg.optimizer_steps)]
    return [s for s in steps if s]


def run(cfg: TrainConfig) -> dict:
    cfg.fsdp = cfg.fsdp or sharding.requested_by_launcher()
    cfg.validate()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    rollout = layout.read_manifest(Path(cfg.rollout), "rollout")
    cfg.lora_targets = lora_targets(cfg.lora_targets, models.recorded(rollout["config"]))  # the family's default, or checked
    adv_files = layout.parquet_files(Path(cfg.advantages), "advantages")
    check_init_lora(cfg)
    if cfg.init_state and not Path(cfg.init_state).is_dir():
        raise InputError(f"--init-state {cfg.init_state}: not a folder", "pass the state/ folder of a previous `tpkit train`")
    if (state := state_in(cfg)) and (state / layout.PRUNED).is_file():  # continuing it would start AdamW afresh
        raise InputError(f"{state}: its optimizer state was deleted by `tpkit run` (keep_rounds) once later rounds had trained",
                         "continue from a round it kept (the last keep_rounds), or set keep_rounds = 0")
    tracking.check_kind(cfg.log_with)
    # Inputs checked before --overwrite clears anything: the advantages belong to this rollout, finite.
    adv_meta = check_advantages_belong(rollout, Path(cfg.rollout), Path(cfg.advantages), adv_files)
    models.check_unchanged(rollout, Path(cfg.rollout))
    adv = read_advantages(Path(cfg.advantages))
    ident = identity(cfg, rollout, adv_files)
    with layout.stage_lock(Path(cfg.out), rank, cfg.overwrite, world, ident,
                           inputs=(cfg.rollout, cfg.advantages, cfg.init_lora, cfg.init_state)):
        return _run(cfg, rollout, adv, adv_meta, ident)


@dataclass
class TrainState:
    """What the steps of a train run share: the prepared model and optimizer, and the progress that a
    mid-round checkpoint saves (global_step, round_start, metrics, bad_in_row)."""

    accelerator: Any
    model: Any  # the tpkit.models model; model.transformer is the unwrapped transformer (EMA, saving)
    transformer: Any  # model.transformer as accelerate prepared it (DDP-wrapped under `accelerate launch`), or sharded
    reference: Any  # finetune = full: the frozen base transformer for the KL (None: LoRA's adapters off, or beta = 0)
    lora_config: Any  # None with finetune = full
    params: list  # the trainable parameters (the LoRA's, or every weight)
    names: list  # their names, in the same order (the optimizer's numbering in saved state)
    sharded: bool  # fsdp over more than one process: params are DTensor shards, saving gathers them
    optimizer: Any  # AdamW (as accelerate prepared it, unless sharded)
    optimizer_kind: str  # TrainConfig.optimizer, saved beside its state (the kinds' states do not convert)
    finetune: str  # TrainConfig.finetune: what params are (the LoRA's, or every weight)
    ema: dict | None  # float32 EMA of the LoRA weights (None without --ema; never with finetune = full)
    embeds: dict  # prompt embeddings by prompt_id, on the device
    settings: dict  # the rollout's sampler settings (sampler, noise_level, sigma_1, guidance)
    global_step: int  # optimizer steps over all rounds so far
    round_start: int  # global_step when this round began (seeds plan_steps)
    metrics: list  # one line per optimizer step of this round
    bad_in_row: int = 0  # optimizer steps in a row with a non-finite loss or gradient
    steps_done: int = 0  # optimizer steps of this round a killed run had finished (resumed after them)


def _run(cfg: TrainConfig, rollout: dict, adv: dict, adv_meta: dict, ident: dict) -> dict:
    # 1. Check inputs: the rollout and its advantages (the state to continue from is read in 2).
    on_cpu = runtime.accelerate_on_cpu(cfg.device)
    phases = Phases("cpu" if on_cpu else runtime.pick_device(cfg.device))
    batches, embeds, meta, zero, no_op = _read_inputs(cfg, rollout, adv, adv_meta, phases)

    # 2. Model: transformer only, frozen, with a trainable float32 LoRA (continuing the previous round's),
    #    AdamW and EMA (continuing the previous round's state, or this stage's checkpoint after a kill).
    st = _setup(cfg, rollout, embeds, meta, on_cpu, phases)

    # 3. Optimizer steps: each accumulates its share of micro-batches, then clips and steps.
    steps = plan_steps(batches, cfg, st.round_start) if not no_op else []
    computed = [[b for b in s if b.has_gradient(cfg.beta)] for s in steps]
    rc = rollout["config"]
    with runtime.memory_options("train", ("train.micro_batch_size", cfg.micro_batch_size or rc["batch_size"]),
                                also="" if cfg.gradient_checkpointing else ", or set train.gradient_checkpointing = true",
                                fits=lambda key, value: memory.suggest_batch(
                                    st.model, "train", value, rc["resolution"], rc["max_sequence_length"], rc["guidance"],
                                    train_cfg=cfg)):
        _train(st, cfg, steps, computed, phases)

    # 4. A round whose every optimizer step was non-finite learned nothing: an error, not "done".
    _check_learned(st, cfg)

    # 5. Save (main process): adapter, EMA adapter, optimizer/EMA state, metrics, then the manifest.
    return _save(st, cfg, rollout, ident, adv, zero, computed, no_op, phases)


def _read_inputs(cfg: TrainConfig, rollout: dict, adv: dict, adv_meta: dict,
                 phases: Phases) -> tuple[list[MicroBatch], dict, dict, set[str], bool]:
    """Step 1: the rollout's micro-batches with their advantages. Returns (micro-batches, prompt
    embeddings, rollout settings, zero-advantage trajectories left out of the loss, no_op: nothing
    to learn from, an error unless --allow-no-op)."""
    with phases("read"):
        zero = zero_advantage_trajectories(adv) if cfg.drop_zero_advantage else set()
        batches, embeds, meta = load_micro_batches(Path(cfg.rollout), adv, cfg,
                                                   set(adv_meta.get("dropped_trajectories", [])), zero, rollout)
    no_op = not any(b.has_gradient(cfg.beta) for b in batches)
    if no_op and not cfg.allow_no_op:
        raise TrainError(f"nothing to learn from: every advantage is 0 ({len({tid for tid, _ in adv})} trajectories)",
                         "check the rewards: a constant reward, or groups of one member, give no advantage "
                         "(`tpkit inspect` the score and advantages folders); --allow-no-op accepts such a round")
    return batches, embeds, meta, zero, no_op


def _setup(cfg: TrainConfig, rollout: dict, embeds: dict, meta: dict, on_cpu: bool, phases: Phases) -> TrainState:
    """Step 2: the state to continue from (the previous round's adapter and state, or this stage's
    checkpoint), the model with its LoRA (or every weight trainable), AdamW and EMA, prepared by
    accelerate (or sharded with fsdp); with finetune = full and beta > 0, the frozen reference model."""
    from accelerate import Accelerator

    out = Path(cfg.out)
    init_lora = str(policy_adapter(cfg.init_lora)) if cfg.init_lora else None  # not the EMA of an EMA run
    state = state_in(cfg)
    global_step = round_start = _trainer_state(state).get("global_step", 0) if state else 0
    resume = _read_checkpoint(out) if not (out / layout.MANIFEST).is_file() else None

    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, cpu=on_cpu)
    device = accelerator.device
    sharded = cfg.fsdp and accelerator.num_processes > 1
    # sharded: each process reads the whole model into CPU memory, and only its shard goes to the device
    load_on = torch.device("cpu") if sharded else device
    model, lora_config = _load_model(cfg, rollout, load_on, device, init_lora, phases)
    reference = _load_reference(cfg, rollout, load_on, device, phases)
    if resume:  # a killed run of this stage: its weights, before they are sharded
        model_base.load_trained_state(model.transformer, _checkpoint_weights(out / CHECKPOINT), cfg.finetune)
    if sharded:
        with phases("load"):
            for module in (model.transformer, reference):
                if module is not None:
                    sharding.shard(module, device, accelerator.num_processes)
            model.device = device
    trained = [(n, p) for n, p in model.transformer.named_parameters() if p.requires_grad]
    params, names = [p for _, p in trained], [n for n, _ in trained]
    optimizer = _adamw(cfg, params)
    moments = out / CHECKPOINT if resume else state  # the checkpoint's, or the previous round's
    if moments and (moments / "optimizer.pt").is_file():
        _load_optimizer(moments, optimizer, cfg.optimizer, model.transformer if sharded else None, names)
        for group in optimizer.param_groups:  # the moments continue; the settings are this config's, not the saved ones
            group.update(_adamw_settings(cfg))
    ema = _load_ema(state, model.transformer) if cfg.ema else None
    metrics, bad_in_row, steps_done = [], 0, 0
    if resume:  # continue after its last finished optimizer step
        if cfg.ema and (out / CHECKPOINT / "ema.safetensors").is_file():
            from safetensors.torch import load_file

            ema = load_file(out / CHECKPOINT / "ema.safetensors")
        metrics, bad_in_row, steps_done = resume["metrics"], resume["bad_in_row"], resume["steps_done"]
        global_step, round_start = resume["global_step"], resume["round_start"]
    transformer = model.transformer
    if not sharded:
        transformer, optimizer = accelerator.prepare(transformer, optimizer)
    return TrainState(
        accelerator=accelerator, model=model, transformer=transformer, reference=reference, lora_config=lora_config,
        params=params, names=names, sharded=sharded,
        optimizer=optimizer, optimizer_kind=cfg.optimizer, finetune=cfg.finetune, ema=ema, embeds={pid: {k: v.to(device) for k, v in e.items()} for pid, e in embeds.items()},
        settings=dict(sampler=meta["sampler"], noise_level=meta["noise_level"], sigma_1=meta["sigmas"][1],
                      guidance=meta["guidance"]),
        global_step=global_step, round_start=round_start, metrics=metrics, bad_in_row=bad_in_row, steps_done=steps_done)


def _load_model(cfg: TrainConfig, rollout: dict, load_on: torch.device, device: torch.device, init_lora: str | None,
                phases: Phases):
    """The rollout's transformer (no text encoders, no VAE), frozen, with a trainable LoRA (a fresh
    one, seeded, or init_lora's); or, with finetune = full, every weight trainable in float32 (loaded
    in float32: a previous round saved them so). Loaded onto `load_on` in the dtype train.dtype gives on
    `device` (where it trains). Returns (model, LoRA config or None)."""
    model_base.release()  # an inference pipeline kept by rollout/score would only take memory now
    full = cfg.finetune == "full"
    with phases("load"):
        model = models.load(rollout["config"]["model"], models.recorded(rollout["config"]), device=str(load_on),
                            dtype="float32" if full else _dtype_name(cfg.dtype, device), text_encoders=False, vae=False)
        lora_config = None
        if full:
            model_base.make_fully_trainable(model.transformer)
        else:
            torch.manual_seed(cfg.seed)  # the LoRA init must not depend on what ran before in this process
            lora_config = model_base.add_trainable_lora(model.transformer, cfg.lora_rank, cfg.lora_alpha,
                                                        cfg.lora_targets, init_lora)
        idle = set(model.idle_parameters(model.transformer))
        for name, p in model.transformer.named_parameters():
            if name in idle:
                p.requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.transformer.enable_gradient_checkpointing()
    return model, lora_config


def _dtype_name(dtype: str, device: torch.device) -> str:
    """train.dtype as `models.load` takes it, resolved for `device` ("auto": bfloat16 on GPUs)."""
    return str(runtime.pick_dtype(dtype, device)).removeprefix("torch.")


def _load_reference(cfg: TrainConfig, rollout: dict, load_on: torch.device, device: torch.device, phases: Phases):
    """finetune = full with beta > 0: the base model's transformer (the run's first model, which a
    fully fine-tuned folder names), frozen, in train.dtype: a second copy of the weights in memory.
    None otherwise (a LoRA's reference is its own adapters switched off)."""
    if cfg.finetune != "full" or cfg.beta == 0:
        return None
    with phases("load"):
        base = model_base.base_model(rollout["config"]["model"])
        return models.load(base, models.recorded(rollout["config"]), device=str(load_on),
                           dtype=_dtype_name(cfg.dtype, device), text_encoders=False, vae=False).transformer


def _adamw_settings(cfg: TrainConfig) -> dict:
    return dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.adam_weight_decay,
                eps=cfg.adam_epsilon)


def _adamw(cfg: TrainConfig, params: list) -> torch.optim.Optimizer:
    """AdamW (torch's, or bitsandbytes' with 8-bit moments) over the trained parameters, fresh moments."""
    if cfg.optimizer == "adamw8bit":
        import bitsandbytes  # validated as installed by TrainConfig

        return bitsandbytes.optim.AdamW8bit(params, **_adamw_settings(cfg))
    return torch.optim.AdamW(params, **_adamw_settings(cfg))


def _trainer_state(folder: Path) -> dict:
    """A state folder's trainer.json (global step, optimizer kind; `_save_state`), {} where there is none."""
    path = folder / "trainer.json"
    return json.loads(path.read_text()) if path.is_file() else {}


MOMENTS = ("exp_avg", "exp_avg_sq", "state1", "state2")  # per-element moments: AdamW's, bitsandbytes' 8-bit


def _load_optimizer(folder: Path, optimizer, kind: str, sharded_model, names: list[str]) -> None:
    """Load folder/optimizer.pt, saved by an optimizer of the same kind (trainer.json says which; states
    saved before it did are torch's AdamW) over the same parameters (`names`, in the optimizer's order).
    `sharded_model`: the sharded transformer whose optimizer this is (None: not sharded)."""
    saved_kind = _trainer_state(folder).get("optimizer", "adamw")
    if saved_kind != kind:
        raise TrainError(f"{folder} holds the moments of optimizer = {saved_kind}; this round uses {kind}",
                         f"keep train.optimizer = {saved_kind} for this run, or start a new one (no --init-lora)")
    # sharded: memory-mapped, so that each process reads only the slices it keeps
    saved = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True, mmap=sharded_model is not None)
    n_saved = sum(len(g["params"]) for g in saved["param_groups"])
    try:
        if n_saved != len(names):
            raise ValueError(f"{len(names)} trained parameters, {n_saved} saved")
        # torch checks only the counts: a state of another LoRA rank would load, then fail in the first step
        params = [p for g in optimizer.param_groups for p in g["params"]]  # sharded: DTensors, global shapes
        ids = [i for g in saved["param_groups"] for i in g["params"]]
        for name, p, i in zip(names, params, ids):
            for key in MOMENTS:
                moment = saved["state"].get(i, {}).get(key)
                if moment is not None and tuple(moment.shape) != tuple(p.shape):
                    raise ValueError(f"{name} is {tuple(p.shape)}, its saved {key} {tuple(moment.shape)}")
        if sharded_model is None:
            optimizer.load_state_dict(saved)
        else:
            sharding.load_optimizer_state(sharded_model, optimizer, saved, names)
    except (ValueError, KeyError, RuntimeError) as e:  # torch: "... doesn't match the size of optimizer's group"
        raise TrainError(f"{folder} holds optimizer moments of other parameters than this round trains ({e})",
                         "continue with the state/ of a round trained with the same finetune and LoRA settings, "
                         "or start without one") from None


def _train(st: TrainState, cfg: TrainConfig, steps: list[list[MicroBatch]], computed: list[list[MicroBatch]],
           phases: Phases) -> None:
    """Step 3: the round's optimizer steps (after those a killed run finished), each step's metrics to
    the tracker, a checkpoint every `checkpoint_every` steps (not after the last: the save follows).
    `computed` holds each step's micro-batches that have a gradient."""
    accelerator, out = st.accelerator, Path(cfg.out)
    if accelerator.num_processes > 1 and computed and min(len(s) for s in computed) < accelerator.num_processes:
        raise TrainError(f"{min(len(s) for s in computed)} micro-batches in an optimizer step for "
                         f"{accelerator.num_processes} processes", "use fewer --optimizer-steps or a larger rollout")
    tracker = tracking.open_tracker(cfg.log_with, out, out.name, to_dict(cfg), cfg.device)
    with track(sum(len(s) for s in computed), "train micro-batches") as advance, tracking.closing(tracker):
        advance(sum(len(s) for s in computed[:st.steps_done]))
        for step_index, step_batches in enumerate(steps):
            if step_index < st.steps_done:
                continue
            _optimizer_step(st, cfg, step_batches, computed[step_index], advance, phases)
            if tracker:
                tracker.scalars(tracking.train_scalars(st.metrics[-1]), st.global_step)
            if st.bad_in_row >= cfg.max_bad_steps:
                raise TrainError(f"{st.bad_in_row} optimizer steps in a row had a non-finite loss or gradient",
                                 "lower --learning-rate, check the rewards/advantages, or raise --max-bad-steps")
            if cfg.checkpoint_every and (step_index + 1) % cfg.checkpoint_every == 0 and step_index + 1 < len(steps):
                _checkpoint_step(st, out, step_index + 1, phases)


def _optimizer_step(st: TrainState, cfg: TrainConfig, step_batches: list[MicroBatch], computed: list[MicroBatch],
                    advance, phases: Phases) -> None:
    """One optimizer step: this process's share of the step's computed micro-batches, gradients
    accumulated; then clip, AdamW and EMA. Appends the step's metrics line."""
    t0 = time.perf_counter()
    n_samples = sum(b.samples for b in step_batches)
    sums = _accumulate(st, cfg, computed, n_samples, advance, phases)
    with phases("optimizer"):  # gradient all-reduce wait, clipping, AdamW, EMA
        sums, grad_norm, finite = _clip_and_step(st, cfg, sums)
    st.global_step += 1
    st.metrics.append(_metrics_line(st.global_step, sums, n_samples, grad_norm, cfg, finite, time.perf_counter() - t0))


def _accumulate(st: TrainState, cfg: TrainConfig, computed: list[MicroBatch], n_samples: int, advance,
                phases: Phases) -> torch.Tensor:
    """Forward and backward of each of this process's micro-batches of a step (every world-th), the
    gradients all-reduced on the last only (sharded: reduce-scattered after each, so no process holds a
    whole gradient). Returns this process's metric sums (float64 [9])."""
    accelerator = st.accelerator
    world = accelerator.num_processes
    mine = computed[accelerator.process_index:: world]
    # Sharded, every process takes part in each forward's and backward's gathers: one with fewer
    # micro-batches than the others repeats its first with the loss times 0 (no gradient, no metrics).
    fillers = -(-len(computed) // world) - len(mine) if st.sharded else 0
    sums = torch.zeros(9, dtype=torch.float64, device=accelerator.device)
    for i, b in enumerate(mine + mine[:1] * fillers):
        sync = i == len(mine) + fillers - 1
        filler = i >= len(mine)
        ctx = accelerator.no_sync(st.transformer) if not (sync or st.sharded) else contextlib.nullcontext()
        with ctx:
            loss, stats = _micro_batch_loss(st.model, st.transformer, st.reference, b, st.embeds, st.settings, cfg,
                                            accelerator, phases)
            with phases("backward"):
                accelerator.backward(loss * (0.0 if filler else world / n_samples))
        if not filler:
            sums += stats
            advance(1)
    return sums


def _clip_and_step(st: TrainState, cfg: TrainConfig, sums: torch.Tensor) -> tuple[torch.Tensor, float, bool]:
    """Sum the metric sums over processes, clip the gradient, and step AdamW (and the EMA when due)
    if loss and gradient are finite. Returns (summed metric sums, gradient norm, finite)."""
    accelerator = st.accelerator
    sums = accelerator.reduce(sums, reduction="sum")
    grad_norm = accelerator.clip_grad_norm_(st.params, cfg.max_grad_norm)  # of the whole gradient, also sharded
    grad_norm = float(sharding.whole(grad_norm)) if grad_norm is not None else float("nan")
    finite = bool(torch.isfinite(sums).all()) and np.isfinite(grad_norm)
    if finite:
        st.optimizer.step()
        st.bad_in_row = 0
        if st.ema is not None and (st.global_step + 1) % cfg.ema_every == 0:
            _update_ema(st.ema, st.model.transformer, ema_decay(cfg.ema_decay, st.global_step + 1))
    else:
        st.bad_in_row += 1
    st.optimizer.zero_grad(set_to_none=True)
    return sums, grad_norm, finite


def _checkpoint_step(st: TrainState, out: Path, steps_done: int, phases: Phases) -> None:
    """A mid-round checkpoint after `steps_done` optimizer steps of this round (written by the main process;
    sharded, every process gathers)."""
    with phases("checkpoint"):
        weights, moments = _trained_state(st), _optimizer_state(st)
        if st.accelerator.is_main_process:
            _write_checkpoint(out / CHECKPOINT, weights, moments, st.optimizer_kind, st.ema, {
                "steps_done": steps_done, "global_step": st.global_step, "round_start": st.round_start,
                "metrics": st.metrics, "bad_in_row": st.bad_in_row})
        st.accelerator.wait_for_everyone()


def _trained_state(st: TrainState) -> dict | None:
    """The weights train updates (the LoRA's, or every weight), whole; gathered onto the main process
    when sharded (None on the others; every process calls this)."""
    trained = model_base.trained_state(st.accelerator.unwrap_model(st.transformer), st.finetune)
    return sharding.gather(trained, st.accelerator.is_main_process) if st.sharded else trained


def _optimizer_state(st: TrainState) -> dict | None:
    """`optimizer.state_dict()`, whole; gathered onto the main process when sharded (as `_trained_state`)."""
    if st.sharded:
        return sharding.optimizer_state(st.transformer, st.optimizer, st.names, st.accelerator.is_main_process)
    return st.optimizer.state_dict()


def _check_learned(st: TrainState, cfg: TrainConfig) -> None:
    """Step 4: an error if every optimizer step was non-finite (unless --allow-no-op) or the LoRA is."""
    metrics = st.metrics
    if metrics and not any(m["finite"] for m in metrics) and not cfg.allow_no_op:
        raise TrainError(f"every optimizer step ({len(metrics)}) had a non-finite loss or gradient: nothing was learned",
                         "lower --learning-rate, check the rewards and advantages (`tpkit inspect`), "
                         "or pass --allow-no-op to accept such a round")

    trained = model_base.trained_state(st.accelerator.unwrap_model(st.transformer), cfg.finetune)
    finite = torch.tensor(float(all(bool(torch.isfinite(sharding.local(v)).all()) for v in trained.values())),
                          device=st.accelerator.device)
    if st.sharded:  # each process sees its shards: all must agree, or one would wait for the others forever
        finite = st.accelerator.reduce(finite, reduction="mean")
    if finite.item() < 1:
        raise TrainError(f"the trained {'LoRA' if cfg.finetune == 'lora' else 'model'} holds NaN or infinite weights",
                         "lower --learning-rate (nothing was saved)")


def _save(st: TrainState, cfg: TrainConfig, rollout: dict, ident: dict, adv: dict, zero: set[str],
          computed: list[list[MicroBatch]], no_op: bool, phases: Phases) -> dict:
    """Step 5: adapter(s), state and metrics, then the manifest, and the checkpoint goes; written by the
    main process (sharded, every process gathers onto it). Returns the manifest ({} on the other processes)."""
    accelerator, out, metrics = st.accelerator, Path(cfg.out), st.metrics
    accelerator.wait_for_everyone()
    manifest = None
    with phases("save"):
        _save_outputs(st, out)
    if accelerator.is_main_process:
        transitions = sum(len(b.prompt_ids) for s in computed for b in s)
        manifest = layout.write_manifest(
            out, "train", to_dict(cfg),
            inputs={"rollout": str(Path(cfg.rollout)), "advantages": str(cfg.advantages), "init_lora": cfg.init_lora,
                    "model": rollout["config"]["model"], "family": models.recorded(rollout["config"])}, identity=ident, rollout_id=rollout.get("rollout_id"),
            no_op=no_op or not any(m["finite"] for m in metrics),
            # Model work of the whole stage, all processes (a CFG pair counts once): each transition is one
            # forward with gradients and its backward, plus one reference forward when beta > 0.
            counts={"optimizer_steps": len(metrics), "micro_batches": sum(len(s) for s in computed),
                    "zero_advantage_trajectories": len(zero),
                    "trained_parameters": sum(p.numel() for p in st.params),
                    "trajectories_in_loss": len({tid for tid, _ in adv} - zero),
                    "transitions": transitions, "transformer_calls": transitions,
                    "reference_calls": transitions if cfg.beta > 0 else 0, "global_step": st.global_step,
                    "processes": accelerator.num_processes,
                    "nonfinite_steps": sum(not m["finite"] for m in metrics)},
            seconds=phases.rounded(),  # this process's (the main one), this run's (not a killed earlier run's)
            last_metrics=metrics[-1] if metrics else {}, resumed_from_step=st.steps_done,
            sharded=st.sharded,  # fsdp over more than one process
        )
        shutil.rmtree(out / CHECKPOINT, ignore_errors=True)  # the finished stage supersedes it
    accelerator.wait_for_everyone()
    return manifest or {}


def _save_outputs(st: TrainState, out: Path) -> None:
    """Adapter (with EMA: adapter/ the EMA, adapter-raw/ the trained weights) or, with finetune = full, the
    model/ pipeline folder; optimizer/EMA state, metrics. Written by the main process; every process
    calls this (sharded, they gather the weights and moments onto it)."""
    unwrapped = st.accelerator.unwrap_model(st.transformer)
    weights = _trained_state(st) if st.sharded else unwrapped
    moments = _optimizer_state(st)
    if not st.accelerator.is_main_process:
        return
    if st.finetune == "full":
        st.model.save_model(sharding.host(unwrapped, weights) if st.sharded else unwrapped, out / MODEL)
    elif st.ema is not None:  # users and evaluations load adapter/; the next round continues adapter-raw/
        st.model.save_lora(weights, st.lora_config, out / ADAPTER_RAW)
        st.model.save_lora(st.ema, st.lora_config, out / ADAPTER)
    else:
        st.model.save_lora(weights, st.lora_config, out / ADAPTER)
    _save_state(out / STATE, moments, st.optimizer_kind, st.ema, st.global_step)
    layout.atomic_write(out / layout.METRICS_FILE, "".join(json.dumps(m) + "\n" for m in st.metrics).encode())


def _micro_batch_loss(model, transformer, reference, b: MicroBatch, embeds, settings, cfg: TrainConfig, accelerator,
                      phases: Phases):
    """Weighted sum over the micro-batch of the per-sample GRPO loss, and metric sums (float64 [9])."""
    device = accelerator.device
    with phases("forward"):
        emb = {k: torch.cat([embeds[p][k] for p in b.prompt_ids]) for k in embeds[b.prompt_ids[0]]}
        x, x_next = b.x.to(device), b.x_next.to(device)
        sigma, sigma_next = b.sigma.to(device), b.sigma_next.to(device)
        with accelerator.autocast():
            v = model.velocity(x, sigma, emb, settings["guidance"], transformer=transformer)
        step = formulas.stochastic_step(settings["sampler"], x, v, sigma, sigma_next, settings["noise_level"],
                                        settings["sigma_1"], sample=x_next)
        old = b.old_log_prob.to(device)
        adv = b.advantage.to(device).float()
        policy, ratio = formulas.clipped_policy_loss(step.log_prob, old, adv, cfg.clip_range, cfg.adv_clip)
    kl = torch.zeros_like(policy)
    if cfg.beta > 0:
        with phases("reference"):
            # the reference policy is the base model: the LoRA's adapters off (no second copy in memory),
            # or the frozen copy loaded beside fully trained weights
            frozen = contextlib.nullcontext(reference) if reference is not None else model.reference(
                accelerator.unwrap_model(transformer))
            with frozen as base, torch.no_grad(), accelerator.autocast():
                v_ref = model.velocity(x, sigma, emb, settings["guidance"], transformer=base)
            ref = formulas.stochastic_step(settings["sampler"], x, v_ref, sigma, sigma_next, settings["noise_level"],
                                           settings["sigma_1"], sample=x_next)
            kl = formulas.kl_to_reference(step.mean, ref.mean, step.noise_scale if cfg.kl == "release" else step.std)
    w = b.weight.to(device)
    loss = (w * (policy + cfg.beta * kl)).sum()
    with torch.no_grad():
        d = (step.log_prob - old).double()
        counted = w > 0
        stats = torch.stack([
            loss.double().detach(), (w * policy).sum().double(), (w * kl).sum().double(), (w * ratio).sum().double(),
            (w * ((ratio - 1).abs() > cfg.clip_range)).sum().double(), (w * 0.5 * d**2).sum().double(),
            ratio[counted].min().double(), ratio[counted].max().double(), w.sum().double(),
        ])
    return loss, stats


def _metrics_line(step: int, sums: torch.Tensor, n: int, grad_norm: float, cfg: TrainConfig, finite: bool, secs: float) -> dict:
    """Loss terms averaged over the step's n counted transitions (what the gradient is of); ratio
    statistics over those that were computed (c; all of them unless some had nothing to learn)."""
    s = sums.tolist()
    c = max(s[8], 1.0)
    return {"step": step, "loss": s[0] / n, "policy_loss": s[1] / n, "kl_loss": s[2] / n, "ratio_mean": s[3] / c,
            "clipfrac": s[4] / c, "approx_kl": s[5] / c, "grad_norm": grad_norm, "lr": cfg.learning_rate,
            "samples": n, "finite": bool(finite), "seconds": round(secs, 3)}


def _load_ema(state_in: Path | None, transformer) -> dict:
    from safetensors.torch import load_file

    path = state_in / "ema.safetensors" if state_in else None
    if path and path.is_file():
        return load_file(path)
    return {k: v.detach().float().clone() for k, v in lora_state(transformer).items()}


def ema_decay(decay: float, step: int) -> float:
    """The release's EMA decay after `step` optimizer steps (counted from 1): a warm-up
    min((1 + step) / (10 + step), decay), so early updates follow the weights closely."""
    return min((1 + step) / (10 + step), decay)


@torch.no_grad()
def _update_ema(ema: dict, transformer, decay: float) -> None:
    for k, v in lora_state(transformer).items():
        ema[k].mul_(decay).add_(v.detach().float().cpu(), alpha=1 - decay)


def _save_state(folder: Path, moments: dict, kind: str, ema: dict | None, global_step: int) -> None:
    """Optimizer state (`optimizer.state_dict()`: torch.save of plain tensors, read back with
    weights_only=True) and its kind, EMA, step."""
    import io

    from safetensors.torch import save

    buf = io.BytesIO()
    torch.save(moments, buf)
    layout.atomic_write(folder / "optimizer.pt", buf.getvalue())
    if ema is not None:
        layout.atomic_write(folder / "ema.safetensors", save({k: v.contiguous() for k, v in ema.items()}))
    layout.atomic_write_json(folder / "trainer.json", {"global_step": global_step, "optimizer": kind})


# ---- mid-round checkpoints: a killed train resumes after its last finished optimizer step -----


def _write_checkpoint(folder: Path, trained: dict, moments: dict, kind: str, ema: dict | None, progress: dict) -> None:
    """Trained weights (`_trained_state`), optimizer state, EMA and progress, swapped in as a whole
    folder (never half-written)."""
    from safetensors.torch import save

    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in trained.items()}
    layout.atomic_write(tmp / "weights.safetensors", save(state))
    _save_state(tmp, moments, kind, ema, progress["global_step"])
    layout.atomic_write_json(tmp / "progress.json", progress)
    old = folder.with_name(f".{folder.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def _read_checkpoint(out: Path) -> dict | None:
    path = out / CHECKPOINT / "progress.json"
    if not path.is_file():
        old = out / f".{CHECKPOINT}.old" / "progress.json"  # killed between the two renames
        if not old.is_file():
            return None
        os.replace(old.parent, out / CHECKPOINT)
    return json.loads((out / CHECKPOINT / "progress.json").read_text())


def _checkpoint_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The trained weights a checkpoint holds (`_write_checkpoint`)."""
    from safetensors.torch import load_file

    weights = folder / "weights.safetensors"
    if not weights.is_file():
        weights = folder / "lora.safetensors"  # the name before full fine-tuning existed
    return load_file(weights)
