"""Stage 1, `tpkit rollout`: SDE trajectories with cached window states, as WebDataset shards.

For every prompt, `group_size` members are sampled with T steps, of which the K steps of the
window [a, a + K) are stochastic (SDE or CPS) and the rest ODE. Stored per trajectory: the
window states s_0..s_K, the K log-probs, the CFG velocity at s_0..s_{K-1} (so score can skip
those calls), the final latent and its decoded image, and every setting needed to reproduce it.
Prompt embeddings are stored once per prompt, so score and train never load text encoders.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tpkit import formulas, layout, memory, models, runtime
from tpkit.config import RolloutConfig, to_dict
from tpkit.errors import InputError
from tpkit.layout import Prompt, PromptRecord, ShardWriter, TrajectoryRecord
from tpkit.models import base as model_base
from tpkit.runtime import png_bytes
from tpkit.timing import Phases
from tpkit.ui import console, track


def derive_seed(*parts) -> int:
    """A 63-bit seed from any parts (base seed, prompt id, member ...), stable across machines."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def plan_shards(prompts: list[Prompt], per_shard: int) -> list[list[Prompt]]:
    """Shard i holds prompts [i * per_shard, (i + 1) * per_shard): groups never split."""
    return [prompts[i: i + per_shard] for i in range(0, len(prompts), per_shard)]


def choose_prompts(prompts: list[Prompt], cfg: RolloutConfig) -> list[Prompt]:
    """Every prompt, or a random subset of prompts_per_round drawn from the seed (file order kept)."""
    n = cfg.prompts_per_round
    if not n or n >= len(prompts):
        return prompts
    keys = sorted(range(len(prompts)), key=lambda i: derive_seed(cfg.seed, "prompts", prompts[i].prompt_id))
    return [prompts[i] for i in sorted(keys[:n])]


def draw_window_start(cfg: RolloutConfig) -> int:
    """One window start a for the whole rollout (one batch), drawn from the base seed."""
    u = derive_seed(cfg.seed, "window") / 2**63
    return formulas.window_start(cfg.window_range[0], cfg.window_range[1], cfg.window_size, u)


@dataclass
class Sampled:
    states: torch.Tensor  # [B, K+1, C, h, w]  s_0..s_K
    velocities: torch.Tensor  # [B, K, C, h, w]  v(s_0)..v(s_{K-1})
    log_probs: torch.Tensor  # [B, K]
    final: torch.Tensor  # [B, C, h, w]  x_T


def sample(model, cfg: RolloutConfig, sigmas: list[float], start: int, embeds: dict, seeds: list[int]) -> Sampled:
    """Sample B trajectories; each draws its initial noise and every eps from its own seed."""
    shape = model.latent_shape(cfg.resolution)
    gens = [torch.Generator().manual_seed(s) for s in seeds]

    def noise() -> torch.Tensor:  # drawn on CPU: the same numbers on every device
        return torch.stack([torch.randn(shape, generator=g) for g in gens]).to(model.device)

    x = noise()
    B, K = len(seeds), cfg.window_size
    states, vels, lps = [], [], []
    with torch.no_grad():
        for j in range(cfg.steps):
            sig = torch.full((B,), sigmas[j])
            v = model.velocity(x, sig, embeds, cfg.guidance)
            if start <= j < start + K:
                if j == start:
                    states.append(x)
                step = formulas.stochastic_step(cfg.sampler, x, v, sigmas[j], sigmas[j + 1], cfg.noise_level,
                                                sigmas[1], noise=noise())
                x = step.sample
                states.append(x)
                vels.append(v)
                lps.append(step.log_prob)
            else:
                x = formulas.ode_step(x, v, sigmas[j], sigmas[j + 1])
    return Sampled(torch.stack(states, 1).cpu(), torch.stack(vels, 1).cpu(), torch.stack(lps, 1).cpu(), x.cpu())


def trajectory_meta(cfg: RolloutConfig, prompt: Prompt, member: int, seed: int, start: int, sigmas: list[float],
                    batch: str, slot: int) -> dict:
    """Everything needed to reproduce (and train on) one trajectory. `batch`/`slot` record which
    transformer batch it was sampled in: train replays the same batches, so that its first
    log-probs match the stored ones bit for bit (matmuls are not batch-invariant)."""
    return {
        "rollout_batch": batch, "batch_slot": slot,
        "trajectory_id": f"{prompt.prompt_id}-m{member:03d}", "prompt_id": prompt.prompt_id, "prompt": prompt.prompt,
        "prompt_metadata": prompt.metadata, "member": member, "seed": seed, "base_seed": cfg.seed,
        "model": cfg.model, "family": cfg.family, "lora": cfg.lora, "sampler": cfg.sampler, "noise_level": cfg.noise_level,
        "guidance": cfg.guidance, "steps": cfg.steps, "window_start": start, "window_size": cfg.window_size,
        "sigmas": sigmas, "resolution": cfg.resolution, "schema_version": layout.SCHEMA_VERSION,
    }


