"""`tpkit doctor`: environment checks, offline, without downloading or building anything."""

from __future__ import annotations

import json
import re
import shutil
import socket
from collections import namedtuple
from pathlib import Path

import pytest

from tpkit import doctor

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "pipelines" / "tiny-cpu.toml"
SD35 = "stabilityai/stable-diffusion-3.5-medium"


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No network at all, and an empty private HF cache (never the user's)."""
    from tpkit import hub

    def refuse(*args, **kwargs):
        raise AssertionError("tpkit doctor tried to open a network connection")

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=2.0: False)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def by_name(checks) -> dict[str, doctor.Check]:
    return {c.name: c for c in checks}


def failed(checks, level: str = "error") -> list[doctor.Check]:
    return [c for c in checks if not c.ok and c.level == level]


def sd35_recipe(tmp_path: Path, rewards: str = "pickscore = 1.0") -> Path:
    """tiny-cpu.toml with SD3.5-Medium and the given [rewards] body."""
    text = TINY.read_text()
    text = text.replace('model = "tiny-sd3"', f'model = "{SD35}"')
    text = text.replace('"../data/tiny-prompts.txt"', json.dumps(str(ROOT / "data" / "tiny-prompts.txt")))
    text = text.replace("brightness = 1.0", rewards)
    path = tmp_path / "sd35.toml"
    path.write_text(text)
    return path


def test_tiny_recipe_passes(tmp_path):
    checks = doctor.run(str(TINY), out=str(tmp_path / "run"))
    assert failed(checks) == [], failed(checks)
    assert doctor.exit_code(checks) == 0
    c = by_name(checks)
    for name in ("python", "torch", "diffusers", "transformers", "peft", "accelerate", "pyarrow", "webdataset",
                 "pipeline", "recipe", "prompts", "run folder", "disk space", "model", "reward brightness",
                 "TPKIT_HOME", "HF cache"):
        assert c[name].ok, c[name]
    assert "tiny-sd3" in c["model"].detail
    assert "per round" in c["disk space"].detail  # the recipe's estimate
    assert not c["hub"].ok and c["hub"].level == "info"  # offline is information, not a failure
    assert not (tmp_path / "run").exists()  # the doctor creates nothing


def test_missing_hub_models_named_with_download_fix(tmp_path):
    checks = doctor.run(str(sd35_recipe(tmp_path)), out=str(tmp_path / "run"))
    assert doctor.exit_code(checks) == 1
    errors = {c.name: c for c in failed(checks)}
    assert f"hf download {SD35}" in errors["model"].fix
    assert "hf download yuvalkirstain/PickScore_v1" in errors["reward pickscore: model"].fix
    assert "hf download laion/CLIP-ViT-H-14-laion2B-s32B-b79K" in errors["reward pickscore: processor"].fix
    assert set(errors) == {"model", "reward pickscore: model", "reward pickscore: processor"}
    # every reward option is honoured: a local folder given for the processor is checked there
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "preprocessor_config.json").write_text("{}")
    (proc / "tokenizer.json").write_text("{}")
    recipe = sd35_recipe(tmp_path, f'[rewards.pickscore]\nweight = 1.0\nprocessor = {json.dumps(str(proc))}\n')
    errors = {c.name for c in failed(doctor.run(str(recipe), out=str(tmp_path / "run")))}
    assert errors == {"model", "reward pickscore: model"}


def test_cli_rewards_and_shared_models(tmp_path):
    checks = doctor.run(out=str(tmp_path), rewards=["clipscore", "geneval=0.5", "nope", "ocr"],
                        reward_opts=["geneval.detector=/no/such/folder"])
    c = by_name(checks)
    assert c["model"].ok  # no recipe, no --model: tiny-sd3
    shared = c["reward clipscore: model; geneval: clip"]  # one check for the CLIP both use
    assert not shared.ok and "hf download openai/clip-vit-large-patch14" in shared.fix
    assert not c["reward geneval: detector"].ok and "/no/such/folder" in c["reward geneval: detector"].detail
    assert not c["reward nope"].ok and "unknown reward" in c["reward nope"].detail
    assert c["reward ocr: extras"].ok and c["reward geneval: extras"].ok


