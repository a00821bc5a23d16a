"""The FLUX.1 family on tiny-flux: diffusers' FluxPipeline reproduced, and every stage on it.

- `velocity` + tpkit's ODE step + `sigmas` give FluxPipeline's own latents (packing, image and text
  ids, the resolution-dependent shift, distilled guidance, timestep scaling all as diffusers does);
- the schedule's shift by hand at two resolutions; packing against diffusers' own functions;
- a velocity call is one transformer forward (SD3: two, the CFG pair);
- rollout -> score -> advantages -> train through the CLI: the family is recorded, the prompt
  encodings are FLUX's (no negative prompt), noise 0 gives the ODE sample, the first training
  ratio is exactly 1 (with the KL reference pass, adapters off), and the adapter loads in
  diffusers' FluxPipeline and changes its output.
(Kill -9 and rerun: tests/test_faults.py; two ranks against one: tests/test_distributed.py.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import branch_0_by_hand, cli

from tpkit import formulas, layout, models
from tpkit.models import base, flux

RES = 64


@pytest.fixture(scope="module")
def tiny_flux(tpkit_home):
    model = models.load("tiny-flux", device="cpu", dtype="float32")
    yield model
    base.release()


def test_family_of_names_and_folders(tiny_flux, tmp_path):
    assert models.family_of("tiny-flux") == "flux" and models.family_of("tiny-sd3") == "sd3"
    assert models.family_of("black-forest-labs/FLUX.1-dev") == "flux"
    assert models.family_of("stabilityai/stable-diffusion-3.5-large") == "sd3"
    assert models.family_of(flux.resolve("tiny-flux")) == "flux"  # a local folder: by its model_index.json
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(Exception, match="StableDiffusionXLPipeline"):
        models.family_of(str(tmp_path))
    assert models.default("tiny-flux", "guidance") == 3.5 and models.default("tiny-flux", "resolution") == 64
    assert models.default("black-forest-labs/FLUX.1-dev", "lora_targets") == flux.LORA_TARGETS


def test_a_forced_family_must_not_contradict_the_model(tiny_flux, tmp_path, capsys):
    """--family is for models only a name could tell; against a built-in or a model_index.json it is refused
    (the family is left out of stage identities, so a finished folder would otherwise pass as done)."""
    from tpkit.config import RolloutConfig
    from tpkit.errors import ConfigError

    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    for model, forced in (("tiny-sd3", "flux"), (flux.resolve("tiny-flux"), "sd3")):
        with pytest.raises(ConfigError, match=f"family '{forced}' contradicts the model"):
            RolloutConfig(model=str(model), family=forced, prompts=str(prompts), out=str(tmp_path / "o")).validate()
    assert cli("rollout", "--model", "tiny-sd3", "--family", "flux", "--prompts", prompts, "--out", tmp_path / "o") != 0
    err = capsys.readouterr().err
    assert "contradicts the model tiny-sd3" in err and "leave --family out" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    # a folder without model_index.json can only be told by its name: forcing it is what --family is for
    assert models.known_family(str(tmp_path)) is None and models.family_of(str(tmp_path / "my-flux")) == "flux"
    cfg = RolloutConfig(model=str(tmp_path / "my-flux"), family="sd3", prompts=str(prompts), out=str(tmp_path / "o"))
    assert cfg.validate().family == "sd3"


def test_pack_and_ids_match_diffusers():
    from diffusers import FluxPipeline

    x = torch.randn(3, 16, 8, 6)
    packed = flux.pack(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 3, 16, 8, 6))
    assert torch.equal(flux.unpack(packed, 8, 6), x)
    assert torch.equal(flux.image_ids(8, 6), FluxPipeline._prepare_latent_image_ids(3, 4, 3, "cpu", torch.float32))


@pytest.mark.parametrize("resolution", [64, 1024])
def test_sigmas_shift_with_the_resolution_as_by_hand(tiny_flux, resolution):
    T = 6
    tokens = (resolution // 8 // 2) ** 2
    mu = 0.5 + (1.15 - 0.5) * (tokens - 256) / (4096 - 256)
    by_hand = [math.exp(mu) / (math.exp(mu) + (1 / s - 1)) for s in np.linspace(1.0, 1 / T, T)] + [0.0]
    assert tiny_flux.sigmas(T, resolution) == pytest.approx(by_hand, abs=1e-6)
    assert tiny_flux.sigmas(T, 1024)[2] > tiny_flux.sigmas(T, 64)[2]  # more tokens, more shift toward noise


def test_ode_with_tpkit_velocity_is_diffusers_flux_pipeline(tiny_flux):
    T, g = 4, 3.5
    prompts = ["a red circle", "two blue squares"]
    emb = tiny_flux.encode(prompts, 16)
    assert set(emb) == {"prompt_embeds", "pooled_prompt_embeds"}
    x0 = torch.randn(2, *tiny_flux.latent_shape(RES), generator=torch.Generator().manual_seed(0))
    sig = tiny_flux.sigmas(T, RES)
    x = x0.clone()
    with torch.no_grad():
        for t in range(T):
            x = formulas.ode_step(x, tiny_flux.velocity(x, torch.full((2,), sig[t]), emb, g), sig[t], sig[t + 1])
    theirs = tiny_flux.pipe(prompt_embeds=emb["prompt_embeds"], pooled_prompt_embeds=emb["pooled_prompt_embeds"],
                            latents=flux.pack(x0), num_inference_steps=T, guidance_scale=g, height=RES, width=RES,
                            output_type="latent").images
    assert torch.allclose(x, flux.unpack(theirs, 8, 8), atol=1e-5)


def test_one_transformer_forward_per_call_for_flux_two_for_sd3(tiny_flux):
    sd3 = models.load("tiny-sd3", device="cpu", dtype="float32")
    for model, guidance, want in ((tiny_flux, 3.5, 1), (sd3, 4.5, 2), (sd3, 1.0, 1)):
        seen = []
        hook = model.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["hidden_states"].shape[0]),
                                                           with_kwargs=True)
        try:
            emb = model.encode(["a cat"] * 3, 8)
            with torch.no_grad():
                model.velocity(torch.randn(3, *model.latent_shape(64)), torch.full((3,), 0.5), emb, guidance)
        finally:
            hook.remove()
        assert len(seen) == 1 and seen[0] == 3 * want == 3 * model.forwards(guidance), (model.FAMILY, guidance, seen)


# --------------------------------------------------------------------------------------------
# The stages on tiny-flux
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory, tpkit_home) -> Path:
    d = tmp_path_factory.mktemp("flux-run")
    (d / "prompts.txt").write_text("a red circle\na green square left of a blue triangle\n")
    small = ["--group-size", "4", "--steps", "6", "--window-size", "5", "--window-range", "0", "5"]
    assert cli("rollout", "--prompts", d / "prompts.txt", "--out", d / "rollout", "--model", "tiny-flux", *small) == 0
    assert cli("score", d / "rollout", "--out", d / "score", "--reward", "brightness") == 0
    assert cli("advantages", d / "score", "--out", d / "advantages") == 0
    assert cli("train", "--rollout", d / "rollout", "--advantages", d / "advantages", "--out", d / "train",
               "--lora-rank", "4", "--lora-alpha", "8", "--learning-rate", "1e-2", "--optimizer-steps", "2",
               "--micro-batch-size", "0", "--beta", "0.01") == 0
    return d


def test_family_is_recorded_and_flux_encodings_stored(flux_run):
    m = json.loads((flux_run / "rollout" / layout.MANIFEST).read_text())
    assert m["config"]["family"] == "flux" and m["config"]["guidance"] == 3.5
    for shard in layout.list_shards(flux_run / "rollout"):
        prompts, trajs = layout.read_shard(shard)
        assert all(t.meta["family"] == "flux" for t in trajs)
        for rec in prompts.values():
            assert set(rec.embeds) == {"prompt_embeds", "pooled_prompt_embeds"}  # no negative prompt
            assert rec.embeds["prompt_embeds"].shape[1] == 128  # T5 tokens only, no CLIP sequence
        for t in trajs:
            assert t.tensors["states"].shape[1:] == (16, 8, 8)  # stored unpacked


def test_branch_0_is_the_ode_sample_from_the_rollout_noise(flux_run, tiny_flux):
    recorded, recomputed = branch_0_by_hand(flux_run, tiny_flux)
    assert recorded == pytest.approx(recomputed, abs=1e-3)  # the same image (up to batch-size rounding)


def test_first_training_ratio_is_exactly_one_with_the_reference_pass(flux_run):
    lines = [json.loads(x) for x in (flux_run / "train" / layout.METRICS_FILE).read_text().splitlines()]
    assert lines[0]["ratio_mean"] == 1.0 and lines[0]["clipfrac"] == 0.0
    assert lines[0]["kl_loss"] == 0.0  # the adapters start at B = 0: policy = reference
    assert lines[1]["kl_loss"] > 0.0  # after one step the reference (adapters off) differs
    m = json.loads((flux_run / "train" / layout.MANIFEST).read_text())
    assert m["config"]["lora_targets"] == list(flux.LORA_TARGETS)


def test_adapter_loads_in_diffusers_flux_pipeline(flux_run, tiny_flux):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux.resolve("tiny-flux"))
    pipe.set_progress_bar_config(disable=True)
    kw = dict(prompt="a red circle", num_inference_steps=3, height=RES, width=RES, output_type="latent",
              max_sequence_length=16)
    before = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    pipe.load_lora_weights(str(flux_run / "train" / "adapter"))
    after = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    assert (before - after).abs().max() > 1e-4
    # and tpkit's own loader with the adapter gives the velocity diffusers computes
    adapted = models.load("tiny-flux", device="cpu", dtype="float32", lora=str(flux_run / "train" / "adapter"))
    x, emb = torch.randn(1, 16, 8, 8), adapted.encode(["a red circle"], 16)
    with torch.no_grad():
        ours = adapted.velocity(x, torch.tensor([0.7]), emb, 3.5)
        theirs = pipe.transformer(hidden_states=flux.pack(x), timestep=torch.tensor([0.7]), guidance=torch.tensor([3.5]),
                                  pooled_projections=emb["pooled_prompt_embeds"], encoder_hidden_states=emb["prompt_embeds"],
                                  txt_ids=torch.zeros(16, 3), img_ids=flux.image_ids(8, 8), return_dict=False)[0]
    assert torch.allclose(ours, flux.unpack(theirs, 8, 8), atol=1e-5)


def test_sd3_lora_targets_are_refused_for_flux(flux_run, tmp_path):
    code = cli("train", "--rollout", flux_run / "rollout", "--advantages", flux_run / "advantages", "--out", tmp_path / "t",
               "--lora-target", "attn2.to_q")
    assert code != 0 and not (tmp_path / "t").exists()
