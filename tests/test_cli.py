"""The `tpkit` command as a user runs it: a subprocess, its exit code, stdout and stderr.

Error messages must be short (one or two lines plus at most one more), name the problem, exit
non-zero and show no traceback unless --debug is given. Subprocesses get no $COLUMNS, as when a
user's output goes to a pipe or a log file.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TPKIT = Path(sys.executable).with_name("tpkit")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(extra)
    return env


def tpkit(*args, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [str(TPKIT)] if TPKIT.is_file() else [sys.executable, "-m", "tpkit"]
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=env or _env())


def flat(text: str) -> str:
    """Whitespace-normalised lower-case text (Rich may wrap long lines)."""
    return " ".join(text.split()).lower()


def write_parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


# ---------------------------------------------------------------------------------------------
# Help and a fast start
# ---------------------------------------------------------------------------------------------

HEAVY_CHECK = """
import sys
from tpkit.cli import main
for argv in {argvs!r}:
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None), (argv, e.code)
print("HEAVY=" + ",".join(m for m in ("torch", "diffusers", "transformers") if m in sys.modules))
"""


def _heavy_modules_after(argvs: list[list[str]]) -> tuple[subprocess.CompletedProcess, str]:
    p = subprocess.run([sys.executable, "-c", HEAVY_CHECK.format(argvs=argvs)], capture_output=True, text=True,
                       timeout=120, env=_env())
    assert p.returncode == 0, p.stderr
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("HEAVY=")][-1]
    return p, line[len("HEAVY="):]


def test_help_does_not_import_torch():
    p, heavy = _heavy_modules_after([["--help"]])
    assert heavy == "", f"tpkit --help imported {heavy}"
    out = flat(p.stdout)
    for cmd in ("rollout", "score", "advantages", "inspect", "rewards"):
        assert cmd in out


def test_stage_help_does_not_import_torch():
    _, heavy = _heavy_modules_after([[c, "--help"] for c in ("rollout", "score", "advantages", "inspect", "rewards")])
    assert heavy == "", f"a stage's --help imported {heavy}"


@pytest.mark.parametrize("command, options", [
    ("rollout", ["--prompts", "--out", "--group-size", "--sampler", "--window-size", "--window-range"]),
    ("score", ["--out", "--reward", "--branches"]),
    ("advantages", ["--out", "--method", "--balance", "--std"]),
    ("inspect", ["path"]),
    ("rewards", []),
])
def test_stage_help(command, options):
    p = tpkit(command, "--help")
    assert p.returncode == 0, p.stderr
    out = flat(p.stdout)
    assert "usage" in out and command in out
    for opt in options:
        assert opt in out, opt


def test_version():
    import tpkit as package

    p = tpkit("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"tpkit {package.__version__}"


def test_tables_are_whole_when_output_is_not_a_terminal():
    """`tpkit run ... > log` (stdout a file, no COLUMNS): the rounds table keeps its headers whole instead
    of cutting them to 80 columns ("held-…")."""
    code = ("from tpkit.show import rounds_view\n"
            "line = dict(round=1, reward_mean=0.5, reward_stderr=0.01, reward_std=0.1, n=128, turning_point_rate=0.05,"
            " transformer_calls=7040, seconds={'rollout': 9.5}, eval={'geneval_overall': 0.38},"
            " reward_by_task={'single_object': 0.9, 'color_attr': 0.1})\n"
            "rounds_view([line], {'geneval_overall': 0.35, 'geneval_single_object': 0.8}, None)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    assert "held-out geneval_overall" in p.stdout and "held-out, base" in p.stdout and "…" not in p.stdout


def test_no_arguments_shows_help_not_a_traceback():
    p = tpkit()
    assert "Traceback" not in p.stdout + p.stderr
    assert "usage" in flat(p.stdout + p.stderr)


# ---------------------------------------------------------------------------------------------
# Bad inputs: non-zero exit, a short message naming the problem, no traceback
# ---------------------------------------------------------------------------------------------


def _nan_reward_module(folder: Path) -> str:
    (folder / "tpk_cli_nan_reward.py").write_text(textwrap.dedent("""
        def fn(images, prompts, metadata):
            return [float("nan")] * len(images)
    """))
    return "tpk_cli_nan_reward:fn"


def _case(name: str, tmp: Path, run: Path, prompts: Path) -> tuple[list, dict | None, list[str]]:
    """(arguments, environment, words the message must contain) of each bad input."""
    if name == "missing-prompts":
        return ["rollout", "--prompts", tmp / "nope.txt", "--out", tmp / "out"], None, ["nope.txt", "does not exist"]
    if name == "empty-prompts":
        (tmp / "empty.txt").write_text("\n   \n")
        return ["rollout", "--prompts", tmp / "empty.txt", "--out", tmp / "out"], None, ["empty.txt", "empty"]
    if name == "unknown-reward":
        return ["score", run / "rollout", "--out", tmp / "score", "--reward", "nope"], None, ["unknown reward", "nope"]
    if name == "unknown-model":
        return (["rollout", "--prompts", prompts, "--model", "/nonexistent/folder", "--out", tmp / "out"], None,
                ["/nonexistent/folder", "model"])
    if name == "missing-columns":
        f = write_parquet(tmp / "s.parquet", {"trajectory_id": ["a"] * 3, "prompt_id": ["p"] * 3, "branch": [0, 1, 2]})
        return ["advantages", f, "--out", tmp / "adv"], None, ["column", "reward"]
    if name == "branch-gap":
        f = write_parquet(tmp / "s.parquet", {
            "trajectory_id": ["t-ok"] * 4 + ["t-gap"] * 3, "prompt_id": ["p"] * 7,
            "branch": [0, 1, 2, 3, 0, 1, 3], "reward": [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 4.0]})
        return ["advantages", f, "--out", tmp / "adv"], None, ["t-gap", "branches"]
    if name == "nan-in-scores":
        f = write_parquet(tmp / "s.parquet", {"trajectory_id": ["t-nan"] * 3, "prompt_id": ["p"] * 3,
                                              "branch": [0, 1, 2], "reward": [1.0, math.nan, 3.0]})
        return ["advantages", f, "--out", tmp / "adv"], None, ["nan", "t-nan"]
    if name == "nan-from-reward":
        spec = _nan_reward_module(tmp)
        return (["score", run / "rollout", "--out", tmp / "score", "--reward", spec, "--branches", "final"],
                _env(PYTHONPATH=str(tmp)), ["nan", "p00000-m000"])
    if name == "bad-sampler":
        return (["rollout", "--prompts", prompts, "--sampler", "euler", "--out", tmp / "out"], None,
                ["sampler", "euler"])
    if name == "window-does-not-fit":
        return (["rollout", "--prompts", prompts, "--steps", "5", "--out", tmp / "out"], None,
                ["window", "does not fit"])
    raise AssertionError(name)


BAD_INPUTS = ["missing-prompts", "empty-prompts", "unknown-reward", "unknown-model", "missing-columns", "branch-gap",
              "nan-in-scores", "nan-from-reward", "bad-sampler", "window-does-not-fit"]


# Counts and rates out of range, and files of the wrong kind, typed as a user would: refused before any
# work, nothing written.
BAD_COUNTS = {
    "pretrain-negative-steps": (["pretrain-shapes", "--out", "{tmp}/pre", "--flow-steps", "-5"], ["--flow-steps", "-5", ">= 1"]),
    "pretrain-zero-steps": (["pretrain-shapes", "--out", "{tmp}/pre", "--flow-steps", "0"], ["--flow-steps", ">= 1"]),
    "pretrain-no-minutes": (["pretrain-shapes", "--out", "{tmp}/pre", "--max-minutes", "0"], ["--max-minutes", "positive"]),
    "pretrain-negative-weight": (["pretrain-shapes", "--out", "{tmp}/pre", "--task-weight", "counting=-1"], ["counting=-1"]),
    "geneval-prompts-none": (["prompts", "geneval", "--split", "train", "--n", "0", "--out", "{tmp}/p.jsonl"], ["--n", ">= 1"]),
    "geneval-prompts-seed": (["prompts", "geneval", "--seed", "-1", "--out", "{tmp}/p.jsonl"], ["--seed", ">= 0"]),
    "shapes-prompts-none": (["prompts", "shapes", "--split", "train", "--n", "0", "--out", "{tmp}/p.jsonl"], ["--n", ">= 1"]),
    "shapes-prompts-seed": (["prompts", "shapes", "--split", "train", "--seed", "-1", "--out", "{tmp}/p.jsonl"], ["--seed", ">= 0"]),
    "rollout-zero-group": (["rollout", "--prompts", "{prompts}", "--group-size", "0", "--out", "{tmp}/r"], ["group_size", "> 0"]),
    "run-zero-rounds": (["run", "{recipe}", "--rounds", "0", "--out", "{tmp}/run"], ["rounds", "> 0"]),
    "reward-pretrain-zero-steps": (["pretrain-shapes-reward", "--out", "{tmp}/pre", "--steps", "0"], ["--steps", ">= 1"]),
    "reward-pretrain-no-minutes": (["pretrain-shapes-reward", "--out", "{tmp}/pre", "--max-minutes", "-1"], ["positive"]),
    "reward-pretrain-graded-by": (["pretrain-shapes-reward", "--out", "{tmp}/pre", "--graded-by", "eye"],
                                  ["--graded-by", "truth, detector"]),
    "reward-pretrain-graded-pairs": (["pretrain-shapes-reward", "--out", "{tmp}/pre", "--graded-pairs", "-1"],
                                     ["--graded-pairs", ">= 0"]),
    "train-adam-beta": (["train", "--rollout", "{tmp}/r", "--advantages", "{tmp}/a", "--out", "{tmp}/t", "--adam-beta2", "1"],
                        ["adam_beta2", "[0, 1)"]),
    "eval-negative-guidance": (["eval", "reward", "--prompts", "{prompts}", "--reward", "brightness", "--guidance", "-1",
                                "--out", "{tmp}/e"], ["guidance", "> 0"]),
    # a file of the wrong kind where a table is expected: the fix is to pass the right one, not to rerun
    "advantages-of-a-text-file": (["advantages", "{prompts}", "--out", "{tmp}/a"], ["not a readable parquet", ".parquet files"]),
    "prompts-are-a-folder": (["rollout", "--prompts", "{tmp}", "--out", "{tmp}/r"], ["is a folder", "--prompts file"]),
    # an --out under a file (a mistyped path): named as such, not as a raw OSError
    "out-under-a-file": (["rollout", "--prompts", "{prompts}", "--group-size", "2", "--out", "{prompts}/r"],
                         ["is a file, not a folder", "parent folders"]),
    "prompt-file-under-a-file": (["prompts", "shapes", "--split", "train", "--out", "{prompts}/p.jsonl"],
                                 ["is a file, not a folder"]),
}


@pytest.mark.parametrize("name", sorted(BAD_COUNTS))
def test_bad_counts_are_refused_before_any_work(name, tmp_path, two_prompts):
    args, words = BAD_COUNTS[name]
    recipe = Path(__file__).resolve().parents[1] / "pipelines" / "tiny-cpu.toml"
    p = tpkit(*[a.format(tmp=tmp_path, prompts=two_prompts, recipe=recipe) for a in args])
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "fix:" in p.stderr, p.stderr
    for w in words:
        assert w in flat(p.stderr), (w, p.stderr)
    assert list(tmp_path.iterdir()) == [], "nothing is written"


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_gives_a_short_message(name, tmp_path, tiny_run, two_prompts):
    args, env, words = _case(name, tmp_path, tiny_run, two_prompts)
    p = tpkit(*args, env=env)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    msg = flat(p.stderr)
    assert "error" in msg
    for w in words:
        assert w.lower() in msg, (w, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) <= 3, f"{len(lines)} lines on stderr:\n{p.stderr}"


def test_bad_input_writes_nothing(tmp_path, tiny_run):
    args, env, _ = _case("unknown-reward", tmp_path, tiny_run, Path("unused"))
    p = tpkit(*args, env=env)
    assert p.returncode != 0
    assert not (tmp_path / "score").exists() or not any((tmp_path / "score").iterdir())


@pytest.mark.parametrize("name", ["bad-sampler", "missing-prompts"])
def test_debug_shows_the_traceback(name, tmp_path, tiny_run, two_prompts):
    args, env, words = _case(name, tmp_path, tiny_run, two_prompts)
    p = tpkit(*args, "--debug", env=env)
    assert p.returncode != 0
    assert "Traceback" in p.stderr
    assert any(e in p.stderr for e in ("ConfigError", "InputError"))
    for w in words:
        assert w.lower() in flat(p.stderr)


# ---------------------------------------------------------------------------------------------
# inspect and rewards
# ---------------------------------------------------------------------------------------------

INSPECT = {
    "rollout-folder": ("rollout", ["rollout stage", "trajectories", "log-prob", "window_start"]),
    "shard": ("rollout/shard-r000-00000.tar", ["1 prompts", "4 trajectories", "log-prob", "states"]),
    "score-folder": ("score", ["score stage", "rewards per branch", "8 trajectories", "reward_calls"]),
    "scores-file": ("score/scores-r000-00001.parquet", ["40 rows", "rewards per branch", "4 trajectories"]),
    "advantages-folder": ("advantages", ["advantages stage", "turning points", "k = 9"]),
    "advantages-file": ("advantages/advantages.parquet", ["72 rows", "turning points"]),
}


@pytest.mark.parametrize("what", list(INSPECT))
def test_inspect(what, tiny_run):
    rel, words = INSPECT[what]
    p = tpkit("inspect", tiny_run / rel)
    assert p.returncode == 0, p.stderr
    out = flat(p.stdout + p.stderr)
    assert "traceback" not in out
    for w in words:
        assert w in out, (w, out[:2000])


def test_inspect_of_a_missing_path_is_an_error(tmp_path):
    p = tpkit("inspect", tmp_path / "nothing-here")
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    assert "nothing-here" in flat(p.stderr)


def test_rewards_lists_the_builtins():
    p = tpkit("rewards")
    assert p.returncode == 0, p.stderr
    out = flat(p.stdout + p.stderr)
    assert "jpeg-compressibility" in out and "jpeg-incompressibility" in out


def test_cps_window_reaching_the_last_step_is_refused():
    from tpkit.config import RolloutConfig
    from tpkit.errors import ConfigError

    with pytest.raises(ConfigError, match="last step"):
        RolloutConfig(prompts="x.txt", steps=6, window_size=5, window_range=(0, 6)).validate()
    RolloutConfig(prompts="x.txt", steps=6, window_size=5, window_range=(0, 6), sampler="sde").validate()  # SDE noise > 0 there


def test_threads_flag_anywhere_and_its_errors(monkeypatch):
    from tpkit import cli_errors

    monkeypatch.setenv("TPKIT_THREADS", "")  # registered, so the value _take_threads writes is undone after the test
    assert cli_errors.take_threads(["run", "--threads", "1", "r.toml"]) == ["run", "r.toml"]
    assert os.environ["TPKIT_THREADS"] == "1"
    assert cli_errors.take_threads(["--threads=3", "rollout"]) == ["rollout"] and os.environ["TPKIT_THREADS"] == "3"
    r = tpkit("--threads", "0", "rewards")
    assert r.returncode == 2 and "--threads" in r.stderr and "Traceback" not in r.stderr


def test_cpu_threads_are_shared_among_local_processes(monkeypatch):
    """Each process takes its share of the cores: two side by side on 2 cores run 1 thread each."""
    import torch

    from tpkit import runtime

    before = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
        monkeypatch.delenv("TPKIT_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert runtime.set_cpu_threads() == max(cores // 2, 1) == torch.get_num_threads()
        monkeypatch.setenv("TPKIT_THREADS", "1")
        assert runtime.set_cpu_threads() == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("reward", ["geneval", "ocr"])
def test_a_reward_checks_its_prompts_before_any_transformer_work(reward, tmp_path, tiny_run, monkeypatch, capsys):
    """Prompts a reward cannot score (no GenEval metadata; no quoted text for OCR) fail before the branches
    are computed (on SD3.5 most of an hour), and before `tpkit run`'s first rollout."""
    from conftest import cli
    from test_run import small_recipe

    from tpkit import models

    def no_model(*args, **kwargs):
        raise AssertionError("the transformer was loaded before the reward looked at the prompts")

    monkeypatch.setattr(models, "load", no_model)
    opts = ["--reward-opt", "geneval.detector=shapes"] if reward == "geneval" else []
    code = cli("score", tiny_run / "rollout", "--out", tmp_path / "score", "--reward", reward, *opts)
    err = " ".join(capsys.readouterr().err.split()).lower()
    assert code == 2 and ("no geneval metadata" if reward == "geneval" else "has no quoted text") in err, err
    assert "fix:" in err and not (tmp_path / "score").exists()

    recipe = small_recipe(tmp_path, _two_prompts(tmp_path), rounds=1)
    text = recipe.read_text().replace("[rewards]\nbrightness = 1.0", f"[rewards.{reward}]\nweight = 1.0"
                                      + ('\ndetector = "shapes"' if reward == "geneval" else ""))
    recipe.write_text(text)
    code = cli("run", recipe, "--out", tmp_path / "run")
    err = " ".join(capsys.readouterr().err.split()).lower()
    assert code == 2 and ("no geneval metadata" if reward == "geneval" else "has no quoted text") in err, err
    assert not list((tmp_path / "run").glob("round-*"))


def _two_prompts(folder: Path) -> Path:
    p = folder / "two.txt"
    p.write_text("a red cube on a wooden table\na small boat on a calm lake at dawn\n")
    return p
