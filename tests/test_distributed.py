"""Multi-process runs for real (issue 6, deliverable 1): 2 CPU processes against 1.

- rollout: two `tpkit rollout --rank R --world-size 2` processes vs one; the union of the shards
  holds the same trajectories, bit for bit, and the manifest appears only once both ranks finished;
- score: two ranks vs one on the same rollout: identical rows and counts;
- advantages on both score outputs: identical tables;
- train: `torchrun --nproc_per_node 2 -m tpkit train` (DDP, gloo on CPU) vs one process: metrics
  and trained weights within float tolerance, for a LoRA and for full fine-tuning;
- `accelerate launch --multi_gpu --num_processes 2 -m tpkit run` of a tiny recipe finishes, both
  ranks wrote shards and train ran DDP over both (on a machine without GPUs accelerate's multi-GPU
  launcher is torchrun, and the processes join a gloo group on the CPU).

Every stage comparison runs on every model family (tiny-sd3, tiny-flux, tiny-qwen-image); the accelerate run on
tiny-sd3. Everything runs in subprocesses (4 prompts x 2 members, T = 6, K = 5, window start 0,
so the window never reaches the deterministic last step), one thread each, no GPU. About a minute
on 2 cores; the processes of one comparison run side by side where they can.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import launch_env, torchrun

from tpkit import layout

TIMEOUT = 240  # seconds per group of subprocesses (a hung file barrier must not hang the suite)
PROMPTS = ["a red cube on a wooden table", "a small boat on a calm lake at dawn", "a green tree in the snow",
           "a yellow bicycle against a brick wall"]
GROUP = 2
ROLLOUT_ARGS = ["--group-size", str(GROUP), "--steps", "6", "--window-size", "5", "--window-range", "0", "5",
                "--prompts-per-shard", "1"]
TRAIN_ARGS = ["--optimizer-steps", "2"]
FINETUNE_ARGS = {"lora": ["--lora-rank", "4", "--lora-alpha", "8"],  # what train updates: a LoRA, or every weight
                 "full": ["--finetune", "full", "--learning-rate", "1e-4"]}
# ... and how 2 processes split it: DDP (a full copy each), or FSDP: the 2 processes started by `accelerate
# launch` with the shipped FSDP config, the 1 process with --fsdp (which shards nothing with one process)
FINETUNE_ARGS.update({f"{k}-fsdp": v for k, v in list(FINETUNE_ARGS.items())})
FSDP_CONFIG = Path(__file__).resolve().parents[1] / "pipelines" / "accelerate-fsdp-8gpu.yaml"
# Per-rank settings that legitimately differ between a 1-process and a 2-process run.
RANK_KEYS = ("out", "rank", "world_size")


# --------------------------------------------------------------------------------------------
# Subprocesses
# --------------------------------------------------------------------------------------------


def tpkit(*args) -> list[str]:
    return [sys.executable, "-m", "tpkit", *map(str, args)]


def accelerate_launch(*args, config: Path | None = None) -> list[str]:
    """2 local processes through `accelerate launch` (its torchrun-based launcher; `--cpu` would start
    one process), on a free port; every option on the command line, where it overrides any
    `accelerate config` file of the machine (or `config`'s, e.g. the shipped FSDP config)."""
    kind = ["--config_file", str(config)] if config else ["--multi_gpu"]
    return [sys.executable, "-m", "accelerate.commands.launch", *kind, "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
            "-m", "tpkit", *map(str, args)]


def run_all(*cmds: list[str], cwd: Path | None = None, timeout: float = TIMEOUT) -> None:
    """Run the commands side by side; every one must exit 0 (its output is shown otherwise)."""
    procs = [subprocess.Popen(c, cwd=cwd, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in cmds]
    outputs = []
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:  # the whole group: torchrun's workers too
                    if q.poll() is None:
                        os.killpg(q.pid, signal.SIGKILL)
                out = p.communicate()[0]
                pytest.fail(f"timed out after {timeout}s: {' '.join(p.args)}\n{out[-6000:]}")
    finally:
        for q in procs:
            if q.poll() is None:
                os.killpg(q.pid, signal.SIGKILL)
                q.wait()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, f"exit {p.returncode}: {' '.join(p.args)}\n{out[-6000:]}"


# --------------------------------------------------------------------------------------------
# Fixtures: each comparison is computed once per module
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory, tpkit_home) -> Path:
    from tpkit.models import sd3

    sd3.resolve("tiny-sd3")  # build once here; the subprocesses inherit $TPKIT_HOME
    d = tmp_path_factory.mktemp("distributed")
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return d


@pytest.fixture(scope="module", params=["tiny-sd3", "tiny-flux", "tiny-qwen-image"])
def chain(request, tmp_path_factory, tpkit_home) -> tuple[Path, str]:
    """A folder for one model family's 1-rank vs 2-rank comparisons (every stage runs on both families)."""
    from tpkit import models

    models.family(models.family_of(request.param)).resolve(request.param)  # built once; subprocesses share $TPKIT_HOME
    d = tmp_path_factory.mktemp(f"distributed-{request.param}")
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return d, request.param


@pytest.fixture(scope="module")
def rollouts(chain) -> dict:
    """One rank (run alongside rank 0 of the 2-rank rollout), then rank 1 after rank 0 finished."""
    work, model = chain
    one, two = work / "rollout-1", work / "rollout-2"
    common = ["--prompts", work / "prompts.txt", "--model", model, *ROLLOUT_ARGS]
    run_all(tpkit("rollout", *common, "--out", one),
            tpkit("rollout", *common, "--out", two, "--rank", 0, "--world-size", 2))
    after_rank0 = sorted(p.name for p in two.iterdir() if not p.name.startswith(".lock-"))
    run_all(tpkit("rollout", *common, "--out", two, "--rank", 1, "--world-size", 2))
    return {"one": one, "two": two, "after_rank0": after_rank0}


@pytest.fixture(scope="module")
def scores(chain, rollouts) -> dict:
    """Score the 1-rank rollout with one process and with two ranks, all side by side."""
    work = chain[0]
    one, two = work / "score-1", work / "score-2"
    src = rollouts["one"]
    common = [src, "--reward", "brightness"]
    run_all(tpkit("score", *common, "--out", one),
            tpkit("score", *common, "--out", two, "--rank", 0, "--world-size", 2),
            tpkit("score", *common, "--out", two, "--rank", 1, "--world-size", 2))
    return {"one": one, "two": two}


@pytest.fixture(scope="module")
def advantage_dirs(chain, scores) -> dict:
    work = chain[0]
    run_all(tpkit("advantages", scores["one"], "--out", work / "adv-1"),
            tpkit("advantages", scores["two"], "--out", work / "adv-2"))
    return {"one": work / "adv-1", "two": work / "adv-2"}


@pytest.fixture(scope="module", params=list(FINETUNE_ARGS))
def trains(request, chain, rollouts, advantage_dirs) -> dict:
    """The same training (a LoRA, or every weight), one process and 2 (DDP under torchrun, or FSDP under
    `accelerate launch` with the shipped config; gloo), side by side."""
    work = chain[0]
    one, two = work / f"train-{request.param}-1", work / f"train-{request.param}-2"
    common = ["--rollout", rollouts["one"], "--advantages", advantage_dirs["one"], *TRAIN_ARGS,
              *FINETUNE_ARGS[request.param]]
    fsdp = request.param.endswith("-fsdp")
    two_processes = accelerate_launch("train", *common, "--out", two, config=FSDP_CONFIG) if fsdp else torchrun(
        "train", *common, "--out", two)
    run_all(tpkit("train", *common, *(["--fsdp"] if fsdp else []), "--out", one), two_processes)
    return {"one": one, "two": two, "fsdp": fsdp}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def manifest(folder: Path) -> dict:
    return json.loads((folder / layout.MANIFEST).read_text())


def without(d: dict, keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def trajectories(folder: Path) -> tuple[dict, dict]:
    """(trajectory_id -> record, prompt_id -> record) over every shard of a rollout folder."""
    trajs, prompts = {}, {}
    for shard in layout.list_shards(folder):
        ps, ts = layout.read_shard(shard)
        for pid, p in ps.items():
            assert pid not in prompts, f"prompt {pid} stored in two shards"
            prompts[pid] = p
        for t in ts:
            assert t.meta["trajectory_id"] not in trajs, f"trajectory {t.meta['trajectory_id']} in two shards"
            trajs[t.meta["trajectory_id"]] = t
    return trajs, prompts


def rows(folder: Path, what: str, key) -> list[dict]:
    return sorted(layout.read_parquet_tables(folder, what).to_pylist(), key=key)


def expected_names(n: int, world: int) -> list[str]:
    """Shard i is written by rank i % world and carries that rank in its name."""
    return [layout.shard_name(i % world, i) for i in range(n)]


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / layout.METRICS_FILE).read_text().splitlines() if line.strip()]


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    """The trained weights of a train folder: its LoRA adapter, or its fully trained transformer."""
    from safetensors.torch import load_file

    files = sorted((folder / "adapter").glob("*.safetensors")) or sorted((folder / "model" / "transformer").glob("*.safetensors"))
    assert len(files) == 1, files
    return load_file(files[0])


