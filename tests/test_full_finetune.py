"""train.finetune = "full": every weight of the transformer trained, on both families, through `tpkit run`.

Two rounds of a tiny recipe with the KL reference on (beta > 0): the first ratio of each round is
exactly 1 (round 1 samples with round 0's saved model/ and trains from it), the weights move, the
saved model/ is a diffusers pipeline folder that `from_pretrained` loads and that samples differently
from the base, the reference stays the base model in round 1, and the optimizer's moments and the
global step continue. A killed round resumes from its checkpoint with the same weights.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import tomli_w
import torch
from safetensors.torch import load_file

from tpkit import layout, models, train
from tpkit.config import TrainConfig, load_recipe
from tpkit.errors import ConfigError
from tpkit.models.base import MODEL_NOTE

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"tiny-sd3": "StableDiffusion3Pipeline", "tiny-flux": "FluxPipeline", "tiny-qwen-image": "QwenImagePipeline"}


def recipe(folder: Path, prompts: Path, model: str, **train_opts) -> Path:
    data = tomllib.loads((ROOT / "pipelines" / "tiny-cpu.toml").read_text())
    data["rounds"] = 2
    data["eval_every"] = 1  # held-out evaluation of each round's model/ (the base's too)
    data["eval"] = {"kind": "reward", "prompts": str(prompts.resolve()), "images_per_prompt": 2, "steps": 4}
    data["rollout"].update(model=model, group_size=4, prompts=str(prompts.resolve()))
    if model == "tiny-flux":
        data["rollout"].update(guidance=3.5)
    data["train"] = {k: v for k, v in data["train"].items() if not k.startswith("lora")}
    data["train"].update(finetune="full", learning_rate=1e-3, beta=0.01, **train_opts)
    path = folder / f"{model}-full.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def weights(model_folder: Path) -> dict[str, torch.Tensor]:
    return load_file(next((Path(model_folder) / "transformer").glob("*.safetensors")))


@pytest.fixture(scope="module", params=list(FAMILIES))
def full_run(request, tmp_path_factory, two_prompts) -> dict:
    from tpkit.run import run

    base = tmp_path_factory.mktemp("full")
    run_dir = base / "run"
    run(load_recipe(recipe(base, two_prompts, request.param), out=str(run_dir)))
    return {"model": request.param, "run_dir": run_dir, "base": base, "prompts": two_prompts,
            "train": [layout.round_dir(run_dir, r) / "train" for r in (0, 1)]}


def test_each_round_starts_with_ratio_exactly_one_and_the_step_continues(full_run):
    m0, m1 = (read_jsonl(t / layout.METRICS_FILE) for t in full_run["train"])
    for m in (m0, m1):
        assert m[0]["ratio_mean"] == 1.0 and m[0]["approx_kl"] == 0, m[0]
        assert all(x["finite"] for x in m)
    assert m0[0]["kl_loss"] == 0  # round 0: the policy is the base model
    assert m1[0]["kl_loss"] > 0  # round 1: the reference is still the base, not round 0's model
    assert m1[0]["step"] == len(m0) + 1
    assert (full_run["train"][1] / train.STATE / "optimizer.pt").is_file()


def test_round_one_samples_with_round_zeros_model(full_run):
    rollout1 = json.loads((layout.round_dir(full_run["run_dir"], 1) / "rollout" / layout.MANIFEST).read_text())
    assert Path(rollout1["config"]["model"]) == full_run["train"][0] / train.MODEL
    assert rollout1["config"]["lora"] is None
    note = json.loads((full_run["train"][1] / train.MODEL / MODEL_NOTE).read_text())
    assert note["base_model"] == full_run["model"]  # round 1's model still names the run's first model
    manifest = json.loads((full_run["train"][0] / layout.MANIFEST).read_text())
    assert manifest["config"]["finetune"] == "full" and not (full_run["train"][0] / train.ADAPTER).exists()
    model = models.load(full_run["model"], text_encoders=False, vae=False)
    idle = set(model.idle_parameters(model.transformer))  # Qwen-Image's last text output, which nothing reads
    assert manifest["counts"]["trained_parameters"] == sum(p.numel() for n, p in model.transformer.named_parameters()
                                                           if n not in idle)  # every other weight


def test_weights_move_and_diffusers_loads_the_model(full_run):
    import diffusers

    base_folder = models.family(models.family_of(full_run["model"])).resolve(full_run["model"])
    before = load_file(next((Path(base_folder) / "transformer").glob("*.safetensors")))
    after = weights(full_run["train"][1] / train.MODEL)
    assert before.keys() == after.keys()
    assert all(v.dtype == torch.float32 for v in after.values())  # the master weights, continued exactly
    moved = [k for k in before if not torch.equal(before[k].float(), after[k])]
    assert len(moved) > len(before) // 2, f"only {len(moved)} of {len(before)} tensors changed"

    cls = getattr(diffusers, FAMILIES[full_run["model"]])
    images = {}
    for name, folder in (("base", base_folder), ("trained", full_run["train"][1] / train.MODEL)):
        pipe = cls.from_pretrained(str(folder), torch_dtype=torch.float32)
        assert type(pipe.transformer).__name__ == type(cls.from_pretrained(str(base_folder)).transformer).__name__
        images[name] = pipe("a red cube", num_inference_steps=2, height=64, width=64, output_type="latent",
                            generator=torch.Generator().manual_seed(0)).images
    assert not torch.equal(images["base"], images["trained"])


def test_a_finished_full_run_is_kept_and_the_eval_reads_the_model(full_run):
    """Each evaluation samples its round's model/ (the base evaluation the recipe's model); rerunning the
    finished run redoes nothing (every stage's identity, with the per-round model, holds)."""
    from tpkit.run import run

    evals = {r: json.loads((layout.eval_dir(full_run["run_dir"], r) / layout.MANIFEST).read_text()) for r in (0, 1)}
    for r, m in evals.items():
        assert Path(m["config"]["model"]) == full_run["train"][r] / train.MODEL and m["config"]["lora"] is None
    base = json.loads((full_run["run_dir"] / layout.BASE_EVAL / layout.MANIFEST).read_text())
    assert base["config"]["model"] == full_run["model"]
    lines = read_jsonl(full_run["run_dir"] / layout.ROUNDS_FILE)
    assert lines[0]["eval"] != lines[1]["eval"]
    before = {p: p.stat().st_mtime_ns for p in full_run["run_dir"].rglob("manifest.json")}
    run(load_recipe(full_run["base"] / f"{full_run['model']}-full.toml", out=str(full_run["run_dir"])))
    assert {p: p.stat().st_mtime_ns for p in full_run["run_dir"].rglob("manifest.json")} == before


@pytest.mark.parametrize("opts, words", [
    ({"ema": True}, "ema = true is not supported with finetune = full"),
    ({"init_lora": "/x/adapter"}, "--init-lora"),
    ({"finetune": "partial"}, "finetune"),
    # sharding (tests/test_distributed.py runs it): what it does not support yet is refused up front, by name
    ({"fsdp": True, "finetune": "lora", "ema": True}, "fsdp = true does not support ema = true"),
    ({"fsdp": True, "optimizer": "adamw8bit"}, "fsdp = true does not support optimizer = adamw8bit"),
    ({"fsdp": True, "mixed_precision": "fp16"}, "fsdp = true does not support mixed_precision = fp16"),
])
def test_full_finetune_refuses_what_it_cannot_do(opts, words):
    with pytest.raises(ConfigError) as e:
        TrainConfig(rollout="r", advantages="a", out="o", **{"finetune": "full", **opts}).validate()
    assert words in str(e.value)


def test_a_killed_full_train_resumes_from_its_checkpoint(tiny_run, tmp_path, monkeypatch):
    """Killed after its first optimizer step (checkpoint_every = 1), the rerun restores every weight and
    AdamW's moments from the checkpoint and ends where an uninterrupted train ends."""
    cfg = dict(rollout=str(tiny_run / "rollout"), advantages=str(tiny_run / "advantages"), finetune="full",
               learning_rate=1e-3, beta=0.01, optimizer_steps=3, checkpoint_every=1)
    train.run(TrainConfig(out=str(tmp_path / "whole"), **cfg))

    calls = {"n": 0}
    real = train._optimizer_step

    def dies_on_the_second(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # stands in for kill -9 after the first step's checkpoint
        return real(*a, **k)

    monkeypatch.setattr(train, "_optimizer_step", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        train.run(TrainConfig(out=str(tmp_path / "killed"), **cfg))
    assert (tmp_path / "killed" / train.CHECKPOINT / "weights.safetensors").is_file()
    monkeypatch.setattr(train, "_optimizer_step", real)
    manifest = train.run(TrainConfig(out=str(tmp_path / "killed"), **cfg))
    assert manifest["resumed_from_step"] == 1
    a, b = weights(tmp_path / "whole" / train.MODEL), weights(tmp_path / "killed" / train.MODEL)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_moments_of_a_lora_do_not_continue_a_full_train(tiny_run, tmp_path):
    """--init-state of a LoRA round (or any other parameters) is refused with a TrainError naming the
    mismatch, before anything is written; a file where the folder is expected too."""
    from tpkit.errors import InputError

    common = dict(rollout=str(tiny_run / "rollout"), advantages=str(tiny_run / "advantages"))
    train.run(TrainConfig(out=str(tmp_path / "lora"), lora_rank=4, lora_alpha=8, **common))
    with pytest.raises(train.TrainError, match="optimizer moments of other parameters"):
        train.run(TrainConfig(out=str(tmp_path / "full"), finetune="full", init_state=str(tmp_path / "lora" / train.STATE),
                              **common))
    assert not (tmp_path / "full" / layout.MANIFEST).exists()
    with pytest.raises(InputError, match="not a folder"):
        train.run(TrainConfig(out=str(tmp_path / "full2"), finetune="full",
                              init_state=str(tmp_path / "lora" / train.STATE / "optimizer.pt"), **common))


def test_keep_rounds_prunes_old_weights_and_the_run_still_continues(tmp_path, two_prompts):
    """keep_rounds with full fine-tuning deletes older rounds' weights (optimizer moments, and model/ unless
    the round was evaluated) but leaves their digests: continuing the run recognises every finished round,
    a pruned model/ is refused by name, and what is kept is what later rounds and users need."""
    from tpkit.errors import ModelError
    from tpkit.run import run, stage_dirs

    path = recipe(tmp_path, two_prompts, "tiny-sd3")
    path.write_text(tomli_w.dumps({**tomllib.loads(path.read_text()), "rounds": 3, "keep_rounds": 1, "eval_every": 2}))
    run_dir = tmp_path / "run"
    run(load_recipe(path, out=str(run_dir)))
    train_dir = lambda r: stage_dirs(run_dir, r)["train"]  # noqa: E731
    weights_of = lambda folder: sorted(p.name for p in folder.rglob("*.safetensors")) + sorted(p.name for p in folder.rglob("*.pt"))  # noqa: E731
    # round 0: both pruned; round 1 (evaluated: eval_every = 2): model/ kept, state/ pruned; round 2 (last): kept
    assert weights_of(train_dir(0) / train.MODEL) == weights_of(train_dir(0) / train.STATE) == []
    assert weights_of(train_dir(1) / train.MODEL) and not weights_of(train_dir(1) / train.STATE)
    assert weights_of(train_dir(2) / train.MODEL) and weights_of(train_dir(2) / train.STATE)
    assert (train_dir(0) / train.MODEL / "model_index.json").is_file()  # configs, notes and links stay
    # the digest left behind is the one round 1's rollout recorded for the model it sampled with
    rollout1 = json.loads((stage_dirs(run_dir, 1)["rollout"] / layout.MANIFEST).read_text())
    assert layout.pruned_digest(train_dir(0) / train.MODEL) == rollout1["identity"]["inputs"]["model_sha256"]
    with pytest.raises(ModelError, match="keep_rounds"):
        models.load(str(train_dir(0) / train.MODEL), "sd3", text_encoders=False, vae=False)
    # continue for a fourth round: rounds 0-2 are recognised as finished (nothing redone), round 3 trains
    stamps = {r: (train_dir(r) / layout.MANIFEST).stat().st_mtime_ns for r in range(3)}
    run(load_recipe(path, ["rounds=4"], out=str(run_dir)))
    assert len(read_jsonl(run_dir / layout.ROUNDS_FILE)) == 4
    assert {r: (train_dir(r) / layout.MANIFEST).stat().st_mtime_ns for r in range(3)} == stamps
    assert not weights_of(train_dir(2) / train.MODEL) and weights_of(train_dir(3) / train.MODEL)  # round 3: evaluated
    # a train continuing a pruned state/ would start AdamW afresh: refused by name
    with pytest.raises(Exception, match="keep_rounds"):
        train.run(TrainConfig(rollout=str(stage_dirs(run_dir, 1)["rollout"]), advantages=str(stage_dirs(run_dir, 1)["advantages"]),
                              out=str(tmp_path / "again"), finetune="full", init_state=str(train_dir(0) / train.STATE)))
