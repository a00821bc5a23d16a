"""Fault injection: real kills, a full disk, failing and NaN rewards, malicious shards, corrupt inputs.

Every kill is a real SIGKILL of a `python -m tpkit ...` process, at a reproducible point: when k
output files exist, after a seeded random delay, or inside tpkit's own writer (a small wrapper
script stalls `tpkit.layout.atomic_write` in the fsync of a chosen file and the test kills it there).
Reruns are the same command line, run through `tpkit.cli.main` in this process (the model stays
loaded), and their outputs are compared with a clean, uninterrupted run of the same command.

Sizes are tiny (3 prompts x 2 members, T = 6, K = 5, LoRA rank 4) and torch runs one thread: the whole
file takes about 75 s on 2 CPU cores.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from conftest import as_written, cli

from tpkit import layout

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "pipelines" / "tiny-cpu.toml"
SEED = 7  # every "random" kill point derives from it
PROMPTS = ["a red cube on a wooden table", "a small boat on a calm lake at dawn", "three green apples in a bowl"]
SMALL = ["--group-size", "2", "--steps", "6", "--window-size", "5", "--window-range", "0", "5", "--prompts-per-shard", "1"]
TRAIN = ["--optimizer-steps", "3", "--lora-rank", "4", "--lora-alpha", "8", "--learning-rate", "1e-2"]
K = 5
N_SHARDS = len(PROMPTS)

# A wrapper around the CLI that injects a fault into tpkit.layout's writer (monkeypatching works only
# in-process, so the subprocess patches itself): the fsync of the first file whose temporary name
# contains FAULT_MATCH stalls (so the test can kill the process right there) or fails with ENOSPC;
# "slow" makes every rollout shard take FAULT_SLEEP seconds longer.
WRAPPER = r'''
import errno, os, sys, time
from tpkit import layout

MODE, MATCH = os.environ.get("FAULT_MODE", ""), os.environ.get("FAULT_MATCH", "")


class _Os:
    def __getattr__(self, name):
        return getattr(os, name)

    def fsync(self, fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if MATCH and MATCH in os.path.basename(name):
            if MODE == "stall":
                with open(os.environ["FAULT_MARK"], "w") as f:
                    f.write(name)
                time.sleep(3600)
            if MODE == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.fsync(fd)


layout.os = _Os()
if MODE == "slow":
    from tpkit import rollout

    _write_shard = rollout.write_shard

    def slow_write_shard(*args, **kwargs):
        time.sleep(float(os.environ["FAULT_SLEEP"]))
        return _write_shard(*args, **kwargs)

    rollout.write_shard = slow_write_shard
from tpkit.cli import main

main(sys.argv[1:])
'''


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def env(**extra: str) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    e.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)
    return e


def rollout_argv(prompts: Path, out: Path, model: str = "tiny-sd3") -> list:
    return ["rollout", "--prompts", prompts, "--out", out, "--model", model, *SMALL]


def score_argv(rollout: Path, out: Path, *extra) -> list:
    return ["score", rollout, "--out", out, *extra]


def train_argv(base: Path, out: Path) -> list:
    return ["train", "--rollout", base / "rollout", "--advantages", base / "advantages", "--out", out, *TRAIN]


def wrapper(tmp_path: Path) -> Path:
    path = tmp_path / "tpkit_fault_wrapper.py"
    path.write_text(WRAPPER)
    return path


def tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.is_file() else ""


def kill_when(cmd: list, ready, log: Path, extra_env: dict | None = None, timeout: float = 300) -> None:
    """Start cmd, SIGKILL it as soon as ready() is true; fail if it ends on its own first."""
    with log.open("wb") as f:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env(**(extra_env or {})))
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None:
                pytest.fail(f"the process ended (rc {proc.returncode}) before the kill point:\n{tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"kill point not reached within {timeout}s:\n{tail(log)}")
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"not killed (rc {proc.returncode}):\n{tail(log)}"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """{relative path: (sha256, mtime_ns)} of every file under folder (dotfiles included)."""
    return {str(p.relative_to(folder)): (sha(p), p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*")) if p.is_file() and not p.is_symlink()}


def leftovers(folder: Path) -> list[str]:
    """Temporary files or folders (".NAME.XXXX.tmp", ".checkpoint.old" ...): anything hidden but a lock."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob(".*") if not p.name.startswith(".lock-"))


def names(folder: Path) -> list[str]:
    """The folder's visible files (temporary ones are `leftovers`)."""
    return sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("."))


def manifest(folder: Path) -> dict:
    return json.loads((Path(folder) / layout.MANIFEST).read_text())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def differences(out: Path, ref: Path, pattern: str, same) -> list[str]:
    """How a stage folder differs from the clean run's: temporary leftovers, missing or extra files,
    outputs that are not the same, manifest counts."""
    problems = []
    if leftovers(out):
        problems.append(f"temporary files left behind: {leftovers(out)}")
    if names(out) != names(ref):
        problems.append(f"missing files {sorted(set(names(ref)) - set(names(out)))}, "
                        f"extra files {sorted(set(names(out)) - set(names(ref)))}")
    files = sorted(out.glob(pattern))
    if len(files) != N_SHARDS:
        problems.append(f"{len(files)} files {pattern}, expected {N_SHARDS}")
    problems += [f"{f.name} differs from the clean run's" for f in files if not same(f, ref / f.name)]
    if not (out / layout.MANIFEST).is_file():
        problems.append("no manifest")
    elif manifest(out)["counts"] != manifest(ref)["counts"]:
        problems.append(f"manifest counts {manifest(out)['counts']}, clean run {manifest(ref)['counts']}")
    return problems


