"""`tpkit train` on the session's tiny_run: metrics, the exact first-step ratio, KL, the adapter
(diffusers-loadable, changes the output), optimizer/EMA state, continuing a round, bad inputs.

Every run uses a small LoRA (rank 4, alpha 8); a train run on tiny_run takes about a second once
the model is loaded.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from conftest import as_written

from tpkit import layout, models, rollout, train
from tpkit.models import base, sd3
from tpkit.config import RolloutConfig, TrainConfig
from tpkit.errors import ConfigError, InputError

RANK, ALPHA = 4, 8
LR = 1e-2  # large enough that two steps visibly change the tiny model's output
METRIC_KEYS = ("step", "loss", "policy_loss", "kl_loss", "ratio_mean", "clipfrac", "approx_kl", "grad_norm", "lr")
WEIGHTS = base.LORA_WEIGHTS


def train_cfg(tiny_run: Path, out: Path, **kw) -> TrainConfig:
    base = dict(rollout=str(tiny_run / "rollout"), advantages=str(tiny_run / "advantages"), out=str(out),
                lora_rank=RANK, lora_alpha=ALPHA, learning_rate=LR)
    base.update(kw)
    return TrainConfig(**base)


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / layout.METRICS_FILE).read_text().splitlines() if line.strip()]


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / WEIGHTS)


def differs(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys()
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def trained(tiny_run, tmp_path_factory) -> Path:
    """Default beta (1e-4), EMA on and updated every step, 2 optimizer steps."""
    out = tmp_path_factory.mktemp("train") / "train"
    train.run(train_cfg(tiny_run, out, ema=True, ema_every=1))
    return out


@pytest.fixture(scope="module")
def trained_beta0(tiny_run, tmp_path_factory) -> Path:
    """beta = 0 (no reference pass), no EMA, 3 optimizer steps."""
    out = tmp_path_factory.mktemp("train-b0") / "train"
    train.run(train_cfg(tiny_run, out, beta=0.0, optimizer_steps=3))
    return out


@pytest.fixture(scope="module")
def continued(trained, tiny_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train-cont") / "train"
    train.run(train_cfg(tiny_run, out, ema=True, ema_every=1, init_lora=str(trained / train.ADAPTER)))
    return out


# --------------------------------------------------------------------------------------------
# metrics.jsonl
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which, steps", [("trained", 2), ("trained_beta0", 3)])
def test_metrics_one_line_per_optimizer_step(which, steps, request):
    out = request.getfixturevalue(which)
    lines = metrics(out)
    assert len(lines) == steps
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    for m in lines:
        assert set(METRIC_KEYS) <= set(m), f"missing {set(METRIC_KEYS) - set(m)}"
        for k in METRIC_KEYS:
            assert isinstance(m[k], (int, float)) and math.isfinite(m[k]), (k, m[k])
        assert m["lr"] == LR
        assert 0 <= m["clipfrac"] <= 1
        assert m["approx_kl"] >= 0 and m["grad_norm"] >= 0
    manifest = json.loads((out / layout.MANIFEST).read_text())
    assert manifest["stage"] == "train"
    assert manifest["counts"]["optimizer_steps"] == steps
    assert manifest["counts"]["global_step"] == steps


@pytest.mark.parametrize("which", ["trained", "trained_beta0"])
def test_manifest_counts_model_work_and_seconds_per_phase(which, request):
    """One forward (with its backward) per transition, one reference forward more when beta > 0."""
    manifest = json.loads((request.getfixturevalue(which) / layout.MANIFEST).read_text())
    counts, seconds, beta = manifest["counts"], manifest["seconds"], manifest["config"]["beta"]
    assert counts["transitions"] > 0 and counts["transformer_calls"] == counts["transitions"]
    lora = adapter(request.getfixturevalue(which) / train.ADAPTER)
    assert counts["trained_parameters"] == sum(v.numel() for v in lora.values())  # the LoRA's, nothing else
    assert counts["reference_calls"] == (counts["transitions"] if beta > 0 else 0)
    phases = {"read", "load", "forward", "backward", "optimizer", "save"} | ({"reference"} if beta > 0 else set())
    if manifest["config"]["checkpoint_every"] and counts["optimizer_steps"] > 1:  # none after the last step
        phases.add("checkpoint")
    assert set(seconds) == phases, seconds
    assert seconds["forward"] > 0 and seconds["backward"] > 0 and all(v >= 0 for v in seconds.values())


@pytest.mark.parametrize("which", ["trained", "trained_beta0"])
def test_first_step_ratio_is_exactly_one(which, request):
    """Replaying the rollout's own batches on unchanged weights: log-probs equal bit for bit."""
    first = metrics(request.getfixturevalue(which))[0]
    assert first["ratio_mean"] == 1.0
    assert first["clipfrac"] == 0
    assert first["approx_kl"] == 0