def test_missing_extra_names_the_pip_fix(tmp_path, monkeypatch):
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist: None if dist == "rapidfuzz" else real(dist))
    checks = by_name(doctor.run(out=str(tmp_path), rewards=["ocr"]))
    c = checks["reward ocr: extras"]
    assert not c.ok and c.level == "error" and "rapidfuzz" in c.detail and c.fix == "pip install 'tpkit[ocr]'"
    assert "reward ocr: text detector" not in checks  # its model files are not looked for without the extra


def test_rewards_declare_their_model_files(tmp_path, monkeypatch):
    """The model files come from the reward's module: ocr's from the rapidocr wheel, none for the
    weight-free shapes detector of geneval, and a reward's own error (with its fix) when it cannot say."""
    from tpkit.rewards import ocr
    from tpkit.errors import ModelError

    c = by_name(doctor.run(out=str(tmp_path), rewards=["ocr", "geneval"], reward_opts=["geneval.detector=shapes"]))
    assert c["reward ocr: text detector"].ok and c["reward ocr: text detector"].detail.endswith(".onnx")
    assert c["reward ocr: text recogniser"].ok
    assert [name for name in c if name.startswith("reward geneval")] == ["reward geneval: extras"]
    assert c["reward geneval: extras"].ok

    def broken_wheel(module):
        raise ModelError("no det model", "reinstall it")

    monkeypatch.setattr(ocr, "_wheel_models", broken_wheel)
    c = by_name(doctor.run(out=str(tmp_path), rewards=["ocr"]))["reward ocr"]
    assert not c.ok and "no det model" in c.detail and c.fix == "reinstall it"


def test_shapes_recipe_needs_no_downloads(tmp_path):
    checks = doctor.run(str(ROOT / "pipelines" / "shapes-tpgrpo.toml"), out=str(tmp_path / "run"))
    assert failed(checks) == [], failed(checks)


def test_requirements_from_pyproject(monkeypatch):
    """Minimum versions and the extras' packages come from tpkit's metadata, else from pyproject.toml."""
    import importlib.metadata

    installed = doctor._requirements()
    assert installed[""]["torch"].startswith(">=") and set(installed["ocr"]) == {"rapidocr", "onnxruntime", "rapidfuzz"}
    real = importlib.metadata.requires

    def not_installed(dist):
        if dist == "tpkit":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    assert doctor._requirements() == installed


