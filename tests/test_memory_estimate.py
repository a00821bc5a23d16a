"""tpkit.memory: the peak-memory counter against hand-counted bytes, the meta-device estimate against
the same code measured on real tensors (tiny-sd3, tiny-flux, tiny-qwen-image: inference, LoRA and full training with and
without gradient checkpointing, VAE decoding), and the doctor's memory lines against a GPU they overflow."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import launch_env, torchrun

from tpkit import doctor, memory, models
from tpkit.config import load_recipe
from tpkit.models import base

ROOT = Path(__file__).resolve().parents[1]


def test_peak_counts_new_storage_alive_at_once_not_views_or_what_existed():
    x = torch.ones(1000)  # float32: 4,000 bytes, allocated before the block

    def work():
        a = x + 1  # 4,000
        b = a * 2  # 4,000 more: a and b alive together
        v = b.view(10, 100)  # a view: nothing new
        del a
        c = v.sum()  # 4 bytes, once a is gone
        return c

    with memory.PeakMemory() as pm:
        work()
    assert pm.peak == 8000
    with memory.PeakMemory() as pm:
        x.view(100, 10).t()
    assert pm.peak == 0


def _both(arch, fn):
    """fn(model) on the meta device (the estimate) and on real CPU tensors (the measurement)."""
    out = []
    for device in ("meta", "cpu"):
        with torch.device(device), memory.flash_attention():
            torch.manual_seed(0)
            model = memory.build_model(arch, torch.float32)
            if device == "cpu":
                model.device = torch.device("cpu")
            out.append(fn(model))
    return out


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux", "tiny-qwen-image"])
@pytest.mark.parametrize("what", ["inference", "decode", "lora", "lora+gc", "full", "full+gc"])
def test_the_estimate_is_what_the_same_code_allocates_on_real_tensors(name, what, tpkit_home):
    fam = models.family(models.family_of(name))
    fam.resolve(name)  # built, so its configs are on disk
    arch = memory.architecture(name)
    res, text = models.default(name, "resolution"), 16

    def run(model):
        if what == "inference":
            return memory.velocity_peak(model, arch, 4, res, text, 4.5)
        if what == "decode":
            return memory.decode_peak(model, 4, res)
        t = model.transformer
        if what.startswith("lora"):
            base.add_trainable_lora(t, 4, 8, models.default(name, "lora_targets"))
        else:
            base.make_fully_trainable(t)
        if what.endswith("+gc"):
            t.enable_gradient_checkpointing()
        return memory.velocity_peak(model, arch, 4, res, text, 4.5, train=True)

    estimated, measured = _both(arch, run)
    assert measured > 0
    assert estimated == pytest.approx(measured, rel=0.05), (estimated, measured)


# Run by 2 processes (torchrun, gloo): the sharded train estimate on the meta device against what a
# forward and backward of the same family allocate once its transformer is sharded as train shards it.
SHARDED = r"""
import json, os, sys, torch, torch.distributed as dist
from types import SimpleNamespace
from tpkit import memory, models, sharding
from tpkit.config import TrainConfig
from tpkit.models import base

dist.init_process_group("gloo")
name, n = sys.argv[1], dist.get_world_size()
arch = memory.architecture(name)
res, text, batch = models.default(name, "resolution"), 16, 4
recipe = SimpleNamespace(train=TrainConfig(finetune="full", fsdp=True, beta=0.0, micro_batch_size=batch),
                         rollout=SimpleNamespace(batch_size=batch))
with torch.device("meta"), memory.flash_attention():
    m = memory.build_model(arch, torch.float32)
    P = sum(p.numel() for p in m.transformer.parameters())
    act = lambda b, **kw: memory.velocity_peak(m, arch, b, res, text, 4.5, **kw)
    parts = memory.train_memory(m, arch, recipe, act, P, 4, n).parts
torch.manual_seed(0)
real = memory.build_model(arch, torch.float32, device="cpu")
base.make_fully_trainable(real.transformer)
block = max(sum(p.numel() * 4 for p in m.parameters()) for m in sharding.blocks(real.transformer))
sharding.shard(real.transformer, torch.device("cpu"), n)
x, emb = torch.zeros(batch, *real.latent_shape(res)), memory.embeddings(real, arch.transformer, batch, text, torch.float32)
with memory.flash_attention(), memory.PeakMemory() as pm:
    real.velocity(x, torch.full((batch,), 0.5), emb, 4.5).square().mean().backward()