def test_later_steps_move_the_policy(trained):
    """After one update at this learning rate the ratio is no longer exactly 1."""
    second = metrics(trained)[1]
    assert second["ratio_mean"] != 1.0 or second["approx_kl"] > 0


def test_beta_zero_has_no_kl(trained_beta0):
    lines = metrics(trained_beta0)
    assert all(m["kl_loss"] == 0 for m in lines)
    assert all(m["loss"] == pytest.approx(m["policy_loss"], rel=1e-12, abs=1e-15) for m in lines)


def test_beta_positive_kl_zero_then_positive(trained):
    lines = metrics(trained)
    assert lines[0]["kl_loss"] == 0  # LoRA B starts at zero: policy == base model
    assert all(m["kl_loss"] > 0 for m in lines[1:])
    for m in lines:  # loss = policy + beta * KL (beta = 1e-4, the default); summed in float32
        assert m["loss"] == pytest.approx(m["policy_loss"] + 1e-4 * m["kl_loss"], rel=1e-3, abs=1e-9)


# --------------------------------------------------------------------------------------------
# The adapter and state
# --------------------------------------------------------------------------------------------


def test_adapter_loads_into_diffusers_and_changes_output(trained):
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3.resolve("tiny-sd3"))
    pipe.set_progress_bar_config(disable=True)

    def generate() -> np.ndarray:
        return pipe("a red cube on a wooden table", num_inference_steps=3, height=64, width=64,
                    output_type="np", generator=torch.Generator().manual_seed(0)).images

    base = generate()
    assert np.array_equal(base, generate())  # same seed, same output: the comparison below is meaningful
    pipe.load_lora_weights(str(trained / train.ADAPTER))
    names = pipe.get_list_adapters().get("transformer", [])
    assert len(names) == 1
    tuned = generate()
    assert tuned.shape == base.shape
    assert np.isfinite(tuned).all()
    assert not np.array_equal(tuned, base)
    assert np.abs(tuned - base).max() > 1e-5

    # The weights diffusers loaded are the saved ones, with the trained alpha / rank scaling.
    saved = {k.removeprefix("transformer."): v for k, v in adapter(trained / train.ADAPTER).items()}
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=names[0])
    assert saved.keys() == loaded.keys()
    for k in saved:
        torch.testing.assert_close(loaded[k].float(), saved[k].float(), rtol=0, atol=0)
    scalings = [m.scaling[names[0]] for m in pipe.transformer.modules()
                if isinstance(getattr(m, "scaling", None), dict) and names[0] in m.scaling]
    assert scalings and all(s == ALPHA / RANK for s in scalings)


def test_adapter_has_every_target(trained):
    keys = adapter(trained / train.ADAPTER).keys()
    for target in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
        assert any(f".{target}.lora_A" in k for k in keys), target
    a = [v for k, v in adapter(trained / train.ADAPTER).items() if "lora_A" in k]
    assert all(v.shape[0] == RANK for v in a)


def test_optimizer_state_loads_with_weights_only(trained):
    state = torch.load(trained / train.STATE / "optimizer.pt", map_location="cpu", weights_only=True)
    assert set(state) == {"state", "param_groups"}
    assert state["param_groups"][0]["lr"] == LR
    assert state["state"], "no per-parameter AdamW state"
    assert all(float(s["step"]) == 2 for s in state["state"].values())
    assert json.loads((trained / train.STATE / "trainer.json").read_text())["global_step"] == 2


