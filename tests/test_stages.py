"""rollout -> score -> advantages on both model families: file contracts, counts, reproducibility, rewards.

Most tests read `tiny_run` (2 prompts x 4 members, T = 10, K = 9, one prompt per shard): conftest's
tiny-sd3 run, and the same on tiny-flux (this module runs every test on each). The few that run a
stage again use `branches="final"` (no transformer) where they can.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tpkit import formulas, layout, rollout, score
from tpkit.config import RolloutConfig, ScoreConfig, parse_reward_specs
from tpkit.errors import ConfigError, RewardError
from tpkit.rewards.registry import BUILTIN, component_column

T, K, PROMPTS, GROUP = 10, 9, 2, 4
N = PROMPTS * GROUP
LATENT = (16, 8, 8)  # tiny-sd3 and tiny-flux at 64 px: 16 channels, VAE downsamples by 8 (stored unpacked)
# What each family stores per prompt: SD3 the prompt's and the empty negative's (CLIP 77 + T5 tokens),
# FLUX the T5 sequence and CLIP's pooled vector (guidance is distilled: no negative prompt).
EMBEDS = {"tiny-sd3": ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds"),
          "tiny-flux": ("prompt_embeds", "pooled_prompt_embeds")}
TOKENS = {"tiny-sd3": 77 + 128, "tiny-flux": 128}
GUIDANCE = {"tiny-sd3": 4.5, "tiny-flux": 3.5}
JPEG = "reward_jpeg_compressibility"


@pytest.fixture(scope="module", params=list(EMBEDS))
def tiny_run(request, tiny_run, tmp_path_factory, two_prompts) -> Path:
    """conftest's tiny-sd3 run, or the same rollout -> score -> advantages on tiny-flux."""
    if request.param == "tiny-sd3":
        return tiny_run
    from tpkit import advantages
    from tpkit.config import AdvantagesConfig

    run = tmp_path_factory.mktemp("tiny-run-flux")
    rollout.run(rollout_cfg(two_prompts, run / "rollout", "tiny-flux"))
    score.run(ScoreConfig(rollout=str(run / "rollout"), out=str(run / "score")))
    advantages.run(AdvantagesConfig(scores=str(run / "score"), out=str(run / "advantages")))
    return run


@pytest.fixture(scope="module")
def model(tiny_run) -> str:
    return json.loads((tiny_run / "rollout" / layout.MANIFEST).read_text())["config"]["model"]


def rollout_cfg(prompts: Path, out: Path, model: str) -> RolloutConfig:
    """The options tiny_run used (so a rerun must give the same files)."""
    return RolloutConfig(model=model, prompts=str(prompts), out=str(out), group_size=GROUP, prompts_per_shard=1)


def jpeg_reward(png: bytes) -> float:
    fn = BUILTIN["jpeg-compressibility"][0]({})
    return fn([Image.open(io.BytesIO(png)).convert("RGB")], [""], [{}])[0]


def scores_rows(folder: Path) -> list[dict]:
    rows = layout.read_parquet_tables(folder, "score").to_pylist()
    return sorted(rows, key=lambda r: (r["trajectory_id"], r["branch"]))


def write_module(folder: Path, name: str, body: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))


@pytest.fixture(scope="module")
def shards(tiny_run) -> list[tuple[Path, dict, list]]:
    """(path, prompts, trajectories) for every shard of tiny_run's rollout."""
    return [(p, *layout.read_shard(p)) for p in layout.list_shards(tiny_run / "rollout")]


@pytest.fixture(scope="module")
def trajectories(shards) -> dict:
    return {t.trajectory_id: t for _, _, trajs in shards for t in trajs}


@pytest.fixture(scope="module")
def run_scores(tiny_run) -> list[dict]:
    return scores_rows(tiny_run / "score")


@pytest.fixture(scope="module")
def manifests(tiny_run) -> dict:
    return {s: json.loads((tiny_run / s / layout.MANIFEST).read_text()) for s in ("rollout", "score", "advantages")}


# ---------------------------------------------------------------------------------------------
# Counts and file contents
# ---------------------------------------------------------------------------------------------


