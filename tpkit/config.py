"""Typed configuration of every stage, validated up front with messages that say what to change.

Each stage's dataclass is what its CLI command builds from flags and what a recipe section
holds; its resolved form (`asdict`) is saved into the stage's manifest. A field's default and help
text are declared here once (`doc`); the CLI's options take both from the field (`tpkit.cli.opt`).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tpkit import models
from tpkit.errors import ConfigError
from tpkit.models.names import TINY_MODEL

SAMPLERS = ("sde", "cps")
METHODS = ("tp-grpo", "flow-grpo")
BRANCHES = ("all", "final")
BALANCE = ("all", "none")
STD_MODES = ("group", "global")
TRACKERS = ("none", "tensorboard", "wandb")  # --log-with (tpkit.tracking)
PRECISIONS = ("no", "fp16", "bf16")
BRANCH_SOLVERS = ("euler", "heun", "ab2")  # score.branch_solver: formulas.ode_step, heun_step, ab2_step
OPTIMIZERS = ("adamw", "adamw8bit")  # torch's AdamW; bitsandbytes' 8-bit AdamW (an optional extra)
FINETUNES = ("lora", "full")  # what train updates: a LoRA adapter, or every weight of the transformer
KL_MODES = ("release", "exact")


def doc(default: Any = MISSING, help: str | None = None, *, factory: Any = MISSING) -> Any:
    """A dataclass field with the help text its CLI option shows: `steps: int = doc(10, "Sampling steps T.")`."""
    return field(default=default, default_factory=factory, metadata={"help": help} if help else {})


def default(cls: type, name: str) -> Any:
    """The default of field `name` of config dataclass `cls` (a fresh one for `default_factory` fields)."""
    f = next((f for f in fields(cls) if f.name == name), None)
    if f is None:
        raise AttributeError(f"{cls.__name__} has no field {name!r}")
    return f.default_factory() if f.default_factory is not MISSING else f.default


def defaults(cls: type) -> dict[str, Any]:
    """Every field of config dataclass `cls` that has a default -> that default."""
    return {f.name: default(cls, f.name) for f in fields(cls)
            if f.default is not MISSING or f.default_factory is not MISSING}


def field_help(cls: type, name: str) -> str | None:
    """The help text of field `name` of `cls` (None: the field has none)."""
    return next(f.metadata.get("help") for f in fields(cls) if f.name == name)


# Help of fields several stages share.
_MODEL = ("Hub id, local folder, or a built-in model: tiny-sd3, tiny-flux, tiny-qwen-image (random, built locally), "
          "tiny-shapes (pretrained, shipped).")
_FAMILY = "Model family, sd3, flux or qwen-image (default: from the model: its model_index.json, else its name)."
_GUIDANCE = ("Guidance scale (default: the model's, as the release: CFG 4.5 for SD3.5, "
             "distilled guidance 3.5 for FLUX.1-dev).")
_TEXT_LENGTH = "T5 tokens per prompt (default: the model's; 128 for SD3.5, as the release)."
_RESOLUTION = "Image size in pixels (default: the model's; 512, 64 for the tiny ones)."
_OVERWRITE = "Clear the output folder first and redo the stage."
_DEVICE = "cuda, cpu, cuda:1 ... (auto: cuda if available)."
_DTYPE = "Model dtype: auto (bf16 on CUDA, float32 on CPU), float32, bf16, fp16."
_RANK = "This process's rank (default: $RANK or 0)."
_WORLD = "Number of processes (default: $WORLD_SIZE or 1)."


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} = {value!r} is not one of {', '.join(choices)}", f"set {name} to one of {', '.join(choices)}")


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} = {value} must be {'>= 0' if allow_zero else '> 0'}", f"set {name} to a positive value")


def _type_ok(value: Any, annotation: str) -> tuple[bool, Any]:
    """Does a recipe/option value fit a field's annotation (a string: postponed annotations)?
    Returns (ok, value converted where lossless, e.g. int -> float)."""
    annotation = annotation.replace(" ", "")
    if annotation.endswith("|None"):
        return (True, None) if value is None else _type_ok(value, annotation[: -len("|None")])
    if annotation == "bool":
        return isinstance(value, bool), value
    if annotation == "int":
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if annotation == "str":
        return isinstance(value, str), value
    if annotation.startswith("tuple[int,int]"):
        ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(_type_ok(v, "int")[0] for v in value)
        return ok, tuple(value) if ok else value
    if annotation.startswith("list[str]"):
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value), list(value) if isinstance(value, (list, tuple)) else value
    if annotation.startswith("dict"):
        return isinstance(value, dict), value
    return True, value


def check_types(cfg: Any, section: str = "") -> None:
    """Every field of a config dataclass has a value of its declared type (recipes and --set are
    untyped text: "abc" for an int or "no" for a bool must be an error that names the key)."""
    for f in fields(cfg):
        ok, value = _type_ok(getattr(cfg, f.name), str(f.type))
        if not ok:
            key = f"{section}.{f.name}" if section else f.name
            want = str(f.type).replace("|", " or ")
            raise ConfigError(f"{key} = {getattr(cfg, f.name)!r} is not of type {want}",
                              f"set {key} to a {want} value (strings in TOML need quotes: true/false for booleans)")
        if isinstance(value, float) and not math.isfinite(value):  # `--beta nan` would train on NaN losses
            key = f"{section}.{f.name}" if section else f.name
            raise ConfigError(f"{key} = {value} is not a finite number", f"set {key} to a finite number")
        setattr(cfg, f.name, value)


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size from flags, else from RANK/WORLD_SIZE (accelerate launch, torchrun), else 0/1."""
    r = rank if rank is not None else int(os.environ.get("RANK", 0))
    w = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    if w < 1 or not 0 <= r < w:
        raise ConfigError(f"rank {r} is not in [0, world size {w})", "pass --rank in [0, --world-size)")
    return r, w