def _fake_cached_pipeline(cache: Path, repo: str, complete: bool) -> Path:
    """A diffusers pipeline in the HF cache layout (refs/main -> snapshots/<commit>/...)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = cache / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    index = {"_class_name": "StableDiffusion3Pipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "transformer": ["diffusers", "SD3Transformer2DModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
             "text_encoder_3": ["transformers", "T5EncoderModel"], "image_encoder": [None, None]}
    snap.mkdir(parents=True)
    (snap / "model_index.json").write_text(json.dumps(index))
    for name, files in {"scheduler": ["scheduler_config.json"], "tokenizer": ["vocab.json"],
                        "transformer": ["config.json", "diffusion_pytorch_model.safetensors"],
                        "text_encoder_3": ["config.json", "model.safetensors.index.json",
                                           "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]}.items():
        (snap / name).mkdir()
        for f in files:
            (snap / name / f).write_text("{}")
    (snap / "text_encoder_3" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    if not complete:
        (snap / "text_encoder_3" / "model-00002-of-00002.safetensors").unlink()
    return snap


@pytest.mark.parametrize("complete", [True, False])
def test_cached_hub_model_complete_or_not(tmp_path, complete):
    _fake_cached_pipeline(tmp_path / "hf-cache", SD35, complete)
    c = by_name(doctor.run(out=str(tmp_path), model=SD35))["model"]
    assert c.ok is complete, c
    if not complete:
        assert "text_encoder_3/1 of 2 shards" in c.detail and f"hf download {SD35}" in c.fix


def test_local_model_folder(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    c = by_name(doctor.run(out=str(tmp_path), model=str(folder)))["model"]
    assert not c.ok and "model_index.json" in c.detail
    c = by_name(doctor.run(out=str(tmp_path), model=str(tmp_path / "nowhere")))["model"]
    assert not c.ok and "not a hub id" in c.detail


def test_broken_recipe_is_a_failed_check(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text() + "lerning_rate = 1e-3\n")  # a typo in [train], the last section
    checks = doctor.run(str(bad), out=str(tmp_path / "run"))
    c = by_name(checks)["recipe"]
    assert not c.ok and c.level == "error" and "unknown key train.lerning_rate" in c.detail and c.fix
    assert doctor.exit_code(checks) == 1
    assert by_name(checks)["python"].ok  # the other checks still ran
    c = by_name(doctor.run(str(tmp_path / "missing.toml"), out=str(tmp_path)))["recipe"]
    assert not c.ok and "does not exist" in c.detail


def test_low_disk_space(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * doctor.GiB, 95 * doctor.GiB, 5 * doctor.GiB))
    checks = doctor.run(str(TINY), out=str(tmp_path / "run"))
    c = by_name(checks)["disk space"]
    assert not c.ok and c.level == "warning" and "5.0 GiB free" in c.detail and "--out" in c.fix
    assert doctor.exit_code(checks) == 0  # a warning: enough for the tiny recipe
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * doctor.GiB, 100 * doctor.GiB, 1024))
    checks = doctor.run(str(TINY), out=str(tmp_path / "run"))
    c = by_name(checks)["disk space"]
    assert not c.ok and c.level == "error" and "not enough for one round" in c.detail
    assert doctor.exit_code(checks) == 1


def test_disk_estimate_for_sd35_recipe():
    from tpkit.config import load_recipe

    recipe = load_recipe(ROOT / "pipelines" / "sd35m-tpgrpo-pickscore.toml")
    per_round, shards, how = doctor.estimate_round_bytes(recipe, cuda=True)
    # 48 prompts x 24: 1152 trajectories of 20 latents 16 x 64 x 64 float32 (+ PNG): about 7 GiB a round
    assert "1152 trajectories" in how
    assert 6 * doctor.GiB < per_round < 9 * doctor.GiB
    assert 0.9 * per_round < shards < per_round  # nearly all of it is what keep_rounds deletes


def test_keep_rounds_in_the_disk_estimate(tmp_path, monkeypatch):
    """The SD3.5-Medium recipe's 500 rounds (~3.5 TiB) do not fit on 1 TiB; keeping 2 rounds' shards they do
    (the recipe keeps 5)."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2048 * doctor.GiB, 1024 * doctor.GiB, 1024 * doctor.GiB))
    text = (ROOT / "pipelines" / "sd35m-tpgrpo-pickscore.toml").read_text().replace('"../data/', f'"{ROOT}/data/')
    recipes = {}
    for keep in (0, 2):
        recipes[keep] = tmp_path / f"keep{keep}.toml"
        recipes[keep].write_text(re.sub(r"(?m)^keep_rounds = 5 .*$", f"keep_rounds = {keep}", text))
    c = by_name(doctor.run(str(recipes[0]), out=str(tmp_path / "run")))["disk space"]
    assert not c.ok and "fill up before the last round" in c.detail and "keep_rounds" in c.fix, c.detail
    c = by_name(doctor.run(str(recipes[2]), out=str(tmp_path / "run")))["disk space"]
    assert c.ok and "with keep_rounds = 2" in c.detail, c.detail


def test_broken_torchvision_is_a_warning(tmp_path, monkeypatch):
    import sys

    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist: "0.99.0" if dist == "torchvision" else real(dist))
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` raises ImportError
    checks = doctor.run(out=str(tmp_path))
    c = by_name(checks)["torchvision"]
    assert not c.ok and c.level == "warning" and "pip uninstall torchvision" in c.fix


def test_render_and_exit_code(capsys):
    checks = [doctor.Check("a", True, "fine", None, "info"), doctor.Check("b", False, "broken", "do X", "error"),
              doctor.Check("c", False, "meh", "do Y", "warning")]
    doctor.render(checks)
    text = capsys.readouterr().out
    assert "✓" in text and "✗" in text and "!" in text and "do X" in text
    assert doctor.exit_code(checks) == 1
    assert doctor.exit_code(checks[::2]) == 0


def test_gpus_reported(tmp_path, monkeypatch):
    """The CUDA branch, with torch.cuda faked (CI has no GPU): names, memory, missing bf16."""
    from types import SimpleNamespace

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H200", total_memory=140 * doctor.GiB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (139 * doctor.GiB, 140 * doctor.GiB))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    c = by_name(doctor.run(out=str(tmp_path)))
    assert c["cuda"].ok and "2 x NVIDIA H200 140 GiB (139 free)" in c["cuda"].detail
    assert not c["bf16"].ok and c["bf16"].level == "warning" and "fp16" in c["bf16"].fix
