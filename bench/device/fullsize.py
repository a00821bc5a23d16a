"""Full-size cost of a TP-GRPO round, per stage and per trajectory, on the GPU you have: SD3.5-Medium,
SD3.5-Large, FLUX.1-dev and Qwen-Image transformers (and their VAE) built from their published configs with
random weights (nothing downloaded), at the settings of their recipes (`pipelines/sd35m-tpgrpo-pickscore.toml`,
`sd35l-...`, `flux-...`, `qwen-image-...`: resolution, steps, window, CFG, batch sizes, LoRA rank and targets).

    python bench/device/fullsize.py [--models sd35m sd35l flux qwen] [--out bench/device]  # on a GPU (bf16)
    python bench/device/fullsize.py --reduced --resolution 64 --batch-cap 2 --out /tmp/x  # the code path on CPU

For each model, through tpkit's own code (the family's `velocity`, `base.add_trainable_lora`,
`base.make_fully_trainable`, `formulas.stochastic_step` / `clipped_policy_loss` / `kl_to_reference`):
  - rollout: T velocity calls at the rollout's batch (seconds per trajectory, peak memory);
  - score: one velocity call at the score's batch, times TP-GRPO's branch calls per trajectory
    (`formulas.branch_calls`) and Flow-GRPO's (the final branch only); VAE decode at its batch;
  - train: one micro-batch (the rollout's batch, as train replays it) forward + backward with the KL
    reference and an AdamW step, for LoRA and full fine-tuning, gradient checkpointing on and off
    (seconds per transition, peak memory; an out-of-memory is recorded as such, not a crash);
  - the transformer forward's FLOPs (torch's FlopCounterMode), achieved TFLOP/s and share of the chip's
    dense bf16 peak;
  - seconds per trajectory of a TP-GRPO and a Flow-GRPO round, and their ratio.
Writes results.json and RESULTS.md to --out. `--reduced` keeps every model's depth but shrinks its
width (2 heads of 16), so the tests run this exact code on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tpkit import formulas, memory, models, runtime  # noqa: E402
from tpkit.config import load_recipe, lora_targets  # noqa: E402
from tpkit.models import base, flux, qwen_image, sd3  # noqa: E402

MODELS = {  # name -> (family class, hub id whose published configs are built, recipe)
    "sd35m": (sd3.SD3, "stabilityai/stable-diffusion-3.5-medium", "sd35m-tpgrpo-pickscore.toml"),
    "sd35l": (sd3.SD3, "stabilityai/stable-diffusion-3.5-large", "sd35l-tpgrpo-pickscore.toml"),
    "flux": (flux.Flux, "black-forest-labs/FLUX.1-dev", "flux-tpgrpo-pickscore.toml"),
    "qwen": (qwen_image.QwenImage, "Qwen/Qwen-Image", "qwen-image-tpgrpo-pickscore.toml"),
}
REDUCED_VAE = {"AutoencoderKL": dict(block_out_channels=[16, 16, 16, 16], norm_num_groups=4),  # --reduced: by VAE class
               "AutoencoderKLQwenImage": dict(base_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)}
DENSE_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense (no sparsity) bf16 peaks


def reduced(cfg: dict) -> dict:
    """Full depth, 2 heads of 16 and narrow inputs: the same code at a width a CPU runs in seconds."""
    small = dict(cfg, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=64)
    if "pooled_projection_dim" in cfg:
        small["pooled_projection_dim"] = 32
    if "caption_projection_dim" in cfg:
        small.update(caption_projection_dim=32, sample_size=32, pos_embed_max_size=64)
    if "axes_dims_rope" in cfg:
        small["axes_dims_rope"] = [4, 6, 6]
    return small


def published(name: str) -> dict:
    """The model's published configs (`tpkit.models.<family>.PUBLISHED`)."""
    cls, hub_id, _ = MODELS[name]
    return models.family(cls.FAMILY).PUBLISHED[hub_id]


def architecture(name: str, args) -> memory.Architecture:
    """The model's published configs, at reduced width with --reduced (the VAE too)."""
    cfg = published(name)["transformer"]
    vae = dict(published(name)["vae"], **(REDUCED_VAE[MODELS[name][0].VAE] if args.reduced else {}))
    return memory.Architecture(MODELS[name][0].FAMILY, reduced(cfg) if args.reduced else cfg, vae, 0, "benchmark")


def build(name: str, args, device: torch.device, dtype: torch.dtype):
    """The family's `Model` around a random transformer and VAE (no text encoders: embeddings are random)."""
    arch = architecture(name, args)
    torch.manual_seed(0)
    with torch.device(device):
        return memory.build_model(arch, dtype, device), arch.transformer