def test_continue_from_adapter(trained, continued):
    assert json.loads((continued / train.STATE / "trainer.json").read_text())["global_step"] == 4
    assert [m["step"] for m in metrics(continued)] == [3, 4]
    assert json.loads((continued / layout.MANIFEST).read_text())["counts"]["global_step"] == 4
    # The optimizer continued too (AdamW step counts 2 -> 4), and the weights moved on.
    state = torch.load(continued / train.STATE / "optimizer.pt", map_location="cpu", weights_only=True)
    assert all(float(s["step"]) == 4 for s in state["state"].values())
    assert differs(adapter(trained / train.ADAPTER_RAW), adapter(continued / train.ADAPTER_RAW))
    # It started from the previous adapter: on step 3 the policy already differs from the base
    # model, so the KL term is positive from the first step of this round.
    assert metrics(continued)[0]["kl_loss"] > 0


def test_ema_adapter(trained, trained_beta0, continued):
    """With EMA on, adapter/ is the EMA (what users and evaluations load), adapter-raw/ the trained weights."""
    raw = trained / train.ADAPTER_RAW
    assert (raw / WEIGHTS).is_file() and (trained / train.ADAPTER / WEIGHTS).is_file()
    assert (trained / train.STATE / "ema.safetensors").is_file()
    assert differs(adapter(trained / train.ADAPTER), adapter(raw))
    assert not (trained_beta0 / train.ADAPTER_RAW).exists()  # EMA off by default: adapter/ is the trained one
    assert not (trained_beta0 / train.STATE / "ema.safetensors").exists()
    # The continued round writes its own EMA, updated by its steps.
    assert differs(adapter(trained / train.ADAPTER), adapter(continued / train.ADAPTER))
    assert differs(adapter(continued / train.ADAPTER), adapter(continued / train.ADAPTER_RAW))
    assert train.policy_adapter(trained / train.ADAPTER) == raw
    assert train.policy_adapter(trained_beta0 / train.ADAPTER) == trained_beta0 / train.ADAPTER


def test_ema_decay_warms_up_as_the_release():
    assert train.ema_decay(0.9, 1) == 2 / 11
    assert train.ema_decay(0.9, 8) == 9 / 18
    assert train.ema_decay(0.9, 80) == 0.9 and train.ema_decay(0.9, 10_000) == 0.9


def test_ema_every_8_steps_by_default(tiny_run, tmp_path):
    """The release's interval: 2 optimizer steps update no EMA, so adapter/ is still the initial LoRA
    (B = 0: the base model) while adapter-raw/ has moved."""
    out = tmp_path / "train"
    train.run(train_cfg(tiny_run, out, ema=True))
    ema, raw = adapter(out / train.ADAPTER), adapter(out / train.ADAPTER_RAW)
    assert all(not v.any() for k, v in ema.items() if "lora_B" in k)
    assert any(v.any() for k, v in raw.items() if "lora_B" in k)


def test_continuing_an_ema_round_continues_the_trained_weights(trained, tiny_run, tmp_path):
    """--init-lora PREV/adapter of an EMA run starts from PREV/adapter-raw, not from the EMA."""
    out = tmp_path / "train"
    train.run(train_cfg(tiny_run, out, init_lora=str(trained / train.ADAPTER), learning_rate=1e-12))
    start, raw, ema = adapter(out / train.ADAPTER), adapter(trained / train.ADAPTER_RAW), adapter(trained / train.ADAPTER)
    assert all(torch.allclose(start[k], raw[k], rtol=0, atol=1e-8) for k in raw)
    assert not all(torch.allclose(start[k], ema[k], rtol=0, atol=1e-6) for k in ema)


