"""Every folder knows what it holds; nothing downstream accepts data it was not computed from.

Each test types commands as a user would (`tpkit ...` through `tpkit.cli.main`, the console
script's code, in this process so the tiny model stays loaded; usage errors in a subprocess) and
checks the outcome: the correct result, or a short error with nothing already written lost.
Sizes are tiny (2 prompts x 2 members, T = 6, K = 5, LoRA rank 4): about a minute on 2 CPU cores.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
from conftest import cli

from tpkit import layout

SMALL = ["--group-size", "2", "--steps", "6", "--window-size", "5", "--window-range", "0", "5",
         "--prompts-per-shard", "1"]
TRAIN = ["--lora-rank", "4", "--lora-alpha", "8", "--optimizer-steps", "1"]
REWARDS = textwrap.dedent("""
    def nan(images, prompts, metadata):
        return [float("nan")] * len(images)

    def const(images, prompts, metadata):
        return [1.0] * len(images)

    def nan_once(images, prompts, metadata):
        return [float("nan")] + [1.0] * (len(images) - 1)
""")


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file() and not p.name.startswith(".lock-")}


def refused(capfd, code: int, *words: str) -> str:
    """A short tpkit error (exit 2, at most 3 lines, no traceback) containing every word."""
    err = capfd.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "error:" in err, err
    err = err[err.index("error:"):]  # after any progress lines
    flat = " ".join(err.split())
    assert len(err.strip().splitlines()) <= 3, err
    for w in words:
        assert w in flat, (w, err)
    return flat


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tpkit_home) -> Path:
    """rollout R -> score S -> advantages A, and a second rollout R2 of the same prompts (seed 1:
    the same trajectory ids, other trajectories)."""
    d = tmp_path_factory.mktemp("identity")
    (d / "two.txt").write_text("a red cube on a wooden table\na small boat on a calm lake at dawn\n")
    (d / "tpk_identity_rewards.py").write_text(REWARDS)
    assert cli("rollout", "--prompts", d / "two.txt", "--out", d / "R", *SMALL) == 0
    assert cli("rollout", "--prompts", d / "two.txt", "--out", d / "R2", *SMALL, "--seed", "1") == 0
    assert cli("score", d / "R", "--out", d / "S") == 0
    assert cli("advantages", d / "S", "--out", d / "A") == 0
    return d


@pytest.fixture
def rewards_on_path(base, monkeypatch):
    monkeypatch.syspath_prepend(str(base))


# --------------------------------------------------------------------------------------------
# 1. Every output folder knows what it holds
# --------------------------------------------------------------------------------------------


def test_rerun_with_other_options_is_refused_then_overwrite_replaces_everything(base, tmp_path, capfd):
    out = tmp_path / "R"
    assert cli("rollout", "--prompts", base / "two.txt", "--out", out, *SMALL) == 0
    assert json.loads((out / layout.STAGE_FILE).read_text())["stage"] == "rollout"
    before = snapshot(out)
    capfd.readouterr()
    code = cli("rollout", "--prompts", base / "two.txt", "--out", out, *SMALL, "--group-size", "3", "--seed", "4")
    refused(capfd, code, "--group-size", "--seed", "--overwrite", "--out")
    assert snapshot(out) == before

    # a half-finished folder (no manifest) knows what it holds too
    (out / layout.MANIFEST).unlink()
    before = snapshot(out)
    code = cli("rollout", "--prompts", base / "two.txt", "--out", out, *SMALL, "--group-size", "3")
    refused(capfd, code, "--group-size")
    assert snapshot(out) == before

    # the same options resume (and finish it)
    assert cli("rollout", "--prompts", base / "two.txt", "--out", out, *SMALL) == 0
    assert (out / layout.MANIFEST).is_file()

    # --overwrite: no old file survives, and the shards hold what the manifest says
    (out / "old-notes.txt").write_text("from before")
    assert cli("rollout", "--prompts", base / "two.txt", "--out", out, *SMALL, "--group-size", "3", "--overwrite") == 0
    assert not (out / "old-notes.txt").exists()
    m = json.loads((out / layout.MANIFEST).read_text())
    assert m["config"]["group_size"] == 3
    for shard in layout.list_shards(out):
        assert {t.meta["member"] for t in layout.read_shard(shard, load_tensors=False)[1]} == {0, 1, 2}


def test_a_stage_never_writes_into_another_stages_folder(base, tmp_path, capfd):
    before = {name: snapshot(base / name) for name in ("R", "S", "A")}
    capfd.readouterr()
    refused(capfd, cli("score", base / "R", "--out", base / "R"), "input")
    refused(capfd, cli("score", base / "R", "--out", base / "R", "--overwrite"), "input")
    refused(capfd, cli("score", base / "R", "--out", base / "R2"), "tpkit rollout", "--overwrite")
    refused(capfd, cli("rollout", "--prompts", base / "two.txt", "--out", base / "S", *SMALL), "tpkit score")
    refused(capfd, cli("advantages", base / "S", "--out", base / "R"), "tpkit rollout")
    refused(capfd, cli("train", "--rollout", base / "R", "--advantages", base / "A", "--out", base / "A", *TRAIN), "input")
    assert {name: snapshot(base / name) for name in ("R", "S", "A")} == before

    # a folder of someone else's files: never written into, never deleted by --overwrite
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    refused(capfd, cli("advantages", base / "S", "--out", mine), "did not write")
    refused(capfd, cli("advantages", base / "S", "--out", mine, "--overwrite"), "did not write")
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]


def test_overwrite_with_a_bad_input_loses_nothing(base, tmp_path, capfd):
    """--overwrite clears the folder only once every input has been checked: a typo keeps the old results."""
    import shutil

    for name in ("R", "S", "A"):
        shutil.copytree(base / name, tmp_path / name)
    assert cli("train", "--rollout", base / "R", "--advantages", base / "A", "--out", tmp_path / "T", *TRAIN) == 0
    before = {name: snapshot(tmp_path / name) for name in ("R", "S", "A", "T")}
    capfd.readouterr()
    refused(capfd, cli("score", base / "R", "--out", tmp_path / "S", "--overwrite", "--reward", "nope"), "nope")
    refused(capfd, cli("advantages", tmp_path / "nope", "--out", tmp_path / "A", "--overwrite"), "nope")
    refused(capfd, cli("train", "--rollout", base / "R2", "--advantages", base / "A", "--out", tmp_path / "T",
                       *TRAIN, "--overwrite"), "another rollout")
    refused(capfd, cli("rollout", "--prompts", tmp_path / "missing.txt", "--out", tmp_path / "R", *SMALL, "--overwrite"),
            "missing.txt")
    assert {name: snapshot(tmp_path / name) for name in ("R", "S", "A", "T")} == before


def test_score_of_a_changed_rollout_is_refused(base, tmp_path, capfd):
    """The issue's case: the rollout redone with another seed, then scored into the old score folder."""
    import shutil

    rollout, scores = tmp_path / "R", tmp_path / "S"
    shutil.copytree(base / "R", rollout)
    shutil.copytree(base / "S", scores)
    assert cli("score", rollout, "--out", scores) == 0  # same rollout: finished, nothing to do
    assert cli("rollout", "--prompts", base / "two.txt", "--out", rollout, *SMALL, "--seed", "5", "--overwrite") == 0
    before = snapshot(scores)
    capfd.readouterr()
    refused(capfd, cli("score", rollout, "--out", scores), "rollout_id", "--overwrite")
    assert snapshot(scores) == before
    # and the old advantages do not train the new rollout
    refused(capfd, cli("train", "--rollout", rollout, "--advantages", base / "A", "--out", tmp_path / "T", *TRAIN),
            "another rollout")
    assert not (tmp_path / "T").exists()