def encode_shard(model, cfg: RolloutConfig, prompts: list[Prompt]) -> tuple[dict[str, torch.Tensor], float]:
    """A shard's prompt embeddings (one text-encoder batch per shard, as always: the stored embeddings do
    not depend on which shards a rerun still has to do), kept on the CPU; and the seconds it took."""
    phases = Phases(model.device)
    with phases("encode"):
        emb = {k: e.cpu() for k, e in model.encode([p.prompt for p in prompts], cfg.max_sequence_length).items()}
    return emb, phases.seconds["encode"]


def write_shard(model, cfg: RolloutConfig, prompts: list[Prompt], sigmas: list[float], start: int, path: Path,
                shard: int, encoded: tuple[dict[str, torch.Tensor], float], advance=lambda n: None) -> None:
    """Sample every member of these prompts and write them as one shard (with its stats sidecar);
    `encoded`: `encode_shard`'s embeddings and seconds."""
    phases = Phases(model.device)
    phases.seconds["encode"] = encoded[1]
    emb = {k: e.to(model.device) for k, e in encoded[0].items()}
    writer = ShardWriter()
    for i, p in enumerate(prompts):
        writer.add_prompt(PromptRecord(p.prompt_id, p.prompt, p.metadata, {k: e[i: i + 1] for k, e in emb.items()}))
    jobs = [(i, p, m) for i, p in enumerate(prompts) for m in range(cfg.group_size)]
    for b in range(0, len(jobs), cfg.batch_size):
        batch = jobs[b: b + cfg.batch_size]
        seeds = [derive_seed(cfg.seed, p.prompt_id, m) for _, p, m in batch]
        idx = torch.tensor([i for i, _, _ in batch], device=emb["prompt_embeds"].device)
        with phases("sample"):
            out = sample(model, cfg, sigmas, start, {k: e[idx] for k, e in emb.items()}, seeds)
        with phases("decode"):
            images = model.decode(out.final)
        with phases("write"):  # PNG encoding and the shard's bytes
            for n, (_, p, m) in enumerate(batch):
                tensors = {"states": out.states[n], "velocities": out.velocities[n], "log_probs": out.log_probs[n],
                           "final_latent": out.final[n]}
                meta = trajectory_meta(cfg, p, m, seeds[n], start, sigmas, f"{shard:05d}-{b // cfg.batch_size:04d}", n)
                writer.add_trajectory(TrajectoryRecord(meta, tensors, png_bytes(images[n])))
        advance(len(batch))
    with phases("write"):
        data = writer.to_bytes()
    layout.write_output(path, data, {
        "counts": {"prompts": len(prompts), "trajectories": len(jobs), "transformer_calls": len(jobs) * cfg.steps,
                   "decodes": len(jobs)},
        "seconds": phases.seconds, "sha256": hashlib.sha256(data).hexdigest(),
    })


def run(cfg: RolloutConfig) -> dict | None:
    """Run (or finish) a rollout. Returns the manifest once every shard exists, else None."""
    cfg.validate()
    prompts = choose_prompts(layout.load_prompts(Path(cfg.prompts)), cfg)  # checked before --overwrite clears anything
    ident = identity(cfg)
    with layout.stage_lock(Path(cfg.out), cfg.rank, cfg.overwrite, cfg.world_size, ident,
                           inputs=(cfg.prompts, cfg.lora)):
        return _run(cfg, ident, prompts)