if dist.get_rank() == 0:
    print("RESULT", json.dumps({"measured": pm.peak, "parts": parts, "block": block}), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # measured: past here only the interpreter's teardown, where gloo's threads can abort a process
"""


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux", "tiny-qwen-image"])
def test_the_sharded_train_estimate_is_what_two_sharded_processes_allocate(name, tpkit_home, tmp_path):
    """train.fsdp over 2 processes: what a sharded forward and backward allocate beyond the shards they
    hold (the gathered units, the activations, the sharded gradients) is at most the estimate, and the
    estimate over it by less than two blocks: it counts the next block's gather and a block's whole
    gradient at the peak, which GPUs overlap with the computing block and gloo's blocking collectives
    on a CPU do not."""
    import json
    import subprocess

    models.family(models.family_of(name)).resolve(name)
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED)
    out = subprocess.run(torchrun(name, script=script), env=launch_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT "):])
    parts = result["parts"]
    with torch.device("meta"):
        P = sum(p.numel() for p in memory.build_model(memory.architecture(name), torch.float32).transformer.parameters())
    assert parts["trained weights (float32), 1/2"] == P * 4 // 2  # float32 masters, half on each process
    estimated = sum(v for k, v in parts.items() if k.split(",")[0] in ("their gradients", "activations")
                    or k.startswith("gathered"))
    assert result["measured"] <= estimated <= result["measured"] + 2 * result["block"], (parts, result)


def test_doctor_warns_where_a_stage_does_not_fit_the_gpu():
    recipe = load_recipe(ROOT / "pipelines" / "sd35m-tpgrpo-pickscore.toml")
    gpu = SimpleNamespace(cuda=SimpleNamespace(device_count=lambda: 1,
                                                get_device_properties=lambda i: SimpleNamespace(total_memory=12 * 2**30)))
    ctx = doctor._Context(torch=gpu, cuda=True)
    doctor._check_memory(ctx, recipe)
    lines = {c.name: c for c in ctx.checks}
    assert set(lines) == {"memory: rollout", "memory: score", "memory: train", "memory: eval"}
    # SD3.5-Medium in bf16: the rollout encodes with T5-XXL beside the transformer: over 12 GiB
    assert not lines["memory: rollout"].ok and lines["memory: rollout"].level == "warning"
    assert "rollout.batch_size" in lines["memory: rollout"].fix and "of 12.0 GiB" in lines["memory: rollout"].detail
    assert "text encoders (encoding), then activations (sampling) 10.4 GiB" in lines["memory: rollout"].detail
    assert lines["memory: train"].ok  # LoRA with gradient checkpointing: well under
    full = load_recipe(ROOT / "pipelines" / "sd35m-tpgrpo-pickscore.toml", ["train.finetune=full", "train.ema=false"])
    ctx = doctor._Context(torch=gpu, cuda=True)
    doctor._check_memory(ctx, full)
    train = next(c for c in ctx.checks if c.name == "memory: train")
    assert not train.ok and "trained weights (float32) 8.4 GiB" in train.detail  # 2.24 B x 4 bytes
    assert "optimizer moments 16.7 GiB" in train.detail and "KL reference" in train.detail



def test_doctor_estimates_a_sharded_train_per_process():
    """`tpkit doctor RECIPE --set train.fsdp=true --processes 8`: Qwen-Image's full fine-tuning does not fit
    an 80 GB GPU unsharded and does sharded over 8 (1/8 of its weights, gradients and moments)."""
    checks = {p: {c.name: c for c in doctor.run(str(ROOT / "pipelines" / "qwen-image-tpgrpo-pickscore.toml"),
                                                overrides=["train.finetune=full", "train.fsdp=true"], processes=p)}
              for p in (1, 8)}
    one, eight = checks[1]["memory: train"].detail, checks[8]["memory: train"].detail
    assert "trained weights (float32) 76.1 GiB" in one  # 20.4 B x 4 bytes, on one process
    assert "trained weights (float32), 1/8 9.5 GiB" in eight and "optimizer moments, 1/8 19.0 GiB" in eight
    assert "gathered whole: the root and 2 blocks" in eight
    per_process = lambda detail: float(detail.split(" GiB per process")[0])  # noqa: E731
    assert per_process(one) > 300 and per_process(eight) < 60, (one, eight)


@pytest.mark.parametrize("kind", ["velocity", "decode", "train"])
def test_after_an_oom_the_suggested_batch_is_the_largest_the_estimate_fits(kind, tpkit_home):
    """suggest_batch on a loaded tiny-sd3: with a GPU of exactly (weights + the peak at batch 3), the
    largest batch that fits is 3; a GPU smaller than batch 1 needs gives None (nothing to suggest)."""
    from tpkit.config import TrainConfig

    model = models.load("tiny-sd3", text_encoders=False)
    arch = memory.loaded_architecture(model)
    cfg = TrainConfig(rollout="r", advantages="a", out="o", lora_rank=4, lora_alpha=8, beta=0.0).validate()
    cfg.lora_targets = list(models.default("tiny-sd3", "lora_targets"))
    res, text = 64, 16
    with torch.device("meta"), memory.flash_attention():
        meta = memory.build_model(arch, model.dtype)
        if kind == "velocity":
            need = lambda b: memory.resident_bytes(model) + memory.velocity_peak(meta, arch, b, res, text, 4.5)  # noqa: E731
        elif kind == "decode":
            need = lambda b: memory.resident_bytes(model) + memory.decode_peak(meta, b, res)  # noqa: E731
        else:
            def need(b):
                m = memory.build_model(arch, model.dtype)
                act = lambda batch, **kw: memory.velocity_peak(m, arch, batch, res, text, 4.5, **kw)  # noqa: E731
                recipe = SimpleNamespace(train=cfg, rollout=SimpleNamespace(batch_size=b))
                P = sum(p.numel() for p in m.transformer.parameters())
                return memory.train_memory(m, arch, recipe, act, P, 4).total
        limit = need(3)
        assert need(4) > limit  # the peak grows with the batch
    train = cfg if kind == "train" else None
    assert memory.suggest_batch(model, kind, 8, res, text, 4.5, train_cfg=train, limit=limit) == 3
    assert memory.suggest_batch(model, kind, 8, res, text, 4.5, train_cfg=train, limit=1) is None
    assert memory.suggest_batch(model, kind, 8, res, text, 4.5, train_cfg=train) is None  # a CPU: no GPU to fit


def test_the_oom_error_names_the_fitting_value_or_half(capsys):
    from tpkit import runtime
    from tpkit.errors import OutOfMemory

    def oom(fits):
        with pytest.raises(OutOfMemory) as e, runtime.memory_options("score", ("score.batch_size", 64), fits=fits):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return e.value.fix

    assert "score.batch_size = 64 (e.g. 24: the memory model's largest that fits)" in oom(lambda key, value: 24)
    assert "score.batch_size = 64 (e.g. 32)" in oom(lambda key, value: None)
    assert "score.batch_size = 64 (e.g. 32)" in oom(lambda key, value: 1 / 0)  # a failing estimate hides nothing


def test_rollout_samples_without_its_text_encoders(two_prompts, tmp_path, monkeypatch):
    """Rollout encodes every prompt first, then frees the text encoders: none is loaded while it samples,
    and the cached pipeline that score may reuse says it has none."""
    from tpkit import rollout
    from tpkit.config import RolloutConfig

    seen = []
    real = rollout.sample

    def sample(model, *a, **k):
        seen.append([getattr(model.pipe, n, None) is None for n in ("text_encoder", "text_encoder_2", "text_encoder_3")])
        return real(model, *a, **k)

    monkeypatch.setattr(rollout, "sample", sample)
    rollout.run(RolloutConfig(prompts=str(two_prompts), out=str(tmp_path / "r"), group_size=2, steps=4, window_size=3,
                              window_range=[0, 3], prompts_per_shard=1))
    assert seen and all(all(s) for s in seen)
    assert [key[1] for key in base._CACHE] == [False]  # (key, has text encoders, has VAE)


def test_doctor_counts_a_full_models_weights_in_the_disk_a_round_writes():
    """finetune = full writes the float32 transformer and AdamW's two moments every round: 12 bytes a
    parameter, 26.9 GB for SD3.5-Medium's 2.24 B (a LoRA round: well under 1 GB)."""
    lora = load_recipe(ROOT / "pipelines" / "sd35m-tpgrpo-pickscore.toml")
    full = load_recipe(ROOT / "pipelines" / "sd35m-tpgrpo-pickscore.toml", ["train.finetune=full", "train.ema=false"])
    (a, _, how_a), (b, _, how_b) = doctor.estimate_round_bytes(lora, True), doctor.estimate_round_bytes(full, True)
    assert b - a == pytest.approx(2_243_171_520 * 12 - lora.train.lora_rank * 3_000_000 * 4, rel=1e-6)
    assert "model/ (float32) and optimizer state" in how_b and "adapter/optimizer" in how_a


def test_the_next_rollout_of_the_process_reuses_the_text_encoders_it_let_go(two_prompts, tmp_path, monkeypatch):
    """The text encoders rollout frees wait on the CPU for the next load of the same ones (next round's
    rollout in `tpkit run`): the very same modules, not read from disk again, and the same embeddings."""
    from tpkit import rollout
    from tpkit.config import RolloutConfig

    used, real = [], rollout.encode_shard

    def encode_shard(model, cfg, prompts):
        used.append(model.pipe.text_encoder_3)
        return real(model, cfg, prompts)

    monkeypatch.setattr(rollout, "encode_shard", encode_shard)
    cfg = dict(prompts=str(two_prompts), group_size=2, steps=4, window_size=3, window_range=[0, 3], prompts_per_shard=2)
    rollout.run(RolloutConfig(out=str(tmp_path / "a"), **cfg))
    base.release()  # as train does between rounds: the cached pipeline goes, the text encoders stay on the CPU
    assert len(base._TEXT_ENCODERS) == 1
    rollout.run(RolloutConfig(out=str(tmp_path / "b"), **cfg))
    assert len(used) == 2 and used[0] is used[1]
    a, b = (sorted((tmp_path / d).glob("shard-*.tar")) for d in ("a", "b"))
    assert [f.read_bytes() for f in a] == [f.read_bytes() for f in b]  # same seed: the same shards, bit for bit
