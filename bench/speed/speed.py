"""Benchmark: tpkit's speed and memory against the reference approach, side by side in one run.

On one model (tiny-sd3, built locally) and one rollout, in one process (memory: one fresh
subprocess per variant), after a warm-up that takes the one-off costs (building tiny-sd3, first
imports, first kernels); every setting comes from one recipe (pipelines/tiny-cpu.toml):

  (a) score stage: tpkit's batched branches (`tpkit.score.run`, the recipe's batch_size 32, and
      --alt-batch 16) against a plain per-branch loop, the reference approach (each branch of each
      trajectory completed alone at batch size 1, the velocity at s_k and R_K recomputed):
      trajectories per second, the ratio, transformer calls per trajectory against the
      minimum (formulas.branch_calls);
  (b) one TP-GRPO round against one Flow-GRPO round (`tpkit.run.run`, rounds = 1, same recipe, at
      the paper's KL weight train.beta = 1e-4 as the authors' ~2.5x was; also TP-GRPO with
      score.branch_steps = 3 if tpkit has it, and both methods at the recipe's own beta, 0 in
      tiny-cpu.toml): seconds per stage, model loading apart, and the wall-clock ratio TP / Flow;
  (c) peak memory (RSS high-water mark) of score and train as tpkit runs them (no text encoders)
      against the same stage with the text encoders loaded, each in its own subprocess;
  (d) share of stage time outside model forward / backward / decode / reward (file I/O, Python);
  (e) SD3.5-Medium's published transformer (and VAE, text encoders) with random weights: built on
      the meta device for parameter counts; with --full-size on a GPU, velocity calls at 512 px in
      bf16 at the rollout's and the score's batch sizes, a LoRA train step, projected costs per
      trajectory;
  (f) if ScoreConfig has `branch_steps`: for N in (1, 2, 3, 5), how well the cheap R_k preserve the
      exact ones (Spearman of step rewards, turning-point agreement) against the calls saved;
  (g) on CPU: score and train with tpkit's raised glibc malloc thresholds against glibc's defaults
      (TPKIT_CPU_MALLOC=0), each run in a fresh subprocess: stage seconds and peak RSS.

The key ratios end with the floor of (b) for exact branches: the Flow round plus 45 calls and K
decodes per trajectory priced at the rollout's own cost per call (what TP / Flow would be if the
score stage spent nothing else).

Numbers vary with the machine and its load (each timing is the best of --repeats, variants
interleaved); the ratios are the point. About 4 minutes on 2 idle CPU cores.

    python bench/speed/speed.py [--prompts 2] [--group-size 8] [--repeats 3] [--quick] [--full-size] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is bench/speed/speed.py)
RECIPE = ROOT / "pipelines" / "tiny-cpu.toml"
out = Console()
if not out.is_terminal:  # redirected to a file: wide enough for the tables
    out = Console(width=240)

# SD3.5-Medium's published architecture (stabilityai/stable-diffusion-3.5-medium, transformer/config.json).
SD35M_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
# SD3's 16-channel VAE (vae/config.json of the same repository).
SD35M_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2,
    norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
    use_post_quant_conv=False,
)
# Text encoders of SD3.5: CLIP ViT-L/14 and OpenCLIP bigG/14 text towers with projection, T5 v1.1 XXL encoder.
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, max_position_embeddings=77, hidden_act="quick_gelu")
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              projection_dim=1280, max_position_embeddings=77, hidden_act="gelu")
T5_XXL = dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
              feed_forward_proj="gated-gelu")
TEXT_TOKENS = 77 + 256  # CLIP tokens + T5 tokens (max_sequence_length 256) in SD3's joint attention
# The same structure in miniature, for running the --full-size code on a CPU.
SD35M_SHAPE_SMALL = dict(SD35M_TRANSFORMER, sample_size=8, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                         joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=32,
                         dual_attention_layers=(0,))
SD35M_VAE_SMALL = dict(SD35M_VAE, block_out_channels=(16, 16, 16, 16), layers_per_block=1, norm_num_groups=8, sample_size=64)


# --------------------------------------------------------------------------------------------
# Time accounting: where each stage spends its time (installed by patching, tpkit unchanged)
# --------------------------------------------------------------------------------------------


class Probe:
    """Accumulates seconds in model loading, transformer forward, VAE decode, backward, optimizer
    steps and train's file I/O; `stages` logs every stage call with its wall time and the deltas."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.stages: list[dict] = []
        self._fwd_t0: float | None = None

    def add(self, key: str, seconds: float, n: int = 1) -> None:
        self.t[key] += seconds
        self.n[key] += n

    def snapshot(self) -> dict[str, float]:
        return dict(self.t)

    _cuda: bool | None = None

    def sync(self) -> None:
        """On a GPU, wait for queued kernels so that time lands where it is spent."""
        import torch

        if self._cuda is None:
            self._cuda = torch.cuda.is_available()
        if self._cuda:
            torch.cuda.synchronize()

    def timed(self, key: str, fn):
        def wrapper(*a, **kw):
            self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.sync()
                self.add(key, time.perf_counter() - t0)
        wrapper.__wrapped__ = fn
        return wrapper

    def attach(self, model) -> None:
        """Hooks on a loaded tpkit.models model: transformer forward time, decode time (once per model)."""
        if getattr(model, "_bench_probed", False):
            return
        model._bench_probed = True

        def pre(module, args):
            self.sync()
            self._fwd_t0 = time.perf_counter()

        def post(module, args, output):
            if self._fwd_t0 is not None:
                self.sync()
                self.add("forward", time.perf_counter() - self._fwd_t0)
                self._fwd_t0 = None

        model.transformer.register_forward_pre_hook(pre)
        model.transformer.register_forward_hook(post)
        model.decode = self.timed("decode", model.decode)


PROBE = Probe()


def install_probe() -> None:
    """Patch the library entry points the bench times (only in this process)."""
    import accelerate
    import accelerate.optimizer

    from tpkit import advantages, models, rollout, score, train
    from tpkit.models import base

    orig_load = models.load

    def load(*a, **kw):
        t0 = time.perf_counter()
        m = orig_load(*a, **kw)
        PROBE.add("load", time.perf_counter() - t0)
        PROBE.attach(m)
        return m

    models.load = load
    accelerate.Accelerator.backward = PROBE.timed("backward", accelerate.Accelerator.backward)
    accelerate.optimizer.AcceleratedOptimizer.step = PROBE.timed("optimizer", accelerate.optimizer.AcceleratedOptimizer.step)
    for name in ("load_micro_batches", "read_advantages", "_save_state"):
        setattr(train, name, PROBE.timed("train_io", getattr(train, name)))
    base.Model.save_lora = PROBE.timed("train_io", base.Model.save_lora)
    from tpkit import report

    report.write = PROBE.timed("report", report.write)
    for module, stage in ((rollout, "rollout"), (score, "score"), (advantages, "advantages"), (train, "train")):
        module.run = _logged(stage, module.run)