def embeddings(model, cfg: dict, batch: int, text_length: int, device, dtype) -> dict:
    """Random prompt embeddings of the shapes the family's `encode` returns."""
    return memory.embeddings(model, cfg, batch, text_length, dtype, device=device, fill=torch.randn)


class Meter:
    """Seconds and peak accelerator memory of a block (CUDA: synchronised, peak since the block began)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    @contextlib.contextmanager
    def __call__(self, out: dict, key: str):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        out[f"{key}_s"] = time.perf_counter() - t0
        out[f"{key}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None


def oom_safe(fn, out: dict, key: str) -> None:
    """Run fn; an out-of-memory is a result ("oom"), not the end of the benchmark."""
    try:
        fn()
    except torch.OutOfMemoryError as e:
        out[f"{key}_s"], out[f"{key}_peak_gib"] = "oom", str(e).splitlines()[0][:120]
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def velocity_flops(model, cfg, recipe, resolution: int, device, dtype) -> float:
    """FLOPs of one velocity call for one sample (a CFG pair counts as its two forwards)."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(1, *model.latent_shape(resolution), device=device)
    emb = embeddings(model, cfg, 1, recipe.rollout.max_sequence_length or 128, device, dtype)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model.velocity(x, torch.full((1,), 0.5, device=device), emb, recipe.rollout.guidance)
    return float(fc.get_total_flops())