def _run(cfg: RolloutConfig, ident: dict, prompts: list[Prompt]) -> dict | None:
    # 1. Plan the work: shards of whole prompt groups, this rank's share.
    out = Path(cfg.out)
    shards = plan_shards(prompts, cfg.prompts_per_shard)
    start = draw_window_start(cfg)

    def existing(i: int) -> list[Path]:
        return list(out.glob(f"shard-r*-{i:05d}.tar"))

    todo = [i for i in range(len(shards)) if i % cfg.world_size == cfg.rank and not existing(i)]

    # 2. Load the model with its text encoders (and the policy's LoRA, from the previous round); encode
    #    every prompt this rank samples, then let the text encoders go: sampling never needs them, and
    #    on SD3.5 they are more than half of the weights (T5-XXL).
    if todo:
        model = models.load(cfg.model, cfg.family, device=cfg.device, dtype=cfg.dtype, text_encoders=True, lora=cfg.lora,
                            reuse=True)
        sigmas = model.sigmas(cfg.steps, cfg.resolution)
        encoded = {i: encode_shard(model, cfg, shards[i]) for i in todo}
        model_base.drop_text_encoders(model)

        # 3. Sample and write each shard (atomically: a crash leaves whole shards only).
        with track(sum(len(shards[i]) for i in todo) * cfg.group_size, "rollout") as advance, \
                runtime.memory_options("rollout", ("rollout.batch_size", cfg.batch_size), fits=lambda key, value: memory.suggest_batch(
                    model, "velocity", value, cfg.resolution, cfg.max_sequence_length, cfg.guidance)):
            for i in todo:
                path = out / layout.shard_name(cfg.rank, i)
                write_shard(model, cfg, shards[i], sigmas, start, path, i, encoded.pop(i), advance)

    # 4. The last rank to finish writes the manifest, summing every shard's stats.
    done = [existing(i) for i in range(len(shards))]
    if not all(done):
        return None
    files = [d[0] for d in done]
    sha256 = {f.name: _shard_sha256(f) for f in files}
    if (out / layout.PRUNED).is_file():  # shards `tpkit run` had deleted, written again: are they the same bytes?
        _check_rewritten(out, sha256)
    stats = layout.sum_stats(files)
    meta0 = layout.read_shard(files[0], load_tensors=False)[1][0].meta
    return layout.write_manifest(
        out, "rollout", to_dict(cfg), identity=ident, rollout_id=ident["id"],
        inputs={"prompts": str(cfg.prompts), "prompts_sha256": ident["inputs"]["prompts_sha256"], "model": cfg.model,
                "lora": cfg.lora, "lora_sha256": ident["inputs"]["lora_sha256"]},
        shard_sha256=sha256,
        counts={"shards": len(files), **stats.get("counts", {})},
        seconds=stats.get("seconds", {}), window_start=start, sigmas=meta0["sigmas"],
        shards=[f.name for f in files],
    )


def _check_rewritten(out: Path, sha256: dict[str, str]) -> None:
    """Later stages of the round were computed on the deleted shards: say so if the new ones differ."""
    old = json.loads((out / layout.MANIFEST).read_text()).get("shard_sha256", {})
    differ = sorted(n for n in sha256 if old.get(n) != sha256[n])
    if differ:
        console.print(f"[yellow]warning: {len(differ)} of {len(sha256)} rewritten shards differ from the deleted ones "
                      f"(other kernels or hardware?), e.g. {differ[0]}: this round's scores, advantages and training "
                      "were computed on the deleted ones[/]")
    else:
        console.print(f"{out}: the deleted shards are written again, byte for byte")


def identity(cfg: RolloutConfig) -> dict:
    """What a rollout folder holds (its `id` is the rollout_id that later stages carry forward, so
    train can refuse another rollout's advantages): the settings, the resolved family, the prompts', the
    policy LoRA's and a local model folder's contents, not where they are, where the output goes or how
    many processes write it. (The family is an input, not an option: folders written before it was
    recorded are then still accepted as finished, `layout._mismatch`.)"""
    return layout.stage_identity("rollout", to_dict(cfg), leave_out=("prompts", "lora", "family"), inputs={
        "prompts_sha256": layout.file_digest(Path(cfg.prompts)) if Path(cfg.prompts).is_file() else None,
        "lora_sha256": layout.tree_digest(cfg.lora, "--lora"),
        "model_sha256": models.content_id(cfg.model), "family": cfg.family})


def _shard_sha256(shard: Path) -> str:
    """From the shard's stats sidecar (computed from the bytes as they were written), else from the file."""
    side = shard.with_name(layout.stats_name(shard))
    try:
        return json.loads(side.read_text())["sha256"]
    except (OSError, KeyError, json.JSONDecodeError):
        return layout.file_digest(shard)


def sampling_lora(manifest: dict, rollout_dir: Path) -> str | None:
    """The policy LoRA a rollout was sampled with, for the stages that must run that same policy again
    (score's branch completions, `tpkit trajectory`): the recorded path, or, when the run folder has
    moved since, the same place relative to the rollout folder; its contents must still be the
    recorded ones (an adapter retrained after the rollout would complete the branches with another policy)."""
    rc = manifest["config"]
    if not rc.get("lora"):
        return None
    recorded = Path(rc["lora"])
    path = recorded
    if not recorded.exists() and rc.get("out"):
        moved = Path(rollout_dir) / os.path.relpath(recorded, rc["out"])
        path = moved if moved.exists() else recorded
    if not path.exists():
        raise InputError(f"{rollout_dir} was sampled with the LoRA {recorded}, which is gone",
                         "put that adapter back (or rerun the rollout with the adapter you have)")
    if layout.tree_digest(path) != manifest["inputs"].get("lora_sha256"):
        raise InputError(f"{path} is no longer the LoRA {rollout_dir} was sampled with (it changed since)",
                         "rerun the rollout with it (the scores must come from the policy that sampled)")
    return str(path)