class ForeignCPU:
    """Share of the machine's CPUs that other processes used while a measurement ran: (busy ticks in
    /proc/stat - this process's own CPU time) / (wall x CPUs). Near 0 on a quiet machine."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float | None:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait, in seconds

    @staticmethod
    def _own() -> float:
        r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime

    def share(self) -> float | None:
        busy = self._busy()
        if busy is None or self.busy0 is None:
            return None
        wall = time.perf_counter() - self.t0
        return max(0.0, (busy - self.busy0) - (self._own() - self.own0)) / (wall * (os.cpu_count() or 1))


def stable(values: list[float], tol: float = 0.15) -> bool:
    """The two fastest of the repeats agree within tol: the best is not a lone outlier."""
    v = sorted(values)
    return len(v) >= 2 and v[1] <= v[0] * (1 + tol)


def repeat(kinds: list[str], run_one, key, min_reps: int, max_reps: int, budget_s: float) -> dict[str, list]:
    """Run every kind min_reps times, interleaved (order reversed every other pass), and keep going up
    to max_reps while some kind's two best runs disagree (another process took the CPUs), as long as
    the section has used less than budget_s."""
    runs: dict[str, list] = {k: [] for k in kinds}
    t0 = time.perf_counter()
    for rep in range(max(min_reps, max_reps)):
        for k in (kinds if rep % 2 == 0 else kinds[::-1]):
            runs[k].append(run_one(k, rep))
        if rep + 1 >= min_reps and (all(stable([key(r) for r in runs[k]]) for k in kinds)
                                    or time.perf_counter() - t0 > budget_s):
            break
    return runs


def _logged(stage: str, fn):
    def wrapper(*a, **kw):
        before = PROBE.snapshot()
        foreign = ForeignCPU()
        t0 = time.perf_counter()
        result = fn(*a, **kw)
        wall = time.perf_counter() - t0
        after = PROBE.snapshot()
        PROBE.stages.append({"stage": stage, "wall": wall, "manifest": result or {}, "foreign_cpu": foreign.share(),
                             **{k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}})
        return result
    return wrapper


def release_cache() -> None:
    """Drop the inference pipeline tpkit keeps between stages of one process (if this tpkit has one),
    so that no measurement inherits a model loaded by an earlier one."""
    from tpkit.models import base

    base.release()


def last_stage(stage: str) -> dict:
    return next(s for s in reversed(PROBE.stages) if s["stage"] == stage)


# --------------------------------------------------------------------------------------------
# The reference approach: every branch alone, batch size 1, no reuse of the rollout's velocity
# --------------------------------------------------------------------------------------------


def reference_score(rollout_dir: Path, rewards: list) -> dict:
    """R_0..R_K of every trajectory as the authors' code computes them: branch k from s_k completed
    alone (batch 1) from step a + k to T, the velocity at s_k recomputed, R_K decoded and scored
    again. Returns rewards by (trajectory_id, k), counts and seconds (model loading apart)."""
    import torch

    from tpkit import formulas, layout, models
    from tpkit.rewards.registry import score_images
    from tpkit.score import _pil

    manifest = layout.read_manifest(rollout_dir, "rollout")
    rc = manifest["config"]
    before = PROBE.snapshot()
    load0 = PROBE.t["load"]
    foreign = ForeignCPU()
    t0 = time.perf_counter()
    model = models.load(rc["model"], models.recorded(rc), text_encoders=False, lora=rc["lora"])
    t_load = PROBE.t["load"] - load0
    calls = decodes = reward_calls = trajectories = 0
    t_read = t_reward = 0.0
    R: dict[tuple[str, int], float] = {}
    with torch.no_grad():
        for shard in layout.list_shards(rollout_dir):
            t1 = time.perf_counter()
            prompts, trajs = layout.read_shard(shard)
            t_read += time.perf_counter() - t1
            for t in trajs:
                m = t.meta
                sig, T, a, K, w = m["sigmas"], m["steps"], m["window_start"], m["window_size"], m["guidance"]
                emb = prompts[m["prompt_id"]].embeds
                meta = prompts[m["prompt_id"]].metadata
                for k in range(K + 1):
                    x = t.tensors["states"][k: k + 1] if k < K else t.tensors["final_latent"][None]
                    for j in range(a + k, T) if k < K else ():  # R_K: the final latent, decoded again
                        v = model.velocity(x, torch.tensor([sig[j]]), emb, w)
                        x = formulas.ode_step(x, v, sig[j], sig[j + 1])
                        calls += 1
                    image = model.decode(x)[0]
                    decodes += 1
                    t1 = time.perf_counter()
                    R[(m["trajectory_id"], k)] = score_images(rewards, [_pil(image)], [m["prompt"]], [meta])["reward"][0]
                    t_reward += time.perf_counter() - t1
                    reward_calls += 1
                trajectories += 1
    wall = time.perf_counter() - t0
    return {"R": R, "trajectories": trajectories, "transformer_calls": calls, "decodes": decodes,
            "reward_calls": reward_calls, "seconds": wall - t_load, "load": t_load, "foreign_cpu": foreign.share(),
            "t_read": t_read, "t_reward": t_reward,
            "probe": {"wall": wall, **{k: v - before.get(k, 0.0) for k, v in PROBE.snapshot().items()}}}


def read_R(score_dir: Path):
    """RewardMatrix (R [N, K+1], sorted trajectory ids) of a score folder."""
    from tpkit import layout
    from tpkit.advantages import reward_matrix

    return reward_matrix(layout.read_parquet_tables(score_dir, "score"), str(score_dir), "tp-grpo")


# --------------------------------------------------------------------------------------------
# (c) peak memory, one fresh subprocess per variant
# --------------------------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def memory_child(spec_file: str) -> None:
    """Run one stage variant and print its memory as one JSON line (called in a subprocess)."""
    import gc

    spec = json.loads(Path(spec_file).read_text())
    # Import the same code in every variant (text-encoder classes included) so baselines compare.
    import torch
    import transformers  # noqa: F401
    from transformers import CLIPTextModelWithProjection, T5EncoderModel  # noqa: F401

    from tpkit import models, runtime, score, train
    from tpkit.config import ScoreConfig, TrainConfig

    runtime.quiet_libraries()
    from diffusers import StableDiffusion3Pipeline  # noqa: F401

    from tpkit import ui

    ui.console.quiet = True
    orig_load, loads, te_seen = models.load, [], []

    def load(*a, **kw):
        if spec["text_encoders"]:
            kw["text_encoders"] = True
        t0 = time.perf_counter()
        m = orig_load(*a, **kw)
        loads.append(time.perf_counter() - t0)
        te_seen.append(m.pipe.text_encoder is not None)
        return m

    models.load = load
    gc.collect()
    baseline = _rss_kib("VmRSS")
    try:  # reset the high-water mark so the peak is this stage's own (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if spec["stage"] == "score":
        score.run(ScoreConfig(**spec["config"]))
    else:
        train.run(TrainConfig(**spec["config"]))
    wall = time.perf_counter() - t0
    peak = _rss_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("MEMORY " + json.dumps({"baseline_kib": baseline, "peak_kib": peak, "ru_maxrss_kib":
                                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "hwm_reset": reset,
                                  "load_s": sum(loads), "wall_s": wall,
                                  "gpu_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
                                  "text_encoders_loaded": any(te_seen)}))


def run_memory(stage: str, text_encoders: bool, config: dict, tmp: Path, env: dict | None = None) -> dict:
    spec = tmp / f"spec-{Path(config['out']).name}.json"  # every variant writes to its own out folder
    spec.write_text(json.dumps({"stage": stage, "text_encoders": text_encoders, "config": config}))
    p = subprocess.run([sys.executable, __file__, "--memory-child", str(spec)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    line = next((x for x in p.stdout.splitlines() if x.startswith("MEMORY ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"memory subprocess {stage} (text encoders {text_encoders}) failed:\n{p.stderr[-3000:]}")
    return json.loads(line[len("MEMORY "):])


# --------------------------------------------------------------------------------------------
# (e) SD3.5-Medium with random weights
# --------------------------------------------------------------------------------------------


def full_size_params() -> dict[str, dict[str, int]]:
    """Parameter and buffer counts of SD3.5-M's transformer, VAE and text encoders, built on the meta
    device (the transformer's sin-cos position table, 384 x 384 x 1536, is a buffer in its checkpoint)."""
    import torch
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    counts = {}
    with torch.device("meta"):
        for name, build in (
            ("transformer", lambda: SD3Transformer2DModel(**SD35M_TRANSFORMER)),
            ("vae", lambda: AutoencoderKL(**SD35M_VAE)),
            ("text_encoder (CLIP-L)", lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L))),
            ("text_encoder_2 (CLIP-G)", lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G))),
            ("text_encoder_3 (T5-XXL)", lambda: T5EncoderModel(T5Config(**T5_XXL))),
        ):
            m = build()
            counts[name] = {"params": sum(p.numel() for p in m.parameters()),
                            "buffers": sum(b.numel() for b in m.buffers())}
    return counts


