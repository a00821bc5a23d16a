"""`tiny-shapes`: a laptop-sized SD3 pretrained with flow matching on `tpkit.shapes.scenes` scenes.

The model is an ordinary diffusers `StableDiffusion3Pipeline`, saved with `save_pretrained` inside
the package (`tpkit/models/tiny-shapes/`) and loaded by `tpkit.models.load("tiny-shapes")` through
`from_pretrained` like any other model:

* VAE (`AutoencoderKL`): 64 px RGB -> 4 x 16 x 16 latents (downsamples 4x: small shapes keep their
  corners; 8x would leave a 10 px triangle one latent pixel).
* Transformer (`SD3Transformer2DModel`): MMDiT with RMS q/k norm, patch 2 -> 64 image tokens.
* Text: two tiny CLIP text encoders with projection and a tiny T5 encoder, all over one
  word-level `CLIPTokenizer` of the closed caption vocabulary (every word of every `tpkit.shapes.scenes`
  prompt is one token; the longest prompt is 10 words + 2 specials). CLIP pads to `CLIP_LENGTH`,
  T5 to the pipeline's `max_sequence_length`: sample with `max_sequence_length=TEXT_LENGTH`, the
  length it was trained with.

Training (`tpkit pretrain-shapes --out DIR`, fixed seed, resumable: rerun the same command):

1. `vae`: the autoencoder alone on rendered scenes (L1 + a small KL), then frozen; its latent
   mean/std over fresh scenes become `shift_factor` / `scaling_factor`.
2. `data`: scenes for prompts of both splits are rendered and encoded once into latent chunks on
   disk. Pretraining sees every prompt, as SD3.5's pretraining saw images of every GenEval prompt;
   what the test split holds out is RL: `tpkit run` trains on train prompts only and its held-out
   evaluation measures whether what RL learned carries over to prompts it never trained on (the
   GenEval protocol of Flow-GRPO and TP-GRPO). No choice is made on test prompts (guidance and
   checkpoints are chosen on train prompts).
3. `flow`: transformer and both text encoders jointly, SD3's rectified-flow objective:
   x_t = (1 - sigma) x0 + sigma noise, target v = noise - x0, transformer timestep = 1000 sigma,
   sigma logit-normal and shifted by the sampling scheduler's shift (plus a share drawn uniformly
   so the low-noise end is learned too); captions dropped to "" 10 % of the time so CFG with the
   empty negative prompt works. An EMA of the weights is what gets saved.

State is checkpointed every few minutes (`state.pt`) and at every phase change; snapshots of the
EMA pipeline are kept every `snapshot_every` flow steps under `DIR/snapshots/`, the final one in
`DIR/pipeline/`.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tpkit import formulas, models
from tpkit.errors import ConfigError, InputError
from tpkit.geneval import detectors
from tpkit.models import sd3
from tpkit.models.sd3 import BUILTIN, SHAPES
from tpkit.shapes import scenes as shapes
from tpkit.ui import console

NAME = SHAPES
RESOLUTION = BUILTIN[NAME]["resolution"]  # pixels
GUIDANCE = BUILTIN[NAME]["guidance"]  # CFG scale to sample with
TEXT_LENGTH = BUILTIN[NAME]["text_length"]  # T5 tokens = the max_sequence_length to sample with (the longest prompt: 10 words + 2 specials)
CLIP_LENGTH = 12  # CLIP tokens (the tokenizer's model_max_length)
SHIFT = 1.0  # FlowMatchEulerDiscreteScheduler shift, for sampling and training sigmas: SD3 trained its 32x32-latent
# (256 px) stage unshifted and shifts by 3 only at 128x128; these latents are 16x16
SEED = 0
SPECIALS = ("<|startoftext|>", "<|endoftext|>")  # ids 0 and 1 (CLIP pools at the first eos)


def weights_dir() -> Path:
    """The committed pipeline folder inside the installed package."""
    return sd3.location(NAME)


@dataclass
class Arch:
    vae_channels: tuple[int, ...] = (16, 32, 32)  # 3 levels: downsample 4x
    latent_channels: int = 4
    vae_groups: int = 8
    layers: int = 6
    heads: int = 4
    head_dim: int = 32
    clip_hidden: int = 64
    clip_layers: int = 2
    clip_heads: int = 2
    t5_layers: int = 2


@dataclass
class Recipe:
    seed: int = SEED
    vae_steps: int = 800
    vae_batch: int = 32
    vae_lr: float = 1e-3
    vae_kl: float = 1e-6
    vae_crop: int = 32  # train on random crops (fully convolutional): 4x cheaper than 64 px
    vae_stats_scenes: int = 512  # fresh scenes whose latent mean/std normalise the latents
    data_scenes: int = 24576
    data_chunk: int = 2048
    # relative share of each GenEval task (in `shapes.TAGS` order) among the flow data's scenes;
    # None: every task alike (the VAE and its latent statistics always see every task alike)
    task_weights: tuple[float, ...] | None = None
    flow_steps: int = 4400
    flow_batch: int = 64
    flow_lr: float = 1e-3
    warmup: int = 100
    cooldown: float = 0.2  # share of flow_steps at the end over which the learning rate falls linearly to 0
    uniform_share: float = 0.25  # share of sigmas drawn uniformly instead of shifted logit-normal
    caption_dropout: float = 0.1
    ema: float = 0.995
    grad_clip: float = 1.0
    snapshot_every: int = 250  # flow steps; 0: none
    checkpoint_minutes: float = 3.0
    arch: Arch = field(default_factory=Arch)

    def validate(self) -> "Recipe":
        """Every count and rate in range, before any work (a negative --flow-steps would render the data,
        train the VAE and save an untrained transformer); an InputError naming the option otherwise."""
        flag = {"flow_steps": "--flow-steps"}
        counts = ("vae_steps", "vae_batch", "vae_crop", "vae_stats_scenes", "data_scenes", "data_chunk", "flow_steps",
                  "flow_batch")
        for name in counts + ("warmup", "snapshot_every"):
            value = getattr(self, name)
            low = 1 if name in counts else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{flag.get(name, name)} {value!r} must be a whole number >= {low}",
                                 f"e.g. {flag.get(name, name)} {getattr(Recipe, name)} (the recipe's)")
        rates = {"vae_lr": (0, None), "vae_kl": (0, None), "flow_lr": (0, None), "grad_clip": (0, None),
                 "checkpoint_minutes": (0, None), "cooldown": (0, 1), "uniform_share": (0, 1),
                 "caption_dropout": (0, 1), "ema": (0, 1)}
        for name, (lo, hi) in rates.items():
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value and (hi is None or value <= hi)):
                raise InputError(f"{name} = {value!r} must be a number in [{lo}, {hi if hi is not None else 'inf'})",
                                 f"e.g. {name} = {getattr(Recipe, name)} (the recipe's)")
        if self.vae_crop > RESOLUTION or self.vae_crop % 4:
            raise InputError(f"vae_crop = {self.vae_crop} must be a multiple of 4 up to {RESOLUTION}",
                             f"e.g. vae_crop = {Recipe.vae_crop}")
        return self


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def caption_words() -> list[str]:
    """Every word of every shapes prompt (both splits: the closed vocabulary), plus "an"."""
    words = {"an"}
    for tag in shapes.TAGS:
        for m in shapes.split_prompts(tag):
            words.update(m["prompt"].lower().split())
    return sorted(words)


def word_tokenizer(words: list[str], max_length: int = CLIP_LENGTH):
    """A `CLIPTokenizer` in which every word is one token ("word</w>").

    BPE merges build each word from its first character left to right (the intermediate prefixes
    are in the vocabulary too); a word that another word's merges would split is moved to the
    front of the merge list until every word comes out whole. Other text falls back to characters
    and, outside the caption alphabet, to the unknown token (= end of text, CLIP's default)."""
    from transformers import CLIPTokenizer

    words = sorted({w.lower() for w in words})
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for c in sorted({c for w in words for c in w}):
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))

    def merges_of(w: str) -> list[tuple[str, str]]:
        sym = list(w[:-1]) + [w[-1] + "</w>"]
        out, cur = [], sym[0]
        for s in sym[1:]:
            out.append((cur, s))
            cur += s
        return out

    order, bad = list(words), []
    for _ in range(len(words) + 1):
        merges, seen, v = [], set(), dict(vocab)
        for w in order:
            for m in merges_of(w):
                if m not in seen:
                    seen.add(m)
                    merges.append(m)
                    v.setdefault(m[0] + m[1], len(v))
        tok = CLIPTokenizer(vocab=v, merges=merges, model_max_length=max_length)
        bad = [w for w in words if len(tok(w, add_special_tokens=False).input_ids) != 1]
        if not bad:
            return tok
        order = bad + [w for w in order if w not in bad]
    raise RuntimeError(f"could not make a word-level tokenizer for {bad}")