def test_eval_rerun_with_other_options_is_refused(base, tmp_path, capfd):
    argv = ["eval", "reward", "--prompts", base / "two.txt", "--reward", "brightness", "--out", tmp_path / "E",
            "--steps", "2", "--images-per-prompt", "1"]
    assert cli(*argv) == 0
    before = snapshot(tmp_path / "E")
    capfd.readouterr()
    refused(capfd, cli(*argv[:-4], "--steps", "3", "--images-per-prompt", "1"), "--steps")
    assert snapshot(tmp_path / "E") == before


# --------------------------------------------------------------------------------------------
# 2. The identity chain holds for every input form
# --------------------------------------------------------------------------------------------


def test_single_files_carry_the_rollout_they_come_from(base, tmp_path, capfd):
    rid = json.loads((base / "R" / layout.MANIFEST).read_text())["rollout_id"]
    one = tmp_path / "A1"
    assert cli("advantages", base / "S" / "scores-r000-00000.parquet", "--out", one) == 0
    assert json.loads((one / layout.MANIFEST).read_text())["rollout_id"] == rid
    assert layout.parquet_meta(one / layout.ADVANTAGES_FILE)["rollout_id"] == rid
    capfd.readouterr()
    # R2 has the same trajectory ids: only the identity tells them apart, whatever the form
    for adv in (one, base / "A", base / "A" / layout.ADVANTAGES_FILE):
        refused(capfd, cli("train", "--rollout", base / "R2", "--advantages", adv, "--out", tmp_path / "T", *TRAIN),
                "another rollout")
    assert not (tmp_path / "T").exists()
    # the right rollout with the advantages file alone trains
    assert cli("train", "--rollout", base / "R", "--advantages", base / "A" / layout.ADVANTAGES_FILE,
               "--out", tmp_path / "T", *TRAIN) == 0


