"""`tpkit run`: recipe parsing (keys, --set values, flow-grpo branches, relative paths), a
property-based check of overrides, one small end-to-end run (continue, extend, redo a stage,
refuse a different recipe) and a real SIGKILL in the middle of a run.

The end-to-end runs use tiny-sd3 with 2 prompts x 4 members and a rank-4 LoRA (seconds a round).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import string
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpkit import layout
from tpkit.config import (AdvantagesConfig, RolloutConfig, ScoreConfig, TrainConfig, apply_override, field_names,
                          load_recipe)
from tpkit.config import defaults as config_defaults
from tpkit.errors import ConfigError, InputError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "pipelines" / "tiny-cpu.toml"
SECTIONS = {"rollout": RolloutConfig, "score": ScoreConfig, "advantages": AdvantagesConfig, "train": TrainConfig}
TOP = {"name", "rounds", "out", "method", "seed", "rewards", "reward_options"}


def config_error(path, overrides=(), **kw) -> str:
    with pytest.raises(ConfigError) as e:
        load_recipe(path, list(overrides), **kw)
    return str(e.value)


def write_recipe(folder: Path, text: str, name: str = "r.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_text(text)
    return p


# --------------------------------------------------------------------------------------------
# Recipe parsing
# --------------------------------------------------------------------------------------------


def test_tiny_cpu_recipe_loads():
    r = load_recipe(TINY)
    assert r.name == "tiny-cpu" and r.method == "tp-grpo" and r.rounds >= 1
    assert r.rollout.model == "tiny-sd3"
    assert r.score.branches == "all"
    assert r.advantages.method == "tp-grpo"
    assert Path(r.rollout.prompts) == (ROOT / "data" / "tiny-prompts.txt").resolve()
    assert Path(r.rollout.prompts).is_file()
    assert r.score.rewards and all(isinstance(w, float) for w in r.score.rewards.values())
    assert isinstance(r.train.learning_rate, float)
    assert r.rollout.window_range == (0, 9)


def test_rounds_and_out_arguments_win():
    r = load_recipe(TINY, rounds=3, out="/tmp/somewhere")
    assert r.rounds == 3 and r.out == "/tmp/somewhere"


def test_unknown_top_level_key(tmp_path):
    p = write_recipe(tmp_path, TINY.read_text() + '\nflavour = "vanilla"\n')
    assert "flavour" in config_error(p)
    assert "colour" in config_error(TINY, ["colour=1"])


def test_unknown_section_key(tmp_path):
    text = TINY.read_text().replace("[train]\n", "[train]\nlr = 1e-3\n")
    p = write_recipe(tmp_path, text)
    assert "train.lr" in config_error(p)
    assert "train.lr" in config_error(TINY, ["train.lr=1e-3"])
    assert "rollout.groupsize" in config_error(TINY, ["rollout.groupsize=4"])


@pytest.mark.parametrize("key", ["rollout.out", "rollout.lora", "rollout.seed", "score.rollout", "score.rewards",
                                 "advantages.method", "train.init_lora", "train.out"])
def test_wired_keys_are_refused(key, tmp_path):
    msg = config_error(TINY, [f'{key}="x"'])
    assert key in msg
    assert "tpkit run" in msg  # the hint says the run wires it


def test_wired_key_in_recipe_file(tmp_path):
    text = TINY.read_text().replace("[rollout]\n", '[rollout]\nout = "somewhere"\n')
    assert "rollout.out" in config_error(write_recipe(tmp_path, text))


@pytest.mark.parametrize("assignment", ["train.learning_rate", "=3", " =3", ""])
def test_bad_set_syntax(assignment):
    msg = config_error(TINY, [assignment])
    assert repr(assignment) in msg or assignment in msg
    assert "key=value" in msg


def test_set_through_a_value_is_refused():
    assert "train.learning_rate.x" in config_error(TINY, ["train.learning_rate.x=1"])


def test_set_values_parse_as_toml():
    r = load_recipe(TINY, ["rollout.group_size=4", "train.learning_rate=1e-3", "train.ema=true",
                           'name="my run"', "rollout.window_range=[1, 9]", "rollout.window_size=8",
                           "train.lora_targets=['attn.to_q', 'attn.to_v']", "method=flow-grpo", "train.beta=0",
                           "rewards.brightness=2"])
    assert r.rollout.group_size == 4 and type(r.rollout.group_size) is int
    assert r.train.learning_rate == 1e-3 and type(r.train.learning_rate) is float
    assert r.train.ema is True
    assert r.name == "my run"
    assert r.rollout.window_range == (1, 9)
    assert r.train.lora_targets == ["attn.to_q", "attn.to_v"]
    assert r.method == "flow-grpo"  # a bare string stays a string
    assert r.train.beta == 0
    assert r.score.rewards == {"brightness": 2.0}


@pytest.mark.parametrize("assignment, key", [
    ("rollout.group_size=abc", "group_size"),
    ("train.learning_rate=fast", "learning_rate"),
    ("rounds=abc", "rounds"),
    ("train.ema=no", "ema"),  # a bare `no` is the string "no", which would switch EMA *on*
])
def test_wrongly_typed_set_values_are_config_errors(assignment, key):
    """A value of the wrong type is a user error: a ConfigError naming the key, not a traceback."""
    assert key in config_error(TINY, [assignment])


def test_flow_grpo_scores_only_the_final_branch():
    assert load_recipe(TINY).score.branches == "all"
    r = load_recipe(TINY, ["method=flow-grpo"])
    assert r.method == "flow-grpo" and r.advantages.method == "flow-grpo"
    assert r.score.branches == "final"
    assert load_recipe(TINY, ["method=flow-grpo", "score.branches=all"]).score.branches == "all"
    assert "branches" in config_error(TINY, ["score.branches=final"])  # tp-grpo needs every branch
    assert "method" in config_error(TINY, ["method=ppo"])


def test_flow_grpo_in_the_file_with_branches_given(tmp_path):
    text = TINY.read_text().replace('method = "tp-grpo"', 'method = "flow-grpo"').replace(
        "[score]\n", '[score]\nbranches = "all"\n')
    assert load_recipe(write_recipe(tmp_path, text)).score.branches == "all"
    text = TINY.read_text().replace('method = "tp-grpo"', 'method = "flow-grpo"')
    assert load_recipe(write_recipe(tmp_path, text)).score.branches == "final"


def test_relative_prompts_resolve_against_the_recipe_folder(tmp_path, monkeypatch):
    folder = tmp_path / "recipes" / "sub"
    (tmp_path / "recipes" / "prompts.txt").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "recipes" / "prompts.txt").write_text("a cat\n")
    text = TINY.read_text().replace('prompts = "../data/tiny-prompts.txt"', 'prompts = "../prompts.txt"')
    p = write_recipe(folder, text)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = load_recipe(Path("..") / "recipes" / "sub" / "r.toml")
    assert Path(r.rollout.prompts).is_absolute()
    assert Path(r.rollout.prompts) == (tmp_path / "recipes" / "prompts.txt").resolve()
    absolute = str((tmp_path / "recipes" / "prompts.txt").resolve())
    r = load_recipe(write_recipe(folder, TINY.read_text().replace("../data/tiny-prompts.txt", absolute), "abs.toml"))
    assert r.rollout.prompts == absolute


# --------------------------------------------------------------------------------------------
# Property-based: overrides
# --------------------------------------------------------------------------------------------

IDENT = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)
ALL_FIELDS = {n for cls in SECTIONS.values() for n in field_names(cls)}


@st.composite
def unknown_keys(draw) -> tuple[str, str]:
    """(dotted key, the prefix the error must name): an unknown top-level key, or an unknown key of a section."""
    if draw(st.booleans()):
        name = draw(IDENT.filter(lambda s: s not in TOP and s not in SECTIONS))
        return name, name
    section = draw(st.sampled_from(sorted(SECTIONS)))
    name = draw(IDENT.filter(lambda s, sec=section: s not in field_names(SECTIONS[sec])))
    key = f"{section}.{name}"
    if draw(st.booleans()):
        return key + "." + draw(IDENT), key
    return key, key


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(unknown_keys(), st.one_of(st.integers(-5, 5).map(str), st.just("true"), st.just('"x"'), st.just("[1, 2]")))
def test_unknown_keys_always_name_the_key(key_and_prefix, value):
    key, prefix = key_and_prefix
    msg = config_error(TINY, [f"{key}={value}"])
    assert prefix in msg


@settings(max_examples=60, deadline=None, database=None)
@given(st.one_of(st.floats(min_value=1e-12, max_value=1e3, allow_nan=False, allow_infinity=False),
                 st.integers(min_value=1, max_value=10**6)))
def test_learning_rate_override_round_trips(lr):
    r = load_recipe(TINY, [f"train.learning_rate={lr!r}"])
    assert r.train.learning_rate == lr
    # What `tpkit run` saves as run.toml reads back equal (the continue check depends on it).
    d = r.to_dict()
    assert tomllib.loads(tomli_w.dumps(d)) == d
    assert d["train"]["learning_rate"] == lr


@settings(max_examples=30, deadline=None, database=None)
@given(st.one_of(st.floats(max_value=0, allow_nan=False, allow_infinity=False), st.integers(max_value=0)))
def test_non_positive_learning_rate_is_refused(lr):
    assert "learning_rate" in config_error(TINY, [f"train.learning_rate={lr!r}"])


TOML_VALUES = st.recursive(
    st.one_of(st.integers(-10**9, 10**9), st.floats(allow_nan=False), st.booleans(),
              st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)),
    lambda inner: st.lists(inner, max_size=4), max_leaves=8)


@settings(max_examples=100, deadline=None, database=None)
@given(st.lists(IDENT, min_size=1, max_size=3), TOML_VALUES)
def test_apply_override_parses_toml_values(parts, value):
    """Any value written as TOML comes back as that value, at the dotted key."""
    rhs = tomli_w.dumps({"v": value}).partition("=")[2].strip()
    data: dict = {}
    apply_override(data, f"{'.'.join(parts)}={rhs}")
    node = data
    for p in parts[:-1]:
        node = node[p]
    assert node == {parts[-1]: value}


@settings(max_examples=60, deadline=None, database=None)
@given(st.text(string.ascii_letters + "-_/", min_size=1, max_size=20).filter(
    lambda s: s not in ("true", "false", "inf", "nan", "-inf", "-nan")))
def test_apply_override_bare_strings(word):
    data: dict = {"train": {}}
    apply_override(data, f"train.x={word}")
    assert data["train"]["x"] == word


# --------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------

ROUND_KEYS = ("reward_mean", "reward_std", "turning_point_rate", "transformer_calls", "seconds")


def small_recipe(folder: Path, prompts: Path, rounds: int = 2) -> Path:
    data = tomllib.loads(TINY.read_text())
    data["rounds"] = rounds
    data["rollout"].update(group_size=4, prompts=str(prompts.resolve()))
    data["train"].update(lora_rank=4, lora_alpha=8)
    return write_recipe(folder, tomli_w.dumps(data), "small.toml")


def files_under(run_dir: Path, *rounds: int) -> dict[str, int]:
    """{relative path: mtime_ns} of every file under the given rounds' folders."""
    out = {}
    for r in rounds:
        for p in layout.round_dir(run_dir, r).rglob("*"):
            if p.is_file():
                out[str(p.relative_to(run_dir))] = p.stat().st_mtime_ns
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, two_prompts) -> dict:
    """A 2-round run; what the read-only tests look at is captured right after it."""
    from tpkit.run import run

    base = tmp_path_factory.mktemp("e2e")
    recipe = small_recipe(base, two_prompts)
    run_dir = base / "run"
    lines = run(load_recipe(recipe, out=str(run_dir)))
    return {
        "recipe": recipe, "run_dir": run_dir, "lines": lines,
        "rounds": read_jsonl(run_dir / layout.ROUNDS_FILE),
        "metrics": {r: read_jsonl(layout.round_dir(run_dir, r) / "train" / layout.METRICS_FILE) for r in (0, 1)},
        "rollout1": json.loads((layout.round_dir(run_dir, 1) / "rollout" / layout.MANIFEST).read_text()),
        "report": (run_dir / "report.png").read_bytes(),
    }