def test_tiny_run_row_counts(tiny_run, trajectories, run_scores):
    assert len(trajectories) == N
    assert set(trajectories) == {f"p{i:05d}-m{m:03d}" for i in range(PROMPTS) for m in range(GROUP)}

    assert len(run_scores) == N * (K + 1) == 80
    branches = {}
    for r in run_scores:
        branches.setdefault(r["trajectory_id"], []).append(r["branch"])
    assert branches == {tid: list(range(K + 1)) for tid in trajectories}

    adv = layout.read_parquet_tables(tiny_run / "advantages", "advantages").to_pylist()
    assert len(adv) == N * K == 72
    assert sorted((r["trajectory_id"], r["step"]) for r in adv) == sorted(
        (tid, k) for tid in trajectories for k in range(1, K + 1))


def test_shard_tensors_and_image(shards):
    assert len(shards) == PROMPTS  # prompts_per_shard = 1
    for _, prompts, trajs in shards:
        assert len(prompts) == 1 and len(trajs) == GROUP
        for t in trajs:
            x = t.tensors
            assert set(x) == set(layout.TENSOR_KEYS)
            assert x["states"].shape == (K + 1, *LATENT) and x["states"].dtype == torch.float32
            assert x["log_probs"].shape == (K,) and x["log_probs"].dtype == torch.float32
            assert x["velocities"].shape == (K, *LATENT) and x["velocities"].dtype == torch.float32
            assert x["final_latent"].shape == LATENT and x["final_latent"].dtype == torch.float32
            assert all(torch.isfinite(v).all() for v in x.values())
            assert (x["log_probs"] <= 0).all()  # CPS log-prob is -mean((x' - mu)^2)
            img = Image.open(io.BytesIO(t.final_png))
            assert img.format == "PNG" and img.size == (64, 64) and img.mode == "RGB"
            # Successive window states differ (every window step is stochastic).
            assert all(not torch.equal(x["states"][k], x["states"][k + 1]) for k in range(K))


def test_trajectory_metadata(trajectories, manifests, model):
    sigmas = manifests["rollout"]["sigmas"]
    for tid, t in trajectories.items():
        m = t.meta
        assert m["trajectory_id"] == tid and m["prompt_id"] == tid.split("-m")[0]
        assert isinstance(m["seed"], int) and m["seed"] == rollout.derive_seed(0, m["prompt_id"], m["member"])
        assert m["sampler"] == "cps" and m["noise_level"] == 0.7 and m["guidance"] == GUIDANCE[model]
        assert m["steps"] == T and m["window_start"] == 0 and m["window_size"] == K
        assert m["model"] == model and m["resolution"] == 64 and m["lora"] is None
        assert m["family"] == {"tiny-sd3": "sd3", "tiny-flux": "flux"}[model]
        assert m["schema_version"] == layout.SCHEMA_VERSION
        assert m["prompt"] and m["prompt_metadata"] == {"prompt": m["prompt"]}
        s = m["sigmas"]
        assert s == sigmas and len(s) == T + 1 and s[0] == 1.0 and s[-1] == 0.0
        assert all(a > b for a, b in zip(s, s[1:]))
    assert len({t.meta["seed"] for t in trajectories.values()}) == N


def test_prompt_embeddings_stored_once_per_prompt(shards, model):
    seen = []
    for path, prompts, trajs in shards:
        with tarfile.open(path) as tar:
            names = tar.getnames()
        embeds = [n for n in names if n.endswith("." + layout.EMBEDS)]
        assert sorted(embeds) == sorted(f"{pid}.{layout.EMBEDS}" for pid in prompts)
        assert len(embeds) == 1
        for rec in prompts.values():
            assert set(rec.embeds) == set(EMBEDS[model])
            assert all(v.shape[0] == 1 for v in rec.embeds.values())
        seen += list(prompts)
        # Trajectory samples carry no embeddings of their own.
        for t in trajs:
            assert not set(t.tensors) & set(EMBEDS[model])
    assert sorted(seen) == ["p00000", "p00001"]


def test_default_rollout_stores_128_t5_tokens(shards, manifests, model):
    """The release encodes prompts with max_sequence_length = 128: SD3 stores CLIP's 77 tokens then
    T5's 128 (and so for the negative prompt), FLUX T5's 128."""
    assert manifests["rollout"]["config"]["max_sequence_length"] == 128
    for _, prompts, _ in shards:
        for rec in prompts.values():
            assert all(rec.embeds[k].shape[1] == TOKENS[model] for k in EMBEDS[model] if "pooled" not in k)