def test_a_table_that_names_no_rollout_does_not_train(base, tmp_path, capfd):
    import pyarrow.parquet as pq

    table = layout.read_parquet_tables(base / "S", "score").replace_schema_metadata(None)
    pq.write_table(table, tmp_path / "foreign.parquet")
    assert cli("advantages", tmp_path / "foreign.parquet", "--out", tmp_path / "A") == 0
    capfd.readouterr()
    refused(capfd, cli("train", "--rollout", base / "R", "--advantages", tmp_path / "A", "--out", tmp_path / "T", *TRAIN),
            "rollout_id")
    # with the rollout's id in a column, it is accepted
    rid = json.loads((base / "R" / layout.MANIFEST).read_text())["rollout_id"]
    pq.write_table(table.append_column("rollout_id", [[rid] * len(table)]), tmp_path / "named.parquet")
    assert cli("advantages", tmp_path / "named.parquet", "--out", tmp_path / "A2") == 0
    assert cli("train", "--rollout", base / "R", "--advantages", tmp_path / "A2", "--out", tmp_path / "T", *TRAIN) == 0


def test_a_glob_of_scores_files_carries_the_rollout_too(base, tmp_path):
    rid = json.loads((base / "R" / layout.MANIFEST).read_text())["rollout_id"]
    assert cli("advantages", str(base / "S" / "scores-*.parquet"), "--out", tmp_path / "A") == 0
    m = json.loads((tmp_path / "A" / layout.MANIFEST).read_text())
    assert m["rollout_id"] == rid and m["counts"]["trajectories"] == 4
    assert sorted(m["identity"]["inputs"]["scores_sha256"]) == ["scores-r000-00000.parquet", "scores-r000-00001.parquet"]


def test_an_unfinished_or_padded_score_folder_is_refused(base, tmp_path, capfd):
    import shutil

    scores = tmp_path / "S"
    shutil.copytree(base / "S", scores)
    shutil.copy(scores / "scores-r000-00000.parquet", scores / "scores-r000-00007.parquet")
    capfd.readouterr()
    refused(capfd, cli("advantages", scores, "--out", tmp_path / "A"), "scores-r000-00007.parquet", "manifest")
    (scores / "scores-r000-00007.parquet").unlink()
    (scores / layout.MANIFEST).unlink()
    refused(capfd, cli("advantages", scores, "--out", tmp_path / "A"), "did not finish")
    assert not (tmp_path / "A").exists()


def test_a_shard_swapped_after_the_rollout_is_refused(base, tmp_path, capfd):
    """A valid shard of another rollout (same name, same trajectory ids) put in place of this one's."""
    import shutil

    rollout = tmp_path / "R"
    shutil.copytree(base / "R", rollout)
    shutil.copy(base / "R2" / "shard-r000-00001.tar", rollout / "shard-r000-00001.tar")
    capfd.readouterr()
    refused(capfd, cli("score", rollout, "--out", tmp_path / "S"), "shard-r000-00001.tar", "changed")
    refused(capfd, cli("train", "--rollout", rollout, "--advantages", base / "A", "--out", tmp_path / "T", *TRAIN),
            "shard-r000-00001.tar", "changed")