def assert_same_rollout(out: Path, ref: Path) -> None:
    """Same files as the clean run (no extra, duplicate or temporary ones), shards byte-identical."""
    problems = differences(out, ref, "shard-*.tar", lambda a, b: a.read_bytes() == b.read_bytes())
    assert not problems, "\n".join(problems)


def assert_same_scores(out: Path, ref: Path) -> None:
    import pyarrow.parquet as pq

    problems = differences(out, ref, "scores-*.parquet", lambda a, b: pq.read_table(a).equals(pq.read_table(b)))
    assert not problems, "\n".join(problems)


def assert_close_metrics(a: list[dict], b: list[dict]) -> None:
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if k == "seconds":
                continue
            if isinstance(x[k], float):
                assert math.isclose(x[k], y[k], rel_tol=1e-5, abs_tol=1e-7), (k, x, y)
            else:
                assert x[k] == y[k], (k, x, y)


def short_error(code: int, stderr: str, stdout: str = "") -> None:
    """Non-zero exit, no traceback, at most 3 non-blank lines on stderr."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code != 0, stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    assert 1 <= len(lines) <= 3, f"{len(lines)} lines on stderr:\n{stderr}"


class FullDisk:
    """Stands in for tpkit.layout's `os`: the fsync of a file whose (temporary) name contains
    `match` fails with ENOSPC, as when the disk fills up while it is written ("" fails every one)."""

    def __init__(self, match: str):
        self.match = match

    def __getattr__(self, name):
        return getattr(os, name)

    def fsync(self, fd):
        if self.match in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.fsync(fd)


def rollout_cfg(prompts: Path, out: Path):
    from tpkit.config import RolloutConfig

    return RolloutConfig(prompts=str(prompts), out=str(out), group_size=2, steps=6, window_size=5, window_range=(0, 5),
                         prompts_per_shard=1)


# --------------------------------------------------------------------------------------------
# The clean, uninterrupted run everything is compared with
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here and in every subprocess: the tiny model runs far faster that way on a busy
    2-core machine (and results do not depend on it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def clean_run(base: Path, model: str) -> Path:
    """rollout -> score -> advantages -> train (3 optimizer steps) of 3 prompts x 2 members."""
    prompts = base / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    assert cli(*rollout_argv(prompts, base / "rollout", model)) == 0
    assert cli(*score_argv(base / "rollout", base / "score")) == 0
    assert cli("advantages", base / "score", "--out", base / "advantages") == 0
    assert cli(*train_argv(base, base / "train")) == 0
    return base


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tpkit_home) -> Path:
    return clean_run(tmp_path_factory.mktemp("faults-clean"), "tiny-sd3")


@pytest.fixture(scope="module")
def clean_flux(tmp_path_factory, tpkit_home) -> Path:
    return clean_run(tmp_path_factory.mktemp("faults-clean-flux"), "tiny-flux")


@pytest.fixture(scope="module")
def clean_qwen(tmp_path_factory, tpkit_home) -> Path:
    return clean_run(tmp_path_factory.mktemp("faults-clean-qwen"), "tiny-qwen-image")


OTHER_FAMILIES = {"tiny-flux": ("clean_flux", "flux"), "tiny-qwen-image": ("clean_qwen", "qwen")}  # model -> fixture, id


@pytest.fixture
def reference(request) -> Path:
    """The clean run of the test's model family (each kill test runs on SD3 at every point, on the others at one)."""
    return request.getfixturevalue(OTHER_FAMILIES.get(request.node.callspec.params.get("model"), ("clean",))[0])


def on_families(points: list[str], other_point: str) -> list:
    return [pytest.param("tiny-sd3", p, id=p) for p in points] + [
        pytest.param(model, other_point, id=f"{name}-{other_point}") for model, (_, name) in OTHER_FAMILIES.items()]


# --------------------------------------------------------------------------------------------
# 1. kill -9 and rerun: the same files as a clean run
# --------------------------------------------------------------------------------------------

ROLLOUT_KILLS = [
    "random",  # a seeded random moment after the stage took its lock (at the latest: 2 shards exist)
    "after-first-shard",  # as soon as the first shard and its .stats.json are in place
    "inside-shard-write",  # shard 2 written to its temporary file, not yet renamed
    "before-shard-stats",  # shard 2's .stats.json being written, so shard 2 not yet in place
]