def _model_defaults(cfg) -> None:
    """Fill a sampling config's family, resolution, text length and guidance from its model."""
    if cfg.family is None:
        cfg.family = models.family_of(cfg.model)
    _choice("family", cfg.family, tuple(models.FAMILIES))
    # Forcing is for models only a name could tell; a contradiction would load the wrong code (and,
    # the family being left out of stage identities, could pass as an earlier finished stage).
    if (known := models.known_family(cfg.model)) not in (None, cfg.family):
        raise ConfigError(f"family {cfg.family!r} contradicts the model {cfg.model}, which is a {known!r} model",
                          f"leave --family out (it follows from the model) or pass a {cfg.family} model")
    for attr, key in (("resolution", "resolution"), ("max_sequence_length", "text_length"), ("guidance", "guidance")):
        if getattr(cfg, attr) is None:
            setattr(cfg, attr, models.default(cfg.model, key, cfg.family))


@dataclass
class RolloutConfig:
    model: str = doc(TINY_MODEL, _MODEL)
    family: str | None = doc(None, _FAMILY)  # None: tpkit.models.family_of
    prompts: str = doc("", ".txt (one prompt a line) or .jsonl (objects with \"prompt\").")
    out: str = doc("", "Output folder for shards and manifest.json.")
    group_size: int = doc(24, "Trajectories per prompt (the GRPO group).")
    steps: int = doc(10, "Sampling steps T.")
    guidance: float | None = doc(None, _GUIDANCE)
    resolution: int | None = doc(None, _RESOLUTION)
    sampler: str = doc("cps", "sde (Flow-GRPO) or cps (coefficients-preserving; the paper's).")
    noise_level: float = doc(0.7, "Noise level a of the stochastic sampler.")
    window_size: int = doc(9, "K: number of consecutive stochastic steps.")
    window_range: tuple[int, int] = doc((0, 9), "LO HI: the window start is drawn from [LO, HI - K].")
    seed: int = doc(0, "Base seed; each trajectory's seed derives from (seed, prompt, member).")
    lora: str | None = doc(None, "LoRA adapter folder from `tpkit train` (the current policy).")
    prompts_per_shard: int = doc(4, "Prompt groups per shard (groups never split).")
    batch_size: int = doc(8, "Trajectories per transformer batch (CFG doubles it).")
    max_sequence_length: int | None = doc(None, _TEXT_LENGTH)
    dtype: str = doc("auto", _DTYPE)
    device: str = doc("auto", _DEVICE)
    prompts_per_round: int = doc(0, "0: every prompt; N: a random subset of N prompts, drawn from the seed "
                                    "(file order kept).")
    overwrite: bool = doc(False, _OVERWRITE)
    rank: int | None = doc(None, _RANK)
    world_size: int | None = doc(None, _WORLD)

    def __post_init__(self) -> None:
        self.window_range = tuple(self.window_range)
        _model_defaults(self)

    def validate(self) -> "RolloutConfig":
        check_types(self)
        if not self.prompts:
            raise ConfigError("no prompts file given", "pass --prompts FILE (.txt, one prompt a line, or .jsonl)")
        _choice("sampler", self.sampler, SAMPLERS)
        for name in ("group_size", "steps", "window_size", "prompts_per_shard", "batch_size", "max_sequence_length"):
            _positive(name, getattr(self, name))
        _positive("guidance", self.guidance)
        _positive("prompts_per_round", self.prompts_per_round, allow_zero=True)
        if not 0 < self.noise_level <= (1.0 if self.sampler == "cps" else 10.0):
            raise ConfigError(f"noise_level = {self.noise_level} is out of range for sampler {self.sampler}",
                              "use a value in (0, 1] for cps (paper: 0.7) or a positive value for sde")
        lo, hi = self.window_range
        if not (0 <= lo and hi <= self.steps and hi - lo >= self.window_size):
            raise ConfigError(
                f"window range ({lo}, {hi}) with window size {self.window_size} does not fit {self.steps} steps",
                "need 0 <= LO, HI <= steps and HI - LO >= window size (paper: --window-range 0 9 --window-size 9 --steps 10)")
        if self.sampler == "cps" and hi >= self.steps:
            # CPS noise is sigma_{j+1} sin(a pi / 2): 0 on the last step, whose transition is then
            # deterministic (no exploration, ratio always 1, KL undefined).
            raise ConfigError(f"window range ({lo}, {hi}) reaches the last step, where CPS adds no noise",
                              f"end the window before step {self.steps}: HI <= {self.steps - 1} (paper: --window-range 0 9 --steps 10)")
        if self.lora:
            self.lora = str(Path(self.lora).expanduser().resolve())  # later stages read it from the manifest
        if self.resolution % 16:
            raise ConfigError(f"resolution {self.resolution} is not a multiple of 16", "use e.g. 512 (or 64 for tiny-sd3)")
        self.rank, self.world_size = resolve_rank(self.rank, self.world_size)
        return self