def _advantages_with(tiny_run: Path, folder: Path, fn) -> Path:
    """A copy of tiny_run's advantages with the column rewritten by fn(trajectory_ids, advantages)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(tiny_run / "advantages", folder)
    path = folder / "advantages.parquet"
    table = pq.read_table(path)
    adv = fn(np.asarray(table["trajectory_id"].to_pylist()), np.asarray(table["advantage"].to_pylist()))
    pq.write_table(table.set_column(table.column_names.index("advantage"), "advantage", pa.array(adv)), path)
    as_written(path)
    return folder


def test_zero_advantage_trajectories_are_left_out_of_the_loss(tiny_run, tmp_path):
    """As the release: a trajectory with A = 0 at every step does not count in the loss average
    (and adds no KL); it still rides in its rollout batch, so the first ratio stays exactly 1."""
    adv = _advantages_with(tiny_run, tmp_path / "adv", lambda tids, a: np.where(tids == "p00000-m001", 0.0, a))
    runs = {}
    for drop in (True, False):
        out = tmp_path / f"train-{drop}"
        train.run(train_cfg(tiny_run, out, advantages=str(adv), optimizer_steps=1, drop_zero_advantage=drop))
        runs[drop] = (metrics(out)[0], json.loads((out / layout.MANIFEST).read_text())["counts"])
    (dropped, counts), (kept, kept_counts) = runs[True], runs[False]
    K = 9
    assert counts["zero_advantage_trajectories"] == 1 and kept_counts["zero_advantage_trajectories"] == 0
    assert counts["trajectories_in_loss"] == 7 and kept_counts["trajectories_in_loss"] == 8
    assert dropped["samples"] == 7 * K and kept["samples"] == 8 * K
    assert dropped["ratio_mean"] == 1.0 and kept["ratio_mean"] == 1.0
    # ratio 1 on the first step: policy loss = -mean(A) over the counted transitions
    assert dropped["policy_loss"] * 7 == pytest.approx(kept["policy_loss"] * 8, rel=1e-6)


def test_nothing_to_learn_is_an_error(tiny_run, tmp_path):
    from tpkit.train import TrainError

    adv = _advantages_with(tiny_run, tmp_path / "adv", lambda tids, a: np.zeros_like(a))
    with pytest.raises(TrainError, match="nothing to learn"):
        train.run(train_cfg(tiny_run, tmp_path / "train", advantages=str(adv)))
    assert not (tmp_path / "train" / layout.MANIFEST).exists()


def test_ema_adapter_loads_into_diffusers(trained):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3.resolve("tiny-sd3"))
    pipe.load_lora_weights(str(trained / train.ADAPTER))
    assert pipe.get_list_adapters().get("transformer")


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_rollout(tmp_path_factory) -> Path:
    """A second, smaller rollout: one different prompt, 2 members."""
    folder = tmp_path_factory.mktemp("other-rollout")
    prompts = folder / "one.txt"
    prompts.write_text("a green apple\n")
    rollout.run(RolloutConfig(prompts=str(prompts), out=str(folder / "rollout"), group_size=2, prompts_per_shard=1))
    return folder / "rollout"


def test_advantages_of_a_different_rollout(tiny_run, other_rollout, tmp_path):
    cfg = train_cfg(tiny_run, tmp_path / "train", rollout=str(other_rollout))
    with pytest.raises(InputError):
        train.run(cfg)
    assert not (tmp_path / "train" / layout.MANIFEST).exists()


@pytest.fixture(scope="module")
def reseeded_rollout(tmp_path_factory) -> Path:
    """A different rollout with the same prompt count and group size (hence the same trajectory
    ids p00000-m000 ...) but different prompts and seed: e.g. another round's rollout."""
    folder = tmp_path_factory.mktemp("reseeded-rollout")
    prompts = folder / "two.txt"
    prompts.write_text("a blue bicycle\na castle in the fog\n")
    rollout.run(RolloutConfig(prompts=str(prompts), out=str(folder / "rollout"), group_size=4, prompts_per_shard=1,
                              seed=1))
    return folder / "rollout"


def test_advantages_of_a_different_rollout_with_the_same_ids(tiny_run, reseeded_rollout, tmp_path):
    """The advantages were computed from tiny_run's trajectories; pairing them with another
    rollout's trajectories (same ids, different prompts, seeds and states) must be refused."""
    cfg = train_cfg(tiny_run, tmp_path / "train", rollout=str(reseeded_rollout))
    with pytest.raises(InputError):
        train.run(cfg)


def test_missing_advantage_rows(tiny_run, tmp_path):
    import pyarrow.parquet as pq

    adv = tmp_path / "advantages"
    shutil.copytree(tiny_run / "advantages", adv)
    path = adv / "advantages.parquet"
    table = pq.read_table(path)
    keep = [not (t.endswith("-m001") and s == 4) for t, s in zip(table["trajectory_id"].to_pylist(),
                                                                 table["step"].to_pylist())]
    assert sum(keep) < len(keep)
    pq.write_table(table.filter(keep), path)
    as_written(path)
    with pytest.raises(InputError, match="step 4"):
        train.run(train_cfg(tiny_run, tmp_path / "train", advantages=str(adv)))