# --------------------------------------------------------------------------------------------
# 1. Rollout
# --------------------------------------------------------------------------------------------


def test_rollout_manifest_only_after_every_rank(rollouts):
    n = len(PROMPTS)
    # rank 0 alone: its shards (0, 2) and their stats, no manifest, no stray temporaries
    assert [f for f in rollouts["after_rank0"] if not f.startswith(".lock-")] == sorted([layout.STAGE_FILE] + [layout.shard_name(0, i) for i in range(0, n, 2)]
                                             + [layout.stats_name(Path(layout.shard_name(0, i))) for i in range(0, n, 2)])
    # after rank 1: exactly one manifest, listing every rank's shards
    two = rollouts["two"]
    names = sorted(p.name for p in two.iterdir() if not p.name.startswith(".lock-"))  # per-rank stage locks
    shards = expected_names(n, 2)
    assert names == sorted([layout.MANIFEST, layout.STAGE_FILE, *shards, *(layout.stats_name(Path(s)) for s in shards)])
    assert [p.name for p in layout.list_shards(two)] == shards
    assert manifest(two)["shards"] == shards
    assert [p.name for p in layout.list_shards(rollouts["one"])] == expected_names(n, 1)


def test_rollout_two_ranks_equal_one_rank(rollouts):
    one, two = rollouts["one"], rollouts["two"]
    t1, p1 = trajectories(one)
    t2, p2 = trajectories(two)
    assert len(t1) == len(PROMPTS) * GROUP
    assert sorted(t1) == sorted(t2)
    for tid, a in t1.items():
        b = t2[tid]
        assert a.meta == b.meta, tid  # ids, seeds, window, sigmas, rollout batch ... (no rank in there)
        assert sorted(a.tensors) == sorted(b.tensors) == ["final_latent", "log_probs", "states", "velocities"]
        for k, v in a.tensors.items():
            assert v.dtype == b.tensors[k].dtype and torch.equal(v, b.tensors[k]), f"{tid} {k}"
        assert a.final_png == b.final_png, tid
    assert sorted(p1) == sorted(p2)
    for pid, a in p1.items():
        b = p2[pid]
        assert (a.prompt, a.metadata) == (b.prompt, b.metadata)
        assert sorted(a.embeds) == sorted(b.embeds)
        assert all(torch.equal(a.embeds[k], b.embeds[k]) for k in a.embeds), pid
    # shards are deterministic tars: shard i has the same bytes whichever rank wrote it
    for s1, s2 in zip(layout.list_shards(one), layout.list_shards(two)):
        assert layout.shard_index(s1) == layout.shard_index(s2)
        assert s1.read_bytes() == s2.read_bytes(), (s1.name, s2.name)