def test_rounds_jsonl(e2e):
    rounds = e2e["rounds"]
    assert len(rounds) == 2
    assert [x["round"] for x in rounds] == [1, 2]
    assert rounds == e2e["lines"]
    for x in rounds:
        for k in ROUND_KEYS:
            assert k in x, k
        assert x["reward_std"] >= 0 and 0 <= x["turning_point_rate"] <= 1
        assert x["transformer_calls"] > 0
        assert {"rollout", "score", "advantages", "train"} <= set(x["seconds"])
        assert all(v >= 0 for v in x["seconds"].values())


def test_report_png(e2e):
    from PIL import Image
    import io

    assert e2e["report"].startswith(b"\x89PNG\r\n\x1a\n")
    img = Image.open(io.BytesIO(e2e["report"]))
    assert img.format == "PNG" and img.width > 100 and img.height > 100


def test_round_one_starts_from_round_zero_with_ratio_one(e2e):
    """Round 1 samples with round 0's adapter (diffusers' load_lora_weights) and trains from it
    (peft): on the first step the recomputed log-probs equal the stored ones bit for bit."""
    adapter0 = layout.round_dir(e2e["run_dir"], 0) / "train" / "adapter"
    assert Path(e2e["rollout1"]["config"]["lora"]) == adapter0.resolve()
    for r in (0, 1):
        first = e2e["metrics"][r][0]
        assert first["ratio_mean"] == 1.0, (r, first)
        assert first["clipfrac"] == 0 and first["approx_kl"] == 0
    assert e2e["metrics"][1][0]["step"] == len(e2e["metrics"][0]) + 1  # global step continues


