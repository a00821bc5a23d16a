"""bench/device/fullsize.py, the GPU benchmark, runs its whole code path here at reduced width (full
depth, every model), so a GPU session spends its minutes measuring, not dying on a typo; and its
published configs are the published models (parameter counts on the meta device, nothing allocated)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "device"))

import fullsize  # noqa: E402


@pytest.mark.parametrize("name, billions, vae_millions", [
    ("sd35m", 2.243, 83.8), ("sd35l", 8.057, 83.8), ("flux", 11.901, 83.8), ("qwen", 20.430, 126.9)])
def test_the_published_configs_have_the_published_sizes(name, billions, vae_millions):
    import diffusers

    cls = fullsize.MODELS[name][0]
    with torch.device("meta"):
        model = getattr(diffusers, cls.TRANSFORMER)(**fullsize.published(name)["transformer"])
        vae = getattr(diffusers, cls.VAE)(**fullsize.published(name)["vae"])
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.001)
    assert sum(p.numel() for p in vae.parameters()) / 1e6 == pytest.approx(vae_millions, abs=0.1)


def test_the_full_size_benchmark_runs_at_reduced_width(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "device" / "fullsize.py"), "--reduced", "--resolution", "64",
                           "--batch-cap", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["model"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert set(results) == {"sd35m", "sd35l", "flux", "qwen"}
    depth = {"sd35m": 24, "sd35l": 38, "flux": 19, "qwen": 60}
    for name, r in results.items():
        assert r["rollout_s_per_trajectory"] > 0 and r["score_s_per_sample_call"] > 0 and r["decode_s_per_image"] > 0
        for key in ("train_lora_gc", "train_lora", "train_full_gc", "train_full"):
            assert r[f"{key}_s_per_transition"] > 0, (name, key)
        full, every = r["train_full_trained_params"], r["transformer_params"]
        assert full == every if name != "qwen" else 0.9 * every < full < every  # Qwen-Image: but the unread text output
        assert r["train_lora_trained_params"] > 0  # (rank 32-64 on a width-32 model: more than its weights here)
        assert r["tflop_per_call"] > 0 and r["round_ratio_tp_over_flow"] > 1
        for key in ("rollout_batch", "score_call", "decode_batch", "train_lora_gc", "train_lora", "train_full_gc", "train_full"):
            assert r[f"{key}_estimate_gib"] > 0, (name, key)  # the doctor's estimate beside each measured peak
        assert r["train_full_estimate_gib"] > r["train_full_gc_estimate_gib"]
        assert r["forwards_per_call"] == (1 if name == "flux" else 2)  # FLUX's distilled guidance: one forward
        assert fullsize.published(name)["transformer"]["num_layers"] == depth[name]  # full depth
    # the recipes' windows: T = 10, K = 9 from step 0 -> 9 + 8 + ... + 1 branch calls; FLUX T = 6, K = 5 -> 15
    assert results["sd35m"]["branch_calls_tp"] == 45 == results["qwen"]["branch_calls_tp"] and results["flux"]["branch_calls_tp"] == 15
    table = (tmp_path / "RESULTS.md").read_text()
    assert all(f"| {m} |" in table for m in results)