def build_pipeline(arch: Arch | None = None, seed: int = SEED, words: list[str] | None = None):
    """A randomly initialised tiny-shapes `StableDiffusion3Pipeline` (deterministic from `seed`)."""
    arch = arch or Arch()
    f = 2 ** (len(arch.vae_channels) - 1)
    shape = sd3.TinyArch(
        resolution=RESOLUTION, vae_channels=tuple(arch.vae_channels), latent_channels=arch.latent_channels,
        vae_groups=arch.vae_groups, scaling_factor=1.0, shift_factor=0.0,  # set from latent statistics after the VAE phase
        layers=arch.layers, heads=arch.heads, head_dim=arch.head_dim, pos_embed_max_size=RESOLUTION // f,
        clip_hidden=arch.clip_hidden, clip_layers=arch.clip_layers, clip_heads=arch.clip_heads,
        t5_ff=4 * arch.clip_hidden, t5_heads=arch.clip_heads, t5_layers=arch.t5_layers, shift=SHIFT)
    return sd3.build_tiny(shape, word_tokenizer(words or caption_words()), seed)


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def _images(scenes) -> torch.Tensor:
    """Rendered scenes -> float [B, 3, H, W] in [-1, 1]."""
    arr = np.stack([shapes.render(s, RESOLUTION) for s in scenes])
    return torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def task_weights(items: list[str], current: tuple[float, ...] | None = None) -> tuple[float, ...]:
    """`--task-weight TAG=W` items over `current` (None: every task 1) -> weights in `shapes.TAGS` order;
    a bad item, or every weight 0, is an InputError naming the fix."""
    weights = dict(zip(shapes.TAGS, current or [1.0] * len(shapes.TAGS)))
    for item in items:
        tag, _, w = item.partition("=")
        try:
            w = float(w)
        except ValueError:
            w = -1.0
        if tag not in weights or not 0 <= w < float("inf"):
            raise InputError(f"--task-weight {item!r} is not TAG=W with a finite weight >= 0",
                             f"TAG is one of {', '.join(shapes.TAGS)}, e.g. --task-weight counting=1.5")
        weights[tag] = w
    if sum(weights.values()) <= 0:
        raise InputError("--task-weight gives every task weight 0", "give at least one task a positive weight")
    return tuple(weights[t] for t in shapes.TAGS)