def test_continue_extend_redo_and_refuse(e2e, tmp_path):
    """Runs after the read-only tests' capture: rerun (nothing redone), rounds=3 (only round 2),
    a deleted train manifest (only that stage), and a different recipe (refused)."""
    import torch
    from safetensors.torch import load_file

    from tpkit.run import run

    run_dir, recipe = e2e["run_dir"], e2e["recipe"]

    # 1. The same command again redoes nothing, also when run.toml was written before tpkit had some
    #    recipe keys (an older tpkit's run: those keys are at their defaults, the behaviour it had).
    saved = tomllib.loads((run_dir / "run.toml").read_text())
    del saved["lr_half_life"], saved["train"]["ema"]
    (run_dir / "run.toml").write_text(tomli_w.dumps(saved))
    #    Likewise a rollout whose identity does not record inputs tpkit records now (family, model content).
    ro0 = layout.round_dir(run_dir, 0) / "rollout"
    for name in (layout.STAGE_FILE, layout.MANIFEST):
        body = json.loads((ro0 / name).read_text())
        ident = body if name == layout.STAGE_FILE else body["identity"]
        del ident["inputs"]["family"], ident["inputs"]["model_sha256"]
        ident["id"] = "written-before"  # an older tpkit's id (rollout_id, which score refers to, stays)
        (ro0 / name).write_text(json.dumps(body))
    before = files_under(run_dir, 0, 1)
    lines = run(load_recipe(recipe, out=str(run_dir)))
    assert files_under(run_dir, 0, 1) == before
    assert lines == e2e["rounds"]
    assert read_jsonl(run_dir / layout.ROUNDS_FILE) == e2e["rounds"]
    #    So does a continuation with other options that only say how the stages run (layout.RUN_ONLY).
    how = ["score.reward_workers=0", "score.on_nan=drop", "train.checkpoint_every=1", "train.max_bad_steps=5"]
    assert run(load_recipe(recipe, how, out=str(run_dir))) == e2e["rounds"]
    assert files_under(run_dir, 0, 1) == before

    # 2. rounds=3 runs only round 2 (from round 1's adapter).
    lines = run(load_recipe(recipe, rounds=3, out=str(run_dir)))
    assert files_under(run_dir, 0, 1) == before
    assert [x["round"] for x in lines] == [1, 2, 3]
    assert read_jsonl(run_dir / layout.ROUNDS_FILE) == lines
    assert lines[:2] == e2e["rounds"]
    for stage in ("rollout", "score", "advantages", "train"):
        assert (layout.round_dir(run_dir, 2) / stage / layout.MANIFEST).is_file()
    lora = json.loads((layout.round_dir(run_dir, 2) / "rollout" / layout.MANIFEST).read_text())["config"]["lora"]
    assert Path(lora) == (layout.round_dir(run_dir, 1) / "train" / "adapter").resolve()
    m2 = read_jsonl(layout.round_dir(run_dir, 2) / "train" / layout.METRICS_FILE)
    assert m2[0]["ratio_mean"] == 1.0

    # 3. Without round 1's train manifest, only that stage runs again; the round's finished stages are
    #    kept, also one written before its stage had some option (advantages' `std` here: gone from
    #    its stage.json and manifest identity, so its id differs too), which is at its default.
    adv1 = layout.round_dir(run_dir, 1) / "advantages"
    stage, manifest = (json.loads((adv1 / name).read_text()) for name in (layout.STAGE_FILE, layout.MANIFEST))
    for ident in (stage, manifest["identity"]):
        del ident["options"]["std"]
        ident["id"] = "written-by-an-older-tpkit"
    (adv1 / layout.STAGE_FILE).write_text(json.dumps(stage))
    (adv1 / layout.MANIFEST).write_text(json.dumps(manifest))
    before = files_under(run_dir, 0, 1, 2)
    train1 = layout.round_dir(run_dir, 1) / "train"
    adapter1 = load_file(train1 / "adapter" / "pytorch_lora_weights.safetensors")
    (train1 / layout.MANIFEST).unlink()
    lines = run(load_recipe(recipe, rounds=3, out=str(run_dir)))
    after = files_under(run_dir, 0, 1, 2)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert changed, "nothing was redone"
    allowed = {"round-0001/round.json"}
    assert all(k.startswith("round-0001/train/") or k in allowed for k in changed), sorted(changed)
    assert "round-0001/train/manifest.json" in after
    assert "round-0001/train/metrics.jsonl" in changed
    assert len(lines) == 3 and [x["round"] for x in lines] == [1, 2, 3]
    assert read_jsonl(train1 / layout.METRICS_FILE)[0]["ratio_mean"] == 1.0
    # Round 2 was sampled with round 1's adapter: the redone stage reproduces its weights exactly
    # (tensors, not file bytes: safetensors' header key order varies between writes).
    adapter1_again = load_file(train1 / "adapter" / "pytorch_lora_weights.safetensors")
    assert adapter1_again.keys() == adapter1.keys()
    assert all(torch.equal(adapter1_again[k], adapter1[k]) for k in adapter1)

    # 4. A different recipe on the same folder is refused, and nothing is touched; so is an option a
    #    finished stage's tpkit did not have, set away from its default.
    saved = (run_dir / "run.toml").read_bytes()
    with pytest.raises(ConfigError) as e:
        run(load_recipe(recipe, ["train.learning_rate=5e-3"], rounds=3, out=str(run_dir)))
    assert "train" in str(e.value)
    assert (run_dir / "run.toml").read_bytes() == saved
    assert files_under(run_dir, 0, 1, 2) == after
    held = json.loads((adv1 / layout.STAGE_FILE).read_text())
    defaults = layout.json_ready(config_defaults(AdvantagesConfig))
    with pytest.raises(InputError, match="--std"):
        layout.check_out(adv1, {**held, "options": {**held["options"], "std": "global"}, "id": "now"},
                         overwrite=False, defaults=defaults)


