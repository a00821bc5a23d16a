"""Typed configuration of every stage, validated up front with messages that say what to change.

Each stage's dataclass is what its CLI command builds from flags and what a recipe section
holds; its resolved form (`asdict`) is saved into the stage's manifest.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tpkit.errors import ConfigError

TINY_MODEL = "tiny-sd3"  # random, built locally: proves plumbing
SHAPES_MODEL = "tiny-shapes"  # pretrained on coloured-shape scenes, shipped in the package: shows learning
FLUX_MODEL = "tiny-flux"  # random FLUX.1 in miniature, built locally: proves the FLUX plumbing
SAMPLERS = ("sde", "cps")
METHODS = ("tp-grpo", "flow-grpo")
BRANCHES = ("all", "final")
BALANCE = ("all", "none")
STD_MODES = ("group", "global")
TRACKERS = ("none", "tensorboard", "wandb")  # --log-with (tpkit.tracking)
PRECISIONS = ("no", "fp16", "bf16")
KL_MODES = ("release", "exact")

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
    from tpkit import models

    if cfg.family is None:
        cfg.family = models.family_of(cfg.model)
    _choice("family", cfg.family, tuple(models.FAMILIES))
    for attr, key in (("resolution", "resolution"), ("max_sequence_length", "text_length"), ("guidance", "guidance")):
        if getattr(cfg, attr) is None:
            setattr(cfg, attr, models.default(cfg.model, key, cfg.family))


@dataclass
class RolloutConfig:
    model: str = TINY_MODEL
    family: str | None = None  # None: the model's (tpkit.models.family_of); sd3 | flux
    prompts: str = ""
    out: str = ""
    group_size: int = 24
    steps: int = 10
    guidance: float | None = None  # None: the model's (4.5 for SD3.5)
    resolution: int | None = None  # None: the model's (512; 64 for tiny-sd3)
    sampler: str = "cps"
    noise_level: float = 0.7
    window_size: int = 9
    window_range: tuple[int, int] = (0, 9)
    seed: int = 0
    lora: str | None = None
    prompts_per_shard: int = 4
    batch_size: int = 8  # trajectories per transformer batch (CFG doubles it)
    max_sequence_length: int | None = None  # T5 tokens per prompt; None: the model's (128, the release's)
    dtype: str = "auto"  # auto: bf16 on CUDA, float32 on CPU
    device: str = "auto"
    prompts_per_round: int = 0  # 0: every prompt; N: a seeded random subset of N prompts
    overwrite: bool = False  # clear the output folder first and redo the stage
    rank: int | None = None  # None: $RANK or 0
    world_size: int | None = None  # None: $WORLD_SIZE or 1

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
    rollout: str = ""
    out: str = ""
    rewards: dict[str, float] = field(default_factory=lambda: {"jpeg-compressibility": 1.0})
    reward_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    branches: str = "all"
    batch_size: int = 16  # branches per transformer batch (CFG doubles it)
    decode_batch_size: int = 8
    reward_workers: int = 1  # threads scoring images while the transformer runs; 0: score inline
    branch_steps: int = 0  # 0: exact ODE completion; N: at most N steps per branch (faster, approximate)
    on_nan: str = "stop"  # a non-finite reward: stop and list the trajectories, or drop them (counted)
    overwrite: bool = False  # clear the output folder first and redo the stage
    dtype: str = "auto"
    device: str = "auto"
    rank: int | None = None
    world_size: int | None = None

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
        self.rank, self.world_size = resolve_rank(self.rank, self.world_size)
        return self


@dataclass
class AdvantagesConfig:
    scores: str = ""
    out: str = ""
    method: str = "tp-grpo"
    balance: str = "all"
    std: str = "group"
    overwrite: bool = False  # clear the output folder first and redo the stage

    def validate(self) -> "AdvantagesConfig":
        check_types(self)
        _choice("method", self.method, METHODS)
        _choice("balance", self.balance, BALANCE)
        _choice("std", self.std, STD_MODES)
        return self


@dataclass
class EvalConfig:
    kind: str = "reward"  # reward | geneval
    model: str = TINY_MODEL
    family: str | None = None  # None: the model's (tpkit.models.family_of); sd3 | flux
    lora: str | None = None
    prompts: str = ""  # .txt/.jsonl; for geneval GenEval metadata jsonl
    out: str = ""
    images: str | None = None  # score this GenEval-layout folder instead of generating
    rewards: dict[str, float] = field(default_factory=dict)
    reward_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    images_per_prompt: int = 4
    steps: int = 40
    guidance: float | None = None  # None: the model's (4.5 for SD3.5)
    resolution: int | None = None
    seed: int = 0
    batch_size: int = 8
    max_sequence_length: int | None = None  # T5 tokens per prompt; None: the model's (128, the release's)
    grid_prompts: int = 8  # prompts shown per grid PNG
    overwrite: bool = False  # clear the output folder first and redo the stage
    dtype: str = "auto"
    device: str = "auto"
    rank: int | None = None
    world_size: int | None = None

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
        if self.lora:
            self.lora = str(Path(self.lora).expanduser().resolve())
        self.rank, self.world_size = resolve_rank(self.rank, self.world_size)
        return self


@dataclass
class CompareConfig:
    """`tpkit eval compare`: every entry evaluated with one protocol (same prompts, seeds, sampler)."""
    entries: list[str] = field(default_factory=list)  # NAME=MODEL or NAME=MODEL+LORA_FOLDER, in table order
    protocol: EvalConfig = field(default_factory=EvalConfig)  # prompts, rewards, sampler; model/lora/out per entry
    out: str = ""
    geneval: bool = False  # also GenEval's verdict on the same images (prompts must be GenEval metadata)
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
    from tpkit import models

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
    rollout: str = ""
    advantages: str = ""
    out: str = ""
    init_lora: str | None = None  # adapter/ of a previous round; its sibling state/ continues the optimizer
    lora_rank: int = 32
    lora_alpha: int = 64
    lora_targets: list[str] | None = None  # None: the model family's (the release's); checked by train
    learning_rate: float = 3e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 1e-4
    adam_epsilon: float = 1e-8
    clip_range: float = 1e-5
    adv_clip: float = 5.0
    beta: float = 1e-4  # KL weight; 0 skips the reference pass
    kl: str = "release"  # release: mean((mu - mu_ref)^2) / (2 s^2) with the release's s; exact: the Gaussian KL
    optimizer_steps: int = 2  # per round; the transitions are split evenly among them
    micro_batch_size: int = 0  # 0: replay the rollout's own batches (first-step ratio exactly 1)
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"
    drop_zero_advantage: bool = True  # leave trajectories whose advantage is 0 at every step out of the loss
    allow_no_op: bool = False  # a round with nothing to learn (all advantages 0, every step non-finite) is not an error
    ema: bool = False  # adapter/ holds the EMA weights, adapter-raw/ the trained ones
    ema_decay: float = 0.9  # the release's, reached after a warm-up min((1 + g) / (10 + g), decay)
    ema_every: int = 8  # update the EMA every N optimizer steps (the release's 8)
    gradient_checkpointing: bool = False
    max_bad_steps: int = 3  # stop after this many non-finite losses in a row
    checkpoint_every: int = 1  # save adapter + optimizer every N optimizer steps (0: only at the end)
    overwrite: bool = False  # clear the output folder first and redo the stage
    log_with: str = "none"  # none | tensorboard | wandb: train metrics per optimizer step (tpkit.tracking)
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"

    def validate(self) -> "TrainConfig":
        check_types(self)
        _choice("mixed_precision", self.mixed_precision, PRECISIONS)
        _choice("kl", self.kl, KL_MODES)
        _choice("log_with", self.log_with, TRACKERS)
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
        if self.init_lora:
            self.init_lora = str(Path(self.init_lora).expanduser().resolve())
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
    "train": {"rollout", "advantages", "out", "init_lora", "seed", "overwrite", "log_with"},
    "eval": {"model", "family", "lora", "out", "images", "resolution", "rank", "world_size", "overwrite"},
}
_SECTIONS = {"rollout": RolloutConfig, "score": ScoreConfig, "advantages": AdvantagesConfig, "train": TrainConfig,
             "eval": EvalConfig}
_TOP = {"name", "rounds", "out", "method", "seed", "rewards", "eval_every", "log_with", "log_images_every"}


@dataclass
class Recipe:
    name: str
    rounds: int
    out: str
    method: str
    seed: int
    rollout: RolloutConfig
    score: ScoreConfig
    advantages: AdvantagesConfig
    train: TrainConfig
    eval: EvalConfig
    eval_every: int = 0  # evaluate the adapter every N rounds (0: never), logged in rounds.jsonl
    log_with: str = "none"  # none | tensorboard | wandb (tpkit.tracking); may change when a run is continued
    log_images_every: int = 5  # with a tracker: a grid of the round's samples every N rounds (0: never)

    def to_dict(self) -> dict:
        """The resolved recipe, as saved in run.toml (None values dropped: TOML has no null)."""
        def clean(d):
            return {k: clean(v) if isinstance(v, dict) else (list(v) if isinstance(v, tuple) else v)
                    for k, v in d.items() if v is not None}

        rewards = {k: ({"weight": w, **self.score.reward_options[k]} if self.score.reward_options.get(k) else w)
                   for k, w in self.score.rewards.items()}
        d = {"name": self.name, "rounds": self.rounds, "out": self.out, "method": self.method, "seed": self.seed,
             "rewards": rewards, "eval_every": self.eval_every, "log_with": self.log_with,
             "log_images_every": self.log_images_every}
        for section, cls in _SECTIONS.items():
            d[section] = {k: v for k, v in asdict(getattr(self, section)).items() if k not in _WIRED[section]}
        return clean(d)


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
    for key, kind in (("name", "str"), ("rounds", "int"), ("out", "str"), ("method", "str"), ("seed", "int"),
                      ("eval_every", "int"), ("log_with", "str"), ("log_images_every", "int")):
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
        eval_every=int(data.get("eval_every", 0)), log_with=str(log_with or data.get("log_with", "none")),
        log_images_every=int(data.get("log_images_every", 5)), **sections,
    )
    _positive("eval_every", recipe.eval_every, allow_zero=True)
    _positive("log_images_every", recipe.log_images_every, allow_zero=True)
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