def test_shards_are_plain_webdataset(shards):
    wds = pytest.importorskip("webdataset")
    n_traj = 0
    for path, prompts, _ in shards:
        samples = list(wds.WebDataset(str(path), shardshuffle=False))
        by_key = {s["__key__"]: {k for k in s if not k.startswith("__")} for s in samples}
        assert len(by_key) == len(samples)  # every key is one grouped sample
        for key, members in by_key.items():
            if key in prompts:
                assert members == {layout.PROMPT_JSON, layout.EMBEDS}
            elif key == layout.INDEX_KEY:  # the shard's closing index (detects truncation at a member boundary)
                assert members == {"json"}
            else:
                assert members == {layout.TRAJ_JSON, layout.TENSORS, layout.FINAL_PNG}
                meta = json.loads(next(s for s in samples if s["__key__"] == key)[layout.TRAJ_JSON])
                assert meta["trajectory_id"] == key
                n_traj += 1
    assert n_traj == N


def test_manifest_counts_match_cost_formula(manifests):
    ro, sc, adv = manifests["rollout"], manifests["score"], manifests["advantages"]
    for stage, m in manifests.items():
        assert m["stage"] == stage and m["schema_version"] == layout.SCHEMA_VERSION
    a = ro["window_start"]
    assert a == 0
    assert ro["counts"]["trajectories"] == N and ro["counts"]["shards"] == PROMPTS
    assert ro["counts"]["transformer_calls"] == N * T == 80
    assert formulas.branch_calls(T, a, K) == 45
    assert sc["counts"]["transformer_calls"] == N * formulas.branch_calls(T, a, K) == 8 * 45
    assert sc["counts"]["decodes"] == N * K == 72
    # Longest branches first: every shard (4 trajectories, 180 calls) in the fewest batches of 16.
    assert sc["counts"]["transformer_batches"] == PROMPTS * math.ceil(N // PROMPTS * 45 / 16) == 24
    assert sc["counts"]["reward_calls"] == N * (K + 1) == 80
    assert sc["counts"]["rows"] == 80
    # Issue 6's check, per trajectory: 45 calls (55 with the rollout), 10 decodes, 10 reward calls.
    assert sc["per_trajectory"] == {"transformer_calls": 45, "transformer_calls_with_rollout": 55, "decodes": 10,
                                    "decodes_in_score": 9, "reward_calls": 10}
    assert adv["counts"]["rows"] == 72 and adv["counts"]["trajectories"] == N
    assert sc["reward_by_task"] is None  # plain-text prompts have no GenEval task
    # every manifest: seconds per phase (summed over the shards), the model phases above zero
    for stage, phases in (("rollout", {"encode", "sample", "decode", "write"}),
                          ("score", {"read", "transformer", "decode", "reward_wait", "write"}),
                          ("advantages", {"read", "compute", "write"})):
        seconds = manifests[stage]["seconds"]
        assert set(seconds) == phases and all(v >= 0 for v in seconds.values()), (stage, seconds)
    assert ro["seconds"]["sample"] > 0 and sc["seconds"]["transformer"] > 0 and sc["seconds"]["decode"] > 0


# ---------------------------------------------------------------------------------------------
# Score: R_K, R_0, determinism, branches=final
# ---------------------------------------------------------------------------------------------


def test_final_branch_is_the_trajectorys_own_image(trajectories, run_scores):
    finals = {r["trajectory_id"]: r for r in run_scores if r["branch"] == K}
    assert len(finals) == N
    for tid, t in trajectories.items():
        expected = jpeg_reward(t.final_png)
        assert finals[tid][JPEG] == expected
        assert finals[tid]["reward"] == expected


def test_initial_noise_is_reproducible_from_the_stored_seed(trajectories):
    for t in trajectories.values():
        noise = torch.randn(LATENT, generator=torch.Generator().manual_seed(t.meta["seed"]))
        assert noise.shape == t.tensors["states"][0].shape == LATENT
        assert torch.equal(t.tensors["states"][0], noise)


def test_branch_0_is_the_ode_sample_from_the_same_noise(trajectories, run_scores, shards):
    """R_0 = R(decode(ODE(x_T-noise))) from torch.randn(seed), not from fresh noise."""
    from tpkit import models, runtime

    _, prompts, trajs = shards[0]
    t = trajs[1]
    m = t.meta
    model = models.load(m["model"], device="cpu", dtype="float32", text_encoders=False)
    x = torch.randn(LATENT, generator=torch.Generator().manual_seed(m["seed"]))[None]
    s = m["sigmas"]
    with torch.no_grad():
        for j in range(T):
            v = model.velocity(x, torch.tensor([s[j]]), prompts[m["prompt_id"]].embeds, m["guidance"])
            x = formulas.ode_step(x, v, s[j], s[j + 1])
    png = runtime.png_bytes(model.decode(x)[0])
    r0 = next(r for r in run_scores if r["trajectory_id"] == t.trajectory_id and r["branch"] == 0)
    # Same noise, same ODE: the same image up to batch-size rounding in the transformer.
    assert r0["reward"] == pytest.approx(jpeg_reward(png), abs=0.01)


def test_rescoring_gives_bit_identical_rewards(tiny_run, run_scores, tmp_path):
    score.run(ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(tmp_path / "score2")))
    again = scores_rows(tmp_path / "score2")
    assert [(r["trajectory_id"], r["branch"]) for r in again] == [(r["trajectory_id"], r["branch"]) for r in run_scores]
    for col in ("reward", JPEG):
        a = np.array([r[col] for r in run_scores], dtype=np.float64)
        b = np.array([r[col] for r in again], dtype=np.float64)
        assert a.tobytes() == b.tobytes(), col
    m = json.loads((tmp_path / "score2" / layout.MANIFEST).read_text())
    assert m["counts"]["transformer_calls"] == 8 * formulas.branch_calls(T, 0, K)