def test_unknown_lora_target(tiny_run, tmp_path):
    with pytest.raises(ConfigError, match="to_qkv"):
        train.run(train_cfg(tiny_run, tmp_path / "train", lora_targets=["to_q", "to_qkv"]))
    assert not (tmp_path / "train").exists()


def test_loads_no_text_encoder_and_no_vae(tiny_run, tmp_path, monkeypatch):
    calls = []
    real = models.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        model = real(*args, **kwargs)
        pipe = model.pipe
        assert pipe.text_encoder is None and pipe.text_encoder_2 is None and pipe.text_encoder_3 is None
        assert pipe.vae is None
        return model

    monkeypatch.setattr(models, "load", spy)
    train.run(train_cfg(tiny_run, tmp_path / "train", beta=0.0, optimizer_steps=1))
    assert len(calls) == 1
    assert calls[0].get("text_encoders") is False
    assert calls[0].get("vae") is False
    assert metrics(tmp_path / "train")[0]["ratio_mean"] == 1.0


def test_the_adapter_file_lists_its_target_modules_in_a_fixed_order(trained):
    """peft holds target_modules as a set (its order follows the process's string hashing); the saved
    metadata lists them sorted, so two identical trainings write byte-identical adapters."""
    from safetensors import safe_open

    (path,) = (trained / train.ADAPTER).glob("*.safetensors")
    with safe_open(path, "pt") as f:
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
    modules = metadata["transformer.target_modules"]
    assert isinstance(modules, list) and len(modules) > 1 and modules == sorted(modules)


def test_moments_of_another_lora_rank_are_refused_before_training(trained, tiny_run, tmp_path):
    """--init-state of a round with another LoRA rank holds as many moments as this round trains, so torch's
    load_state_dict takes it (it checks counts only) and the first AdamW step would fail on shapes. Refused
    up front, naming the tensor and both shapes, before anything is written."""
    with pytest.raises(train.TrainError, match=r"optimizer moments of other parameters .* is \(.*8.*\), its saved exp_avg \(.*4.*\)"):
        train.run(train_cfg(tiny_run, tmp_path / "rank8", lora_rank=8, lora_alpha=16,
                            init_state=str(trained / train.STATE)))
    assert not (tmp_path / "rank8" / layout.MANIFEST).exists()