def random_scenes(rng: np.random.Generator, n: int, task_weights: tuple[float, ...] | None = None) -> list:
    """Scenes for random prompts of both splits (prompt uniform within a task; tasks alike, or drawn
    with the relative `task_weights`, in `shapes.TAGS` order)."""
    if task_weights is None:  # its own draw, so that the uniform recipe's data stays what it was
        return [shapes.sample_scene(rng, size=RESOLUTION) for _ in range(n)]
    p = np.asarray(task_weights, dtype=float) / sum(task_weights)
    return [shapes.sample_scene(rng, task=shapes.TAGS[int(rng.choice(len(p), p=p))], size=RESOLUTION)
            for _ in range(n)]


def sample_sigmas(gen: torch.Generator, n: int, uniform_share: float) -> torch.Tensor:
    """SD3's logit-normal(0, 1) sigmas, shifted like the sampling schedule (s' = k s / (1 + (k - 1) s)),
    a `uniform_share` of them uniform in (0, 1) instead."""
    u = torch.sigmoid(torch.randn(n, generator=gen))
    u = SHIFT * u / (1 + (SHIFT - 1) * u)
    uni = torch.rand(n, generator=gen)
    pick = torch.rand(n, generator=gen) < uniform_share
    return torch.where(pick, uni, u).clamp(1e-4, 1.0)


def flow_lr(r: Recipe, step: int) -> float:
    """Warmup-stable-decay: linear warmup over `warmup` steps, constant, then linear to 0 over the last
    `cooldown` share of `flow_steps`. The decay is what the loss gains most from at the end (the EMA alone
    averages a constant-rate walk); the stable part is what lets a run be lengthened before it starts."""
    warm = (step + 1) / max(1, r.warmup)
    cool = (r.flow_steps - step) / max(1.0, r.cooldown * r.flow_steps) if r.cooldown > 0 else 1.0
    return r.flow_lr * max(0.0, min(1.0, warm, cool))