def test_branches_final_writes_only_branch_K_and_calls_no_transformer(tiny_run, run_scores, tmp_path, monkeypatch):
    from tpkit import models

    def no_model(*a, **k):
        raise AssertionError("score --branches final must not load the model")

    monkeypatch.setattr(models, "load", no_model)
    out = tmp_path / "final"
    score.run(ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(out), branches="final"))
    rows = scores_rows(out)
    assert len(rows) == N and {r["branch"] for r in rows} == {K}
    expected = {r["trajectory_id"]: r["reward"] for r in run_scores if r["branch"] == K}
    assert {r["trajectory_id"]: r["reward"] for r in rows} == expected
    counts = json.loads((out / layout.MANIFEST).read_text())["counts"]
    assert counts["transformer_calls"] == 0 and counts["decodes"] == 0 and counts["reward_calls"] == N


# ---------------------------------------------------------------------------------------------
# Rollout: reproducibility and resuming
# ---------------------------------------------------------------------------------------------


def test_rollout_rerun_into_another_folder_is_identical(tiny_run, two_prompts, shards, tmp_path, model):
    out = tmp_path / "rollout2"
    rollout.run(rollout_cfg(two_prompts, out, model))
    again = layout.list_shards(out)
    assert [p.name for p in again] == [p.name for p, _, _ in shards]
    for (path, _, trajs), path2 in zip(shards, again):
        _, trajs2 = layout.read_shard(path2)
        assert [t.trajectory_id for t in trajs2] == [t.trajectory_id for t in trajs]
        for t, t2 in zip(trajs, trajs2):
            assert t2.meta == t.meta
            for key in layout.TENSOR_KEYS:
                assert torch.equal(t.tensors[key], t2.tensors[key]), (t.trajectory_id, key)
            assert t2.final_png == t.final_png
        assert path2.read_bytes() == path.read_bytes()  # the writer is deterministic


def test_rollout_rerun_keeps_finished_shards_and_recreates_deleted_ones(tiny_run, two_prompts, tmp_path, monkeypatch, model):
    from tpkit import models

    out = tmp_path / "rollout"
    shutil.copytree(tiny_run / "rollout", out)
    shard0, shard1 = layout.list_shards(out)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (shard0, shard1)}

    def no_model(*a, **k):
        raise AssertionError("rollout loaded the model for a complete folder")

    # 1. A complete folder: nothing to sample (the model is not even loaded), nothing rewritten.
    with monkeypatch.context() as mp:
        mp.setattr(models, "load", no_model)
        manifest = rollout.run(rollout_cfg(two_prompts, out, model))
    assert manifest is not None and manifest["counts"]["trajectories"] == N
    for p, (mtime, data) in before.items():
        assert p.stat().st_mtime_ns == mtime and p.read_bytes() == data

    # 2. A deleted shard comes back byte for byte; the other one is left alone.
    shard1.unlink()
    rollout.run(rollout_cfg(two_prompts, out, model))
    assert shard1.read_bytes() == before[shard1][1]
    assert shard0.stat().st_mtime_ns == before[shard0][0]
    assert sorted(p.name for p in out.glob("*.tar")) == [shard0.name, shard1.name]
    assert not list(out.glob(".*.tmp"))