@pytest.mark.parametrize("model, point", on_families(ROLLOUT_KILLS, "inside-shard-write"))
def test_rollout_sigkill_then_rerun_gives_the_clean_shards(reference, tmp_path, model, point):
    clean = reference
    out = tmp_path / "rollout"
    argv = rollout_argv(clean / "prompts.txt", out, model)
    log = tmp_path / "killed.log"
    if point in ("random", "after-first-shard"):
        need = 2 if point == "random" else 1
        delay = random.Random(f"{SEED}:rollout").uniform(0.2, 3.0) if point == "random" else 0.0
        t_lock: list[float] = []

        def ready() -> bool:
            if not t_lock and (out / ".lock-r000").exists():
                t_lock.append(time.monotonic())
            shards = len(list(out.glob("shard-*.tar" if point == "random" else "shard-*.stats.json")))
            return shards >= need or bool(t_lock and point == "random" and time.monotonic() - t_lock[0] >= delay)

        kill_when([sys.executable, "-m", "tpkit", *argv], ready, log)
    else:
        mark = tmp_path / "stalled"
        match = {"inside-shard-write": "shard-r000-00001.tar.", "before-shard-stats": "shard-r000-00001.stats.json."}[point]
        kill_when([sys.executable, wrapper(tmp_path), *argv], mark.exists, log,
                  {"FAULT_MODE": "stall", "FAULT_MATCH": match, "FAULT_MARK": str(mark)})

    assert not (out / layout.MANIFEST).exists()
    survivors = {s.name: (sha(s), s.stat().st_mtime_ns, s.stat().st_ino) for s in out.glob("shard-*.tar")}
    for name, (digest, _, _) in survivors.items():  # whole shards only, the same as the clean run's
        assert digest == sha(clean / "rollout" / name), name
    if point == "inside-shard-write":
        assert len(survivors) == 1
    if point == "before-shard-stats":  # a shard's stats sidecar is written before the shard itself
        assert len(survivors) == 1

    assert cli(*argv) == 0  # the same command again
    for name, state in survivors.items():  # only what was missing was redone
        s = out / name
        assert (sha(s), s.stat().st_mtime_ns, s.stat().st_ino) == state, name
    assert_same_rollout(out, clean / "rollout")


@pytest.mark.parametrize("model, point", on_families(["random-shard", "before-shard-stats"], "random-shard"))
def test_score_sigkill_then_rerun_gives_the_clean_tables(reference, tmp_path, model, point):
    clean = reference
    out = tmp_path / "score"
    argv = score_argv(clean / "rollout", out)
    if point == "random-shard":
        k = random.Random(f"{SEED}:score").choice([1, 2])  # kill once k of the 3 shards are scored
        kill_when([sys.executable, "-m", "tpkit", *argv], lambda: len(list(out.glob("scores-*.parquet"))) >= k,
                  tmp_path / "killed.log")
    else:  # the first .stats.json being written: its Parquet file (written after it) not yet in place
        mark = tmp_path / "stalled"
        kill_when([sys.executable, wrapper(tmp_path), *argv], mark.exists, tmp_path / "killed.log",
                  {"FAULT_MODE": "stall", "FAULT_MATCH": "scores-r000-00000.stats.json.", "FAULT_MARK": str(mark)})
        k = 0
    assert not (out / layout.MANIFEST).exists()
    survivors = {p.name: (sha(p), p.stat().st_mtime_ns) for p in out.glob("scores-*.parquet")}
    assert len(survivors) >= k
    assert cli(*argv) == 0
    assert {n: (sha(out / n), (out / n).stat().st_mtime_ns) for n in survivors} == survivors
    assert_same_scores(out, clean / "score")


@pytest.mark.parametrize("model, point", on_families(["after-first-checkpoint", "inside-metrics-write"], "after-first-checkpoint"))
def test_train_sigkill_resumes_to_the_same_adapter(reference, tmp_path, model, point):
    clean = reference
    import torch
    from safetensors.torch import load_file

    from tpkit.models import base

    out = tmp_path / "train"
    argv = train_argv(clean, out)
    if point == "after-first-checkpoint":
        kill_when([sys.executable, "-m", "tpkit", *argv], (out / "checkpoint" / "progress.json").is_file,
                  tmp_path / "killed.log")
        assert not (out / "adapter").exists()
    else:  # every step done, adapter and state saved, metrics.jsonl being written
        mark = tmp_path / "stalled"
        kill_when([sys.executable, wrapper(tmp_path), *argv], mark.exists, tmp_path / "killed.log",
                  {"FAULT_MODE": "stall", "FAULT_MATCH": ".metrics.jsonl.", "FAULT_MARK": str(mark)})
    assert not (out / layout.MANIFEST).exists()

    assert cli(*argv) == 0
    m = manifest(out)
    assert m["resumed_from_step"] >= 1, m
    assert m["counts"]["optimizer_steps"] == 3
    assert not (out / "checkpoint").exists()
    a = load_file(out / "adapter" / base.LORA_WEIGHTS)
    b = load_file(clean / "train" / "adapter" / base.LORA_WEIGHTS)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=0, atol=1e-6), key
    assert_close_metrics(read_jsonl(out / layout.METRICS_FILE), read_jsonl(clean / "train" / layout.METRICS_FILE))
    opt_a = torch.load(out / "state" / "optimizer.pt", weights_only=True)
    opt_b = torch.load(clean / "train" / "state" / "optimizer.pt", weights_only=True)
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for i in opt_a["state"]:
        assert torch.equal(opt_a["state"][i]["step"], opt_b["state"][i]["step"])
        assert torch.allclose(opt_a["state"][i]["exp_avg"], opt_b["state"][i]["exp_avg"], rtol=1e-4, atol=1e-8)
    assert leftovers(out) == []