@dataclass
class ScoreConfig:
    rollout: str = doc("", "Folder written by `tpkit rollout`.")
    out: str = doc("", "Output folder for scores Parquet and manifest.json.")
    rewards: dict[str, float] = field(default_factory=lambda: {"jpeg-compressibility": 1.0})  # name -> weight
    reward_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> its options (model paths ...)
    branches: str = doc("all", "all: R_0..R_K (TP-GRPO); final: only R_K (Flow-GRPO).")
    batch_size: int = doc(16, "Branches per transformer batch (CFG doubles it).")
    decode_batch_size: int = doc(8, "Images per VAE decode and reward call.")
    reward_workers: int = doc(1, "Threads scoring images while the transformer runs (0: inline).")
    branch_steps: int = doc(0, "0: exact branches; N: at most N ODE steps per branch (faster, approximate).")
    branch_solver: str = doc("euler", "euler: the rollout's own ODE steps (exact with branch_steps 0); heun: second "
                                      "order, two calls a step; ab2: second-order multistep, one call a step; "
                                      "both for --branch-steps N (formulas.heun_step, ab2_step).")
    on_nan: str = doc("stop", "A NaN/infinite reward: stop (list the trajectories) or drop them.")
    overwrite: bool = doc(False, _OVERWRITE)
    dtype: str = doc("auto", _DTYPE)
    device: str = doc("auto", _DEVICE)
    rank: int | None = doc(None, _RANK)
    world_size: int | None = doc(None, _WORLD)

    def validate(self) -> "ScoreConfig":
        check_types(self)
        _choice("branches", self.branches, BRANCHES)
        _choice("on_nan", self.on_nan, ("stop", "drop"))
        if not self.rewards:
            raise ConfigError("no reward given", "pass --reward NAME[=WEIGHT], e.g. --reward jpeg-compressibility")
        for name in ("batch_size", "decode_batch_size"):
            _positive(name, getattr(self, name))
        _positive("reward_workers", self.reward_workers, allow_zero=True)
        _positive("branch_steps", self.branch_steps, allow_zero=True)
        _choice("branch_solver", self.branch_solver, BRANCH_SOLVERS)
        if self.branch_solver != "euler" and not self.branch_steps:  # R_k is defined by the sampler's own Euler steps
            raise ConfigError(f"branch_solver = {self.branch_solver} needs branch_steps: on the full schedule it costs "
                              "more calls than the exact Euler branches that define R_k",
                              "add --branch-steps N (fewer steps than the rollout's), or keep branch_solver = euler")
        self.rank, self.world_size = resolve_rank(self.rank, self.world_size)
        return self


@dataclass
class AdvantagesConfig:
    scores: str = doc("", "Folder of scores Parquet files, or one file.")
    out: str = doc("", "Output folder for advantages.parquet and manifest.json.")
    method: str = doc("tp-grpo", "tp-grpo (turning points) or flow-grpo (r_k = R_K).")
    balance: str = doc("all", "all: balance positive/negative turning points; none: keep all.")
    std: str = doc("group", "group: per-prompt std; global: std over all trajectories per step.")
    overwrite: bool = doc(False, _OVERWRITE)

    def validate(self) -> "AdvantagesConfig":
        check_types(self)
        _choice("method", self.method, METHODS)
        _choice("balance", self.balance, BALANCE)
        _choice("std", self.std, STD_MODES)
        return self