def flow_loss(pipe, latents: torch.Tensor, captions: list[str], gen: torch.Generator, uniform_share: float,
              text_length: int = TEXT_LENGTH) -> torch.Tensor:
    """SD3's rectified-flow loss on normalised latents, text through the pipeline's own encode_prompt."""
    sigma = sample_sigmas(gen, len(latents), uniform_share)
    noise = torch.randn(latents.shape, generator=gen)
    s = sigma.view(-1, 1, 1, 1)
    x_t = (1 - s) * latents + s * noise
    pe, _, pooled, _ = pipe.encode_prompt(prompt=captions, prompt_2=None, prompt_3=None, device=latents.device,
                                          num_images_per_prompt=1, do_classifier_free_guidance=False,
                                          max_sequence_length=text_length)
    v = pipe.transformer(hidden_states=x_t, timestep=sigma * 1000.0, encoder_hidden_states=pe,
                         pooled_projections=pooled, return_dict=False)[0]
    return (v.float() - (noise - latents)).pow(2).mean()


def vae_loss(vae, images: torch.Tensor, kl: float, gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    post = vae.encode(images).latent_dist
    rec = vae.decode(post.sample(generator=gen)).sample
    l1 = (rec - images).abs().mean()
    return l1 + kl * post.kl().mean(), l1


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_pipeline(pipe, folder: Path) -> None:
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        pipe.save_pretrained(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class ThreadTuner:
    """Time `probe` steps on 1 thread and `probe` on all, keep the faster;
    probe again every `every` steps, or as soon as 3 steps in a row take 1.5x the chosen median.

    On a CPU shared with other jobs, oversubscribed OpenMP threads spin and a step can take several
    times longer on 2 threads than on 1; on an idle machine 2 are faster."""

    def __init__(self, every: int = 100, probe: int = 3):
        self.max, self.every, self.probe = torch.get_num_threads(), every, probe
        self.k, self.times, self.ref, self.slow = 0, {}, None, 0

    def _probing(self) -> int:
        return 0 if self.max < 2 or self.k >= 2 * self.probe else (1 if self.k < self.probe else self.max)

    def __enter__(self):
        if n := self._probing():
            torch.set_num_threads(n)
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        dt = time.perf_counter() - self.t0
        if n := self._probing():
            self.times.setdefault(n, []).append(dt)
            if self.k == 2 * self.probe - 1:
                one, many = (float(np.median(self.times[k])) for k in (1, self.max))
                torch.set_num_threads(self.max if many < one else 1)
                self.ref, self.times = min(one, many), {}
        elif self.ref is not None:
            self.slow = self.slow + 1 if dt > 1.5 * self.ref else 0
        self.k += 1
        if self.k >= self.every or self.slow >= 3:
            self.k, self.slow = 0, 0


class _Trainer:
    """All training state; `state()` / `load()` are what `state.pt` holds."""

    FLOW_MODULES = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")

    def __init__(self, out: Path, recipe: Recipe):
        self.out, self.r = Path(out), recipe
        self.pipe = build_pipeline(recipe.arch, recipe.seed)
        self.phase, self.step, self.seconds = "vae", 0, 0.0
        self.rng = np.random.default_rng(recipe.seed)
        self.gen = torch.Generator().manual_seed(recipe.seed)
        self.vae_opt = torch.optim.AdamW(self.pipe.vae.parameters(), lr=recipe.vae_lr, weight_decay=0.0)
        params = [p for m in self.FLOW_MODULES for p in getattr(self.pipe, m).parameters()]
        self.flow_opt = torch.optim.AdamW(params, lr=recipe.flow_lr, betas=(0.9, 0.99), weight_decay=0.01)
        self.ema = {m: {k: v.detach().clone() for k, v in getattr(self.pipe, m).state_dict().items()}
                    for m in self.FLOW_MODULES}
        self.losses: list[tuple[str, int, float]] = []

    # ---- state ---------------------------------------------------------------------------
    def state(self) -> dict:
        return dict(recipe=asdict(self.r), phase=self.phase, step=self.step, seconds=self.seconds,
                    rng=self.rng.bit_generator.state, gen=self.gen.get_state(),
                    models={m: getattr(self.pipe, m).state_dict() for m in ("vae",) + self.FLOW_MODULES},
                    vae_config=dict(scaling_factor=self.pipe.vae.config.scaling_factor,
                                    shift_factor=self.pipe.vae.config.shift_factor),
                    vae_opt=self.vae_opt.state_dict(), flow_opt=self.flow_opt.state_dict(), ema=self.ema,
                    losses=self.losses)

    def load(self, st: dict) -> None:
        self.phase, self.step, self.seconds = st["phase"], st["step"], st["seconds"]
        self.rng.bit_generator.state = st["rng"]
        self.gen.set_state(st["gen"])
        for m, sd in st["models"].items():
            getattr(self.pipe, m).load_state_dict(sd)
        self.pipe.vae.register_to_config(**st["vae_config"])
        self.vae_opt.load_state_dict(st["vae_opt"])
        self.flow_opt.load_state_dict(st["flow_opt"])
        self.ema = st["ema"]
        self.losses = st["losses"]

    def checkpoint(self) -> None:
        _atomic_save(self.state(), self.out / "state.pt")

    # ---- phases --------------------------------------------------------------------------
    def vae_step(self) -> float:
        vae = self.pipe.vae
        vae.train()
        images = _images(random_scenes(self.rng, self.r.vae_batch))
        c = self.r.vae_crop
        if c < RESOLUTION:
            xy = self.rng.integers(0, (RESOLUTION - c) // 4 + 1, size=(len(images), 2)) * 4
            images = torch.stack([im[:, y: y + c, x: x + c] for im, (x, y) in zip(images, xy)])
        loss, l1 = vae_loss(vae, images, self.r.vae_kl, self.gen)
        self.vae_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), self.r.grad_clip)
        self.vae_opt.step()
        return float(l1.detach())

    @torch.no_grad()
    def finish_vae(self) -> None:
        """Freeze the VAE; latent mean/std over fresh scenes -> shift_factor / scaling_factor."""
        vae = self.pipe.vae.eval()
        rng = np.random.default_rng([self.r.seed, 1])
        n = self.r.vae_stats_scenes
        z = torch.cat([vae.encode(_images(random_scenes(rng, min(128, n - i)))).latent_dist.mean
                       for i in range(0, n, 128)])
        vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1.0 / z.std()))

    def chunk_path(self, i: int) -> Path:
        return self.out / "data" / f"chunk-{i:03d}.pt"

    @torch.no_grad()
    def make_chunk(self, i: int) -> None:
        """Scenes for prompts of both splits (tasks weighted as the recipe says) -> normalised latents."""
        rng = np.random.default_rng([self.r.seed, 2, i])
        scenes = random_scenes(rng, self.r.data_chunk, self.r.task_weights)
        vae, cfg = self.pipe.vae.eval(), self.pipe.vae.config
        lat = torch.cat([vae.encode(_images(scenes[j: j + 256])).latent_dist.mean
                         for j in range(0, len(scenes), 256)])
        lat = (lat - cfg.shift_factor) * cfg.scaling_factor
        self.chunk_path(i).parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(dict(latents=lat.half(), captions=[s.prompt for s in scenes]), self.chunk_path(i))

    def load_data(self) -> None:
        n = math.ceil(self.r.data_scenes / self.r.data_chunk)
        chunks = [torch.load(self.chunk_path(i)) for i in range(n)]
        self.latents = torch.cat([c["latents"] for c in chunks]).float()
        self.captions = [c for ch in chunks for c in ch["captions"]]

    def flow_step(self) -> float:
        r = self.r
        for m in self.FLOW_MODULES:
            getattr(self.pipe, m).train()
        idx = self.rng.integers(len(self.latents), size=r.flow_batch)
        drop = self.rng.random(r.flow_batch) < r.caption_dropout
        captions = ["" if d else self.captions[i] for i, d in zip(idx, drop)]
        lr = flow_lr(r, self.step)
        for g in self.flow_opt.param_groups:
            g["lr"] = lr
        loss = flow_loss(self.pipe, self.latents[torch.from_numpy(idx)], captions, self.gen, r.uniform_share)
        self.flow_opt.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in self.flow_opt.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, r.grad_clip)
        self.flow_opt.step()
        decay = min(r.ema, (1 + self.step) / (10 + self.step))
        with torch.no_grad():
            for m in self.FLOW_MODULES:
                for k, v in getattr(self.pipe, m).state_dict().items():
                    e = self.ema[m][k]
                    if v.dtype.is_floating_point:
                        e.lerp_(v, 1 - decay)
                    else:
                        e.copy_(v)
        return float(loss.detach())

    def ema_pipeline(self):
        """A copy of the pipeline with the EMA weights (the training weights stay as they are)."""
        import copy

        pipe = copy.deepcopy(self.pipe)
        for m in self.FLOW_MODULES:
            getattr(pipe, m).load_state_dict(self.ema[m])
            getattr(pipe, m).eval()
        pipe.vae.eval()
        return pipe