def small_recipe(folder: Path, prompts: Path, rounds: int = 2) -> Path:
    import tomllib

    import tomli_w

    data = tomllib.loads(TINY_RECIPE.read_text())
    data["rounds"] = rounds
    data["rollout"].update(group_size=2, steps=6, window_size=5, window_range=[0, 5], prompts_per_shard=1,
                           prompts=str(prompts.resolve()))
    data["train"].update(lora_rank=4, lora_alpha=8)
    path = folder / "small.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def test_run_sigkill_in_round_one_then_rerun(clean, tmp_path):
    prompts = tmp_path / "two.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    recipe = small_recipe(tmp_path, prompts)
    run_dir = tmp_path / "run"
    argv = ["run", recipe, "--out", run_dir]
    r1 = layout.round_dir(run_dir, 1)
    pattern = random.Random(f"{SEED}:run").choice(["rollout/shard-*.tar", "score/scores-*.parquet"])
    kill_when([sys.executable, "-m", "tpkit", *argv], lambda: any(r1.glob(pattern)), tmp_path / "killed.log")

    r0 = layout.round_dir(run_dir, 0)
    assert (r0 / "round.json").is_file() and not (r1 / "round.json").exists()
    before = snapshot(r0)
    kept_round1 = {k: v for k, v in snapshot(r1).items() if k.endswith((".tar", ".parquet"))}
    assert kept_round1

    assert cli(*argv) == 0
    assert snapshot(r0) == before  # round 0 untouched
    assert {k: v for k, v in snapshot(r1).items() if k in kept_round1} == kept_round1
    rounds = read_jsonl(run_dir / layout.ROUNDS_FILE)
    assert [x["round"] for x in rounds] == [1, 2]  # each round once
    for stage in ("rollout", "score", "advantages", "train"):
        assert (r1 / stage / layout.MANIFEST).is_file()
    assert (run_dir / "report.png").read_bytes().startswith(b"\x89PNG")
    assert leftovers(run_dir) == []


# --------------------------------------------------------------------------------------------
# 2. Two processes on one folder: the second refuses at once
# --------------------------------------------------------------------------------------------


def test_second_process_on_the_same_folder_is_refused(clean, tmp_path):
    out = tmp_path / "rollout"
    argv = [str(a) for a in rollout_argv(clean / "prompts.txt", out)]
    log = tmp_path / "first.log"
    with log.open("wb") as f:  # each shard takes 3 s longer, so the first surely outlives the second's start-up
        first = subprocess.Popen([sys.executable, str(wrapper(tmp_path)), *argv], stdout=f, stderr=subprocess.STDOUT,
                                 env=env(FAULT_MODE="slow", FAULT_SLEEP="3"))
    try:
        deadline = time.monotonic() + 120
        while not (out / ".lock-r000").exists():
            assert first.poll() is None, tail(log)
            assert time.monotonic() < deadline, tail(log)
            time.sleep(0.01)
        time.sleep(0.3)
        t0 = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "tpkit", *argv], capture_output=True, text=True, timeout=120,
                                env=env())
        elapsed = time.monotonic() - t0
        assert first.poll() is None, "the first process ended before the second started: the test proves nothing"
        short_error(second.returncode, second.stderr, second.stdout)
        assert "in use" in " ".join(second.stderr.split()), second.stderr
        assert elapsed < 60
        assert first.wait(timeout=300) == 0, tail(log)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert_same_rollout(out, clean / "rollout")


# --------------------------------------------------------------------------------------------
# 3. A full disk (ENOSPC from the writer)
# --------------------------------------------------------------------------------------------


def test_full_disk_keeps_the_file_being_replaced(tmp_path, monkeypatch):
    path = tmp_path / "rounds.jsonl"
    path.write_bytes(b"old line\n")
    monkeypatch.setattr(layout, "os", FullDisk("rounds.jsonl"))
    with pytest.raises(OSError) as e:
        layout.atomic_write(path, b"new line\n" * 1000)
    assert e.value.errno == errno.ENOSPC
    assert path.read_bytes() == b"old line\n"
    assert leftovers(tmp_path) == []


def test_full_disk_during_rollout(clean, tmp_path, monkeypatch):
    from tpkit import rollout
    from tpkit.errors import TpkitError

    out = tmp_path / "rollout"
    ref = clean / "rollout"
    monkeypatch.setattr(layout, "os", FullDisk("shard-r000-00001.tar"))  # the disk fills up while shard 2 is written
    with pytest.raises((OSError, TpkitError)) as e:
        rollout.run(rollout_cfg(clean / "prompts.txt", out))
    assert "space" in str(e.value).lower() or getattr(e.value, "errno", None) == errno.ENOSPC
    # shard 2's stats sidecar is written before the shard, so it may stand alone; the rerun rewrites it
    assert names(out) == ["shard-r000-00000.stats.json", "shard-r000-00000.tar", "shard-r000-00001.stats.json",
                          layout.STAGE_FILE]
    assert leftovers(out) == []
    done = snapshot(out)
    assert sha(out / "shard-r000-00000.tar") == sha(ref / "shard-r000-00000.tar")

    # Still full at the next write: what was finished stays as it was.
    monkeypatch.setattr(layout, "os", FullDisk(""))
    with pytest.raises((OSError, TpkitError)):
        rollout.run(rollout_cfg(clean / "prompts.txt", out))
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(".lock-")} == \
           {k: v for k, v in done.items() if not k.startswith(".lock-")}
    assert leftovers(out) == []

    # Space again: the same command completes to the clean result.
    monkeypatch.setattr(layout, "os", os)
    rollout.run(rollout_cfg(clean / "prompts.txt", out))
    assert_same_rollout(out, ref)