@dataclass
class EvalConfig:
    kind: str = "reward"  # reward | geneval
    model: str = doc(TINY_MODEL, _MODEL)
    family: str | None = doc(None, _FAMILY)  # None: tpkit.models.family_of
    lora: str | None = doc(None, "LoRA adapter folder (e.g. runs/NAME/round-NNNN/train/adapter).")
    prompts: str = doc("", "Test prompts: .txt or .jsonl.")  # geneval: GenEval metadata; "": GenEval's 553
    out: str = doc("", "Output folder: images/, results.jsonl, summary.json, grid PNGs.")
    images: str | None = doc(None, "Evaluate this folder of images (GenEval layout) instead of generating.")
    rewards: dict[str, float] = field(default_factory=dict)  # name -> weight
    reward_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> its options
    images_per_prompt: int = doc(4, "Images per prompt.")
    steps: int = doc(40, "ODE steps.")
    guidance: float | None = doc(None, _GUIDANCE)
    resolution: int | None = doc(None, _RESOLUTION)
    seed: int = doc(0, "Base seed; each image's seed derives from (seed, prompt, image).")
    batch_size: int = doc(8, "Images per transformer batch (CFG doubles it).")
    max_sequence_length: int | None = doc(None, _TEXT_LENGTH)
    grid_prompts: int = doc(8, "Prompts shown per grid PNG.")
    overwrite: bool = doc(False, _OVERWRITE)
    dtype: str = doc("auto", _DTYPE)
    device: str = doc("auto", _DEVICE)
    rank: int | None = doc(None, _RANK)
    world_size: int | None = doc(None, _WORLD)

    def validate(self) -> "EvalConfig":
        check_types(self)
        if self.kind not in ("reward", "geneval"):
            raise ConfigError(f"unknown evaluation {self.kind!r}", "use `tpkit eval reward` or `tpkit eval geneval`")
        if self.kind == "reward" and not self.rewards:
            raise ConfigError("no reward given", "pass --reward NAME[=WEIGHT], e.g. --reward pickscore")
        _model_defaults(self)
        for name in ("images_per_prompt", "steps", "batch_size", "grid_prompts", "max_sequence_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)} must be >= 1", f"set {name} to a positive value")
        _positive("guidance", self.guidance)  # as the rollout's: the sampler the evaluation measures
        if self.lora:
            self.lora = str(Path(self.lora).expanduser().resolve())
        self.rank, self.world_size = resolve_rank(self.rank, self.world_size)
        return self


@dataclass
class CompareConfig:
    """`tpkit eval compare`: every entry evaluated with one protocol (same prompts, seeds, sampler)."""
    entries: list[str] = doc(factory=list, help="NAME=MODEL or NAME=MODEL+LORA_FOLDER, repeatable: one column each, "
                                                "the first is the base the others are compared with.")
    protocol: EvalConfig = field(default_factory=EvalConfig)  # prompts, rewards, sampler; model/lora/out per entry
    out: str = doc("", "Output folder: entries/, compare.md|csv|json, grid.png.")
    geneval: bool = doc(False, "Also GenEval's accuracy (overall and per task) on the same images.")
    geneval_options: dict[str, Any] = field(default_factory=dict)  # detector, clip

    def parsed(self) -> list[tuple[str, str, str | None]]:
        """(name, model, lora or None) per entry."""
        out = []
        for e in self.entries:
            name, eq, rest = e.partition("=")
            model, plus, lora = rest.partition("+")
            if not eq or not re.fullmatch(r"[A-Za-z0-9][\w.-]*", name) or not model or (plus and not lora):
                raise ConfigError(f"--entry {e!r} is not NAME=MODEL or NAME=MODEL+LORA",
                                  "e.g. --entry base=tiny-sd3 --entry round4=tiny-sd3+runs/demo/round-0003/train/adapter "
                                  "(NAME: letters, digits, . _ -)")
            out.append((name, model, lora or None))
        return out

    def validate(self) -> "CompareConfig":
        entries = self.parsed()
        names = [n for n, _, _ in entries]
        if len(entries) < 1 or len(set(names)) != len(names):
            raise ConfigError(f"entries {names}: need at least one, each with its own name",
                              "pass --entry NAME=MODEL[+LORA] once per column, names unique")
        if not self.protocol.rewards and not self.geneval:
            raise ConfigError("nothing to measure", "pass --reward NAME (repeatable) and/or --geneval")
        if not self.protocol.prompts and not self.geneval:
            raise ConfigError("no prompts given", "pass --prompts FILE (.txt or .jsonl)")
        if not self.out:
            raise ConfigError("no output folder", "pass --out DIR")
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise ConfigError(f"--out {self.out} is a file, not a folder", "pass a folder (new or an earlier compare's)")
        return self