@pytest.mark.parametrize("changes, differs", [
    (["score.reward_workers=4", "score.on_nan=drop", "rewards.geneval.workers=2",
      "eval.reward_options.geneval.workers=2", "train.checkpoint_every=1", "train.allow_no_op=true"], []),
    (["rewards.geneval.soft=true"], ["rewards"]),
    (["score.batch_size=8"], ["score"]),  # another batch shape may round differently
    (["eval.reward_options.geneval.detector=mask2former"], ["eval"]),
])
def test_a_continued_run_may_change_how_stages_run_not_what_they_compute(tmp_path, changes, differs):
    """The run-level recipe check leaves out what the stages' identities leave out: reward threads,
    --on-nan, the shapes detector's processes (same detections), when to checkpoint; not what changes
    results. Whichever way round (options added or dropped on the continuation)."""
    from tpkit.layout import RUN_TOML
    from tpkit.run import recipe_difference

    recipe = ROOT / "pipelines" / "shapes-tpgrpo.toml"
    for first, then in ((changes, []), ([], changes)):
        (tmp_path / RUN_TOML).write_text(tomli_w.dumps(load_recipe(recipe, first).to_dict()))
        assert recipe_difference(tmp_path, load_recipe(recipe, then)) == differs


def test_stage_identities_leave_out_the_detectors_processes():
    from tpkit import evaluate, score
    from tpkit.config import EvalConfig

    def score_id(**opts):
        return score.identity(ScoreConfig(rewards={"geneval": 1.0}, reward_options={"geneval": opts}), {"rollout_id": "r"})

    def eval_id(**opts):
        return evaluate.identity(EvalConfig(kind="geneval", reward_options={"geneval": opts}))

    for ident in (score_id, eval_id):
        assert ident(detector="shapes", workers=4)["id"] == ident(detector="shapes")["id"]
        assert ident(detector="shapes", soft=True)["id"] != ident(detector="shapes")["id"]