def test_full_disk_during_score(clean, tmp_path, monkeypatch):
    from tpkit import score
    from tpkit.config import ScoreConfig
    from tpkit.errors import TpkitError

    out = tmp_path / "score"
    cfg = lambda: ScoreConfig(rollout=str(clean / "rollout"), out=str(out))  # noqa: E731
    monkeypatch.setattr(layout, "os", FullDisk("scores-r000-00001.parquet"))
    with pytest.raises((OSError, TpkitError)):
        score.run(cfg())
    assert names(out) == ["scores-r000-00000.parquet", "scores-r000-00000.stats.json", "scores-r000-00001.stats.json",
                          layout.STAGE_FILE]
    assert leftovers(out) == []
    # finished outputs (and their sidecars) must stay as they are; the orphan sidecar is redone
    first = {k: v for k, v in snapshot(out).items() if k != "scores-r000-00001.stats.json"}

    monkeypatch.setattr(layout, "os", FullDisk(layout.MANIFEST))  # every table written, then the manifest fails
    with pytest.raises((OSError, TpkitError)):
        score.run(cfg())
    assert not (out / layout.MANIFEST).exists()
    assert len(list(out.glob("scores-*.parquet"))) == N_SHARDS
    assert leftovers(out) == []
    assert {k: v for k, v in snapshot(out).items() if k in first} == first

    monkeypatch.setattr(layout, "os", os)
    score.run(cfg())
    assert {k: v for k, v in snapshot(out).items() if k in first} == first
    assert_same_scores(out, clean / "score")


def test_full_disk_through_the_cli_is_a_short_error(clean, tmp_path):
    out = tmp_path / "advantages"
    before = snapshot(clean / "score")
    p = subprocess.run([sys.executable, str(wrapper(tmp_path)), "advantages", str(clean / "score"), "--out", str(out)],
                       capture_output=True, text=True, timeout=180, env=env(FAULT_MODE="enospc", FAULT_MATCH="advantages.parquet"))
    short_error(p.returncode, p.stderr, p.stdout)
    text = " ".join(p.stderr.split()).lower()
    assert "no space left" in text, p.stderr
    # which folder, how much is free there, the fix, and that a rerun continues
    assert str(out).lower() in text and " free there" in text and "free space there" in text, p.stderr
    assert "rerun the same command to continue" in text, p.stderr
    assert not (out / layout.ADVANTAGES_FILE).exists() and not (out / layout.MANIFEST).exists()
    assert not out.exists() or leftovers(out) == []
    assert snapshot(clean / "score") == before


def test_read_only_out_is_a_short_error_naming_the_file(clean, tmp_path, monkeypatch, capsys):
    """A read-only file system (EROFS, what a read-only --out gives even to root): the file, and the fix."""
    from conftest import cli

    class ReadOnly(FullDisk):
        def fsync(self, fd):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.readlink(f"/proc/self/fd/{fd}"))

    out = tmp_path / "advantages"
    monkeypatch.setattr(layout, "os", ReadOnly(""))
    code = cli("advantages", clean / "score", "--out", out)
    err = capsys.readouterr().err
    short_error(code, err)
    text = " ".join(err.split()).lower()
    assert "read-only file system" in text and str(out).lower() in text, err
    assert "pass an --out folder you can write to" in text and "rerun the same command to continue" in text, err
    assert not (out / layout.MANIFEST).exists()


def test_full_disk_in_a_run_says_what_a_round_writes(tmp_path, two_prompts, monkeypatch, capsys):
    """`tpkit run` on a full disk: the run folder, what is free and the doctor's estimate of a round."""
    from conftest import cli
    from test_run import small_recipe

    from tpkit import run

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run, "write_rounds", full)
    code = cli("run", small_recipe(tmp_path, two_prompts, rounds=1), "--out", tmp_path / "run")
    err = capsys.readouterr().err
    err = err[err.index("error:"):]  # after the round's progress
    short_error(code, err)
    text = " ".join(err.split()).lower()
    assert f"in {tmp_path / 'run'}".lower() in text and " free; a round writes about " in text, err
    assert "then rerun the same command: it continues" in text, err


# --------------------------------------------------------------------------------------------
# 4./5. Rewards that raise halfway or return NaN
# --------------------------------------------------------------------------------------------

RAISING_REWARD = '''
from pathlib import Path

import numpy as np

BROKEN = Path({flag!r})  # while this file exists, the reward fails: on its 2nd call, or on the 2nd shard's prompt
CALLS = [0]


def score(images, prompts, metadata):
    CALLS[0] += 1
    if BROKEN.exists() and ({trigger!r} == "second-call" and CALLS[0] == 2 or {prompt!r} in prompts):
        raise RuntimeError("the reward server went away")
    return [float(np.asarray(im.convert("L"), dtype=np.float64).mean()) for im in images]
'''