def lora_targets(targets: list[str] | None, family: str) -> list[str]:
    """The adapter's target modules: the family's default (the release's) when None, else the
    user's, each one of the family's known names (a bare `to_q` would match more than meant)."""
    d = models.family(family).DEFAULTS
    if targets is None:
        return list(d["lora_targets"])
    known = (*d["lora_targets"], *d["lora_targets_optional"])
    unknown = set(targets) - set(known)
    if unknown:
        raise ConfigError(f"unknown LoRA target(s) {', '.join(sorted(unknown))} for the {family} family",
                          f"choose from {', '.join(known)} (qualified names: `to_q` alone would also match "
                          "layers the release leaves alone)")
    return list(targets)


@dataclass
class TrainConfig:
    rollout: str = doc("", "Folder written by `tpkit rollout`.")
    advantages: str = doc("", "Folder written by `tpkit advantages`, or its advantages.parquet.")
    out: str = doc("", "Output folder: adapter/ (or model/ with finetune = full), state/, metrics.jsonl, manifest.json.")
    finetune: str = doc("lora", "lora: train a LoRA adapter (adapter/); full: every weight of the transformer, kept in "
                                "float32 (model/: a diffusers pipeline folder; 16 bytes a parameter with AdamW).")
    init_lora: str | None = doc(None, "adapter/ of a previous round (its state/ is continued too).")
    init_state: str | None = doc(None, "state/ of a previous round to continue (optimizer moments, step); default: "
                                       "the one beside --init-lora. With finetune = full the weights come from the "
                                       "rollout's model (the previous round's model/).")
    lora_rank: int = doc(32, "LoRA rank r.")
    lora_alpha: int = doc(64, "LoRA alpha.")
    lora_targets: list[str] | None = doc(  # None: the model family's; checked by train
        None, "Modules to adapt (repeatable; default: the model family's, as the release: SD3's joint-attention "
              "projections, FLUX's attention and double-block feed-forward layers; SD3.5's second attention "
              "(attn2.to_q ...) and FLUX's single-block proj_mlp/proj_out are opt-in).")
    optimizer: str = doc("adamw", "adamw (torch), or adamw8bit: bitsandbytes' AdamW with 8-bit moments (about a quarter "
                                  "of the optimizer state's memory; `pip install bitsandbytes`).")
    learning_rate: float = doc(3e-4, "AdamW learning rate.")
    adam_beta1: float = doc(0.9, "AdamW beta1.")
    adam_beta2: float = doc(0.999, "AdamW beta2.")
    adam_weight_decay: float = doc(1e-4, "AdamW weight decay.")
    adam_epsilon: float = doc(1e-8, "AdamW epsilon.")
    clip_range: float = doc(1e-5, "PPO clip range eps of the ratio.")
    adv_clip: float = doc(5.0, "Advantages are clamped to [-x, x].")
    beta: float = doc(1e-4, "KL weight; 0 skips the reference pass.")
    kl: str = doc("release", "release: the KL on the release's scale (sde: without its dt, so published weights "
                             "mean the same); exact: the Gaussian KL.")  # release: mean((mu - mu_ref)^2) / (2 s^2)
    optimizer_steps: int = doc(2, "Optimizer steps per round (transitions split evenly).")
    micro_batch_size: int = doc(0, "0: replay the rollout's batches (first ratio exactly 1); N: split them.")
    max_grad_norm: float = doc(1.0, "Gradient-norm clip.")
    mixed_precision: str = doc("no", "no, fp16 or bf16 (accelerate autocast).")
    drop_zero_advantage: bool = doc(True, "Leave trajectories whose advantage is 0 at every step out of the loss "
                                          "(as the release).")
    allow_no_op: bool = doc(False, "Accept a round with nothing to learn (every advantage 0, or every step non-finite): "
                                   "save the adapter unchanged instead of failing.")
    ema: bool = doc(False, "Keep an EMA of the LoRA: adapter/ is then the EMA, adapter-raw/ the trained weights.")
    ema_decay: float = doc(0.9, "EMA decay (after the release's warm-up).")  # warm-up: min((1 + g) / (10 + g), decay)
    ema_every: int = doc(8, "Update the EMA every N optimizer steps.")  # the release's 8
    gradient_checkpointing: bool = doc(False, "Trade compute for activation memory.")
    fsdp: bool = doc(False, "Shard the trained weights, gradients and optimizer state over the processes (FSDP2, "
                            "each transformer block a unit) instead of a full copy on each (DDP); also on under "
                            "`accelerate launch` with an FSDP config.")
    max_bad_steps: int = doc(3, "Stop after this many non-finite steps in a row.")
    checkpoint_every: int = doc(1, "Save a resumable checkpoint (adapter + optimizer) every N optimizer steps "
                                   "(0: only the final save).")
    overwrite: bool = doc(False, _OVERWRITE)
    log_with: str = doc("none", "Track the metrics of every optimizer step: none, tensorboard (OUT/tensorboard/) "
                                "or wandb (OUT/wandb/; offline without network).")
    seed: int = doc(0, "Seed of the micro-batch order.")
    dtype: str = doc("auto", _DTYPE)
    device: str = doc("auto", _DEVICE)

    def validate(self) -> "TrainConfig":
        check_types(self)
        _choice("mixed_precision", self.mixed_precision, PRECISIONS)
        _choice("kl", self.kl, KL_MODES)
        _choice("log_with", self.log_with, TRACKERS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("finetune", self.finetune, FINETUNES)
        if self.finetune == "full" and self.init_lora:
            raise ConfigError("finetune = full continues the rollout's model, not a LoRA (--init-lora)",
                              "sample with the previous round's model/ (`tpkit rollout --model`) and pass its state/ "
                              "as --init-state, or use finetune = lora")
        if self.finetune == "full" and self.ema:
            raise ConfigError("ema = true is not supported with finetune = full yet (it would keep a second float32 "
                              "copy of every weight)", "set train.ema = false, or use finetune = lora")
        if self.fsdp and (self.ema or self.optimizer == "adamw8bit" or self.mixed_precision == "fp16"):
            what = "ema = true" if self.ema else ("optimizer = adamw8bit" if self.optimizer == "adamw8bit" else
                                                  "mixed_precision = fp16")
            raise ConfigError(f"fsdp = true does not support {what} yet",
                              "use fsdp with ema = false, optimizer = adamw and mixed_precision = bf16 or no; "
                              "or DDP (fsdp = false)")
        if self.optimizer == "adamw8bit" and importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("optimizer = adamw8bit needs bitsandbytes, which is not installed",
                              "pip install bitsandbytes (or pip install 'tpkit[8bit]'), or use optimizer = adamw")
        for name in ("ema_every", "lora_rank", "lora_alpha", "learning_rate", "optimizer_steps", "max_grad_norm", "adv_clip",
                     "clip_range", "max_bad_steps"):
            _positive(name, getattr(self, name))
        _positive("beta", self.beta, allow_zero=True)
        _positive("micro_batch_size", self.micro_batch_size, allow_zero=True)
        _positive("checkpoint_every", self.checkpoint_every, allow_zero=True)
        if self.learning_rate > 1e6:  # AdamW moves each weight by about the learning rate per step
            raise ConfigError(f"learning_rate = {self.learning_rate} is above 1e6 (float32 overflows in AdamW)",
                              "use e.g. 3e-4 (the paper's)")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"ema_decay = {self.ema_decay} is not in [0, 1)", "use e.g. 0.9 (the release's)")
        for name, usual in (("adam_beta1", 0.9), ("adam_beta2", 0.999)):
            if not 0 <= getattr(self, name) < 1:  # torch.optim.AdamW refuses them only at the first step
                raise ConfigError(f"{name} = {getattr(self, name)} is not in [0, 1)", f"use e.g. {usual} (the default)")
        _positive("adam_epsilon", self.adam_epsilon)
        _positive("adam_weight_decay", self.adam_weight_decay, allow_zero=True)
        if self.init_lora:
            self.init_lora = str(Path(self.init_lora).expanduser().resolve())
        if self.init_state:
            self.init_state = str(Path(self.init_state).expanduser().resolve())
        return self