def full_size_gpu(device: str = "cuda", transformer_cfg: dict | None = None, vae_cfg: dict | None = None,
                  resolution: int = 512, rollout_batch: int = 8, score_batch: int = 32, text_tokens: int = TEXT_TOKENS,
                  iters: int = 5, lora_rank: int = 32) -> dict:
    """Time tpkit's own velocity/decode code (tpkit.models.sd3.SD3) on a randomly initialised transformer at
    the rollout's batch (one sigma), the score's batch (per-sample sigmas) and batch 1 (the
    reference), a VAE decode, and a LoRA train micro-batch (forward + backward, plus the KL
    reference forward with adapters off). Seconds per call; GPU peak memory."""
    import types

    import torch
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    from tpkit import runtime
    from tpkit.models import base, sd3

    runtime.quiet_libraries()
    tcfg, vcfg = transformer_cfg or SD35M_TRANSFORMER, vae_cfg or SD35M_VAE
    dev = torch.device(device)
    dtype = runtime.pick_dtype("auto", dev)
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with dev:
        transformer = SD3Transformer2DModel(**tcfg).to(device=dev, dtype=dtype).eval().requires_grad_(False)
        vae = AutoencoderKL(**vcfg).to(device=dev, dtype=dtype).eval().requires_grad_(False)
    sync()
    build_s = time.perf_counter() - t0
    model = sd3.SD3(pipe=types.SimpleNamespace(transformer=transformer, vae=vae), model="sd3.5m-random", device=dev,
                    dtype=dtype)
    c, h = tcfg["in_channels"], resolution // 8
    jd, pd = tcfg["joint_attention_dim"], tcfg["pooled_projection_dim"]

    def inputs(B):
        emb = {"prompt_embeds": torch.randn(B, text_tokens, jd, device=dev, dtype=dtype),
               "negative_prompt_embeds": torch.randn(B, text_tokens, jd, device=dev, dtype=dtype),
               "pooled_prompt_embeds": torch.randn(B, pd, device=dev, dtype=dtype),
               "negative_pooled_prompt_embeds": torch.randn(B, pd, device=dev, dtype=dtype)}
        return torch.randn(B, c, h, h, device=dev), emb

    def bench(fn, n=iters):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t0) / n

    res = {"device": str(dev), "dtype": str(dtype), "build_s": build_s, "resolution": resolution,
           "tokens": (h // tcfg["patch_size"]) ** 2 + text_tokens}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for label, B, per_sample in (("batch1", 1, False), ("rollout", rollout_batch, False),
                                     ("score", score_batch, True)):
            x, emb = inputs(B)
            sig = torch.rand(B) if per_sample else torch.full((B,), 0.7)
            res[f"velocity_{label}_s"] = bench(lambda: model.velocity(x, sig, emb, 4.5))
            res[f"velocity_{label}_batch"] = B
        res["inference_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        for label, B in (("batch1", 1), ("batch8", 8)):
            z = torch.randn(B, c, h, h, device=dev)
            res[f"decode_{label}_s"] = bench(lambda: model.decode(z), n=max(1, iters // 2))
    # Train: a LoRA on the attention projections, a micro-batch as the rollout batched it.
    base.add_trainable_lora(transformer, lora_rank, 2 * lora_rank, sd3.LORA_TARGETS)
    x, emb = inputs(rollout_batch)
    sig = torch.full((rollout_batch,), 0.7)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def train_step():
        v = model.velocity(x, sig, emb, 4.5)
        v.float().pow(2).mean().backward()
        transformer.disable_adapters()
        with torch.no_grad():
            model.velocity(x, sig, emb, 4.5)
        transformer.enable_adapters()

    res["train_microbatch_s"] = bench(train_step, n=max(1, iters // 2))
    res["train_batch"] = rollout_batch
    res["train_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return res


def print_full_size(g: dict, p: dict, title: str) -> None:
    """Table (e) of full_size_gpu's timings and their projection to one trajectory."""
    t = Table(title=title)
    for col in ("measurement", "batch", "seconds per call", "ms per sample"):
        t.add_column(col, justify="right")
    for label in ("batch1", "rollout", "score"):
        B = g[f"velocity_{label}_batch"]
        t.add_row(f"velocity (CFG pair) {label}", str(B), f"{g[f'velocity_{label}_s']:.4f}",
                  f"{1000 * g[f'velocity_{label}_s'] / B:.1f}")
    for label, B in (("batch1", 1), ("batch8", 8)):
        t.add_row(f"VAE decode {label}", str(B), f"{g[f'decode_{label}_s']:.4f}", f"{1000 * g[f'decode_{label}_s'] / B:.1f}")
    t.add_row("train micro-batch (fwd+bwd+KL ref fwd)", str(g["train_batch"]), f"{g['train_microbatch_s']:.4f}",
              f"{1000 * g['train_microbatch_s'] / g['train_batch']:.1f}")
    t.add_row("per trajectory: rollout / score tpkit / score loop / train", "",
              f"{p['rollout']:.3f} / {p['score_tpkit']:.3f} / {p['score_reference']:.3f} / {p['train']:.3f}", "")
    t.add_row("score speed-up (loop / tpkit)", "", f"{p['score_reference'] / p['score_tpkit']:.2f}x", "")
    t.add_row("round TP / Flow (rewards excluded)", "", f"{p['round_tp'] / p['round_flow']:.2f}x", "")
    if g["inference_peak_gib"] is not None:
        t.add_row("GPU peak GiB: inference / train", "", f"{g['inference_peak_gib']:.1f} / {g['train_peak_gib']:.1f}", "")
    out.print(t)


def project(res: dict, T: int = 10, K: int = 9, a: int = 0) -> dict:
    """Seconds per trajectory at full size from the timed calls (rewards left out)."""
    from tpkit import formulas

    per = lambda key: res[f"velocity_{key}_s"] / res[f"velocity_{key}_batch"]  # noqa: E731
    n_tp = formulas.branch_calls(T, a, K)
    rollout = T * per("rollout") + res["decode_batch8_s"] / 8
    score_tp = n_tp * per("score") + K * res["decode_batch8_s"] / 8
    score_ref = (n_tp + K) * res["velocity_batch1_s"] + (K + 1) * res["decode_batch1_s"]
    train = K * res["train_microbatch_s"] / res["train_batch"]
    return {"rollout": rollout, "score_tpkit": score_tp, "score_reference": score_ref, "train": train,
            "round_tp": rollout + score_tp + train, "round_flow": rollout + train,
            "round_tp_reference": rollout + score_ref + train}


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def machine() -> dict:
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    mem = next((int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), None) if Path("/proc/meminfo").exists() else None
    return {"cpus": os.cpu_count(), "cpu": cpu, "ram_mib": mem, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def fmt_pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f} %"


def fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def gib(p) -> float:
    """GiB of p bf16 weights."""
    return p * 2 / 2**30


@dataclasses.dataclass
class Bench:
    """What every part shares: the options, the recipe and its sizes, the scratch folder, and the
    results (what --json writes)."""

    args: argparse.Namespace
    recipe: object  # tpkit.config.Recipe, rounds = 1
    overrides: list[str]  # the recipe overrides of every part (the bench's prompts and group size)
    rewards: list
    tmp: Path  # scratch folder
    results: dict
    prompts: list[str]  # data/tiny-prompts.txt (the warm-up takes the first)
    n: int  # trajectories in the rollout
    T: int
    K: int
    batch: int  # (a) tpkit's score batch_size
    has_branch_steps: bool  # whether this tpkit's ScoreConfig has branch_steps
    t_start: float
    roll_dir: Path  # the rollout (a), (c), (f), (g) measure


@dataclasses.dataclass
class ScoreRuns:
    """What (a) measured that later parts use."""

    a_res: dict  # results["score"]
    best_tp: dict  # tpkit's fastest score run (its folder, manifest, probe)
    best_ref: dict  # the per-branch loop's fastest run
    m_exact: object  # RewardMatrix of tpkit's first score run (exact branches)


@dataclasses.dataclass
class Rounds:
    """What (b) measured that later parts use."""

    b_res: dict  # results["rounds"]
    best: dict  # each variant's fastest round (its stages)
    own: str  # "beta=..." of the recipe's own train.beta
    cheap: str  # the variant with score.branch_steps


@dataclasses.dataclass
class Memory:
    """What (c) measured that later parts use."""

    score_cfg: dict  # the score and train configs the subprocesses run
    train_cfg: dict
    params: dict  # full_size_params()
    size: dict  # parameters + buffers of each SD3.5-M component
    te_p: int  # parameters + buffers of SD3.5-M's text encoders
    sm: dict  # score runs by text_encoders
    tm: dict  # train runs by text_encoders


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default 2; --quick 1)")
    ap.add_argument("--group-size", type=int, default=None, help="members per prompt (default 8; --quick 4)")
    ap.add_argument("--repeats", type=int, default=None, help="timings are the best of this many (default 3; --quick 1)")
    ap.add_argument("--max-repeats", type=int, default=None,
                    help="(a), (b): repeat up to this often while the two best runs differ by > 15%% (a busy machine; "
                         "default 5, --quick 1)")
    ap.add_argument("--recipe", default=str(RECIPE), help="recipe whose settings every part uses")
    ap.add_argument("--full-size", action="store_true", help="(e): SD3.5-Medium's architecture, random weights")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, one repeat: a smoke run")
    ap.add_argument("--score-batch", type=int, default=None, help="(a) tpkit's score batch_size (default: the recipe's, 32)")
    ap.add_argument("--alt-batch", type=int, default=16, help="(a) also time tpkit at this batch_size (0: no)")
    ap.add_argument("--round-branch-steps", type=int, default=3,
                    help="(b) also times a TP-GRPO round with score.branch_steps = N, if tpkit has it (0: no)")
    ap.add_argument("--round-beta", type=float, default=1e-4,
                    help="(b) train.beta of the judged TP / Flow pair (default 1e-4, the paper's and TrainConfig's); "
                         "the recipe's own beta is timed as a second pair when it differs")
    ap.add_argument("--round-set", action="append", default=[], metavar="KEY=VALUE",
                    help="(b) extra recipe overrides for every round variant, e.g. score.batch_size=16 (repeatable)")
    ap.add_argument("--json", help="also write every number to this file")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run folders")
    ap.add_argument("--verbose", action="store_true", help="show tpkit's progress bars")
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.memory_child:
        return memory_child(args.memory_child)
    args.prompts = args.prompts or (1 if args.quick else 2)
    args.group_size = args.group_size or (4 if args.quick else 8)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.max_repeats = args.max_repeats or (1 if args.quick else 5)

    b = setup(args)
    warm_up(b)
    a = make_rollout(b)
    scored = score_batched_vs_loop(b, a)  # (a)
    rounds = tp_vs_flow_round(b)  # (b)
    rows = time_outside_model(b, scored, rounds)  # (d)
    mem = peak_memory(b, scored)  # (c)
    alloc_best = cpu_allocator(b, mem)  # (g)
    fs = full_size(b, mem, a)  # (e)
    branch_steps(b, scored)  # (f)
    key_ratios(b, scored, rounds, rows, mem, alloc_best, fs)
    if args.json:
        Path(args.json).write_text(json.dumps(b.results, indent=1, default=str))
    if not args.keep:
        shutil.rmtree(b.tmp, ignore_errors=True)


def setup(args: argparse.Namespace) -> Bench:
    """Imports, the probe, the scratch folder with the bench's prompts, the recipe; prints the machine
    and the sizes."""
    t_start = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    import torch

    from tpkit import ui
    from tpkit.config import ScoreConfig, load_recipe
    from tpkit.rewards.registry import load_rewards

    ui.console.quiet = not args.verbose
    has_branch_steps = hasattr(ScoreConfig(), "branch_steps")
    install_probe()
    tmp = Path(tempfile.mkdtemp(prefix="tpkit-speed-"))
    results: dict = {"args": vars(args), "machine": machine(), "loadavg_start": os.getloadavg()}
    prompts_file = tmp / "prompts.txt"
    base = [p for p in (ROOT / "data" / "tiny-prompts.txt").read_text().splitlines() if p.strip()]
    prompts_file.write_text("".join(f"{base[i % len(base)]}{'' if i < len(base) else f' ({i})'}\n"
                                    for i in range(args.prompts)))
    overrides = [f"rollout.prompts={prompts_file}", f"rollout.group_size={args.group_size}"]
    recipe = load_recipe(args.recipe, overrides, rounds=1)
    n = args.prompts * args.group_size
    T, K = recipe.rollout.steps, recipe.rollout.window_size
    rewards = load_rewards(recipe.score.rewards, recipe.score.reward_options)
    mach = results["machine"]
    out.print(f"machine: {mach['cpus']} CPUs ({mach['cpu']}), {mach['ram_mib']} MiB RAM, GPU {mach['gpu']}, torch "
              f"{mach['torch']} ({mach['torch_threads']} threads), Python {mach['python']}, {mach['date']}; load average "
              f"{' '.join(f'{x:.1f}' for x in results['loadavg_start'])}")
    out.print(f"[bold]tpkit speed benchmark[/]: {args.prompts} prompts x {args.group_size} = {n} trajectories, "
              f"T = {T}, K = {K}, model {recipe.rollout.model}, reward {', '.join(recipe.score.rewards)}, "
              f"{torch.get_num_threads()} torch threads, best of {args.repeats}; scratch {tmp}")
    return Bench(args=args, recipe=recipe, overrides=overrides, rewards=rewards, tmp=tmp, results=results,
                 prompts=base, n=n, T=T, K=K,
                 batch=recipe.score.batch_size if args.score_batch is None else args.score_batch,
                 has_branch_steps=has_branch_steps, t_start=t_start, roll_dir=tmp / "rollout")


def warm_up(b: Bench) -> None:
    """0. Warm-up: build tiny-sd3, import everything, run each stage once on a small rollout."""
    from tpkit import advantages, models, rollout, score

    recipe, rewards, tmp = b.recipe, b.rewards, b.tmp
    t0 = time.perf_counter()
    models.family(recipe.rollout.family).resolve(recipe.rollout.model)
    t_build = time.perf_counter() - t0
    warm = tmp / "warmup"
    (warm / "p.txt").parent.mkdir(parents=True)
    (warm / "p.txt").write_text(b.prompts[0] + "\n")
    wr = dataclasses.replace(recipe.rollout, prompts=str(warm / "p.txt"), out=str(warm / "rollout"), group_size=2)
    rollout.run(wr)
    score.run(dataclasses.replace(recipe.score, rollout=wr.out, out=str(warm / "score")), rewards)
    advantages.run(dataclasses.replace(recipe.advantages, scores=str(warm / "score"), out=str(warm / "adv")))
    from tpkit import train

    train.run(dataclasses.replace(recipe.train, rollout=wr.out, advantages=str(warm / "adv"), out=str(warm / "train")))
    reference_score(Path(wr.out), rewards)
    b.results["warmup"] = {"build_tiny_s": t_build, "total_s": time.perf_counter() - t0}
    out.print(f"warm-up (one-off: build tiny-sd3 {t_build:.1f} s, first imports and kernels): "
              f"{b.results['warmup']['total_s']:.1f} s")


def make_rollout(b: Bench) -> int:
    """The rollout the parts measure, in b.roll_dir. Returns its window start a."""
    from tpkit import rollout

    rcfg = dataclasses.replace(b.recipe.rollout, out=str(b.roll_dir), seed=b.recipe.seed)
    rollout.run(rcfg)
    rman = json.loads((b.roll_dir / "manifest.json").read_text())
    return rman["window_start"]


def score_batched_vs_loop(b: Bench, a: int) -> ScoreRuns:
    """(a) score: tpkit's batched branches (at the score batch and --alt-batch) against the per-branch loop."""
    from tpkit import formulas, score

    args, n, T, K, batch, roll_dir, tmp = b.args, b.n, b.T, b.K, b.batch, b.roll_dir, b.tmp

    def score_once(which: str, rep: int) -> dict:
        release_cache()
        if which == "reference":
            return reference_score(roll_dir, b.rewards)
        bs = batch if which == "tpkit" else args.alt_batch
        sdir = tmp / f"score-{which}-{rep}"
        man = score.run(dataclasses.replace(b.recipe.score, rollout=str(roll_dir), out=str(sdir), batch_size=bs), b.rewards)
        st = last_stage("score")
        c = man["counts"]
        return {"dir": sdir, "manifest": man, "seconds": st["wall"] - st.get("load", 0.0), "load": st.get("load", 0.0),
                "probe": st, "transformer_calls": c["transformer_calls"], "decodes": c["decodes"],
                "reward_calls": c["reward_calls"], "batch": bs, "foreign_cpu": st["foreign_cpu"]}

    runs = repeat(["tpkit", "reference"] + (["tpkit-alt"] if args.alt_batch else []), score_once,
                  lambda r: r["seconds"], args.repeats, args.max_repeats, budget_s=100)
    best_runs = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.items() if v}
    best_tp, best_ref = best_runs["tpkit"], best_runs["reference"]
    m_exact = read_R(runs["tpkit"][0]["dir"])
    diff = max(abs(m_exact.R[i, k] - best_ref["R"][(tid, k)]) for i, tid in enumerate(m_exact.trajectory_ids)
               for k in range(K + 1))
    a_res = {k: {"seconds": [r["seconds"] for r in runs[k]], "traj_per_s": n / r["seconds"], "load_s": r["load"],
                 "foreign_cpu": r["foreign_cpu"],
                 "transformer_calls": r["transformer_calls"] / n, "decodes": r["decodes"] / n,
                 "reward_calls": r["reward_calls"] / n, "batch": r.get("batch", 1)}
             for k, r in best_runs.items()}
    a_res.update(minimum_calls=formulas.branch_calls(T, a, K), max_abs_reward_diff=diff,
                 speedup=a_res["tpkit"]["traj_per_s"] / a_res["reference"]["traj_per_s"])
    b.results["score"] = a_res

    t = Table(title=f"(a) score stage, {n} trajectories x {K + 1} rewards (T = {T}, K = {K}, a = {a}), "
                    f"best of {len(runs['tpkit'])} runs each, model loading excluded")
    for col in ("approach", "trajectories/s", "vs loop", "seconds (all runs)", "calls/traj score", "calls/traj +rollout",
                "decodes/traj", "reward calls/traj", "others' CPU"):
        t.add_column(col, justify="right")
    labels = {"tpkit": f"tpkit batched (batch_size {batch}, reuses v(s_k))",
              "tpkit-alt": f"tpkit batched (batch_size {args.alt_batch})",
              "reference": "per-branch loop (batch 1, reference approach)"}
    for key in ("tpkit", "tpkit-alt", "reference"):
        if key not in best_runs:
            continue
        r = a_res[key]
        speed = r["traj_per_s"] / a_res["reference"]["traj_per_s"]
        t.add_row(("[bold]" if key == "tpkit" else "") + labels[key], f"{r['traj_per_s']:.2f}",
                  ("[bold]" if key == "tpkit" else "") + f"{speed:.2f}x", " / ".join(f"{s:.2f}" for s in r["seconds"]),
                  f"{r['transformer_calls']:.0f}", f"{r['transformer_calls'] + T:.0f}",
                  f"{r['decodes']:.0f} (+1 in rollout)" if key != "reference" else f"{r['decodes']:.0f} (+1 in rollout)",
                  f"{r['reward_calls']:.0f}", fmt_pct(r["foreign_cpu"]))
    mc = a_res["minimum_calls"]
    t.add_row("minimum (formulas.branch_calls)", "", "", "", f"{mc}", f"{mc + T}", f"{K} (+1 in rollout)",
              f"{K + 1}", "")
    out.print(t)
    out.print(f"  R_k agreement, tpkit vs loop: max |difference| = {diff:.2e} (batching and the reused velocity "
              f"change float rounding only)")
    return ScoreRuns(a_res=a_res, best_tp=best_tp, best_ref=best_ref, m_exact=m_exact)


def tp_vs_flow_round(b: Bench) -> Rounds:
    """(b) one TP-GRPO round against one Flow-GRPO round (tpkit.run.run, rounds = 1), and the variants."""
    from tpkit import run
    from tpkit.config import load_recipe

    args, recipe, tmp, n, overrides = b.args, b.recipe, b.tmp, b.n, b.overrides
    # Judged at the paper's KL weight (tpkit's default train.beta): the authors' ~2.5x is a step of their
    # recipe, and its train step includes the KL term's reference forward. The recipe's own beta (0 in
    # tiny-cpu.toml: no reference forward) is timed as a second pair. Each variant: (overrides, its Flow).
    paper = [f"train.beta={args.round_beta:g}"]
    variants: dict[str, tuple[list[str], str | None]] = {
        "tp-grpo": (["method=tp-grpo"] + paper, "flow-grpo"), "flow-grpo": (["method=flow-grpo"] + paper, None)}
    cheap = f"tp-grpo, branch_steps={args.round_branch_steps}"
    if b.has_branch_steps and args.round_branch_steps:
        variants[cheap] = (["method=tp-grpo", f"score.branch_steps={args.round_branch_steps}"] + paper, "flow-grpo")
    own = f"beta={recipe.train.beta:g}"
    if recipe.train.beta != args.round_beta:
        variants[f"tp-grpo, {own}"] = (["method=tp-grpo"], f"flow-grpo, {own}")
        variants[f"flow-grpo, {own}"] = (["method=flow-grpo"], None)

    def round_once(v: str, rep: int) -> dict:
        rdir = tmp / f"run-{v.replace(', ', '-').replace('=', '')}-{rep}"
        release_cache()  # each round starts cold, as round r + 1 (a new LoRA) does
        mark = len(PROBE.stages)
        before = PROBE.snapshot()
        foreign = ForeignCPU()
        t0 = time.perf_counter()
        run.run(load_recipe(args.recipe, overrides + args.round_set + variants[v][0], rounds=1, out=str(rdir)))
        wall = time.perf_counter() - t0
        stages = {s["stage"]: s for s in PROBE.stages[mark:]}
        line = json.loads((rdir / "rounds.jsonl").read_text().splitlines()[0])
        return {"wall": wall, "stages": stages, "line": line, "dir": rdir, "foreign_cpu": foreign.share(),
                "report": PROBE.t["report"] - before.get("report", 0.0),
                "total": sum(s["wall"] for s in stages.values()),
                "load": sum(s.get("load", 0.0) for s in stages.values())}

    rounds = repeat(list(variants), round_once, lambda r: r["total"], args.repeats, args.max_repeats, budget_s=120)
    best = {v: min(r, key=lambda x: x["total"]) for v, r in rounds.items()}
    b_res = {v: {"stages": {s: {"wall": x["wall"], "load": x.get("load", 0.0)} for s, x in r["stages"].items()},
                 "total_s": r["total"], "load_s": r["load"], "run_wall_s": r["wall"], "report_s": r["report"],
                 "totals_all": [x["total"] for x in rounds[v]], "foreign_cpu": r["foreign_cpu"],
                 "overrides": variants[v][0], "flow": variants[v][1],
                 "transformer_calls_per_traj": r["line"]["transformer_calls"] / r["line"]["n"]}
             for v, r in best.items()}
    for v, r in best.items():
        f = best[variants[v][1] or v]
        b_res[v]["ratio_to_flow"] = r["total"] / f["total"]
        b_res[v]["ratio_to_flow_excl_load"] = (r["total"] - r["load"]) / (f["total"] - f["load"])
        # Each pass runs a variant next to its Flow (repeat() keeps the pairs adjacent), so the per-pass
        # ratio cancels slow drifts of this VM's speed that best-of-N per variant does not.
        b_res[v]["paired_ratios"] = [x["total"] / y["total"] for x, y in zip(rounds[v], rounds[variants[v][1] or v])]
    b_res["ratio"], b_res["ratio_excl_load"] = b_res["tp-grpo"]["ratio_to_flow"], b_res["tp-grpo"]["ratio_to_flow_excl_load"]
    b.results["rounds"] = b_res

    extra = f" --set {' '.join(args.round_set)}" if args.round_set else ""
    t = Table(title=f"(b) one round ({Path(args.recipe).name}{extra}, {n} trajectories, tpkit.run.run, rounds = 1; "
                    f"train.beta = {args.round_beta:g} (the paper's) unless a column says otherwise): seconds (of which "
                    f"model loading), best of {len(rounds['tp-grpo'])} runs each; each ratio is to the Flow-GRPO column "
                    f"with the same beta")
    t.add_column("stage", justify="right")
    for v, (_, fv) in variants.items():
        t.add_column(v, justify="right")
        if fv:
            t.add_column("/ Flow", justify="right")
    def cells(fn) -> list[str]:
        """fn(variant) -> (cell, ratio cell) for every variant; Flow columns have no ratio cell."""
        row = []
        for v, (_, fv) in variants.items():
            cell, ratio = fn(v)
            row += [cell, ratio] if fv else [cell]
        return row

    def stage_cells(s: str):
        def fn(v):
            x, f = best[v]["stages"].get(s, {}), best[variants[v][1] or v]["stages"].get(s)
            return (f"{x['wall']:.2f} ({x.get('load', 0.0):.2f})" if x else "–",
                    f"{x['wall'] / f['wall']:.2f}x" if x and f and f["wall"] > 0 else "–")
        return fn
    for s in ("rollout", "score", "advantages", "train"):
        t.add_row(s, *cells(stage_cells(s)))
    t.add_row("[bold]round (4 stages)", *cells(lambda v: (f"{best[v]['total']:.2f} ({best[v]['load']:.2f})",
                                                          f"[bold]{b_res[v]['ratio_to_flow']:.2f}x")))
    t.add_row("round, model loading excluded", *cells(lambda v: (f"{best[v]['total'] - best[v]['load']:.2f}",
                                                                 f"{b_res[v]['ratio_to_flow_excl_load']:.2f}x")))
    t.add_row("all runs (round totals)", *cells(lambda v: (" / ".join(f"{x:.2f}" for x in b_res[v]["totals_all"]),
                                                         " / ".join(f"{x:.2f}" for x in b_res[v]["paired_ratios"]))))
    t.add_row("transformer calls / trajectory", *cells(lambda v: (f"{b_res[v]['transformer_calls_per_traj']:.0f}", "")))
    t.add_row("others' CPU (best run)", *cells(lambda v: (fmt_pct(b_res[v]["foreign_cpu"]), "")))
    t.add_row("report.png (outside stages)", *cells(lambda v: (f"{b_res[v]['report_s']:.2f}", "")))
    out.print(t)
    out.print("  round = the four stages' wall-clock inside tpkit.run.run; the whole run.run call adds reward set-up and "
              "report.png: " + ", ".join(f"{v} {best[v]['wall']:.2f} s" for v in variants))
    return Rounds(b_res=b_res, best=best, own=own, cheap=cheap)


def breakdown(label: str, st: dict, io: float, reward_wait: float = 0.0, encode: float = 0.0) -> dict:
    """(d) a stage's time (model loading excluded) split into model compute, reward wait, optimizer,
    file I/O and the rest (Python/other)."""
    wall = st["wall"] - st.get("load", 0.0)
    model = st.get("forward", 0.0) + st.get("backward", 0.0) + st.get("decode", 0.0) + encode
    other = wall - model - reward_wait - io - st.get("optimizer", 0.0)
    return {"label": label, "wall": wall, "encode": encode, "forward": st.get("forward", 0.0),
            "backward": st.get("backward", 0.0), "decode": st.get("decode", 0.0), "reward_wait": reward_wait,
            "optimizer": st.get("optimizer", 0.0), "io": io, "other": other,
            "outside_pct": 100 * (io + other) / wall if wall > 0 else None}


def time_outside_model(b: Bench, scored: ScoreRuns, rounds: Rounds) -> list[dict]:
    """(d) share of stage time outside model forward / backward / decode / reward (file I/O, Python)."""
    best_tp, best_ref, best = scored.best_tp, scored.best_ref, rounds.best
    sec = best_tp["manifest"]["seconds"]
    rows = [breakdown("score (tpkit, batched)", best_tp["probe"], sec.get("read", 0) + sec.get("write", 0),
                      sec.get("reward_wait", 0.0)),
            breakdown("score (per-branch loop, reward inline)", best_ref["probe"], best_ref["t_read"], best_ref["t_reward"])]
    for m in ("tp-grpo", "flow-grpo"):
        st = best[m]["stages"]
        ro = st["rollout"]["manifest"].get("seconds", {})
        rows.append(breakdown(f"rollout ({m})", st["rollout"], ro.get("write", 0.0), encode=ro.get("encode", 0.0)))
        if m == "tp-grpo":
            ss = st["score"]["manifest"].get("seconds", {})
            rows.append(breakdown(f"score ({m} round)", st["score"], ss.get("read", 0) + ss.get("write", 0),
                                  ss.get("reward_wait", 0.0)))
        rows.append(breakdown(f"train ({m})", st["train"], st["train"].get("train_io", 0.0)))
    b.results["overhead"] = rows
    t = Table(title="(d) where stage time goes (seconds, model loading excluded): outside = file I/O + Python/other")
    for col in ("stage", "wall", "text encode", "transformer fwd", "backward", "VAE decode", "reward wait", "optimizer",
                "file I/O", "Python/other", "outside %"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["label"], *(fmt(r[k]) for k in ("wall", "encode", "forward", "backward", "decode", "reward_wait",
                                                   "optimizer", "io", "other")), fmt(r["outside_pct"], ".1f") + " %")
    out.print(t)
    out.print(f"  score manifest seconds (best tpkit run): {json.dumps(sec)}; reward wait = time the stage waited for "
              f"the reward thread (the loop computes rewards inline)")
    return rows


def peak_memory(b: Bench, scored: ScoreRuns) -> Memory:
    """(c) peak memory of score and train as tpkit runs them against the same stage with the text
    encoders loaded, each in a fresh subprocess; SD3.5-M's weights from the parameter counts of (e)."""
    from tpkit import advantages

    recipe, tmp, roll_dir, batch, results = b.recipe, b.tmp, b.roll_dir, b.batch, b.results
    best_tp = scored.best_tp
    adv_dir = tmp / "adv"
    advantages.run(dataclasses.replace(recipe.advantages, scores=str(best_tp["dir"]), out=str(adv_dir)))
    score_cfg = dataclasses.asdict(dataclasses.replace(recipe.score, rollout=str(roll_dir), batch_size=batch))
    train_cfg = dataclasses.asdict(dataclasses.replace(recipe.train, rollout=str(roll_dir), advantages=str(adv_dir)))
    mem = []
    for stage, cfg in (("score", score_cfg), ("train", train_cfg)):
        for te in (False, True):
            c = dict(cfg, out=str(tmp / f"mem-{stage}-{int(te)}"))
            r = run_memory(stage, te, c, tmp)
            mem.append({"stage": stage, "text_encoders": te, **r})
    results["memory"] = mem
    params = full_size_params()
    results["full_size_params"] = params
    t = Table(title="(c) peak memory of a stage, each variant in a fresh subprocess (RSS high-water mark, MiB)")
    gpu = any(r["gpu_peak_mib"] is not None for r in mem)
    for col in ("stage", "text encoders", "RSS before stage", "peak RSS", "stage's increase", "model load s") + \
            (("GPU peak MiB",) if gpu else ()):
        t.add_column(col, justify="right")
    for r in mem:
        t.add_row(f"{r['stage']} ({'variant' if r['text_encoders'] else 'tpkit'})",
                  "loaded" if r["text_encoders_loaded"] else "not loaded",
                  f"{r['baseline_kib'] / 1024:.0f}", f"{r['peak_kib'] / 1024:.0f}",
                  f"{(r['peak_kib'] - r['baseline_kib']) / 1024:.0f}", f"{r['load_s']:.2f}",
                  *((fmt(r["gpu_peak_mib"], ".0f"),) if gpu else ()))
    size = {k: v["params"] + v["buffers"] for k, v in params.items()}
    te_p = sum(v for k, v in size.items() if k.startswith("text_encoder"))
    out.print(t)
    base_w = gib(size["transformer"] + size["vae"])
    out.print(f"  at SD3.5-M size (bf16 weights from the parameter counts of (e)): score holds transformer + VAE = "
              f"{base_w:.1f} GiB of weights, train the transformer = {gib(size['transformer']):.1f} GiB; loading the "
              f"text encoders would add {gib(te_p):.1f} GiB ({(base_w + gib(te_p)) / base_w:.1f}x the score stage's weights)")
    sm = {r["text_encoders"]: r for r in mem if r["stage"] == "score"}
    tm = {r["text_encoders"]: r for r in mem if r["stage"] == "train"}
    return Memory(score_cfg=score_cfg, train_cfg=train_cfg, params=params, size=size, te_p=te_p, sm=sm, tm=tm)


def cpu_allocator(b: Bench, mem: Memory) -> dict:
    """(g) on CPU: score and train with tpkit's raised glibc malloc thresholds against glibc's defaults,
    each run in a fresh subprocess. Returns the best stage seconds by (stage, tuned); {} when not
    measured (a GPU, or no allocator tuning in this tpkit)."""
    import torch

    from tpkit import runtime

    args, tmp, score_cfg, train_cfg = b.args, b.tmp, mem.score_cfg, mem.train_cfg
    if torch.cuda.is_available() or not runtime.tune_cpu_allocator():
        return {}
    alloc = []
    for rep in range(args.repeats):
        for stage, cfg in (("score", score_cfg), ("train", train_cfg)):
            for tuned in ((True, False) if rep % 2 == 0 else (False, True)):
                c = dict(cfg, out=str(tmp / f"alloc-{stage}-{int(tuned)}-{rep}"))
                r = run_memory(stage, False, c, tmp, env=None if tuned else {"TPKIT_CPU_MALLOC": "0"})
                alloc.append({"stage": stage, "tuned": tuned, **r})
    b.results["allocator"] = alloc
    for r in alloc:
        r["stage_s"] = r["wall_s"] - r["load_s"]
    alloc_best = {(r["stage"], r["tuned"]): min(x["stage_s"] for x in alloc if (x["stage"], x["tuned"]) ==
                                                (r["stage"], r["tuned"])) for r in alloc}
    t = Table(title="(g) glibc malloc thresholds raised by tpkit (CPU) vs glibc's defaults (TPKIT_CPU_MALLOC=0): "
                    f"one fresh subprocess per run, best of {args.repeats}")
    for col in ("stage", "allocator", "stage seconds (all runs)", "best", "speed-up", "peak RSS MiB (max)"):
        t.add_column(col, justify="right")
    for stage in ("score", "train"):
        for tuned in (True, False):
            runs_ = [r for r in alloc if r["stage"] == stage and r["tuned"] == tuned]
            t.add_row(stage, "tpkit (raised)" if tuned else "glibc default",
                      " / ".join(f"{r['stage_s']:.2f}" for r in runs_), f"{alloc_best[stage, tuned]:.2f}",
                      f"{alloc_best[stage, False] / alloc_best[stage, tuned]:.2f}x",
                      f"{max(r['peak_kib'] for r in runs_) / 1024:.0f}")
    out.print(t)
    return alloc_best


def full_size(b: Bench, mem: Memory, a: int) -> dict:
    """(e) SD3.5-Medium's architecture with random weights: parameter counts; with --full-size, timed
    calls (on a GPU; without one, the same code on a 2-layer model of its structure). Returns what
    results["full_size"] holds."""
    import torch

    args, T, K, params, size = b.args, b.T, b.K, mem.params, mem.size
    fs = {"params": params}
    t = Table(title="(e) SD3.5-Medium architecture, random weights")
    t.add_column("component")
    t.add_column("parameters", justify="right")
    t.add_column("buffers", justify="right")
    t.add_column("bf16 GiB (both)", justify="right")
    for k, v in params.items():
        t.add_row(k, f"{v['params'] / 1e9:.3f} B", f"{v['buffers'] / 1e9:.3f} B", f"{gib(size[k]):.2f}")
    out.print(t)
    if args.full_size:
        if torch.cuda.is_available():
            g = full_size_gpu("cuda")
            torch.cuda.empty_cache()  # the random SD3.5-M is gone with the call
            fs["gpu"] = g
            fs["projection"] = project(g, T, K, a)
            print_full_size(g, fs["projection"], f"(e) full size on {torch.cuda.get_device_name()} ({g['dtype']}, "
                                                 f"{g['resolution']} px, {g['tokens']} tokens per sample)")
        else:
            # No GPU: run the same timing code on CPU on a 2-layer model of SD3.5-M's structure (dual
            # attention, RMS q/k norm, 333 text tokens) so the path is known to work when a GPU comes.
            g = full_size_gpu("cpu", SD35M_SHAPE_SMALL, SD35M_VAE_SMALL, resolution=64, iters=2)
            fs["cpu_code_check"] = g
            print_full_size(g, project(g, T, K, a), "(e) --full-size without a GPU: its timing code on CPU, on a 2-layer "
                                                    "model of SD3.5-M's structure at 64 px (checks that the path runs; "
                                                    "these are not SD3.5-M timings)")
    return fs


def branch_steps(b: Bench, scored: ScoreRuns) -> None:
    """(f) if ScoreConfig has `branch_steps`: for N in (1, 2, 3, 5), how well the cheap R_k preserve the
    exact ones (Spearman of step rewards, turning-point agreement) against the calls saved."""
    if not b.has_branch_steps:
        out.print("(f) skipped: ScoreConfig has no branch_steps in this tpkit")
        return
    import numpy as np
    from scipy.stats import spearmanr

    from tpkit import formulas, score

    recipe, rewards, tmp, roll_dir, batch, n = b.recipe, b.rewards, b.tmp, b.roll_dir, b.batch, b.n
    a_res, m_exact = scored.a_res, scored.m_exact
    exact = m_exact
    d_exact, tp_exact = formulas.step_rewards(exact.R), formulas.turning_points(exact.R)
    f_rows = []
    for N in (1, 2, 3, 5):
        sdir = tmp / f"score-steps-{N}"
        release_cache()
        man = score.run(dataclasses.replace(recipe.score, rollout=str(roll_dir), out=str(sdir), batch_size=batch,
                                            branch_steps=N), rewards)
        st = last_stage("score")
        mN = read_R(sdir)
        assert list(mN.trajectory_ids) == list(exact.trajectory_ids)
        dN, tpN = formulas.step_rewards(mN.R), formulas.turning_points(mN.R)
        rho = spearmanr(d_exact.ravel(), dN.ravel()).statistic
        per_traj = [spearmanr(d_exact[i], dN[i]).statistic for i in range(len(dN))]
        per_traj = [x for x in per_traj if np.isfinite(x)]
        f_rows.append({"N": N, "spearman": float(rho), "spearman_per_traj": float(np.mean(per_traj)) if per_traj else None,
                       "tp_agreement": float((tpN == tp_exact).mean()), "tp_exact": int(tp_exact.sum()),
                       "tp_cheap": int(tpN.sum()), "calls_per_traj": man["counts"]["transformer_calls"] / n,
                       "seconds": st["wall"] - st.get("load", 0.0)})
    b.results["branch_steps"] = f_rows
    t = Table(title="(f) --branch-steps N against the exact branches (same rollout)")
    for col in ("N", "calls/traj", "calls saved", "seconds (1 run)", "Spearman d_k (pooled)", "Spearman per trajectory",
                "turning-point agreement", "TPs exact / cheap"):
        t.add_column(col, justify="right")
    t.add_row("exact", f"{a_res['tpkit']['transformer_calls']:.0f}", "0 %", fmt(a_res["tpkit"]["seconds"][0]),
              "1", "1", "100 %", f"{int(tp_exact.sum())}")
    for r in f_rows:
        t.add_row(str(r["N"]), f"{r['calls_per_traj']:.0f}",
                  f"{100 * (1 - r['calls_per_traj'] / a_res['tpkit']['transformer_calls']):.0f} %", fmt(r["seconds"]),
                  f"{r['spearman']:.3f}", fmt(r["spearman_per_traj"], ".3f"), f"{100 * r['tp_agreement']:.1f} %",
                  f"{r['tp_exact']} / {r['tp_cheap']}")
    out.print(t)


def key_ratios(b: Bench, scored: ScoreRuns, rounds: Rounds, rows: list[dict], mem: Memory, alloc_best: dict,
               fs: dict) -> None:
    """The key ratios of (a)-(g), and the floor of (b) for exact branches."""
    args, results, n, T, K = b.args, b.results, b.n, b.T, b.K
    a_res, b_res, best, own, cheap = scored.a_res, rounds.b_res, rounds.best, rounds.own, rounds.cheap
    mc, flow = a_res["minimum_calls"], best["flow-grpo"]
    sm, tm, te_p = mem.sm, mem.tm, mem.te_p
    results["total_s"] = time.perf_counter() - b.t_start
    results["loadavg_end"] = os.getloadavg()
    out.rule("key ratios")
    train_row = next(r for r in rows if r["label"] == "train (tp-grpo)")
    ok = lambda cond: "[green]meets[/]" if cond else "[red]misses[/]"  # noqa: E731
    out.print(f"score, batched vs per-branch loop: [bold]{a_res['speedup']:.2f}x[/] trajectories/s "
              f"({a_res['tpkit']['traj_per_s']:.2f} vs {a_res['reference']['traj_per_s']:.2f}); target >= 2x: "
              f"{ok(a_res['speedup'] >= 2)}")
    out.print(f"transformer calls per trajectory: tpkit {a_res['tpkit']['transformer_calls']:.0f} + {T} rollout = "
              f"{a_res['tpkit']['transformer_calls'] + T:.0f}, minimum {mc} + {T} = {mc + T}, reference loop "
              f"{a_res['reference']['transformer_calls']:.0f} + {T} = {a_res['reference']['transformer_calls'] + T:.0f}")
    out.print(f"round TP-GRPO / Flow-GRPO at the paper's KL weight (train.beta = {args.round_beta:g}): [bold]"
              f"{b_res['ratio']:.2f}x[/] ({b_res['ratio_excl_load']:.2f}x without model loading); authors ~2.5x, "
              f"target <= 2x: {ok(b_res['ratio'] <= 2)}")
    def paired(v: str) -> str:
        r = sorted(b_res[v]["paired_ratios"])
        return f"median of the per-pass ratios {statistics.median(r):.2f}x (range {r[0]:.2f}-{r[-1]:.2f}x)"
    out.print(f"  {paired('tp-grpo')}")
    if f"tp-grpo, {own}" in b_res:
        r = b_res[f"tp-grpo, {own}"]
        out.print(f"  with the recipe's {own} (train skips the reference forward): {r['ratio_to_flow']:.2f}x "
                  f"({r['ratio_to_flow_excl_load']:.2f}x without model loading); {paired(f'tp-grpo, {own}')}")
    # The floor with exact branches: TP = Flow + the score stage, whose least work is 45 calls and K decodes
    # per trajectory. Priced at the rollout's own cost per call and per decode (measured in the same round),
    # that is what the ratio would be if score spent nothing on anything else.
    ro = best["tp-grpo"]["stages"]["rollout"]
    per_call, per_decode = ro.get("forward", 0.0) / (n * T), ro.get("decode", 0.0) / n
    floor = 1 + (mc * per_call + K * per_decode) * n / flow["total"]
    score_st = best["tp-grpo"]["stages"]["score"]
    b_res["floor"] = {"ratio": floor, "rollout_s_per_call": per_call, "rollout_s_per_decode": per_decode,
                      "score_s_per_call": score_st.get("forward", 0.0) / max(1, n * mc),
                      "score_s_per_decode": score_st.get("decode", 0.0) / max(1, n * K)}
    out.print(f"  exact-branch floor at the rollout's cost per call ({1e3 * per_call:.2f} ms) and per decode "
              f"({1e3 * per_decode:.2f} ms): 1 + ({mc} calls + {K} decodes) x {n} / Flow round = [bold]{floor:.2f}x[/] "
              f"(score's own: {1e3 * b_res['floor']['score_s_per_call']:.2f} ms per call, "
              f"{1e3 * b_res['floor']['score_s_per_decode']:.2f} ms per decode)")
    if cheap in b_res:
        out.print(f"round TP-GRPO with branch_steps={args.round_branch_steps} / Flow-GRPO: [bold]"
                  f"{b_res[cheap]['ratio_to_flow']:.2f}x[/] ({b_res[cheap]['transformer_calls_per_traj']:.0f} calls per "
                  f"trajectory; its R_k quality in (f))")
    out.print(f"score time outside model forward/decode/reward: [bold]{rows[0]['outside_pct']:.1f} %[/]; target < 10 %: "
              f"{ok(rows[0]['outside_pct'] < 10)}; train (TP round): {train_row['outside_pct']:.1f} %")
    out.print(f"peak RSS with vs without text encoders: score {sm[True]['peak_kib'] / 1024:.0f} vs "
              f"{sm[False]['peak_kib'] / 1024:.0f} MiB, train {tm[True]['peak_kib'] / 1024:.0f} vs "
              f"{tm[False]['peak_kib'] / 1024:.0f} MiB (tiny model); at SD3.5-M size the text encoders are "
              f"{gib(te_p):.1f} GiB of bf16 weights")
    if alloc_best:
        out.print("CPU allocator tuning (g): " + ", ".join(
            f"{stage} {alloc_best[stage, False] / alloc_best[stage, True]:.2f}x faster" for stage in ("score", "train")))
    if "projection" in fs:
        p = fs["projection"]
        out.print(f"full size (GPU): score speed-up {p['score_reference'] / p['score_tpkit']:.2f}x, "
                  f"round TP / Flow {p['round_tp'] / p['round_flow']:.2f}x")
    results["full_size"] = fs
    out.print(f"benchmark wall-clock: {results['total_s']:.0f} s; load average at start "
              f"{' '.join(f'{x:.1f}' for x in results['loadavg_start'])}, at end "
              f"{' '.join(f'{x:.1f}' for x in results['loadavg_end'])} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
