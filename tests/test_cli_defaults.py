"""Every default is declared once: the stage commands' options take default and help from the config fields.

The stage configs (`tpkit.config`) are what recipes, `tpkit run` and the library use; a default changed in
cli.py only (a hard-coded `typer.Option(25)`) would make `tpkit rollout` and `tpkit run` sample differently.
The commands are read as click sees them (`typer.main.get_command`), so this checks what users get."""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import typer.main

from tpkit import cli
from tpkit.config import (AdvantagesConfig, CompareConfig, EvalConfig, RolloutConfig, ScoreConfig, TrainConfig,
                          default, field_help, parse_reward_options, parse_reward_specs)


def _prompts_or_geneval(path) -> str:
    return str(path) if path else ""  # no file: GenEval's 553 prompts


def _metrics(specs: list[str]) -> dict[str, float]:
    return {r: 1.0 for r in parse_reward_specs(specs)}  # compare: a reward is a metric, weights do not apply


@dataclasses.dataclass
class Case:
    command: str  # as typed after `tpkit`
    cls: type  # the config dataclass the command builds
    renamed: dict[str, str | tuple[str, Callable]] = dataclasses.field(default_factory=dict)
    # option (parameter name) -> its field, or (field, how the option's value becomes the field's value)
    not_options: dict[str, str] = dataclasses.field(default_factory=dict)  # field -> why no option sets it
    others: tuple[str, ...] = ()  # options that set no field of `cls` (another config's, or folded into one)
    own_help: tuple[str, ...] = ()  # options whose help says more than their field's, for this command


_REWARDS = {"reward": ("rewards", parse_reward_specs), "reward_opt": ("reward_options", parse_reward_options)}
_EVAL_KIND = {"kind": "the subcommand is the kind: `tpkit eval reward` / `tpkit eval geneval`"}

CASES = [
    Case("rollout", RolloutConfig),
    Case("score", ScoreConfig, {"rollout_dir": "rollout", **_REWARDS}),
    Case("advantages", AdvantagesConfig),
    Case("train", TrainConfig, {"rollout_dir": "rollout", "advantages_dir": "advantages", "lora_target": "lora_targets"}),
    Case("eval reward", EvalConfig, _REWARDS, _EVAL_KIND),
    Case("eval geneval", EvalConfig, {"metadata": ("prompts", _prompts_or_geneval)},
         {**_EVAL_KIND,
          "rewards": "GenEval's verdict is the score; there is no reward to weigh",
          "reward_options": "built from --detector and --clip (its `geneval` entry)"},
         others=("detector", "clip"), own_help=("metadata",)),
    Case("eval compare", CompareConfig, {"entry": "entries"},
         {"protocol": "built from the EvalConfig options (the next case)",
          "geneval_options": "built from --detector and --clip"},
         others=("prompts", "reward", "reward_opt", "detector", "clip", "images_per_prompt", "steps", "guidance",
                 "resolution", "seed", "batch_size", "max_sequence_length", "grid_prompts", "device", "dtype",
                 "rank", "world_size", "overwrite")),
    Case("eval compare", EvalConfig,
         {"prompts": ("prompts", _prompts_or_geneval), "reward": ("rewards", _metrics),
          "reward_opt": ("reward_options", parse_reward_options)},
         {"kind": "per entry: reward, or geneval when there is no reward (tpkit.compare)",
          "model": "per entry: --entry NAME=MODEL", "lora": "per entry: --entry NAME=MODEL+LORA",
          "family": "per entry, from its model (entries may be of different families)",
          "out": "per entry: OUT/entries/NAME (--out is the CompareConfig's)",
          "images": "compare generates every entry's images itself"},
         others=("entry", "out", "geneval", "detector", "clip"), own_help=("prompts", "overwrite")),
]


def _command(path: str):
    cmd = typer.main.get_command(cli.app)
    for name in path.split():
        cmd = cmd.commands[name]
    return cmd


def _options(case: Case) -> dict[str, tuple]:
    """field -> (its click parameter, how the parameter's value becomes the field's) for every option that
    sets a field of case.cls; fails on an option that is neither a field nor listed."""
    names = {f.name for f in dataclasses.fields(case.cls)}
    out = {}
    for p in _command(case.command).params:
        if p.name in case.others:
            continue
        target = case.renamed.get(p.name, p.name)
        name, convert = target if isinstance(target, tuple) else (target, lambda v: v)
        assert name in names, (f"`tpkit {case.command}` option {p.opts or p.name} sets no {case.cls.__name__} field: "
                               "rename it after its field, or list it in the case's `renamed` or `others`")
        out[name] = (p, convert)
    return out


def _same(a, b) -> bool:
    norm = (lambda v: tuple(v) if isinstance(v, (list, tuple)) else v)
    return norm(a) == norm(b) and type(norm(a)) is type(norm(b))


CASE_IDS = [f"{c.command}:{c.cls.__name__}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_option_defaults_are_the_config_defaults(case):
    for name, (p, convert) in _options(case).items():
        want = default(case.cls, name)
        if p.required:  # the command asks for it; the config's default is only "not given"
            assert not want, f"`tpkit {case.command}` requires {p.opts or p.name}, yet {case.cls.__name__}.{name} = {want!r}"
            continue
        got = convert(p.default)
        assert _same(got, want), (f"`tpkit {case.command}` {p.opts[0]}: default {p.default!r} "
                                  f"but {case.cls.__name__}.{name} = {want!r}: declare it once, in tpkit.config")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_config_field_is_an_option_or_listed(case):
    reached = set(_options(case))
    listed = set(case.not_options)
    fields = [f.name for f in dataclasses.fields(case.cls)]
    missing = [f for f in fields if f not in reached | listed]
    assert not missing, (f"`tpkit {case.command}` has no option for {case.cls.__name__}.{', '.join(missing)}: "
                         "add one (cli.opt) or list the field in not_options with the reason")
    assert not reached & listed, f"listed as no option, yet `tpkit {case.command}` has one: {sorted(reached & listed)}"
    assert listed <= set(fields), f"not_options names no field of {case.cls.__name__}: {sorted(listed - set(fields))}"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_option_help_is_the_field_help(case):
    for name, (p, _) in _options(case).items():
        assert p.help, f"`tpkit {case.command}` {p.opts or p.name} has no help"
        if field_help(case.cls, name) and p.name not in case.own_help:
            assert p.help == field_help(case.cls, name), (
                f"`tpkit {case.command}` {p.opts or p.name}: help written in cli.py although "
                f"{case.cls.__name__}.{name} declares it: use cli.opt")