class _Session:
    """One call of `train`: its time budget, a checkpoint every few minutes, the progress bar, and a log
    line now and then when the bar cannot be drawn (`nohup ... > log`)."""

    def __init__(self, tr: _Trainer, bar, max_minutes: float | None, progress: bool, tune_threads: bool):
        self.tr, self.bar, self.max_minutes, self.progress = tr, bar, max_minutes, progress
        self.threads = ThreadTuner() if tune_threads else contextlib.nullcontext()
        self.start = self.last_checkpoint = time.monotonic()
        self.seconds0 = tr.seconds

    def tick(self) -> bool:
        """Account time; checkpoint every few minutes; False when this call's budget is spent."""
        now = time.monotonic()
        self.tr.seconds = self.seconds0 + now - self.start
        if now - self.last_checkpoint > self.tr.r.checkpoint_minutes * 60:
            self.tr.checkpoint()
            self.last_checkpoint = now
        return self.max_minutes is None or now - self.start < self.max_minutes * 60

    def stepped(self, phase: str, name: str, value: float, smoothed: list, task, total: int) -> None:
        """One finished step of a phase: smoothed loss (kept every 10 steps), progress bar, log line."""
        tr = self.tr
        tr.step += 1
        smoothed[0] = value if smoothed[0] is None else 0.98 * smoothed[0] + 0.02 * value
        if tr.step % 10 == 0:
            tr.losses.append((phase, tr.step, smoothed[0]))
        self.bar.update(task, advance=1, info=f"{name} {smoothed[0]:.4f} ({torch.get_num_threads()} thr)")
        if self.progress and not console.is_terminal and tr.step % 50 == 0:
            console.print(f"{phase} {tr.step}/{total} {name} {smoothed[0]:.4f} ({torch.get_num_threads()} threads, "
                          f"{tr.seconds / 60:.1f} min)", highlight=False)