NAN_REWARD = '''
import hashlib

import numpy as np

TARGET = {target!r}  # sha256 of the RGB pixels of one trajectory's final image


def score(images, prompts, metadata):
    out = []
    for im in images:
        if hashlib.sha256(im.convert("RGB").tobytes()).hexdigest() == TARGET:
            out.append(float("nan"))
        else:
            out.append(float(np.asarray(im.convert("L"), dtype=np.float64).mean()))
    return out
'''


@pytest.mark.parametrize("trigger", ["second-call", "second-shard"])
def test_reward_that_raises_halfway_leaves_no_partial_output(clean, tmp_path, monkeypatch, trigger):
    import pyarrow.parquet as pq

    from tpkit import score
    from tpkit.config import ScoreConfig
    from tpkit.errors import RewardError

    flag = tmp_path / "broken"
    flag.touch()
    module = f"tpkit_fault_raising_reward_{trigger.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(RAISING_REWARD.format(flag=str(flag), trigger=trigger, prompt=PROMPTS[1]))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "score"
    cfg = lambda: ScoreConfig(rollout=str(clean / "rollout"), out=str(out), rewards={f"{module}:score": 1.0})  # noqa: E731
    with pytest.raises(RewardError) as e:
        score.run(cfg())
    assert "went away" in str(e.value)
    assert not (out / layout.MANIFEST).exists()
    if trigger == "second-call":  # inside the first shard: nothing written at all
        assert not out.exists() or names(out) == []
    else:
        first = out / "scores-r000-00000.parquet"
        assert pq.read_table(first).num_rows == 2 * (K + 1)  # the shard scored before: a complete file
        assert names(out) == ["scores-r000-00000.parquet", "scores-r000-00000.stats.json",  # none for the failing one
                              layout.STAGE_FILE]
    assert not out.exists() or leftovers(out) == []
    kept = snapshot(out) if out.exists() else {}

    flag.unlink()  # the reward is fixed
    m = score.run(cfg())
    assert m and m["counts"]["trajectories"] == 2 * N_SHARDS
    assert {k: v for k, v in snapshot(out).items() if k in kept} == kept
    table = layout.read_parquet_tables(out, "score")
    assert table.num_rows == 2 * N_SHARDS * (K + 1)
    assert sorted(set(table["branch"].to_pylist())) == list(range(K + 1))
    assert leftovers(out) == []


def test_nan_reward_stops_by_default_and_drop_leaves_the_trajectory_out(clean, tmp_path, monkeypatch):
    import numpy as np
    from PIL import Image

    from tpkit import advantages, score, train
    from tpkit.config import AdvantagesConfig, ScoreConfig, TrainConfig
    from tpkit.errors import RewardError

    # The NaN goes to one trajectory of the middle shard: the one whose final image (R_K) is unique.
    finals = {}
    for s in layout.list_shards(clean / "rollout"):
        for t in layout.read_shard(s, load_tensors=False)[1]:
            img = Image.open(io.BytesIO(t.final_png)).convert("RGB")
            finals[t.trajectory_id] = (s.name, hashlib.sha256(img.tobytes()).hexdigest())
    digests = [d for _, d in finals.values()]
    candidates = [tid for tid, (name, d) in finals.items() if name.endswith("00001.tar") and digests.count(d) == 1]
    assert candidates, "no trajectory with a unique final image"
    bad = candidates[0]
    (tmp_path / "tpkit_fault_nan_reward.py").write_text(NAN_REWARD.format(target=finals[bad][1]))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "score"
    spec = {"tpkit_fault_nan_reward:score": 1.0}

    with pytest.raises(RewardError) as e:
        score.run(ScoreConfig(rollout=str(clean / "rollout"), out=str(out), rewards=spec))
    assert bad in str(e.value) and "--on-nan drop" in str(e.value)
    assert not (out / "scores-r000-00001.parquet").exists()
    assert not (out / layout.MANIFEST).exists()
    assert leftovers(out) == []

    m = score.run(ScoreConfig(rollout=str(clean / "rollout"), out=str(out), rewards=spec, on_nan="drop"))
    assert m["counts"]["dropped_nan"] == 1
    assert m["counts"]["trajectories"] == 2 * N_SHARDS - 1
    stats = json.loads((out / "scores-r000-00001.stats.json").read_text())
    assert stats["counts"]["dropped_nan"] == 1
    table = layout.read_parquet_tables(out, "score")
    ids = set(table["trajectory_id"].to_pylist())
    assert bad not in ids and len(ids) == 2 * N_SHARDS - 1
    assert np.isfinite(np.asarray(table["reward"].to_pylist())).all()

    a = advantages.run(AdvantagesConfig(scores=str(out), out=str(tmp_path / "advantages")))
    assert a["counts"]["trajectories"] == 2 * N_SHARDS - 1
    adv = layout.read_parquet_tables(tmp_path / "advantages", "advantages")
    values = np.asarray(adv["advantage"].to_pylist(), dtype=float)
    assert np.isfinite(values).all()
    alone = [t for t in ids if t.split("-m")[0] == bad.split("-m")[0]]  # the group now has size 1: advantage 0
    assert len(alone) == 1
    sel = np.asarray(adv["trajectory_id"].to_pylist()) == alone[0]
    assert (values[sel] == 0).all()

    t = train.run(TrainConfig(rollout=str(clean / "rollout"), advantages=str(tmp_path / "advantages"),
                              out=str(tmp_path / "train"), lora_rank=4, lora_alpha=8, optimizer_steps=2))
    # the lone member's advantage is 0 at every step: left out of the loss, as the release does
    assert t["counts"]["zero_advantage_trajectories"] == 1
    assert t["counts"]["trajectories_in_loss"] == 2 * N_SHARDS - 2
    assert t["counts"]["transitions"] == (2 * N_SHARDS - 2) * K
    assert t["counts"]["nonfinite_steps"] == 0