def _scale_rewards(table_path: Path, column: str) -> None:
    """Rewrite a tpkit table in place with one column changed (finite, same rollout id, same metadata)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(table_path)
    i = table.schema.get_field_index(column)
    table = table.set_column(i, column, pc.multiply(table[column], pa.scalar(-1.0, table[column].type)))
    pq.write_table(table, table_path)


def test_a_table_edited_after_its_stage_finished_is_refused(base, tmp_path, capfd):
    """A finished score or advantages folder whose table was rewritten (valid, finite, same rollout id)."""
    import shutil

    shutil.copytree(base / "S", tmp_path / "S")
    shutil.copytree(base / "A", tmp_path / "A")
    _scale_rewards(tmp_path / "S" / "scores-r000-00000.parquet", "reward")
    _scale_rewards(tmp_path / "A" / layout.ADVANTAGES_FILE, "advantage")
    capfd.readouterr()
    refused(capfd, cli("advantages", tmp_path / "S", "--out", tmp_path / "A2"), "scores-r000-00000.parquet", "changed",
            "--overwrite")
    refused(capfd, cli("train", "--rollout", base / "R", "--advantages", tmp_path / "A", "--out", tmp_path / "T",
                       *TRAIN), layout.ADVANTAGES_FILE, "changed")
    assert not (tmp_path / "A2").exists() and not (tmp_path / "T").exists()


def test_a_local_model_retrained_in_place_is_a_new_input(base, tmp_path, capfd):
    """A local model folder is identified by its weights, not its path: after retraining it in place, rerunning
    a finished rollout is refused (not silently kept), and score/train of the old rollout refuse to run the
    new weights on it. A copy of the folder elsewhere is the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tpkit import models

    local = tmp_path / "my-model"
    shutil.copytree(models.sd3.resolve("tiny-sd3"), local)
    assert models.content_id(str(local)) is not None and models.content_id("tiny-sd3") is None
    shutil.copytree(local, tmp_path / "moved")
    assert models.content_id(str(tmp_path / "moved")) == models.content_id(str(local))
    rollout = ["rollout", "--prompts", base / "two.txt", "--model", local, "--out", tmp_path / "R", *SMALL]
    assert cli(*rollout) == 0
    assert cli(*rollout) == 0  # finished: nothing to do
    weights = next((local / "transformer").glob("*.safetensors"))
    state = load_file(weights)
    save_file({k: (v * 1.01 if v.is_floating_point() else v).contiguous() for k, v in state.items()}, weights)
    capfd.readouterr()
    refused(capfd, cli(*rollout), "inputs: model_sha256", "--overwrite")
    refused(capfd, cli("score", tmp_path / "R", "--out", tmp_path / "S"), str(local), "weights changed", "--overwrite")
    assert not (tmp_path / "S").exists()


def test_the_family_is_part_of_a_rollouts_identity(tmp_path):
    """Forcing --family on a model only its name can place, against a finished folder of the other family:
    the identities differ, so the finished folder is not taken as done."""
    from tpkit import rollout
    from tpkit.config import RolloutConfig

    (tmp_path / "p.txt").write_text("a cat\n")
    one = dict(prompts=str(tmp_path / "p.txt"), out=str(tmp_path / "R"), model="someone/unknown-model")
    sd3 = rollout.identity(RolloutConfig(**one, family="sd3").validate())
    flux = rollout.identity(RolloutConfig(**one, family="flux").validate())
    assert sd3["id"] != flux["id"] and sd3["inputs"]["family"] == "sd3"


# --------------------------------------------------------------------------------------------
# 3. Numbers are checked where they enter
# --------------------------------------------------------------------------------------------


def _poison_shard(shard: Path, member_key: str, tensor: str) -> str:
    """Rewrite one trajectory's latents member with a NaN in `tensor` (a valid file otherwise)."""
    from safetensors.torch import load, save

    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    out = []
    for info, data in members:
        if info.name.startswith(member_key) and info.name.endswith(layout.TENSORS):
            tensors = load(data)
            tensors[tensor].view(-1)[0] = float("nan")
            data = save(tensors)
            info.size = len(data)
        out.append((info, data))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for info, data in out:
            tar.addfile(info, io.BytesIO(data))
    shard.write_bytes(buf.getvalue())
    return member_key