def test_rollout_manifests_agree(rollouts):
    m1, m2 = manifest(rollouts["one"]), manifest(rollouts["two"])
    assert m1["counts"] == m2["counts"]
    assert m1["counts"]["shards"] == len(PROMPTS)
    assert m1["counts"]["trajectories"] == len(PROMPTS) * GROUP
    assert m1["rollout_id"] == m2["rollout_id"]
    assert (m1["window_start"], m1["sigmas"]) == (m2["window_start"], m2["sigmas"])
    assert without(m1["config"], RANK_KEYS) == without(m2["config"], RANK_KEYS)
    assert (m2["config"]["world_size"], m1["config"]["world_size"]) == (2, 1)
    assert m1["inputs"] == m2["inputs"]
    assert m1["shards"] == expected_names(len(PROMPTS), 1)
    assert m2["shards"] == expected_names(len(PROMPTS), 2)


# --------------------------------------------------------------------------------------------
# 2. Score
# --------------------------------------------------------------------------------------------


def test_score_two_ranks_equal_one_rank(scores):
    one, two = scores["one"], scores["two"]
    key = lambda r: (r["trajectory_id"], r["branch"])  # noqa: E731
    r1, r2 = rows(one, "score", key), rows(two, "score", key)
    assert len(r1) == len(PROMPTS) * GROUP * 6  # R_0..R_K, K = 5
    assert r1 == r2
    # each score file is named after its shard (whichever rank scored it): both hold the same files
    assert sorted(p.name for p in one.glob("scores-*.parquet")) == sorted(p.name for p in two.glob("scores-*.parquet"))
    m1, m2 = manifest(one), manifest(two)
    assert m1["counts"] == m2["counts"]
    for k in ("trajectories", "rows", "transformer_calls", "decodes", "reward_calls"):
        assert k in m1["counts"], k
    assert m1["counts"]["rows"] == len(r1)
    assert m1["files"] == m2["files"]
    assert m1["reward_columns"] == m2["reward_columns"]
    assert m1["rollout_id"] == m2["rollout_id"]
    assert without(m1["config"], RANK_KEYS) == without(m2["config"], RANK_KEYS)