def test_killed_train_resumes_from_its_checkpoint_with_the_same_result(tiny_run, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from tpkit import train as train_mod

    kw = dict(rollout=str(tiny_run / "rollout"), advantages=str(tiny_run / "advantages"), lora_rank=4, lora_alpha=8,
              learning_rate=1e-2, optimizer_steps=3, beta=1e-4)
    train_mod.run(TrainConfig(out=str(tmp_path / "clean"), **kw))

    real = train_mod._metrics_line
    calls = {"n": 0}

    def dies_on_step_two(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated kill")
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "_metrics_line", dies_on_step_two)
    with pytest.raises(KeyboardInterrupt):
        train_mod.run(TrainConfig(out=str(tmp_path / "killed"), **kw))
    assert (tmp_path / "killed" / "checkpoint" / "progress.json").is_file()
    assert not (tmp_path / "killed" / "manifest.json").exists()
    monkeypatch.setattr(train_mod, "_metrics_line", real)
    m = train_mod.run(TrainConfig(out=str(tmp_path / "killed"), **kw))
    assert m["resumed_from_step"] == 1 and not (tmp_path / "killed" / "checkpoint").exists()
    a = load_file(tmp_path / "clean" / "adapter" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "killed" / "adapter" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma = [json.loads(x) for x in (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in x.items() if k != "seconds"} for x in ma] == \
           [{k: v for k, v in x.items() if k != "seconds"} for x in mb]


def test_score_merges_the_policy_adapter_and_matches_it_unmerged(trained, two_prompts, tmp_path, monkeypatch):
    """Score (an inference-only stage) merges the rollout's LoRA into the weights: its branch rewards
    equal those of the separate peft adapter up to float rounding, and the pipeline it used has no
    LoRA layers left. Rollout keeps the adapter separate (train's ratio-1 replay needs its numbers)."""
    from tpkit import score
    from tpkit.config import ScoreConfig

    lora = str(trained / train.ADAPTER)
    rollout.run(RolloutConfig(prompts=str(two_prompts), out=str(tmp_path / "rollout"), group_size=2, steps=6,
                              window_size=5, window_range=(0, 5), lora=lora))
    cached = next(iter(base._CACHE.values()))
    assert not cached.lora_fused and any("lora" in n for n, _ in cached.transformer.named_modules())

    def rewards(name: str) -> np.ndarray:
        score.run(ScoreConfig(rollout=str(tmp_path / "rollout"), out=str(tmp_path / name), rewards={"brightness": 1.0}))
        t = layout.read_parquet_tables(tmp_path / name, "score").sort_by([("trajectory_id", "ascending"), ("branch", "ascending")])
        return np.asarray(t["reward"].to_pylist())

    merged = rewards("merged")
    model = next(iter(base._CACHE.values()))
    assert model is cached and model.lora_fused  # the rollout's pipeline, merged in place
    assert not any("lora" in n for n, _ in model.transformer.named_modules())
    again = models.load("tiny-sd3", lora=lora, reuse=True)  # what the next rollout asks for
    assert again is not model and not again.lora_fused

    base.release()
    monkeypatch.setattr(base, "_fuse", lambda m: None)  # keep peft's separate adapter
    separate = rewards("separate")
    assert np.abs(merged - separate).max() < 1e-5

    # The merged weights are the adapter's, not the base model's.
    plain = models.load("tiny-sd3", text_encoders=False)
    x, sigma = torch.randn(1, *plain.latent_shape(64), generator=torch.Generator().manual_seed(0)), torch.tensor([0.5])
    emb = next(iter(layout.read_shard(layout.list_shards(tmp_path / "rollout")[0])[0].values())).embeds
    with torch.no_grad():
        assert (model.velocity(x, sigma, emb, 4.5) - plain.velocity(x, sigma, emb, 4.5)).abs().max() > 1e-4


# --------------------------------------------------------------------------------------------
# train.optimizer = adamw8bit (bitsandbytes, an optional extra)
# --------------------------------------------------------------------------------------------


def test_8bit_adamw_is_refused_without_bitsandbytes(tiny_run, tmp_path, monkeypatch):
    """Before any work, one line naming the install (or the other optimizer); nothing written."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        train.run(train_cfg(tiny_run, tmp_path / "train", optimizer="adamw8bit"))
    assert "pip install bitsandbytes" in str(e.value) and "optimizer = adamw" in str(e.value)
    assert not (tmp_path / "train").exists()
    with pytest.raises(ConfigError, match="optimizer"):
        train_cfg(tiny_run, tmp_path / "t2", optimizer="sgd").validate()


def test_moments_of_one_optimizer_are_not_loaded_into_the_other(trained, tiny_run, tmp_path):
    """state/ records which optimizer wrote it; continuing with the other kind is refused (its state
    would not convert), naming the setting to keep."""
    assert json.loads((trained / train.STATE / "trainer.json").read_text())["optimizer"] == "adamw"
    pytest.importorskip("bitsandbytes")  # the refusal needs the other kind to be constructible
    with pytest.raises(Exception, match="optimizer = adamw"):
        train.run(train_cfg(tiny_run, tmp_path / "train", ema=True, ema_every=1, optimizer="adamw8bit",
                            init_lora=str(trained / train.ADAPTER)))


def test_8bit_adamw_trains_and_continues(tiny_run, tmp_path):
    """With bitsandbytes installed (`pip install 'tpkit[8bit]'`): the first ratio is still exactly 1,
    the LoRA changes, and the next round continues its 8-bit moments."""
    pytest.importorskip("bitsandbytes")
    first, second = tmp_path / "r1", tmp_path / "r2"
    train.run(train_cfg(tiny_run, first, optimizer="adamw8bit", beta=0.0))
    assert metrics(first)[0]["ratio_mean"] == 1.0
    assert json.loads((first / train.STATE / "trainer.json").read_text())["optimizer"] == "adamw8bit"
    train.run(train_cfg(tiny_run, second, optimizer="adamw8bit", beta=0.0, init_lora=str(first / train.ADAPTER)))
    assert differs(adapter(first / train.ADAPTER), adapter(second / train.ADAPTER))
    assert [m["step"] for m in metrics(second)] == [3, 4]