def test_lr_half_life_decays_each_rounds_learning_rate(tmp_path, two_prompts):
    """lr_half_life = 1 halves train.learning_rate every round: round r trains at lr 2^-r (its train
    stage's config and metrics, and rounds.jsonl, say so)."""
    from tpkit.run import run, stage_dirs

    recipe = load_recipe(small_recipe(tmp_path, two_prompts), ["lr_half_life=1"], out=str(tmp_path / "run"))
    lines = run(recipe)
    lr = recipe.train.learning_rate
    for r, line in enumerate(lines):
        train_dir = stage_dirs(tmp_path / "run", r)["train"]
        assert json.loads((train_dir / layout.MANIFEST).read_text())["config"]["learning_rate"] == lr / 2**r
        assert {m["lr"] for m in read_jsonl(train_dir / layout.METRICS_FILE)} == {lr / 2**r}
        assert line["train"]["lr"] == lr / 2**r


def test_keep_rounds_deletes_old_rounds_shards_only(e2e, tmp_path, two_prompts, capsys):
    """keep_rounds = 1 over 3 rounds: round 1's shards go once round 2 has trained, rounds 0 and 2 keep
    theirs; the results are those of a run that keeps everything; reading the pruned rollout is refused
    with the fix, and following the fix writes the same shards again."""
    from conftest import cli

    from tpkit.run import prune_rounds, run, stage_dirs

    recipe = small_recipe(tmp_path, two_prompts, rounds=3)
    run_dir = tmp_path / "run"
    lines = run(load_recipe(recipe, ["keep_rounds=1"], out=str(run_dir)))
    rollouts = [stage_dirs(run_dir, r)["rollout"] for r in range(3)]
    assert [len(layout.list_shards(d)) for d in rollouts] == [1, 0, 1]
    assert (rollouts[1] / layout.PRUNED).is_file() and (rollouts[1] / layout.MANIFEST).is_file()
    assert all(not (d / layout.PRUNED).exists() for d in (rollouts[0], rollouts[2]))
    for stage in ("score", "advantages", "train"):  # everything after the rollout stays
        assert (stage_dirs(run_dir, 1)[stage] / layout.MANIFEST).is_file()
    assert (stage_dirs(run_dir, 1)["train"] / "state").is_dir()
    assert "deleted the rollout shards of round(s) 2 (" in capsys.readouterr().err  # folder round-0001
    assert [x["reward_mean"] for x in lines[:2]] == [x["reward_mean"] for x in e2e["rounds"]]  # as if nothing were deleted
    assert (run_dir / "report.png").is_file()

    # the pruned rollout cannot be scored again; the fix is to rerun it, which writes the same bytes
    assert cli("score", rollouts[1], "--out", tmp_path / "rescore", "--reward", "brightness") != 0
    err = capsys.readouterr().err
    assert "deleted by `tpkit run` (keep_rounds)" in err and "rerun `tpkit rollout`" in err
    manifest = json.loads((rollouts[1] / layout.MANIFEST).read_text())
    c = manifest["config"]
    assert cli("rollout", "--model", c["model"], "--prompts", c["prompts"], "--out", rollouts[1], "--lora", c["lora"],
               "--group-size", c["group_size"], "--seed", c["seed"]) == 0
    assert "written again, byte for byte" in capsys.readouterr().err
    assert not (rollouts[1] / layout.PRUNED).exists()
    again = json.loads((rollouts[1] / layout.MANIFEST).read_text())
    assert again["shard_sha256"] == manifest["shard_sha256"] and again["rollout_id"] == manifest["rollout_id"]

    # pruning again frees those bytes; another keep_rounds on the finished run is no other recipe
    size = sum(p.stat().st_size for p in layout.list_shards(rollouts[1]))
    assert size > 0 and prune_rounds(run_dir, 1) == {1: size} and prune_rounds(run_dir, 1) == {}
    assert run(load_recipe(recipe, ["keep_rounds=0"], out=str(run_dir))) == lines
    assert [len(layout.list_shards(d)) for d in rollouts] == [1, 0, 1]