# ---------------------------------------------------------------------------------------------
# Rewards: user callables, weights, NaN
# ---------------------------------------------------------------------------------------------


def test_user_reward_module_function(tiny_run, trajectories, tmp_path, monkeypatch):
    write_module(tmp_path, "tpk_user_reward_a", """
        import numpy as np
        CALLS = []
        def brightness(images, prompts, metadata):
            CALLS.append((list(prompts), list(metadata), [(im.mode, im.size) for im in images]))
            return [float(np.asarray(im, dtype=np.float64).mean() / 255.0) for im in images]
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tpk_user_reward_a", raising=False)  # a fresh CALLS for each family's run
    spec = "tpk_user_reward_a:brightness"
    out = tmp_path / "score"
    manifest = score.run(ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(out), rewards={spec: 1.0},
                                     branches="final"))
    col = component_column(spec)
    assert col == "reward_tpk_user_reward_a_brightness"
    assert col in manifest["reward_columns"]
    rows = scores_rows(out)
    assert len(rows) == N
    for r in rows:
        img = Image.open(io.BytesIO(trajectories[r["trajectory_id"]].final_png)).convert("RGB")
        assert r[col] == np.asarray(img, dtype=np.float64).mean() / 255.0
        assert r["reward"] == r[col]
        assert JPEG not in r
    import tpk_user_reward_a

    calls = tpk_user_reward_a.CALLS
    assert sum(len(c[0]) for c in calls) == N
    for prompts, metadata, images in calls:
        assert all(isinstance(p, str) and p for p in prompts)
        assert [md["prompt"] for md in metadata] == prompts  # prompt-file objects reach the reward
        assert all(im == ("RGB", (64, 64)) for im in images)


def test_weighted_rewards_sum_into_reward(tiny_run, run_scores, tmp_path, monkeypatch):
    write_module(tmp_path, "tpk_user_reward_b", """
        import numpy as np
        def dark(images, prompts, metadata):
            return [1.0 - float(np.asarray(im, dtype=np.float64).mean() / 255.0) for im in images]
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    weights = parse_reward_specs(["jpeg-compressibility=2", "tpk_user_reward_b:dark"])
    assert weights == {"jpeg-compressibility": 2.0, "tpk_user_reward_b:dark": 1.0}
    out = tmp_path / "score"
    score.run(ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(out), rewards=weights))  # all branches
    rows = scores_rows(out)
    dark = component_column("tpk_user_reward_b:dark")
    assert len(rows) == 80
    for r, base in zip(rows, run_scores):
        assert (r["trajectory_id"], r["branch"]) == (base["trajectory_id"], base["branch"])
        assert r[JPEG] == base[JPEG]  # the component column is unweighted and deterministic
        assert 0.0 <= r[dark] <= 1.0
        assert r["reward"] == pytest.approx(2.0 * r[JPEG] + 1.0 * r[dark], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("which", ["all", "boat"])
def test_nan_reward_raises_and_writes_no_scores(tiny_run, trajectories, tmp_path, monkeypatch, which):
    name = f"tpk_nan_reward_{which}"
    write_module(tmp_path, name, f"""
        def fn(images, prompts, metadata):
            return [float("nan") if {which!r} == "all" or "boat" in p else 1.0 for p in prompts]
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "score"
    with pytest.raises(RewardError) as err:
        score.run(ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(out), rewards={f"{name}:fn": 1.0},
                              branches="final"))
    msg = str(err.value)
    assert "nan" in msg.lower()
    bad = sorted(tid for tid, t in trajectories.items() if which == "all" or "boat" in t.meta["prompt"])
    good = sorted(set(trajectories) - set(bad))
    assert bad[0] in msg
    assert not any(g in msg for g in good)
    assert not (out / layout.MANIFEST).exists()
    written = sorted(p.name for p in out.glob("*.parquet")) if out.exists() else []
    if which == "all":
        assert written == []
    else:  # the failing shard (prompt 1, the boat) has no scores file
        assert "scores-r000-00001.parquet" not in written
    assert not (out.exists() and list(out.glob(".*.tmp")))


def test_branch_steps_caps_calls_and_is_exact_when_large(tiny_run, tmp_path):
    def table(folder):
        return layout.read_parquet_tables(folder, "score")

    exact = table(tiny_run / "score").sort_by([("trajectory_id", "ascending"), ("branch", "ascending")])
    m = score.run(ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(tmp_path / "cap3"), branch_steps=3))
    assert m["counts"]["transformer_calls"] == 8 * formulas.branch_calls(10, 0, 9, 3)
    m = score.run(ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(tmp_path / "cap10"), branch_steps=10))
    same = table(tmp_path / "cap10").sort_by([("trajectory_id", "ascending"), ("branch", "ascending")])
    assert m["counts"]["transformer_calls"] == 8 * 45
    assert same["reward"].to_pylist() == exact["reward"].to_pylist()


def test_heun_branches_cost_what_formulas_say(tiny_run, tmp_path):
    """--branch-solver heun --branch-steps N: the calls of formulas.branch_calls, recorded in the manifest
    (solver, steps, calls per trajectory); R_K, the rollout's own image, untouched; not Euler's numbers."""
    def table(folder):
        return layout.read_parquet_tables(folder, "score").sort_by([("trajectory_id", "ascending"), ("branch", "ascending")])

    exact = table(tiny_run / "score")
    for steps in (3, 10):
        out = tmp_path / f"heun{steps}"
        m = score.run(ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(out), branch_steps=steps, branch_solver="heun"))
        assert m["counts"]["transformer_calls"] == 8 * formulas.branch_calls(10, 0, 9, steps, "heun")
        assert m["per_trajectory"]["transformer_calls"] == formulas.branch_calls(10, 0, 9, steps, "heun")
        assert m["config"]["branch_solver"] == "heun" and m["config"]["branch_steps"] == steps
        heun = table(out)
        last = np.asarray(heun["branch"].to_pylist()) == 9
        assert np.array_equal(np.asarray(heun["reward"].to_pylist())[last], np.asarray(exact["reward"].to_pylist())[last])
        assert heun["reward"].to_pylist() != exact["reward"].to_pylist()


def test_heun_and_ab2_branches_integrate_a_known_flow(monkeypatch):
    """The batched branch machine against the closed form: with v(x, sigma) = -x every Euler step
    multiplies x by (1 - dt) and every Heun step by (1 - dt + dt^2 / 2) (dt = sigma' - sigma < 0); AB2's
    first step is Euler's, each later one x + dt ((1 + r/2)(-x) - (r/2) v_prev), here in scalars (x and
    v_prev are multiples of s_k). Branches of different lengths share batches of 3, so Heun's two calls a
    step interleave across branches and AB2's velocities must stay with their branch."""
    from concurrent.futures import Future

    from tpkit.layout import PromptRecord, TrajectoryRecord

    class Flow:  # dx/dsigma = -x
        device = torch.device("cpu")

        def velocity(self, x, sigma, embeds, guidance):
            return -x

        def decode(self, x):
            return list(x)

    sigmas = [1.0, 0.8, 0.55, 0.3, 0.1, 0.0]
    K = 4
    torch.manual_seed(0)
    states = torch.randn(K + 1, 2, 2, 2)
    meta = {"sigmas": sigmas, "window_start": 0, "window_size": K, "guidance": 1.0, "prompt_id": "p", "prompt": "x"}
    traj = TrajectoryRecord(meta, {"states": states, "velocities": -states[:K]}, b"")
    prompts = {"p": PromptRecord("p", "x", {}, {"prompt_embeds": torch.zeros(1, 1)})}
    for solver, steps in (("euler", 0), ("euler", 2), ("heun", 2), ("heun", 5), ("ab2", 3), ("ab2", 5)):
        cfg = ScoreConfig(batch_size=3, decode_batch_size=1, reward_workers=0, branch_steps=steps, branch_solver=solver)
        scorer = score.BranchScorer(Flow(), [], cfg)
        got = {}

        def keep(keys, images, trajs, prompts_):
            got.update(dict(zip(keys, images)))
            done = Future()
            done.set_result((keys, {}))
            return done

        monkeypatch.setattr(scorer, "_score_async", keep)
        scorer._complete(prompts, [traj], lambda n: None)
        for k in range(K):
            sched = formulas.branch_schedule(sigmas, k, steps)
            factor, v_prev = 1.0, -1.0  # x = factor s_k, v_prev = v_prev s_k
            for j, (s0, s1) in enumerate(zip(sched, sched[1:])):
                dt = s1 - s0
                if solver == "ab2" and j:
                    r = dt / (s0 - sched[j - 1])
                    factor, v_prev = factor + dt * ((1 + r / 2) * -factor - r / 2 * v_prev), -factor
                else:
                    factor, v_prev = factor * ((1 - dt + dt * dt / 2) if solver == "heun" else (1 - dt)), -factor
            torch.testing.assert_close(got[0, k], states[k] * factor, rtol=1e-5, atol=1e-6)
        assert scorer.counters.transformer_calls == formulas.branch_calls(5, 0, K, steps, solver)


def test_heun_needs_a_step_budget(tiny_run, tmp_path):
    with pytest.raises(ConfigError, match="branch-steps"):
        ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(tmp_path / "h"), branch_solver="heun").validate()


@pytest.mark.parametrize("env, expected", [({}, True), ({"TPKIT_CPU_MALLOC": "0"}, False),
                                           ({"MALLOC_TRIM_THRESHOLD_": "131072"}, False)])
def test_cpu_allocator_tuning_is_applied_unless_the_user_chose(env, expected):
    """glibc's malloc thresholds are raised once per process for CPU runs (a measured 1.4-1.8x on
    tiny-sd3 calls), except where the user set the allocator up themselves or opted out."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the tuning applies to glibc only")
    base = {k: v for k, v in os.environ.items()
            if k not in ("TPKIT_CPU_MALLOC", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", "from tpkit import runtime; print(runtime.tune_cpu_allocator(), runtime.tune_cpu_allocator())"],
                         env={**base, **env}, capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(expected)] * 2


def test_task_rewards_by_hand():
    from tpkit.score import mean_by_task, task_rewards

    def rec(tag):
        return layout.PromptRecord("p", "text", {"prompt": "text", **({"tag": tag} if tag else {})}, {})

    prompts = {"p0": rec("counting"), "p1": rec("colors"), "p2": rec(None)}
    rows = [  # R_K is each trajectory's last branch, whatever the row order
        {"trajectory_id": "a", "prompt_id": "p0", "branch": 9, "reward": 0.5},
        {"trajectory_id": "a", "prompt_id": "p0", "branch": 0, "reward": 0.9},
        {"trajectory_id": "b", "prompt_id": "p0", "branch": 0, "reward": 0.2},
        {"trajectory_id": "b", "prompt_id": "p0", "branch": 9, "reward": 1.0},
        {"trajectory_id": "c", "prompt_id": "p1", "branch": 9, "reward": 0.25},
        {"trajectory_id": "d", "prompt_id": "p2", "branch": 9, "reward": 0.0},  # no tag: not counted
    ]
    stats = task_rewards(rows, prompts)
    assert stats == {"task_reward_sum": {"counting": 1.5, "colors": 0.25}, "task_trajectories": {"counting": 2, "colors": 1}}
    assert mean_by_task([stats]) == {"colors": 0.25, "counting": 0.75}
    # over shards: summed before dividing (not a mean of means)
    other = {"task_reward_sum": {"counting": 0.0}, "task_trajectories": {"counting": 2}}
    assert mean_by_task([stats, other]) == {"colors": 0.25, "counting": 0.375}
    # no tagged prompt: nothing to report; a shard scored without the sums (an older tpkit, resumed): nothing either
    untagged = task_rewards(rows, {"p2": rec(None)})
    assert untagged == {"task_reward_sum": {}, "task_trajectories": {}} and mean_by_task([untagged]) is None
    assert mean_by_task([stats, untagged]) == mean_by_task([stats])
    assert mean_by_task([stats, {"counts": {"trajectories": 4}}]) is None and mean_by_task([]) is None