def parse_reward_options(specs: list[str]) -> dict[str, dict[str, Any]]:
    """['pickscore.model=/models/ps', 'ocr.x=1'] -> {'pickscore': {'model': '/models/ps'}, 'ocr': {'x': 1}}."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        name, dot, option = key.strip().rpartition(".")
        if not sep or not dot or not name or not option:
            raise ConfigError(f"--reward-opt {spec!r} is not NAME.OPTION=VALUE", "use e.g. --reward-opt pickscore.model=/models/PickScore_v1")
        out.setdefault(name, {})[option] = parse_value(value.strip())
    return out


def parse_reward_specs(specs: list[str]) -> dict[str, float]:
    """['pickscore', 'ocr=0.5'] -> {'pickscore': 1.0, 'ocr': 0.5}."""
    out: dict[str, float] = {}
    for spec in specs:
        name, sep, weight = spec.partition("=")
        name = name.strip()
        if not name:
            raise ConfigError(f"--reward {spec!r} has no name", "use --reward NAME or --reward NAME=WEIGHT")
        try:
            out[name] = float(weight) if sep else 1.0
        except ValueError:
            raise ConfigError(f"--reward {spec!r}: weight {weight!r} is not a number", "use e.g. --reward pickscore=1.0") from None
    return out


def to_dict(cfg: Any) -> dict:
    return asdict(cfg)


def field_names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def as_path(p: str | Path) -> Path:
    return Path(p).expanduser()


# --------------------------------------------------------------------------------------------
# Recipes: one TOML file for a whole run (`tpkit run`)
# --------------------------------------------------------------------------------------------

# Fields a recipe may not set: `tpkit run` wires them between stages and rounds.
_WIRED = {
    "rollout": {"out", "lora", "rank", "world_size", "seed", "overwrite"},
    "score": {"rollout", "out", "rewards", "reward_options", "rank", "world_size", "overwrite"},
    "advantages": {"scores", "out", "method", "overwrite"},
    "train": {"rollout", "advantages", "out", "init_lora", "init_state", "seed", "overwrite", "log_with"},
    "eval": {"model", "family", "lora", "out", "images", "resolution", "rank", "world_size", "overwrite"},
}
_SECTIONS = {"rollout": RolloutConfig, "score": ScoreConfig, "advantages": AdvantagesConfig, "train": TrainConfig,
             "eval": EvalConfig}


@dataclass
class Recipe:
    name: str  # default: the recipe file's stem
    rounds: int
    out: str  # default: runs/NAME
    method: str
    seed: int
    rollout: RolloutConfig
    score: ScoreConfig
    advantages: AdvantagesConfig
    train: TrainConfig
    eval: EvalConfig
    # Top-level keys with a default (counts: at least 0); [rewards] is the score section's rewards.
    eval_every: int = 0  # evaluate the adapter every N rounds (0: never), logged in rounds.jsonl
    log_with: str = "none"  # none | tensorboard | wandb (tpkit.tracking); may change when a run is continued
    log_images_every: int = 5  # with a tracker: a grid of the round's samples every N rounds (0: never)
    keep_rounds: int = 0  # keep the rollout shards (and full fine-tuning's weights) of round 0 and the last N rounds only (0: all)
    lr_half_life: int = 0  # halve train.learning_rate every N rounds, exponentially (0: constant); formulas.round_learning_rate

    def to_dict(self) -> dict:
        """The resolved recipe, as saved in run.toml (None values dropped: TOML has no null)."""
        rewards = {k: ({"weight": w, **self.score.reward_options[k]} if self.score.reward_options.get(k) else w)
                   for k, w in self.score.rewards.items()}
        d = {k: getattr(self, k) for k in _SCALARS} | {"rewards": rewards}
        for section, cls in _SECTIONS.items():
            d[section] = {k: v for k, v in asdict(getattr(self, section)).items() if k not in _WIRED[section]}
        return _toml_ready(d)


_SCALARS = {f.name: str(f.type) for f in fields(Recipe) if f.name not in _SECTIONS}  # top-level key -> type
_DEFAULTED = {f.name: f.default for f in fields(Recipe) if f.default is not MISSING}
_TOP = set(_SCALARS) | {"rewards"}


def _toml_ready(d: dict) -> dict:
    """None values dropped (TOML has no null), tuples as lists, as tomllib reads them back."""
    return {k: _toml_ready(v) if isinstance(v, dict) else (list(v) if isinstance(v, tuple) else v)
            for k, v in d.items() if v is not None}


def with_new_keys(saved: dict) -> dict:
    """A run.toml written by an older tpkit, with the recipe keys added since at their defaults (a new
    key's default keeps the behaviour from before it existed), so that the run can be continued."""
    out = _toml_ready(_DEFAULTED) | saved
    for section, cls in _SECTIONS.items():
        if section in saved:
            new = {f.name: default(cls, f.name) for f in fields(cls) if f.name not in _WIRED[section]}
            out[section] = _toml_ready(new) | saved[section]
    return out


def parse_value(text: str) -> Any:
    """A --set value as TOML (numbers, booleans, arrays, quoted strings), else the bare string."""
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `--set key=value` (dotted keys: rollout.group_size=8, method=flow-grpo)."""
    key, sep, value = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r} is not key=value", "use e.g. --set train.learning_rate=1e-3")
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {p} is not a section", "check the key against the recipe")
    node[parts[-1]] = parse_value(value.strip())


def _recipe_rewards(rewards: Any, path: Path) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """[rewards] maps a name to its weight, or to a table with `weight` and the reward's options:
    pickscore = 1.0   or   [rewards.pickscore] weight = 1.0, model = "/models/PickScore_v1"."""
    fix = 'write e.g. [rewards] pickscore = 1.0, or [rewards.pickscore] with weight = 1.0 and its options'
    if not isinstance(rewards, dict) or not rewards:
        raise ConfigError(f"{path}: [rewards] must name at least one reward", fix)
    weights, options = {}, {}
    for name, v in rewards.items():
        if isinstance(v, dict):
            v = dict(v)
            weight = v.pop("weight", 1.0)
            if v:
                options[name] = v
        else:
            weight = v
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"{path}: rewards.{name} weight {weight!r} is not a number", fix)
        weights[name] = float(weight)
    return weights, options


def load_recipe(path: str | Path, overrides: list[str] = (), rounds: int | None = None, out: str | None = None,
                log_with: str | None = None) -> Recipe:
    """Parse, override, check every key, resolve paths (relative to the recipe's folder) and validate."""
    import tomllib

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist", "pass a TOML recipe, e.g. pipelines/tiny-cpu.toml")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})", "fix the recipe's syntax") from None
    for o in overrides:
        apply_override(data, o)
    unknown = set(data) - _TOP - set(_SECTIONS)
    if unknown:
        raise ConfigError(f"{path}: unknown key {sorted(unknown)[0]!r}",
                          f"top-level keys are {', '.join(sorted(_TOP))} and sections [{'], ['.join(_SECTIONS)}]")
    sections = {}
    for name, cls in _SECTIONS.items():
        body = data.get(name, {})
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: {name} must be a section", f"write [{name}] with its keys below it")
        allowed = set(field_names(cls)) - _WIRED[name]
        bad = set(body) - allowed
        if bad:
            key = sorted(bad)[0]
            hint = ("set by `tpkit run` itself" if key in _WIRED[name] else f"valid keys: {', '.join(sorted(allowed))}")
            raise ConfigError(f"{path}: unknown key {name}.{key}", hint)
        try:
            sections[name] = cls(**body)
        except TypeError as e:
            raise ConfigError(f"{path}: [{name}]: {e}", "check the section's keys and values") from None
        check_types(sections[name], name)
    for key, kind in _SCALARS.items():
        if key in data and not _type_ok(data[key], kind)[0]:
            raise ConfigError(f"{path}: {key} = {data[key]!r} is not of type {kind}", f"set {key} to a {kind} value")
    method = data.get("method", "tp-grpo")
    _choice("method", method, METHODS)
    prompts = sections["rollout"].prompts
    if prompts and not Path(prompts).is_absolute():
        sections["rollout"].prompts = str((path.parent / prompts).resolve())
    weights, options = _recipe_rewards(data.get("rewards", {"jpeg-compressibility": 1.0}), path)
    sections["score"].rewards, sections["score"].reward_options = weights, options
    if "branches" not in data.get("score", {}):
        sections["score"].branches = "all" if method == "tp-grpo" else "final"  # flow-grpo needs only R_K
    sections["advantages"].method = method
    ev = sections["eval"]
    ev.model, ev.family, ev.resolution = sections["rollout"].model, sections["rollout"].family, sections["rollout"].resolution
    if "max_sequence_length" not in data.get("eval", {}):  # prompts encoded as in training
        ev.max_sequence_length = sections["rollout"].max_sequence_length
    if ev.kind == "reward" and not ev.rewards:  # by default, evaluate what is trained
        ev.rewards, ev.reward_options = dict(weights), dict(options)
    if ev.prompts and not Path(ev.prompts).is_absolute():
        ev.prompts = str((path.parent / ev.prompts).resolve())
    recipe = Recipe(
        name=str(data.get("name", path.stem)), rounds=int(rounds if rounds is not None else data.get("rounds", 1)),
        out=str(out or data.get("out") or Path("runs") / path.stem), method=method, seed=int(data.get("seed", 0)),
        **{k: data.get(k, default) for k, default in _DEFAULTED.items()}, **sections,
    )
    recipe.log_with = log_with or recipe.log_with
    for key in _DEFAULTED:
        if _SCALARS[key] == "int":
            _positive(key, getattr(recipe, key), allow_zero=True)
    _choice("log_with", recipe.log_with, TRACKERS)
    if recipe.eval_every:
        recipe.eval.validate()
    _positive("rounds", recipe.rounds)
    recipe.rollout.prompts = recipe.rollout.prompts or ""
    recipe.rollout.validate()
    recipe.score.validate()
    recipe.advantages.validate()
    recipe.train.validate()
    recipe.train.lora_targets = lora_targets(recipe.train.lora_targets, recipe.rollout.family)  # checked up front
    if method == "tp-grpo" and recipe.score.branches != "all":
        raise ConfigError("method tp-grpo needs every branch scored", "set score.branches = \"all\" (or method = \"flow-grpo\")")
    return recipe