def _claim(out: Path) -> None:
    """A folder is a pretraining run once it holds state.pt (written before anything else is, through
    state.pt.tmp); anything else in it (an RL run folder given as --out by mistake) is refused, not written into."""
    if out.is_file() or (out.is_dir() and not (out / "state.pt").is_file()
                         and any(p.name != "state.pt.tmp" and not p.name.startswith(".") for p in out.iterdir())):
        raise InputError(f"{out} is {'a file' if out.is_file() else 'a folder of other files'}, not a pretraining run",
                         "pass a new or empty --out folder (or the folder of the run to continue)")


def _resume(tr: _Trainer, r: Recipe) -> None:
    """Continue the run in tr.out/state.pt, if its recipe is `r`'s. It may be lengthened or shortened while
    every step it took had the learning rate the new length gives it too (before either cooldown began);
    a field added since that run keeps its default."""
    st = torch.load(tr.out / "state.pt", weights_only=False)
    free = ("flow_steps", "snapshot_every", "checkpoint_minutes")
    mine = {k: v for k, v in asdict(r).items() if k not in free}
    theirs = {**mine, **{k: v for k, v in st["recipe"].items() if k not in free}}
    if theirs != mine:
        differ = ", ".join(f"{k} {theirs[k]} (now {mine[k]})" for k in mine if theirs[k] != mine[k])
        raise ConfigError(f"{tr.out} holds a run with another recipe: {differ}",
                          "rerun with that run's options (e.g. its --task-weight) or use a fresh --out folder")
    then = replace(r, flow_steps=st["recipe"].get("flow_steps", r.flow_steps))
    taken = st["step"] if st["phase"] in ("flow", "done") else 0
    if any(flow_lr(then, s) != flow_lr(r, s) for s in range(taken)):
        raise ConfigError(f"{tr.out} took {taken} of {then.flow_steps} flow steps, into its learning-rate cooldown: "
                          f"{r.flow_steps} steps would continue at another rate than it trained with",
                          f"pass --flow-steps {then.flow_steps} (its own) or use a fresh --out folder")
    tr.load(st)
    console.print(f"resuming {tr.out}: phase {tr.phase}, step {tr.step}, {tr.seconds / 60:.1f} min so far")


def _vae_phase(tr: _Trainer, s: _Session) -> bool:
    """Phase 1: the autoencoder alone, then frozen with its latent statistics. False: out of time (checkpointed)."""
    r = tr.r
    task = s.bar.add_task("vae", total=r.vae_steps, completed=tr.step, info="")
    smoothed = [None]
    while tr.step < r.vae_steps:
        with s.threads:
            l1 = tr.vae_step()
        s.stepped("vae", "L1", l1, smoothed, task, r.vae_steps)
        if not s.tick():
            tr.checkpoint()
            return False
    tr.finish_vae()
    tr.phase, tr.step = "data", 0
    tr.checkpoint()
    return True


