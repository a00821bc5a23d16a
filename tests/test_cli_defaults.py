"""Every default is declared once: a CLI option that sets a config field has the field's default.

The stage configs (`tpkit.config`) are what recipes, `tpkit run` and the library use; the Typer
options of the stage commands must not drift from them (a changed default in one place only would
make `tpkit rollout` and `tpkit run` sample differently)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from tpkit import cli, config, evaluate

COMMANDS = {  # command function -> the config it builds
    cli.rollout: config.RolloutConfig,
    cli.score: config.ScoreConfig,
    cli.advantages: config.AdvantagesConfig,
    cli.train: config.TrainConfig,
    cli.eval_reward: evaluate.EvalConfig,
    cli.eval_geneval: evaluate.EvalConfig,
}


def _field_defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _normal(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


@pytest.mark.parametrize("command", list(COMMANDS), ids=lambda c: c.__name__)
def test_cli_option_defaults_are_the_config_defaults(command):
    fields = _field_defaults(COMMANDS[command])
    checked = []
    for name, p in inspect.signature(command).parameters.items():
        default = getattr(p.default, "default", p.default)
        if name not in fields or default is ...:  # required options have no default to agree on
            continue
        assert _normal(default) == _normal(fields[name]), (
            f"{command.__name__} --{name.replace('_', '-')}: CLI default {default!r} != "
            f"{COMMANDS[command].__name__}.{name} = {fields[name]!r}")
        checked.append(name)
    assert len(checked) >= 3  # the test really compared something