def test_a_moved_run_folder_and_checkout_continue(tmp_path, two_prompts):
    """A run folder copied elsewhere, continued from a recipe whose prompt file moved too (same bytes):
    the finished round is kept as it is and the next one runs; other prompt bytes are another run."""
    import shutil

    from tpkit.run import run

    first = tmp_path / "a"
    (first / "data").mkdir(parents=True)
    shutil.copy(two_prompts, first / "data" / "p.txt")
    run(load_recipe(small_recipe(first, first / "data" / "p.txt", rounds=1), out=str(first / "run")))
    # the checkout and the run folder move (a copy: the old paths no longer hold them)
    second = tmp_path / "b"
    shutil.copytree(first, second)
    shutil.rmtree(first)
    before = files_under(second / "run", 0)
    lines = run(load_recipe(small_recipe(second, second / "data" / "p.txt", rounds=2), out=str(second / "run")))
    assert [x["round"] for x in lines] == [1, 2] and files_under(second / "run", 0) == before
    saved = tomllib.loads((second / "run" / "run.toml").read_text())
    assert saved["out"] == str(second / "run") and saved["rollout"]["prompts"] == str((second / "data" / "p.txt").resolve())
    # the same path with other prompts is another run
    (second / "data" / "p.txt").write_text("a green apple\na blue door\n")
    with pytest.raises(ConfigError, match="differs in: rollout"):
        run(load_recipe(small_recipe(second, second / "data" / "p.txt", rounds=3), out=str(second / "run")))