@pytest.mark.parametrize("tensor", ["states", "log_probs"])
def test_non_finite_numbers_in_a_shard_are_named_errors(base, tmp_path, capfd, tensor):
    import shutil

    rollout = tmp_path / "R"
    shutil.copytree(base / "R", rollout)
    shard = layout.list_shards(rollout)[1]
    key = layout.read_shard(shard, load_tensors=False)[1][0].trajectory_id
    _poison_shard(shard, key, tensor)
    # as if the rollout itself had written it (a diverged policy): the manifest lists its digest
    m = json.loads((rollout / layout.MANIFEST).read_text())
    m["shard_sha256"][shard.name] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (rollout / layout.MANIFEST).write_text(json.dumps(m))
    capfd.readouterr()
    refused(capfd, cli("score", rollout, "--out", tmp_path / "S"), shard.name, key, tensor, "NaN")
    refused(capfd, cli("train", "--rollout", rollout, "--advantages", base / "A", "--out", tmp_path / "T", *TRAIN),
            shard.name, key, tensor)
    assert not (tmp_path / "S" / layout.MANIFEST).exists() and not (tmp_path / "T").exists()


def test_non_finite_advantages_are_named(base, tmp_path, capfd):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = base / "A" / layout.ADVANTAGES_FILE
    table = pq.read_table(path)
    adv = table["advantage"].to_pylist()
    adv[3] = float("inf")
    bad = table["trajectory_id"][3].as_py()
    (tmp_path / "A").mkdir()
    pq.write_table(table.set_column(table.column_names.index("advantage"), "advantage", pa.array(adv)),
                   tmp_path / "A" / layout.ADVANTAGES_FILE)
    capfd.readouterr()
    refused(capfd, cli("train", "--rollout", base / "R", "--advantages", tmp_path / "A" / layout.ADVANTAGES_FILE,
                       "--out", tmp_path / "T", *TRAIN), bad, "infinite")


def test_every_reward_nan_with_drop_is_an_error_and_no_manifest(base, tmp_path, capfd, rewards_on_path):
    code = cli("score", base / "R", "--out", tmp_path / "S", "--reward", "tpk_identity_rewards:nan",
               "--on-nan", "drop", "--branches", "final")
    refused(capfd, code, "every trajectory", "NaN")
    assert not (tmp_path / "S" / layout.MANIFEST).exists()


def test_a_nan_reward_in_eval_is_an_error(base, tmp_path, capfd, rewards_on_path):
    code = cli("eval", "reward", "--prompts", base / "two.txt", "--reward", "tpk_identity_rewards:nan_once",
               "--out", tmp_path / "E", "--steps", "2", "--images-per-prompt", "2")
    refused(capfd, code, "p00000", "NaN")
    assert not (tmp_path / "E" / layout.MANIFEST).exists()


# --------------------------------------------------------------------------------------------
# 4. No silent no-op
# --------------------------------------------------------------------------------------------


def test_constant_reward_is_an_error_unless_allowed(base, tmp_path, capfd, rewards_on_path):
    assert cli("score", base / "R", "--out", tmp_path / "S", "--reward", "tpk_identity_rewards:const",
               "--branches", "final") == 0
    assert cli("advantages", tmp_path / "S", "--out", tmp_path / "A", "--method", "flow-grpo") == 0
    capfd.readouterr()
    argv = ["train", "--rollout", base / "R", "--advantages", tmp_path / "A", *TRAIN]
    refused(capfd, cli(*argv, "--out", tmp_path / "T"), "nothing to learn", "--allow-no-op")
    assert not (tmp_path / "T").exists()
    assert cli(*argv, "--out", tmp_path / "T", "--allow-no-op") == 0
    m = json.loads((tmp_path / "T" / layout.MANIFEST).read_text())
    assert m["no_op"] is True and m["counts"]["optimizer_steps"] == 0