def _data_phase(tr: _Trainer, s: _Session) -> bool:
    """Phase 2: scenes encoded once into latent chunks on disk (each chunk a file: a rerun skips the
    finished ones). False: out of time."""
    n_chunks = math.ceil(tr.r.data_scenes / tr.r.data_chunk)
    task = s.bar.add_task("data", total=n_chunks, info="")
    for i in range(n_chunks):
        s.bar.update(task, advance=1)
        if tr.chunk_path(i).is_file():
            continue
        tr.make_chunk(i)
        if not s.tick():
            return False
    tr.phase, tr.step = "flow", 0
    tr.checkpoint()
    return True


def _flow_phase(tr: _Trainer, s: _Session) -> bool:
    """Phase 3: transformer and text encoders on the latents, EMA snapshots every `snapshot_every` steps.
    False: out of time (checkpointed)."""
    r = tr.r
    tr.load_data()
    task = s.bar.add_task("flow", total=r.flow_steps, completed=tr.step, info="")
    smoothed = [None]
    while tr.step < r.flow_steps:
        with s.threads:
            loss = tr.flow_step()
        s.stepped("flow", "loss", loss, smoothed, task, r.flow_steps)
        if r.snapshot_every and tr.step % r.snapshot_every == 0 and tr.step < r.flow_steps:
            save_pipeline(tr.ema_pipeline(), tr.out / "snapshots" / f"step-{tr.step:05d}")
        if not s.tick():
            tr.checkpoint()
            return False
    return True


def train(out: Path, recipe: Recipe | None = None, max_minutes: float | None = None, progress: bool = True,
          tune_threads: bool = True) -> Path | None:
    """Run (or continue) pretraining into `out`; returns `out/pipeline` once finished, None when
    `max_minutes` of this call ran out first (rerun to continue). tune_threads: let `ThreadTuner` pick
    1 or all threads (faster on a shared CPU; floating-point results then depend on its picks)."""
    r, out = (recipe or Recipe()).validate(), Path(out)
    if max_minutes is not None and not (isinstance(max_minutes, (int, float)) and math.isfinite(max_minutes)
                                        and max_minutes >= 0):  # 0: claim the folder and stop
        raise InputError(f"--max-minutes {max_minutes!r} must be a number of minutes >= 0",
                         "e.g. --max-minutes 30 (rerun the same command to continue), or leave it out")
    # 1. The folder: new, empty, or a run of this recipe to continue.
    _claim(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(r.seed)
    tr = _Trainer(out, r)
    if (out / "state.pt").is_file():
        _resume(tr, r)
    # 2. The phases in order, each resumable, until done or this call's time is spent.
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=console, disable=not progress) as bar:
        s = _Session(tr, bar, max_minutes, progress, tune_threads)
        if tr.phase == "vae" and not _vae_phase(tr, s):
            return None
        if tr.phase == "data" and not _data_phase(tr, s):
            return None
        if not _flow_phase(tr, s):
            return None
    # 3. The EMA weights as a diffusers pipeline.
    tr.phase = "done"
    tr.checkpoint()
    save_pipeline(tr.ema_pipeline(), out / "pipeline")
    console.print(f"[green]done[/]: {out / 'pipeline'} after {tr.seconds / 60:.1f} min")
    return out / "pipeline"


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def _complete(m, emb: dict, x: torch.Tensor, sigmas, k: int, guidance: float, v: torch.Tensor | None = None) -> np.ndarray:
    """Euler ODE steps with CFG from the state x at sigmas[k] to sigma = 0 -> uint8 [B, H, W, 3]. v: v(x) when the
    caller has it already (one network call saved)."""
    for t in range(k, len(sigmas) - 1):
        if v is None:
            v = m.velocity(x, torch.full((len(x),), sigmas[t]), emb, guidance)
        x, v = formulas.ode_step(x, v, sigmas[t], sigmas[t + 1]), None
    return m.decode(x)


def ode_images(m, emb: dict, x: torch.Tensor, steps: int, guidance: float) -> np.ndarray:
    """The evaluation sampler: `steps` Euler ODE steps with CFG from the noise x -> uint8 [B, H, W, 3]."""
    with torch.no_grad():
        return _complete(m, emb, x, m.sigmas(steps, RESOLUTION), 0, guidance)