def test_score_runs_the_policy_that_sampled_even_after_a_move(tmp_path, two_prompts):
    """Scoring a round again finds its rollout's LoRA when the run folder moved (the manifest holds the
    old absolute path), and refuses an adapter that changed since the rollout sampled with it."""
    import shutil

    from tpkit import score
    from tpkit.errors import InputError
    from tpkit.run import run

    run(load_recipe(small_recipe(tmp_path, two_prompts, rounds=2), out=str(tmp_path / "a")))
    shutil.move(tmp_path / "a", tmp_path / "b")
    r1 = tmp_path / "b" / "round-0001"
    recorded = Path(layout.read_manifest(r1 / "rollout", "rollout")["config"]["lora"])
    assert not recorded.exists() and str(recorded).startswith(str(tmp_path / "a"))
    before = layout.read_parquet_tables(r1 / "score", "score").to_pylist()
    settings = layout.read_manifest(r1 / "score", "score")["config"]
    settings = {k: v for k, v in settings.items() if k in field_names(ScoreConfig)}
    score.run(ScoreConfig(**{**settings, "rollout": str(r1 / "rollout"), "out": str(tmp_path / "again")}))
    assert layout.read_parquet_tables(tmp_path / "again", "score").to_pylist() == before

    # the adapter retrained after the rollout (here: one weight changed) is another policy
    from safetensors.torch import load_file, save_file

    moved = tmp_path / "b" / recorded.relative_to(tmp_path / "a")
    weights = next(moved.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights)
    with pytest.raises(InputError, match="no longer the LoRA"):
        score.run(ScoreConfig(**{**settings, "rollout": str(r1 / "rollout"), "out": str(tmp_path / "third")}))
    assert not (tmp_path / "third").exists() or not list((tmp_path / "third").glob("*.parquet"))


# --------------------------------------------------------------------------------------------
# A real kill
# --------------------------------------------------------------------------------------------


def tpkit_command() -> list[str]:
    exe = Path(sys.executable).parent / "tpkit"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "tpkit"]


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix in (".tar", ".parquet")}


