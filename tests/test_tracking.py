"""Experiment tracking (`--log-with`): TensorBoard event files read back and checked against
rounds.jsonl and metrics.jsonl; W&B offline without network; a failing tracker never stops a run;
trackers that are unknown or not installed are refused up front."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from tests.conftest import cli
from tpkit import layout, tracking
from tpkit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "pipelines" / "tiny-cpu.toml"


def recipe(folder: Path, prompts: Path, **top) -> Path:
    data = tomllib.loads(TINY.read_text())
    data.update({"rounds": 2, "log_images_every": 1, **top})
    data["rollout"].update(group_size=4, prompts=str(prompts.resolve()))
    data["train"].update(lora_rank=4, lora_alpha=8)
    path = folder / "r.toml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(data))
    return path


def events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def scalars(acc, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory, two_prompts) -> Path:
    base = tmp_path_factory.mktemp("tb")
    assert cli("run", recipe(base, two_prompts), "--out", base / "run", "--log-with", "tensorboard") == 0
    return base / "run"


def test_tensorboard_holds_the_round_metrics(tb_run):
    acc = events(tb_run / tracking.TENSORBOARD_DIR)
    rounds = jsonl(tb_run / layout.ROUNDS_FILE)
    steps = [json.loads((layout.round_dir(tb_run, r) / "train" / layout.MANIFEST).read_text())["counts"]["global_step"]
             for r in (0, 1)]
    logged = scalars(acc, "reward/mean")
    assert [s for s, _ in logged] == steps
    assert np.allclose([v for _, v in logged], [x["reward_mean"] for x in rounds])
    assert np.allclose([v for _, v in scalars(acc, "turning_points/rate")], [x["turning_point_rate"] for x in rounds])
    assert [v for _, v in scalars(acc, "calls/transformer")] == [x["transformer_calls"] for x in rounds]
    assert {f"turning_points/rate_step_{k}" for k in range(9)} <= set(acc.Tags()["scalars"])
    assert {"seconds/rollout", "seconds/score", "seconds/train"} <= set(acc.Tags()["scalars"])


def test_tensorboard_holds_every_optimizer_step(tb_run):
    acc = events(tb_run / tracking.TENSORBOARD_DIR)
    metrics = [m for r in (0, 1) for m in jsonl(layout.round_dir(tb_run, r) / "train" / layout.METRICS_FILE)]
    logged = scalars(acc, "train/loss")
    assert [s for s, _ in logged] == [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    assert np.allclose([v for _, v in logged], [m["loss"] for m in metrics], rtol=1e-6, atol=1e-12)
    assert np.allclose([v for _, v in scalars(acc, "train/ratio_mean")], [m["ratio_mean"] for m in metrics])


def test_tensorboard_holds_sample_grids(tb_run):
    acc = events(tb_run / tracking.TENSORBOARD_DIR)
    grids = acc.Images("samples")
    assert len(grids) == 2  # log_images_every = 1
    size = tomllib.loads((tb_run / "run.toml").read_text())["rollout"]["resolution"]
    assert (grids[0].width, grids[0].height) == (4 * size, 2 * size)  # a group of 4 per row, 2 prompts


def test_a_continued_run_may_change_its_tracker(tb_run, two_prompts):
    path = recipe(tb_run.parent / "more", two_prompts, rounds=3)
    assert cli("run", path, "--out", tb_run, "--log-with", "none") == 0
    assert len(jsonl(tb_run / layout.ROUNDS_FILE)) == 3


def test_train_alone_logs_each_optimizer_step(tiny_run, tmp_path):
    out = tmp_path / "train"
    assert cli("train", "--rollout", tiny_run / "rollout", "--advantages", tiny_run / "advantages", "--out", out,
               "--lora-rank", "4", "--optimizer-steps", "3", "--log-with", "tensorboard") == 0
    metrics = jsonl(out / layout.METRICS_FILE)
    logged = scalars(events(out / tracking.TENSORBOARD_DIR), "train/grad_norm")
    assert [s for s, _ in logged] == [1, 2, 3]
    assert np.allclose([v for _, v in logged], [m["grad_norm"] for m in metrics])


def test_unknown_or_missing_tracker_is_refused_before_any_work(tmp_path, two_prompts, monkeypatch, capsys):
    assert cli("run", recipe(tmp_path, two_prompts), "--out", tmp_path / "run", "--log-with", "mlflow") != 0
    assert "log_with" in capsys.readouterr().err and not (tmp_path / "run" / "round-0000").exists()
    import builtins

    real = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    assert cli("run", recipe(tmp_path, two_prompts), "--out", tmp_path / "run2", "--log-with", "wandb") != 0
    assert "pip install wandb" in capsys.readouterr().err
    assert not (tmp_path / "run2").exists()


def test_a_failing_tracker_is_switched_off_and_the_run_goes_on(tmp_path, capsys):
    t = tracking.Tracker("tensorboard", tmp_path, "x", {"a": 1})

    def broken(*args, **kwargs):
        raise OSError("disk full")

    t._tracker.log = broken
    t.scalars({"a": 1.0}, 1)
    assert "tracking is off" in capsys.readouterr().err
    t.scalars({"a": 2.0}, 2)  # no second warning, no error
    t.images({"g": np.zeros((4, 4, 3), np.uint8)}, 2)
    t.close()


def test_wandb_runs_offline_without_network_and_continues_its_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "")  # restored (unset) after the test: the tracker sets it
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(tracking, "_reachable", lambda *a, **k: False)
    t = tracking.Tracker("wandb", tmp_path, "x", {"train.learning_rate": 1e-3})
    import os

    assert os.environ["WANDB_MODE"] == "offline"
    t.scalars({"reward/mean": 0.5}, 1)
    t.images({"samples": np.zeros((8, 8, 3), np.uint8)}, 1)
    t.close()
    run_id = (tmp_path / tracking.WANDB_ID).read_text().strip()
    offline = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert offline and list(offline[0].glob("*.wandb"))
    tracking.Tracker("wandb", tmp_path, "x", {}).close()  # a continued run keeps its id
    assert (tmp_path / tracking.WANDB_ID).read_text().strip() == run_id


def test_tile_places_images_row_by_row():
    ims = [np.full((2, 3, 3), i, np.uint8) for i in range(5)]
    grid = tracking.tile(ims, 2)
    assert grid.shape == (6, 6, 3)
    assert grid[0, 0, 0] == 0 and grid[0, 3, 0] == 1 and grid[2, 0, 0] == 2 and grid[4, 0, 0] == 4
    assert (grid[4:, 3:] == 255).all()  # the empty cell stays white


def test_wandb_that_cannot_start_online_falls_back_to_offline(tmp_path, monkeypatch, capsys):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "")  # restored (unset) after the test: the tracker sets it
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(tracking, "_reachable", lambda *a, **k: True)  # "online", but init fails (no login)
    real = wandb.init

    def init(*args, **kwargs):
        if os.environ.get("WANDB_MODE") != "offline":
            raise wandb.errors.UsageError("api_key not configured (no-tty)")
        return real(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", init)
    t = tracking.Tracker("wandb", tmp_path, "x", {})
    t.scalars({"a": 1.0}, 1)
    t.close()
    assert "logging offline" in capsys.readouterr().err
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_a_tracker_that_cannot_start_is_a_clear_error(tmp_path):
    (tmp_path / "tensorboard").write_text("a file where the event folder goes")
    with pytest.raises(ConfigError, match="tensorboard tracking could not start"):
        tracking.Tracker("tensorboard", tmp_path, "x", {})