def test_run_stops_at_a_round_with_nothing_to_learn(base, tmp_path, capfd, rewards_on_path):
    import tomllib

    import tomli_w

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pipelines" / "tiny-cpu.toml").read_text())
    data.update(rounds=2, rewards={"tpk_identity_rewards:const": 1.0}, method="flow-grpo")
    data["rollout"].update(group_size=2, steps=6, window_size=5, window_range=[0, 5], prompts_per_shard=1,
                           prompts=str(base / "two.txt"))
    data["train"].update(lora_rank=4, lora_alpha=8)
    recipe = tmp_path / "const.toml"
    recipe.write_text(tomli_w.dumps(data))
    capfd.readouterr()
    refused(capfd, cli("run", recipe, "--out", tmp_path / "run"), "round 1:", "nothing to learn")
    assert not layout.round_dir(tmp_path / "run", 1).exists()
    assert not (layout.round_dir(tmp_path / "run", 0) / "train" / layout.MANIFEST).exists()
    # another recipe into that run folder: refused; --overwrite starts again
    refused(capfd, cli("run", recipe, "--out", tmp_path / "run", "--set", "seed=3"), "--overwrite")
    (recipe.parent / "allow.toml").write_text(tomli_w.dumps({**data, "train": {**data["train"], "allow_no_op": True},
                                                             "rounds": 1}))
    assert cli("run", recipe.parent / "allow.toml", "--out", tmp_path / "run", "--overwrite") == 0
    assert json.loads((layout.round_dir(tmp_path / "run", 0) / "train" / layout.MANIFEST).read_text())["no_op"]


def test_run_keeps_a_finished_stage_only_if_it_holds_what_the_round_would_write(base, tmp_path, capfd):
    import shutil
    import tomllib

    import tomli_w

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pipelines" / "tiny-cpu.toml").read_text())
    data.update(rounds=1)
    data["rollout"].update(group_size=2, steps=6, window_size=5, window_range=[0, 5], prompts_per_shard=1,
                           prompts=str(base / "two.txt"))
    data["train"].update(lora_rank=4, lora_alpha=8, optimizer_steps=1)
    recipe = tmp_path / "small.toml"
    recipe.write_text(tomli_w.dumps(data))
    run_dir = tmp_path / "run"
    assert cli("run", recipe, "--out", run_dir) == 0
    r0 = layout.round_dir(run_dir, 0)
    # the round's rollout redone by hand with another seed, its train gone: the run does not build on it
    shutil.rmtree(r0 / "train")
    (r0 / "round.json").unlink()
    assert cli("rollout", "--prompts", base / "two.txt", "--out", r0 / "rollout", *SMALL, "--seed", "9", "--overwrite") == 0
    capfd.readouterr()
    refused(capfd, cli("run", recipe, "--out", run_dir), "round 1:", "--seed")
    assert not (r0 / "train").exists()


def test_run_rechecks_a_finished_round(base, tmp_path, capfd):
    """A finished round (round.json written) whose advantages were redone by hand with other options: the
    run does not skip it as finished, it refuses it, naming the round and the option."""
    import tomllib

    import tomli_w

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pipelines" / "tiny-cpu.toml").read_text())
    data.update(rounds=1)
    data["rollout"].update(group_size=2, steps=6, window_size=5, window_range=[0, 5], prompts_per_shard=1,
                           prompts=str(base / "two.txt"))
    data["train"].update(lora_rank=4, lora_alpha=8, optimizer_steps=1)
    recipe = tmp_path / "small.toml"
    recipe.write_text(tomli_w.dumps(data))
    run_dir = tmp_path / "run"
    assert cli("run", recipe, "--out", run_dir) == 0
    r0 = layout.round_dir(run_dir, 0)
    assert cli("advantages", r0 / "score", "--out", r0 / "advantages", "--std", "global", "--overwrite") == 0
    capfd.readouterr()
    refused(capfd, cli("run", recipe, "--out", run_dir, "--rounds", "2"), "round 1:", "--std")
    assert not layout.round_dir(run_dir, 1).exists()


# --------------------------------------------------------------------------------------------
# 5. CLI errors in tpkit's voice
# --------------------------------------------------------------------------------------------


