"""Typed configuration of every stage, validated up front with messages that say what to change.

Each stage's dataclass is what its CLI command builds from flags and what a recipe section
holds; its resolved form (`asdict`) is saved into the stage's manifest.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tpkit.errors import ConfigError

TINY_MODEL = "tiny-sd3"
SAMPLERS = ("sde", "cps")
METHODS = ("tp-grpo", "flow-grpo")
BRANCHES = ("all", "final")
BALANCE = ("all", "none")
STD_MODES = ("group", "global")
PRECISIONS = ("no", "fp16", "bf16")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} = {value!r} is not one of {', '.join(choices)}", f"set {name} to one of {', '.join(choices)}")


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} = {value} must be {'>= 0' if allow_zero else '> 0'}", f"set {name} to a positive value")


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size from flags, else from RANK/WORLD_SIZE (accelerate launch, torchrun), else 0/1."""
    r = rank if rank is not None else int(os.environ.get("RANK", 0))
    w = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    if w < 1 or not 0 <= r < w:
        raise ConfigError(f"rank {r} is not in [0, world size {w})", "pass --rank in [0, --world-size)")
    return r, w


@dataclass
class RolloutConfig:
    model: str = TINY_MODEL
    prompts: str = ""
    out: str = ""
    group_size: int = 24
    steps: int = 10
    guidance: float = 4.5
    resolution: int | None = None  # None: 512, or 64 for tiny-sd3
    sampler: str = "cps"
    noise_level: float = 0.7
    window_size: int = 9
    window_range: tuple[int, int] = (0, 9)
    seed: int = 0
    lora: str | None = None
    prompts_per_shard: int = 4
    batch_size: int = 8  # trajectories per transformer batch (CFG doubles it)
    max_sequence_length: int = 256
    dtype: str = "auto"  # auto: bf16 on CUDA, float32 on CPU
    device: str = "auto"
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        self.window_range = tuple(self.window_range)
        if self.resolution is None:
            self.resolution = 64 if self.model == TINY_MODEL else 512

    def validate(self) -> "RolloutConfig":
        if not self.prompts:
            raise ConfigError("no prompts file given", "pass --prompts FILE (.txt, one prompt a line, or .jsonl)")
        _choice("sampler", self.sampler, SAMPLERS)
        for name in ("group_size", "steps", "window_size", "prompts_per_shard", "batch_size", "max_sequence_length"):
            _positive(name, getattr(self, name))
        _positive("guidance", self.guidance)
        if not 0 < self.noise_level <= (1.0 if self.sampler == "cps" else 10.0):
            raise ConfigError(f"noise_level = {self.noise_level} is out of range for sampler {self.sampler}",
                              "use a value in (0, 1] for cps (paper: 0.7) or a positive value for sde")
        lo, hi = self.window_range
        if not (0 <= lo and hi <= self.steps and hi - lo >= self.window_size):
            raise ConfigError(
                f"window range ({lo}, {hi}) with window size {self.window_size} does not fit {self.steps} steps",
                "need 0 <= LO, HI <= steps and HI - LO >= window size (paper: --window-range 0 9 --window-size 9 --steps 10)")
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
    dtype: str = "auto"
    device: str = "auto"
    rank: int = 0
    world_size: int = 1

    def validate(self) -> "ScoreConfig":
        _choice("branches", self.branches, BRANCHES)
        if not self.rewards:
            raise ConfigError("no reward given", "pass --reward NAME[=WEIGHT], e.g. --reward jpeg-compressibility")
        for name in ("batch_size", "decode_batch_size"):
            _positive(name, getattr(self, name))
        self.rank, self.world_size = resolve_rank(self.rank, self.world_size)
        return self


@dataclass
class AdvantagesConfig:
    scores: str = ""
    out: str = ""
    method: str = "tp-grpo"
    balance: str = "all"
    std: str = "group"

    def validate(self) -> "AdvantagesConfig":
        _choice("method", self.method, METHODS)
        _choice("balance", self.balance, BALANCE)
        _choice("std", self.std, STD_MODES)
        return self


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