def test_sigkill_then_rerun_finishes(tmp_path, two_prompts):
    recipe = small_recipe(tmp_path, two_prompts, rounds=3)
    run_dir = tmp_path / "run"
    cmd = [*tpkit_command(), "run", str(recipe), "--out", str(run_dir)]
    log = (tmp_path / "first.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    marker = layout.round_dir(run_dir, 0) / "round.json"
    deadline = time.monotonic() + 240
    try:
        while not marker.is_file():
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "round 0 did not finish in time"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (layout.round_dir(run_dir, 2) / "train" / layout.MANIFEST).exists()  # killed mid-run

    round0 = layout.round_dir(run_dir, 0)
    kept = digests(round0)
    assert any(k.endswith(".tar") for k in kept) and any(k.endswith(".parquet") for k in kept)
    round0_json = marker.read_bytes()

    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, env=dict(os.environ))
    assert done.returncode == 0, done.stdout.decode(errors="replace")[-3000:]
    assert digests(round0) == kept
    assert marker.read_bytes() == round0_json
    rounds = read_jsonl(run_dir / layout.ROUNDS_FILE)
    assert [x["round"] for x in rounds] == [1, 2, 3]
    for r in range(3):
        for stage in ("rollout", "score", "advantages", "train"):
            assert (layout.round_dir(run_dir, r) / stage / layout.MANIFEST).is_file()
    assert (run_dir / "report.png").read_bytes().startswith(b"\x89PNG")
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.parametrize("tp", sorted(p.name for p in (ROOT / "pipelines").glob("*tpgrpo*.toml")
                                      if (ROOT / "pipelines" / p.name.replace("tpgrpo", "flowgrpo")).is_file()))
def test_flow_grpo_recipes_are_their_tp_grpo_twins_but_the_method(tp):
    """Both methods tuned equally: a recipe pair differs in the method (and what it implies: which
    branches are scored), in nothing else."""
    import dataclasses

    from tpkit.config import load_recipe

    a, b = (load_recipe(ROOT / "pipelines" / n) for n in (tp, tp.replace("tpgrpo", "flowgrpo")))
    assert (a.method, b.method) == ("tp-grpo", "flow-grpo")
    assert (a.score.branches, b.score.branches) == ("all", "final")
    for section in ("rollout", "train", "eval"):
        assert dataclasses.asdict(getattr(a, section)) == dataclasses.asdict(getattr(b, section)), section
    assert dataclasses.replace(a.score, branches="final") == b.score
    assert (a.rounds, a.seed, a.eval_every, a.score.rewards) == (b.rounds, b.seed, b.eval_every, b.score.rewards)


def test_flux_recipes_carry_the_release_settings():
    from tpkit.config import load_recipe
    from tpkit.models import flux

    for name in ("flux-tpgrpo-pickscore", "flux-tpgrpo-geneval"):
        r = load_recipe(ROOT / "pipelines" / f"{name}.toml")
        ro = r.rollout
        assert (ro.family, ro.steps, ro.guidance, ro.resolution, ro.group_size, ro.noise_level, ro.sampler) == (
            "flux", 6, 3.5, 512, 24, 0.8, "cps")
        assert (ro.window_size, ro.window_range) == (5, (0, 5))
        assert (r.eval.steps, r.eval.family, r.train.mixed_precision) == (28, "flux", "bf16")
        assert r.train.lora_targets == list(flux.LORA_TARGETS) and (r.train.lora_rank, r.train.lora_alpha) == (64, 128)
    assert load_recipe(ROOT / "pipelines" / "sd35l-tpgrpo-pickscore.toml").rollout.family == "sd3"


def test_rounds_count_from_one_in_rounds_jsonl_whatever_round_json_says(tmp_path):
    """rounds.jsonl numbers each round by its folder (round-0000 is round 1), also for round.json files a
    tpkit before 0.2 wrote with rounds counted from 0: a run folder of that version continues consistently."""
    from tpkit import layout
    from tpkit.run import write_rounds

    for r, stored in ((0, 0), (1, 2)):  # an old summary, and one of this version
        layout.round_dir(tmp_path, r).mkdir(parents=True)
        layout.atomic_write_json(layout.round_dir(tmp_path, r) / layout.ROUND_JSON, {"round": stored, "reward_mean": r})
    lines = write_rounds(tmp_path, 3)
    assert [(x["round"], x["folder"], x["reward_mean"]) for x in lines] == [(1, "round-0000", 0), (2, "round-0001", 1)]
    assert layout.read_jsonl(tmp_path / layout.ROUNDS_FILE) == lines