def tpkit(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run([sys.executable, "-m", "tpkit", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.parametrize("args, words", [
    (["rollout", "--group-size", "four", "--prompts", "p.txt", "--out", "o"], ["--group-size", "'four'", "integer"]),
    (["train", "--rollout", "r", "--advantages", "a", "--out", "o", "--beta", "lots"], ["--beta", "'lots'", "number"]),
    (["rollout", "--group-szie", "4"], ["--group-szie", "did you mean --group-size"]),
    (["score", "--out", "o"], ["missing", "ROLLOUT_DIR"]),
    (["rollout", "--prompts", "p.txt"], ["missing", "--out"]),
    (["rollout", "--sampler"], ["--sampler", "requires an argument"]),
    (["frobnicate"], ["frobnicate"]),
])
def test_usage_errors_name_the_flag_and_the_expected_value(args, words):
    p = tpkit(*args)
    err = " ".join(p.stderr.split())
    assert p.returncode == 2, p.stderr
    assert err.startswith("error:") and "fix:" in err, p.stderr
    assert len(p.stderr.strip().splitlines()) <= 3, p.stderr
    for name in ("Traceback", "Exception", "BadParameter", "NoSuchOption", "UsageError", "Error:"):
        assert name not in p.stderr + p.stdout, p.stderr
    for w in words:
        assert w in err, (w, p.stderr)


@pytest.mark.parametrize("args", [[], ["eval"], ["prompts"]])
def test_bare_command_prints_help_and_exits_0(args):
    p = tpkit(*args)
    assert p.returncode == 0, p.stderr
    out = " ".join((p.stdout + p.stderr).split()).lower()
    assert "usage" in out and "error" not in out and "Traceback" not in p.stderr


@pytest.mark.parametrize("extra, words", [
    (["--beta", "nan"], ["beta", "finite"]),
    (["--learning-rate", "inf"], ["learning_rate", "finite"]),
    (["--learning-rate", "1e38"], ["learning_rate", "above 1e6"]),
    (["--init-lora", "/nonexistent/adapter"], ["--init-lora", "/nonexistent/adapter"]),
])
def test_unusable_train_values_are_refused_before_any_work(base, tmp_path, capfd, extra, words):
    code = cli("train", "--rollout", base / "R", "--advantages", base / "A", "--out", tmp_path / "T", *TRAIN, *extra)
    refused(capfd, code, *words)
    assert not (tmp_path / "T").exists()


def test_a_missing_policy_lora_is_named(base, tmp_path, capfd):
    code = cli("rollout", "--prompts", base / "two.txt", "--out", tmp_path / "R", *SMALL, "--lora", "/nonexistent/adapter")
    refused(capfd, code, "--lora /nonexistent/adapter")
    assert not (tmp_path / "R").exists()


def test_lora_rank_mismatch_names_both_ranks(base, tmp_path, capfd):
    assert cli("train", "--rollout", base / "R", "--advantages", base / "A", "--out", tmp_path / "T", *TRAIN) == 0
    capfd.readouterr()
    code = cli("train", "--rollout", base / "R", "--advantages", base / "A", "--out", tmp_path / "T2", *TRAIN,
               "--lora-rank", "8", "--init-lora", tmp_path / "T" / "adapter")
    refused(capfd, code, "rank 4", "--lora-rank 8")


# --------------------------------------------------------------------------------------------
# 6. Files honour the umask; 7. commands never replace an existing file unasked
# --------------------------------------------------------------------------------------------


def test_files_honour_the_umask(base, tmp_path):
    old = os.umask(0o002)
    try:
        assert cli("rollout", "--prompts", base / "two.txt", "--out", tmp_path / "R", *SMALL) == 0
        assert cli("train", "--rollout", base / "R", "--advantages", base / "A", "--out", tmp_path / "T", *TRAIN) == 0
    finally:
        os.umask(old)
    files = [p for p in [*(tmp_path / "R").iterdir(), *(tmp_path / "T").rglob("*")]
             if p.is_file() and not p.name.startswith(".lock-")]
    assert any(p.suffix == ".tar" for p in files) and any(p.suffix == ".safetensors" for p in files)
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(0o664)}, modes
    assert stat.S_IMODE((tmp_path / "T" / "adapter").stat().st_mode) == 0o775


@pytest.mark.parametrize("command", [["prompts", "geneval", "--split", "train", "--n", "1"],
                                     ["prompts", "shapes", "--split", "train", "--n", "1"]])
def test_prompt_commands_never_replace_an_existing_file_unasked(tmp_path, capfd, command):
    out = tmp_path / "shipped.jsonl"
    out.write_text('{"prompt": "keep me"}\n')
    capfd.readouterr()
    refused(capfd, cli(*command, "--out", out), "already exists", "--overwrite")
    assert out.read_text() == '{"prompt": "keep me"}\n'
    assert cli(*command, "--out", out, "--overwrite") == 0
    assert "keep me" not in out.read_text()