def bench_model(name: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    recipe = load_recipe(ROOT / "pipelines" / MODELS[name][2])
    ro, sc, tr = recipe.rollout, recipe.score, recipe.train
    res = args.resolution or ro.resolution
    cap = lambda b: min(b, args.batch_cap) if args.batch_cap else b  # noqa: E731
    T, K, text_length, guidance = ro.steps, ro.window_size, ro.max_sequence_length or 128, ro.guidance
    model, cfg = build(name, args, device, dtype)
    meter = Meter(device)
    out: dict = {"model": name, "recipe": MODELS[name][2], "resolution": res, "steps": T, "window": K,
                 "transformer_params": sum(p.numel() for p in model.transformer.parameters()),
                 "forwards_per_call": model.forwards(guidance)}
    sigma = lambda b, s=0.5: torch.full((b,), s, device=device)  # noqa: E731

    # 1. Rollout: T velocity calls for a batch of trajectories.
    B = cap(ro.batch_size)
    x, emb = torch.randn(B, *model.latent_shape(res), device=device), embeddings(model, cfg, B, text_length, device, dtype)
    with torch.no_grad():
        model.velocity(x, sigma(B), emb, guidance)  # warm-up (kernels, allocator)
        with meter(out, "rollout_batch"):
            for _ in range(T):
                model.velocity(x, sigma(B), emb, guidance)
    out["rollout_s_per_trajectory"] = out["rollout_batch_s"] / B

    # 2. Score: TP-GRPO's branch calls (every window state's ODE completion) and Flow-GRPO's (the last), decode.
    S = cap(sc.batch_size)
    xs, es = torch.randn(S, *model.latent_shape(res), device=device), embeddings(model, cfg, S, text_length, device, dtype)
    with torch.no_grad(), meter(out, "score_call"):
        model.velocity(xs, sigma(S), es, guidance)
    out["score_s_per_sample_call"] = per_call = out["score_call_s"] / S
    start = ro.window_range[0]
    out["branch_calls_tp"] = formulas.branch_calls(T, start, K, sc.branch_steps, sc.branch_solver)
    out["branch_calls_flow"] = max(0, T - start - K)  # the final branch's completion from s_K
    D = cap(sc.decode_batch_size)
    with meter(out, "decode_batch"):
        model.decode(torch.randn(D, *model.latent_shape(res), device=device))
    out["decode_s_per_image"] = out["decode_batch_s"] / D

    # 3. Train: one replayed micro-batch, forward + backward with the KL reference, and an AdamW step.
    M = cap(tr.micro_batch_size or ro.batch_size)
    xm, em = torch.randn(M, *model.latent_shape(res), device=device), embeddings(model, cfg, M, text_length, device, dtype)
    targets = lora_targets(tr.lora_targets, model.FAMILY)
    for finetune in ("lora", "full"):
        for gc in (True, False):
            key = f"train_{finetune}{'_gc' if gc else ''}"
            oom_safe(lambda: train_step(model, cfg, finetune, gc, targets, tr, ro, xm, em, sigma(M), meter, out, key,
                                        lambda: build(name, args, device, dtype)[0].transformer), out, key)
            if isinstance(out.get(f"{key}_s"), float):
                out[f"{key}_s_per_transition"] = out[f"{key}_s"] / M
            model = None  # freed before the next variant's fresh, frozen transformer is built
            gc_collect()
            model, cfg = build(name, args, device, dtype)

    # 4. FLOPs of a forward and what the chip achieved in the rollout.
    flops = velocity_flops(model, cfg, recipe, res, device, dtype)
    out["tflop_per_call"] = flops / 1e12
    out["achieved_tflops"] = flops * T * B / out["rollout_batch_s"] / 1e12
    chip = next((k for k in DENSE_BF16_TFLOPS if device.type == "cuda" and k in torch.cuda.get_device_name()), None)
    out["share_of_bf16_peak"] = out["achieved_tflops"] / DENSE_BF16_TFLOPS[chip] if chip else None

    # 5. What `tpkit doctor` estimates for each measured peak (the same settings, traced on the meta device).
    out.update(estimates(name, args, recipe, dtype, B=B, S=S, D=D, M=M, resolution=res, text_length=text_length))

    # 6. A round per trajectory: rollout + branches + decode of every scored branch + K trained transitions.
    train_s = out.get("train_lora_gc_s_per_transition")
    if isinstance(train_s, float):
        for method, calls, images in (("tp", out["branch_calls_tp"], K + 1), ("flow", out["branch_calls_flow"], 1)):
            out[f"round_s_per_trajectory_{method}"] = (out["rollout_s_per_trajectory"] + calls * per_call
                                                        + images * out["decode_s_per_image"] + K * train_s)
        out["round_ratio_tp_over_flow"] = out["round_s_per_trajectory_tp"] / out["round_s_per_trajectory_flow"]
    return out


def gc_collect() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def estimates(name: str, args, recipe, dtype, B: int, S: int, D: int, M: int, resolution: int,
              text_length: int) -> dict:
    """tpkit.memory's estimate (GiB) of each peak measured above: the weights this benchmark holds
    (transformer, VAE; no text encoders) plus the traced activations, at the same batch sizes."""
    import dataclasses

    arch = architecture(name, args)
    b = torch.empty((), dtype=dtype).element_size()
    guidance = recipe.rollout.guidance
    out = {}
    with torch.device("meta"), memory.flash_attention():
        model = memory.build_model(arch, dtype)
        P = sum(p.numel() for p in model.transformer.parameters())
        vae = sum(p.numel() for p in model.pipe.vae.parameters()) * b
        act = lambda batch, **kw: memory.velocity_peak(model, arch, batch, resolution, text_length, guidance, **kw)  # noqa: E731
        out["rollout_batch_estimate_gib"] = (P * b + vae + act(B)) / memory.GiB
        out["score_call_estimate_gib"] = (P * b + vae + act(S)) / memory.GiB
        out["decode_batch_estimate_gib"] = (P * b + vae + memory.decode_peak(model, D, resolution)) / memory.GiB
        for finetune in ("lora", "full"):
            for gc in (True, False):
                model = memory.build_model(arch, dtype)
                train = dataclasses.replace(recipe.train, finetune=finetune, gradient_checkpointing=gc, micro_batch_size=M,
                                            mixed_precision="bf16" if dtype == torch.bfloat16 else "no")
                est = memory.train_memory(model, arch, dataclasses.replace(recipe, train=train), act, P, b)
                out[f"train_{finetune}{'_gc' if gc else ''}_estimate_gib"] = (est.total + vae) / memory.GiB
    return out


def train_step(model, cfg, finetune: str, gc: bool, targets, tr, ro, x, emb, sigma, meter, out: dict, key: str,
               frozen_copy) -> None:
    """One measured optimizer step (after a warm-up step) of `finetune` on `model`'s transformer;
    frozen_copy() builds the reference that full fine-tuning keeps beside the trained weights."""
    t = model.transformer
    device = x.device
    reference = None
    if finetune == "lora":
        base.add_trainable_lora(t, tr.lora_rank, tr.lora_alpha, targets)
    else:
        reference = frozen_copy()
        base.make_fully_trainable(t)
    idle = set(model.idle_parameters(t))  # frozen, as train freezes them
    for n, p in t.named_parameters():
        if n in idle:
            p.requires_grad_(False)
    if gc:
        t.enable_gradient_checkpointing()
    params = [p for p in t.parameters() if p.requires_grad]
    out[f"{key}_trained_params"] = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-6)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    x_next = x + 0.01 * torch.randn_like(x)
    sigma_next = sigma - 0.1

    def step():
        with autocast:
            v = model.velocity(x, sigma, emb, ro.guidance, transformer=t)
        s = formulas.stochastic_step(ro.sampler, x, v, sigma, sigma_next, ro.noise_level, 1.0, sample=x_next)
        policy, _ = formulas.clipped_policy_loss(s.log_prob, s.log_prob.detach(), torch.ones_like(s.log_prob),
                                                 tr.clip_range, tr.adv_clip)
        frozen = contextlib.nullcontext(reference) if reference is not None else model.reference(t)
        with frozen as ref, torch.no_grad(), autocast:
            v_ref = model.velocity(x, sigma, emb, ro.guidance, transformer=ref)
        r = formulas.stochastic_step(ro.sampler, x, v_ref, sigma, sigma_next, ro.noise_level, 1.0, sample=x_next)
        loss = (policy + tr.beta * formulas.kl_to_reference(s.mean, r.mean, s.noise_scale)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: AdamW's moments are allocated here, so the measured step holds them as training does
    with meter(out, key):
        step()


def markdown(results: list[dict], device: str) -> str:
    def f(v, nd=2):
        return "n/a" if v is None else v if isinstance(v, str) else f"{v:.{nd}f}" if isinstance(v, float) else str(v)

    L = [f"# Full-size benchmark ({device})", "",
         "Regenerated by `bench/device/fullsize.sh` (random weights from the published configs, recipe settings).", "",
         "| model | params | rollout s/traj | score call s/sample | TP / Flow branch calls | decode s/img | "
         "train LoRA+GC s/transition (peak GiB; doctor's estimate) | LoRA no GC | full+GC | full no GC | TFLOP/call | TFLOP/s (share of peak) | "
         "TP/Flow s per trajectory |", "|" + " --- |" * 13]
    for r in results:
        def train(key):
            s = r.get(f"{key}_s_per_transition", r.get(f"{key}_s"))
            est = f(r.get(f"{key}_estimate_gib"), 1)
            return f"{f(s, 3)} ({f(r.get(f'{key}_peak_gib'), 1)}; est. {est})" if s != "oom" else f"OOM (est. {est})"
        L.append(f"| {r['model']} | {r['transformer_params'] / 1e6:,.0f} M | {f(r['rollout_s_per_trajectory'], 3)} "
                 f"({f(r['rollout_batch_peak_gib'], 1)} GiB; est. {f(r['rollout_batch_estimate_gib'], 1)}) | {f(r['score_s_per_sample_call'], 3)} | "
                 f"{r['branch_calls_tp']} / {r['branch_calls_flow']} | {f(r['decode_s_per_image'], 3)} | "
                 f"{train('train_lora_gc')} | {train('train_lora')} | {train('train_full_gc')} | {train('train_full')} | "
                 f"{f(r['tflop_per_call'], 3)} | {f(r['achieved_tflops'], 1)} ({f(r['share_of_bf16_peak'], 2)}) | "
                 f"{f(r.get('round_s_per_trajectory_tp'), 2)} / {f(r.get('round_s_per_trajectory_flow'), 2)} "
                 f"= {f(r.get('round_ratio_tp_over_flow'), 2)} |")
    return "\n".join(L) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "device")
    p.add_argument("--reduced", action="store_true", help="full depth, 2 heads of 16 (the CPU test of this code)")
    p.add_argument("--resolution", type=int, default=0, help="override the recipes' (0: theirs)")
    p.add_argument("--batch-cap", type=int, default=0, help="cap every batch size (0: the recipes')")
    args = p.parse_args(argv)
    runtime.quiet_libraries()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    results = []
    args.out.mkdir(parents=True, exist_ok=True)
    for m in args.models:  # written after each model: a run stopped at its time limit keeps what it measured
        print(f"{m} ...", flush=True)
        results.append(bench_model(m, args, device, dtype))
        print(json.dumps(results[-1]), flush=True)
        if not all(math.isfinite(v) for v in results[-1].values() if isinstance(v, float)):
            sys.exit(f"{m}: a non-finite measurement")
        (args.out / "results.json").write_text(json.dumps({"device": name, "reduced": args.reduced, "results": results},
                                                          indent=1))
        (args.out / "RESULTS.md").write_text(markdown(results, name + (" (reduced width)" if args.reduced else "")))
    print(markdown(results, name))


if __name__ == "__main__":
    main()