def branch_images(m, emb: dict, x: torch.Tensor, steps: int, guidance: float, sampler: str, noise_level: float,
                  gen: torch.Generator) -> np.ndarray:
    """What the score stage judges along one rollout with the window (0, T - 1): a trajectory s_0 = x, s_1, ...,
    s_{T-1} of T - 1 stochastic steps (`formulas.stochastic_step`, noise drawn from `gen`), and the Euler ODE
    completion (CFG) from every state s_k, k = 0..T-1 -> uint8 [B, T, H, W, 3]. The completion from s_0 is
    ode_images(x); one velocity v(s_k) serves both s_k's completion and its stochastic step."""
    sigmas = m.sigmas(steps, RESOLUTION)
    out = []
    with torch.no_grad():
        for k in range(steps):
            v = m.velocity(x, torch.full((len(x),), sigmas[k]), emb, guidance)
            out.append(_complete(m, emb, x, sigmas, k, guidance, v))
            if k < steps - 1:
                eps = torch.randn(x.shape, generator=gen)
                x = formulas.stochastic_step(sampler, x, v, sigmas[k], sigmas[k + 1], noise_level, sigmas[1],
                                             noise=eps).sample
    return np.stack(out, 1)


def accuracy(model: str, metadata: list[dict], images_per_prompt: int = 4, steps: int = 40, guidance: float = GUIDANCE,
             seed: int = 0, batch_size: int = 32, text_length: int = TEXT_LENGTH, lora: str | None = None) -> dict:
    """GenEval accuracy with the shapes detector, sampled like `tpkit eval geneval` (ODE, CFG, one seed
    per image): {"overall": unweighted mean over tasks, task: accuracy, ...}. For choosing a checkpoint
    on train-split prompts while pretraining; the held-out number comes from `tpkit eval geneval`.
    lora: an adapter from `tpkit train` on the model."""
    return accuracies(model, metadata, (None,), images_per_prompt, steps, guidance, seed, batch_size, text_length, lora)[0]


def accuracies(model: str, metadata: list[dict], thresholds: tuple[float | None, ...], images_per_prompt: int = 4,
               steps: int = 40, guidance: float = GUIDANCE, seed: int = 0, batch_size: int = 32,
               text_length: int = TEXT_LENGTH, lora: str | None = None) -> list[dict]:
    """`accuracy` of the same images judged at each detection threshold (`tpkit.geneval.judge`; None:
    GenEval's): one result per threshold, the images sampled once."""
    from PIL import Image

    m = models.load(model, device="cpu", lora=lora)
    detector, colours = detectors.load_models("shapes")
    jobs = [(meta, j) for meta in metadata for j in range(images_per_prompt)]
    right: list[dict[str, list[bool]]] = [{} for _ in thresholds]
    for b in range(0, len(jobs), batch_size):
        batch = jobs[b: b + batch_size]
        emb = m.encode([meta["prompt"] for meta, _ in batch], text_length)
        g = torch.Generator().manual_seed(seed * 1_000_003 + b)
        x = torch.randn(len(batch), *m.latent_shape(RESOLUTION), generator=g)
        images = [Image.fromarray(a) for a in ode_images(m, emb, x, steps, guidance)]
        for th, out in zip(thresholds, right):
            judged = detectors.detect_and_judge(images, [meta for meta, _ in batch], detector, colours, threshold=th)
            for (meta, _), jd in zip(batch, judged):
                out.setdefault(meta["tag"], []).append(bool(jd.correct))
    results = []
    for out in right:
        acc = {tag: float(np.mean(v)) for tag, v in out.items()}
        results.append({**acc, "overall": float(np.mean(list(acc.values())))})
    return results


def sample_grid(model: str, prompts: list[str], seeds: list[int], path: Path, steps: int = 40, guidance: float = GUIDANCE,
                scale: int = 2) -> Path:
    """A captioned PNG: one row per prompt, one column per seed (the eval sampler: ODE, CFG)."""
    from PIL import Image, ImageDraw, ImageFont

    m = models.load(model, device="cpu")
    emb = m.encode([p for p in prompts for _ in seeds], TEXT_LENGTH)
    x = torch.stack([torch.randn(m.latent_shape(RESOLUTION), generator=torch.Generator().manual_seed(s))
                     for _ in prompts for s in seeds])
    images = ode_images(m, emb, x, steps, guidance)
    cell, pad, label = RESOLUTION * scale, 4, 250
    grid = Image.new("RGB", (label + len(seeds) * (cell + pad), len(prompts) * (cell + pad)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i, p in enumerate(prompts):
        y = i * (cell + pad)
        draw.text((6, y + cell // 2 - 8), p.removeprefix("a photo of "), fill=(0, 0, 0), font=ImageFont.load_default(15))
        for j in range(len(seeds)):
            im = Image.fromarray(images[i * len(seeds) + j]).resize((cell, cell), Image.Resampling.NEAREST)
            grid.paste(im, (label + j * (cell + pad), y))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path