# --------------------------------------------------------------------------------------------
# 6. A malicious shard: data, never code, never a path
# --------------------------------------------------------------------------------------------


class _Payload:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _members(shard: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(shard) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]


def _write_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    path.write_bytes(buf.getvalue())


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o755
    return info, data


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def test_malicious_shard_executes_nothing_and_writes_nothing_outside(clean, tmp_path, monkeypatch, capfd):
    import numpy as np

    run = tmp_path / "run"
    bad = run / "rollout"
    shutil.copytree(clean / "rollout", bad)
    marker = tmp_path / "PWNED"
    evil_abs = Path(f"/tmp/tpkit-fault-evil-{os.getpid()}.json")
    payload = pickle.dumps(_Payload(marker))
    npy = io.BytesIO()
    np.save(npy, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
    shards = layout.list_shards(bad)

    # Shard 1 keeps its real members and gains hostile ones; shard 2's tensors of one trajectory are a pickle.
    original = _members(shards[1])
    traj = next(m.name.split(".")[0] for m, _ in original if m.name.endswith(".meta.json"))
    hostile = [
        _file("../escape.json", b'{"escaped": true}'), _file("../../escape2.json", b"{}"),
        _file(str(evil_abs), b'{"absolute": true}'), _link("link.json", "/etc/passwd"),
        _link("uplink", "../../.."), _file("uplink/escape3.json", b"{}"),
        _link("hard.json", "../escape.json", tarfile.LNKTYPE),
        _file("evil.npy", npy.getvalue()), _file("evil.pyd", payload), _file("evil.pkl", payload),
        _file("evil.pt", payload), _file(f"{traj}.npy", npy.getvalue()), _file(f"{traj}.pth", payload),
    ]
    _write_tar(shards[1], hostile[:7] + original[:-1] + hostile[7:] + original[-1:])
    pickled = _members(shards[2])
    victim = next(m.name.split(".")[0] for m, _ in pickled if m.name.endswith(".meta.json"))
    _write_tar(shards[2], [(_resized(m, payload), payload) if m.name == f"{victim}.latents.safetensors" else (m, d)
                           for m, d in pickled])

    would_be = [bad.parent / "escape.json", bad.parent.parent / "escape2.json", bad.parent.parent.parent / "escape3.json",
                evil_abs, marker, bad / "link.json", bad / "hard.json", bad / "uplink", bad / "evil.npy"]

    def escaped() -> list[str]:
        found = [str(p) for p in would_be if os.path.lexists(p)]
        return found + [str(p) for p in run.rglob("*") if p.is_symlink()]

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    before_outside = snapshot(outside)

    # A separate process reads the hostile shard, started inside the rollout folder.
    p = subprocess.run([sys.executable, "-m", "tpkit", "inspect", str(shards[1])], capture_output=True, text=True,
                       timeout=180, env=env(), cwd=bad)
    if p.returncode != 0:
        short_error(p.returncode, p.stderr, p.stdout)
    assert escaped() == []

    # In this process: inspect the pickled shard, then score the folder (cwd: the rollout folder).
    monkeypatch.chdir(bad)
    capfd.readouterr()
    code = cli("inspect", shards[2])
    err = capfd.readouterr().err
    short_error(code, err)
    assert shards[2].name in " ".join(err.split())
    code = cli("score", bad, "--out", run / "score")
    err = capfd.readouterr().err
    short_error(code, err)  # shard 2 cannot be read; shard 1's hostile extras are ignored or refused
    assert escaped() == []
    assert snapshot(outside) == before_outside
    assert not marker.exists()


def _resized(info: tarfile.TarInfo, data: bytes) -> tarfile.TarInfo:
    info.size = len(data)
    return info


# --------------------------------------------------------------------------------------------
# 7. Corrupt inputs through the CLI: short named error, exit != 0, nothing changed
# --------------------------------------------------------------------------------------------


def _truncate_mid_member(case: Path) -> tuple[list, str]:
    shard = layout.list_shards(case / "rollout")[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: int(len(data) * 0.6)])
    return ["score", case / "rollout", "--out", case / "new-score"], shard.name


def _truncate_at_member_boundary(case: Path) -> tuple[list, str]:
    shard = layout.list_shards(case / "rollout")[1]
    members = _members(shard)
    _write_tar(shard, members[:-4])  # a valid tar, cut before its last trajectory sample and the closing index
    return ["score", case / "rollout", "--out", case / "new-score"], shard.name


def _as_written(f: Path, table) -> None:
    """Write a table into a finished score folder as a faulty scorer would have (conftest.as_written)."""
    import pyarrow.parquet as pq

    pq.write_table(table, f)
    as_written(f)