# --------------------------------------------------------------------------------------------
# 3. Advantages
# --------------------------------------------------------------------------------------------


def test_advantages_equal_on_both_score_outputs(advantage_dirs):
    key = lambda r: (r["trajectory_id"], r["step"])  # noqa: E731
    a1, a2 = rows(advantage_dirs["one"], "advantages", key), rows(advantage_dirs["two"], "advantages", key)
    assert len(a1) == len(PROMPTS) * GROUP * 5
    assert a1 == a2
    m1, m2 = manifest(advantage_dirs["one"]), manifest(advantage_dirs["two"])
    assert m1["counts"] == m2["counts"]
    assert m1["summary"] == m2["summary"]
    assert m1["rollout_id"] == m2["rollout_id"]


# --------------------------------------------------------------------------------------------
# 4. Train (DDP over 2 processes vs 1)
# --------------------------------------------------------------------------------------------


def test_train_two_processes_match_one(trains):
    one, two = trains["one"], trains["two"]
    m1, m2 = metrics(one), metrics(two)
    assert len(m1) == len(m2) == 2
    # Step 1 runs on the untouched weights: the replayed batches give ratio exactly 1 in both runs.
    assert m1[0]["ratio_mean"] == m2[0]["ratio_mean"] == 1.0
    for a, b in zip(m1, m2):
        assert a["step"] == b["step"] and a["samples"] == b["samples"]
        assert a["finite"] and b["finite"], (a, b)
        for k in ("kl_loss", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4), (a["step"], k, a[k], b[k])
        # The policy loss is a near-cancelling sum of -A * ratio with |A| ~ 1 and float32 ratios
        # within ~1e-6 of 1 (loss ~ 1e-7): after step 1 the two runs' weights differ by float32
        # rounding (the gradient all-reduce adds in another order), which moves these by ~1e-8
        # absolute, i.e. a few float32 ulps of the O(1) terms, but up to ~1% relative. So: rel
        # 1e-4, or 1e-6 absolute (8 ulps of 1.0).
        for k in ("loss", "policy_loss", "ratio_mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["step"], k, a[k], b[k])
        assert b["approx_kl"] == pytest.approx(a["approx_kl"], rel=1e-4, abs=1e-12)
        # a ratio within float noise of the clip edge may flip one sample, no more
        assert abs(b["clipfrac"] - a["clipfrac"]) <= 1 / a["samples"] + 1e-12, (a, b)
    w1, w2 = adapter(one), adapter(two)
    assert sorted(w1) == sorted(w2) and w1
    diff = max((w1[k].float() - w2[k].float()).abs().max().item() for k in w1)
    assert diff < 1e-4, diff
    # the update did something (the comparison is not between two untouched initialisations)
    assert m1[0]["grad_norm"] > 0
    man1, man2 = manifest(one), manifest(two)
    assert man2["counts"]["processes"] == 2 and man1["counts"]["processes"] == 1
    assert man1["sharded"] is False and man2["sharded"] is trains["fsdp"]  # --fsdp with 1 process shards nothing
    assert without(man1["counts"], ["processes"]) == without(man2["counts"], ["processes"])


# A train that dies (as under kill -9: nothing after it runs) right after writing its first checkpoint.
CRASH_AFTER_CHECKPOINT = r'''
import os, sys
from tpkit import train

_write = train._write_checkpoint


def write_then_die(*args, **kwargs):
    _write(*args, **kwargs)
    os._exit(9)


train._write_checkpoint = write_then_die
from tpkit.cli import main

main(sys.argv[1:])
'''


def test_fsdp_resumes_after_a_crash_and_its_state_continues_either_way(chain, rollouts, advantage_dirs):
    """Full fine-tuning sharded over 2 processes: killed after its first checkpoint (gathered from the shards),
    the rerun resumes there and ends where an uninterrupted run ends; its saved optimizer state continues
    a next round sharded (2 processes) and unsharded (1) alike."""
    work, model = chain
    if model != "tiny-qwen-image":
        pytest.skip("on one family: Qwen-Image, whose idle (frozen) parameters the optimizer's numbering skips")
    base = ["train", "--rollout", rollouts["one"], "--advantages", advantage_dirs["one"], *FINETUNE_ARGS["full"]]
    common = [*base, "--optimizer-steps", "3", "--checkpoint-every", "1", "--fsdp"]
    clean, crashed = work / "fsdp-clean", work / "fsdp-crashed"
    script = work / "crash_after_checkpoint.py"
    script.write_text(CRASH_AFTER_CHECKPOINT)
    dying = subprocess.Popen(torchrun(*common, "--out", crashed, script=script), env=launch_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run_all(torchrun(*common, "--out", clean))
    out = dying.communicate(timeout=TIMEOUT)[0]
    assert dying.returncode != 0, out[-3000:]
    assert (crashed / "checkpoint" / "progress.json").is_file() and not (crashed / layout.MANIFEST).exists(), out[-3000:]

    run_all(torchrun(*common, "--out", crashed))
    assert manifest(crashed)["resumed_from_step"] == 1 and manifest(crashed)["sharded"] is True
    assert [m["step"] for m in metrics(crashed)] == [1, 2, 3]
    w1, w2 = adapter(clean), adapter(crashed)
    assert sorted(w1) == sorted(w2)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-6
    o1, o2 = (torch.load(d / "state" / "optimizer.pt", weights_only=True) for d in (clean, crashed))
    assert o1["state"].keys() == o2["state"].keys() and o1["param_groups"][0]["params"] == o2["param_groups"][0]["params"]
    for i in o1["state"]:
        assert torch.allclose(o1["state"][i]["exp_avg_sq"], o2["state"][i]["exp_avg_sq"], rtol=1e-5, atol=1e-12)

    # the next round, continuing clean's (gathered) optimizer state: one unsharded process, 2 sharded
    cont = [*base, "--optimizer-steps", "2", "--init-state", clean / "state"]
    run_all(tpkit(*cont, "--out", work / "fsdp-next-1"), torchrun(*cont, "--fsdp", "--out", work / "fsdp-next-2"))
    m1, m2 = metrics(work / "fsdp-next-1"), metrics(work / "fsdp-next-2")
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [4, 5]  # the global step continued
    for a, b in zip(m1, m2):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    w1, w2 = adapter(work / "fsdp-next-1"), adapter(work / "fsdp-next-2")
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4


# --------------------------------------------------------------------------------------------
# 5. `tpkit run` under accelerate launch
# --------------------------------------------------------------------------------------------


RECIPE = """\
name = "distributed"
rounds = 1
method = "tp-grpo"
seed = 0

[rewards]
brightness = 1.0

[rollout]
model = "tiny-sd3"
prompts = "prompts.txt"
group_size = 2
steps = 6
window_size = 5
window_range = [0, 5]
prompts_per_shard = 1

[train]
lora_rank = 4
lora_alpha = 8
optimizer_steps = 2
"""


def test_run_under_accelerate_launch(work):
    d = work / "run"
    d.mkdir()
    (d / "prompts.txt").write_text("\n".join(PROMPTS[:2]) + "\n")
    (d / "recipe.toml").write_text(RECIPE)
    out = d / "out"
    run_all(accelerate_launch("run", d / "recipe.toml", "--out", out, "--log-with", "tensorboard"), cwd=d)
    lines = (out / layout.ROUNDS_FILE).read_text().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["round"] == 1 and line["folder"] == "round-0000" and line["n"] == 2 * GROUP
    r0 = layout.round_dir(out, 0)
    rollout, score, train = r0 / "rollout", r0 / "score", r0 / "train"
    assert [p.name for p in layout.list_shards(rollout)] == expected_names(2, 2)  # rank 0 and rank 1 each wrote one
    assert sorted(p.name for p in score.glob("scores-*.parquet")) == ["scores-r000-00000.parquet",
                                                                      "scores-r001-00001.parquet"]
    assert manifest(rollout)["counts"]["trajectories"] == 2 * GROUP
    assert manifest(train)["counts"]["processes"] == 2
    assert all(m["finite"] for m in metrics(train))
    # Tracking under two processes: the main one alone writes events, holding this round's reward.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == pytest.approx([line["reward_mean"]])
    assert len(acc.Scalars("train/loss")) == 2