def _mistyped_parquet_column(case: Path) -> tuple[list, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = sorted((case / "score").glob("scores-*.parquet"))[1]
    t = pq.read_table(f)
    i = t.column_names.index("branch")
    pq.write_table(t.set_column(i, "branch", pa.array([f"k{x}" for x in t["branch"].to_pylist()])), f)
    return ["advantages", f, "--out", case / "new-advantages"], f.name


def _mistyped_parquet_column_in_folder(case: Path) -> tuple[list, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = sorted((case / "score").glob("scores-*.parquet"))[1]
    t = pq.read_table(f)
    i = t.column_names.index("reward")
    _as_written(f, t.set_column(i, "reward", pa.array([str(x) for x in t["reward"].to_pylist()])))
    return ["advantages", case / "score", "--out", case / "new-advantages"], "score"


def _schema_999_manifest(case: Path) -> tuple[list, str]:
    path = case / "rollout" / layout.MANIFEST
    m = json.loads(path.read_text())
    m["schema_version"] = 999
    path.write_text(json.dumps(m))
    return ["score", case / "rollout", "--out", case / "new-score"], "schema version"


def _schema_999_advantages_manifest(case: Path) -> tuple[list, str]:
    path = case / "advantages" / layout.MANIFEST
    m = json.loads(path.read_text())
    m["schema_version"] = 999
    path.write_text(json.dumps(m))
    return ["train", "--rollout", case / "rollout", "--advantages", case / "advantages", "--out", case / "new-train",
            *TRAIN], "schema version"


def _unknown_trajectories(case: Path) -> tuple[list, str]:
    """Scores (and so advantages) with a trajectory the rollout does not have; train on them."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from tpkit import advantages
    from tpkit.config import AdvantagesConfig

    f = sorted((case / "score").glob("scores-*.parquet"))[0]
    t = pq.read_table(f)
    first = t["trajectory_id"][0].as_py()
    extra = t.filter(pc.equal(t["trajectory_id"], first))
    extra = extra.set_column(extra.column_names.index("trajectory_id"), "trajectory_id",
                             pa.array(["p00000-m999"] * extra.num_rows))
    _as_written(f, pa.concat_tables([t, extra]))
    shutil.rmtree(case / "advantages")
    advantages.run(AdvantagesConfig(scores=str(case / "score"), out=str(case / "advantages")))
    return ["train", "--rollout", case / "rollout", "--advantages", case / "advantages", "--out", case / "new-train",
            *TRAIN], "p00000-m999"


def _missing_trajectories(case: Path) -> tuple[list, str]:
    """Scores (and so advantages) that miss a trajectory the rollout has (not dropped for NaN)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from tpkit import advantages
    from tpkit.config import AdvantagesConfig

    f = sorted((case / "score").glob("scores-*.parquet"))[0]
    t = pq.read_table(f)
    gone = t["trajectory_id"][0].as_py()
    _as_written(f, t.filter(pc.not_equal(t["trajectory_id"], gone)))
    shutil.rmtree(case / "advantages")
    try:  # refusing already here is fine too
        advantages.run(AdvantagesConfig(scores=str(case / "score"), out=str(case / "advantages")))
    except Exception:
        return ["advantages", case / "score", "--out", case / "new-advantages"], gone
    return ["train", "--rollout", case / "rollout", "--advantages", case / "advantages", "--out", case / "new-train",
            *TRAIN], gone


CORRUPTIONS = {
    "truncated-shard": _truncate_mid_member,
    "shard-cut-at-member-boundary": _truncate_at_member_boundary,
    "parquet-mistyped-column": _mistyped_parquet_column,
    "parquet-folder-mistyped-column": _mistyped_parquet_column_in_folder,
    "manifest-schema-999": _schema_999_manifest,
    "advantages-manifest-schema-999": _schema_999_advantages_manifest,
    "advantages-with-unknown-trajectory": _unknown_trajectories,
    "advantages-missing-a-trajectory": _missing_trajectories,
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_input_is_a_short_named_error_and_changes_nothing(clean, tmp_path, capfd, kind):
    case = tmp_path / "case"
    for stage in ("rollout", "score", "advantages"):
        shutil.copytree(clean / stage, case / stage)
    argv, named = CORRUPTIONS[kind](case)
    before = snapshot(case)
    capfd.readouterr()
    code = cli(*argv)
    captured = capfd.readouterr()
    short_error(code, captured.err, captured.out)
    assert named.lower() in " ".join(captured.err.split()).lower(), captured.err
    assert {k: v for k, v in snapshot(case).items() if k in before} == before  # existing files as they were
    for new in ("new-score", "new-advantages", "new-train"):
        assert not (case / new / layout.MANIFEST).exists()
        assert not (case / new).exists() or leftovers(case / new) == []


def test_truncated_shard_in_a_separate_process(clean, tmp_path):
    """The same through the console script: `tpkit inspect` on a shard cut short."""
    shard = tmp_path / "shard-r000-00001.tar"
    data = (clean / "rollout" / shard.name).read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    p = subprocess.run([sys.executable, "-m", "tpkit", "inspect", str(shard)], capture_output=True, text=True,
                       timeout=180, env=env())
    short_error(p.returncode, p.stderr, p.stdout)
    assert shard.name in " ".join(p.stderr.split())
    assert sha(shard) == hashlib.sha256(data[: len(data) // 2]).hexdigest()
