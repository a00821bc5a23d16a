"""The Qwen-Image family on tiny-qwen-image: diffusers' QwenImagePipeline reproduced, and every stage on it.

- `velocity` + tpkit's ODE step + `sigmas` give QwenImagePipeline's own latents (packing, img_shapes,
  the exponential dynamic shift with its terminal stretch, true CFG with its norm rescale, timestep
  scaling), with tpkit's fixed-length encodings and with the pipeline's own batch-padded ones;
- the pieces by hand: the schedule, true CFG's rescale, padding that changes nothing, the tokenizer's
  34-token template prefix, the 3-D VAE's decode against the pipeline's;
- rollout -> score -> advantages -> train through the CLI: the family is recorded, the prompt
  encodings (with masks and the negative prompt's) are stored at a fixed length, noise 0 gives the
  ODE sample, the first training ratio is exactly 1 (with the KL reference pass and gradient
  checkpointing: the adapters switched back on must not make the frozen ones trainable), and the
  adapter loads in diffusers' QwenImagePipeline and changes its output;
- every trained parameter of every family gets a gradient (DDP's requirement).
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
from tpkit.models import base, qwen_image

RES = 64
PROMPTS = ["a red circle", "two blue squares left of a green triangle"]


@pytest.fixture(scope="module")
def tiny_qwen(tpkit_home):
    model = models.load("tiny-qwen-image", device="cpu", dtype="float32")
    yield model
    base.release()


def pipeline_embeds(emb: dict) -> dict:
    """tpkit's stored encodings as QwenImagePipeline's keyword arguments (they are named alike)."""
    return {k: emb[k] for k in ("prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds",
                                "negative_prompt_embeds_mask")}


def test_family_of_names_and_folders(tiny_qwen):
    assert models.family_of("tiny-qwen-image") == "qwen-image" and models.family_of("Qwen/Qwen-Image") == "qwen-image"
    assert models.family_of(qwen_image.resolve("tiny-qwen-image")) == "qwen-image"  # by its model_index.json
    assert models.default("tiny-qwen-image", "guidance") == 4.0 and models.default("Qwen/Qwen-Image", "resolution") == 512
    assert models.default("Qwen/Qwen-Image", "lora_targets") == qwen_image.LORA_TARGETS
    assert models.builtin_models()["tiny-qwen-image"] == "qwen-image"


def test_tokenizer_template_prefix_is_the_pipelines_34_tokens(tiny_qwen):
    """The pipeline drops a fixed 34 tokens (the system prompt) from the hidden states: the tiny tokenizer
    must cut the template where the real one does, or prompts would be read from the middle of it."""
    pipe = tiny_qwen.pipe
    prefix = pipe.prompt_template_encode.split("{}")[0]
    ids = pipe.tokenizer(prefix)["input_ids"]
    assert len(ids) == pipe.prompt_template_encode_start_idx == 34
    tokens = pipe.tokenizer.convert_ids_to_tokens(pipe.tokenizer(pipe.prompt_template_encode.format("a cat"))["input_ids"])
    assert tokens[34] == "a" and tokens[:2] == ["<|im_start|>", "system"]


def test_sigmas_by_hand(tiny_qwen):
    """Exponential time shift by mu(tokens), then the terminal stretch to sigma = 0.02 (Qwen-Image's scheduler)."""
    T = 6
    for resolution in (64, 1024):
        tokens = (resolution // 8 // 2) ** 2
        mu = 0.5 + (0.9 - 0.5) * (tokens - 256) / (8192 - 256)
        shifted = np.array([math.exp(mu) / (math.exp(mu) + (1 / s - 1)) for s in np.linspace(1.0, 1 / T, T)])
        stretched = 1 - (1 - shifted) / ((1 - shifted[-1]) / (1 - 0.02))
        assert tiny_qwen.sigmas(T, resolution) == pytest.approx(list(stretched) + [0.0], abs=1e-6)
    assert tiny_qwen.sigmas(T, 64)[-2] == pytest.approx(0.02)


def test_true_cfg_by_hand():
    """v = v_neg + w (v_cond - v_neg), rescaled per token to |v_cond|: one token [3, 4] / [0, 1], w = 2."""
    cond, neg = torch.tensor([[[3.0, 4.0]]]), torch.tensor([[[0.0, 1.0]]])
    combined = torch.tensor([6.0, 7.0])  # [0, 1] + 2 ([3, 4] - [0, 1])
    want = combined * 5.0 / math.sqrt(36 + 49)
    assert torch.allclose(qwen_image.true_cfg(cond, neg, 2.0)[0, 0], want)
    assert torch.allclose(qwen_image.true_cfg(cond, neg, 1.0), cond)


def test_encodings_have_a_fixed_length_and_padding_changes_nothing(tiny_qwen):
    short, long_ = tiny_qwen.encode(PROMPTS, 48), tiny_qwen.encode(PROMPTS, 96)
    assert set(short) == {"prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask"}
    assert short["prompt_embeds"].shape == (2, 48, 32) and short["prompt_embeds_mask"].dtype == torch.int64
    valid = short["prompt_embeds_mask"].sum(1).tolist()
    assert valid[0] < valid[1] < 48 and long_["prompt_embeds_mask"].sum(1).tolist() == valid
    assert (short["prompt_embeds"][0, valid[0]:] == 0).all()  # zero padding, masked out
    x = torch.randn(2, *tiny_qwen.latent_shape(RES), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = tiny_qwen.velocity(x, torch.tensor([0.8, 0.3]), short, 4.0)
        b = tiny_qwen.velocity(x, torch.tensor([0.8, 0.3]), long_, 4.0)
        c = tiny_qwen.velocity(x[1:], torch.tensor([0.3]), {k: v[1:] for k, v in short.items()}, 4.0)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a[1:], c, atol=1e-5)
    cut = tiny_qwen.encode(PROMPTS, 8)  # cut as the pipeline's max_sequence_length cuts
    assert cut["prompt_embeds_mask"].all() and torch.allclose(cut["prompt_embeds"], short["prompt_embeds"][:, :8])


@pytest.mark.parametrize("own_encoding", [False, True])
def test_ode_with_tpkit_velocity_is_diffusers_qwen_image_pipeline(tiny_qwen, own_encoding):
    T, g = 4, 4.0
    emb = tiny_qwen.encode(PROMPTS, 64)
    x0 = torch.randn(2, *tiny_qwen.latent_shape(RES), generator=torch.Generator().manual_seed(0))
    sig = tiny_qwen.sigmas(T, RES)
    x = x0.clone()
    with torch.no_grad():
        for t in range(T):
            x = formulas.ode_step(x, tiny_qwen.velocity(x, torch.full((2,), sig[t]), emb, g), sig[t], sig[t + 1])
    given = (dict(prompt=PROMPTS, negative_prompt=[qwen_image.NEGATIVE_PROMPT] * 2, max_sequence_length=64) if own_encoding
             else pipeline_embeds(emb))  # the pipeline's own encodings are padded to the batch's longest prompt
    theirs = tiny_qwen.pipe(**given, true_cfg_scale=g, latents=qwen_image.pack(x0), num_inference_steps=T, height=RES,
                            width=RES, output_type="latent").images
    assert torch.allclose(x, qwen_image.unpack(theirs, 8, 8), atol=1e-5)


def test_decode_is_the_pipelines(tiny_qwen):
    emb = tiny_qwen.encode(PROMPTS[:1], 64)
    x = torch.randn(1, *tiny_qwen.latent_shape(RES), generator=torch.Generator().manual_seed(2))
    sig = tiny_qwen.sigmas(2, RES)
    with torch.no_grad():
        for t in range(2):
            x = formulas.ode_step(x, tiny_qwen.velocity(x, torch.tensor([sig[t]]), emb, 4.0), sig[t], sig[t + 1])
        ours = tiny_qwen.decode(x)
    z0 = torch.randn(1, *tiny_qwen.latent_shape(RES), generator=torch.Generator().manual_seed(2))
    theirs = tiny_qwen.pipe(**pipeline_embeds(emb), true_cfg_scale=4.0, latents=qwen_image.pack(z0), num_inference_steps=2,
                            height=RES, width=RES, output_type="np").images
    assert ours.shape == (1, RES, RES, 3) and ours.dtype == np.uint8
    assert np.abs(ours.astype(float) - theirs * 255).max() <= 0.5 + 1e-3  # the same image, rounded to uint8


def test_two_transformer_forwards_per_call_with_cfg(tiny_qwen):
    for guidance, want in ((4.0, 2), (1.0, 1)):
        seen = []
        hook = tiny_qwen.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["hidden_states"].shape[0]),
                                                               with_kwargs=True)
        try:
            emb = tiny_qwen.encode(["a cat"] * 3, 16)
            with torch.no_grad():
                tiny_qwen.velocity(torch.randn(3, *tiny_qwen.latent_shape(RES)), torch.full((3,), 0.5), emb, guidance)
        finally:
            hook.remove()
        assert seen == [3 * want] and want == tiny_qwen.forwards(guidance)


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux", "tiny-qwen-image"])
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_every_trained_parameter_gets_a_gradient(name, finetune, tpkit_home):
    """DDP refuses trained parameters without a gradient: train freezes each family's `idle_parameters`
    (Qwen-Image's last block computes a text output nothing reads), and then none is left without one."""
    model = models.load(name, device="cpu", dtype="float32")
    t = model.transformer
    if finetune == "full":
        base.make_fully_trainable(t)
    else:
        base.add_trainable_lora(t, 2, 2, models.default(name, "lora_targets"))
    idle = set(model.idle_parameters(t))
    assert bool(idle) == (name == "tiny-qwen-image")
    for n, p in t.named_parameters():
        if n in idle:
            p.requires_grad_(False)
    g = models.default(name, "guidance")
    model.velocity(torch.randn(1, *model.latent_shape(RES)), torch.tensor([0.5]), model.encode(["a cat"], 16), g).sum().backward()
    assert [n for n, p in t.named_parameters() if p.requires_grad and p.grad is None] == []
    base.release()


# --------------------------------------------------------------------------------------------
# The stages on tiny-qwen-image
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory, tpkit_home) -> Path:
    d = tmp_path_factory.mktemp("qwen-run")
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    small = ["--group-size", "4", "--steps", "6", "--window-size", "5", "--window-range", "0", "5"]
    assert cli("rollout", "--prompts", d / "prompts.txt", "--out", d / "rollout", "--model", "tiny-qwen-image", *small) == 0
    assert cli("score", d / "rollout", "--out", d / "score", "--reward", "brightness") == 0
    assert cli("advantages", d / "score", "--out", d / "advantages") == 0
    assert cli("train", "--rollout", d / "rollout", "--advantages", d / "advantages", "--out", d / "train",
               "--lora-rank", "4", "--lora-alpha", "8", "--learning-rate", "1e-2", "--optimizer-steps", "2",
               "--micro-batch-size", "0", "--beta", "0.01", "--gradient-checkpointing") == 0
    return d


def test_family_is_recorded_and_qwen_encodings_stored(qwen_run):
    m = json.loads((qwen_run / "rollout" / layout.MANIFEST).read_text())
    assert m["config"]["family"] == "qwen-image" and m["config"]["guidance"] == 4.0
    assert m["config"]["max_sequence_length"] == 64  # tiny-qwen-image's text length
    score, train = (json.loads((qwen_run / name / layout.MANIFEST).read_text()) for name in ("score", "train"))
    assert score["inputs"]["rollout_config"]["family"] == train["inputs"]["family"] == "qwen-image"
    for shard in layout.list_shards(qwen_run / "rollout"):
        prompts, trajs = layout.read_shard(shard)
        assert all(t.meta["family"] == "qwen-image" for t in trajs)
        for rec in prompts.values():
            assert rec.embeds["prompt_embeds"].shape == (1, 64, 32)
            assert rec.embeds["negative_prompt_embeds_mask"].dtype == torch.int64
            assert 0 < int(rec.embeds["prompt_embeds_mask"].sum()) < 64
        for t in trajs:
            assert t.tensors["states"].shape[1:] == (16, 8, 8)  # stored unpacked


def test_branch_0_is_the_ode_sample_from_the_rollout_noise(qwen_run, tiny_qwen):
    recorded, recomputed = branch_0_by_hand(qwen_run, tiny_qwen)
    assert recorded == pytest.approx(recomputed, abs=1e-3)  # the same image (up to batch-size rounding)


def test_first_training_ratio_is_exactly_one_with_the_reference_pass(qwen_run):
    lines = [json.loads(x) for x in (qwen_run / "train" / layout.METRICS_FILE).read_text().splitlines()]
    assert lines[0]["ratio_mean"] == 1.0 and lines[0]["clipfrac"] == 0.0
    assert lines[0]["kl_loss"] == 0.0 and lines[1]["kl_loss"] > 0.0
    m = json.loads((qwen_run / "train" / layout.MANIFEST).read_text())
    assert m["config"]["lora_targets"] == list(qwen_image.LORA_TARGETS)


def test_adapter_loads_in_diffusers_qwen_image_pipeline(qwen_run, tiny_qwen):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(qwen_image.resolve("tiny-qwen-image"))
    pipe.set_progress_bar_config(disable=True)
    kw = dict(prompt="a red circle", negative_prompt=" ", true_cfg_scale=4.0, num_inference_steps=3, height=RES,
              width=RES, output_type="latent", max_sequence_length=64)
    before = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    pipe.load_lora_weights(str(qwen_run / "train" / "adapter"))
    after = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    assert (before - after).abs().max() > 1e-4
    # and tpkit's own loader with the adapter gives the velocity diffusers computes
    adapted = models.load("tiny-qwen-image", device="cpu", dtype="float32", lora=str(qwen_run / "train" / "adapter"))
    x, emb = torch.randn(1, 16, 8, 8), adapted.encode(["a red circle"], 64)
    with torch.no_grad():
        ours = adapted.velocity(x, torch.tensor([0.7]), emb, 1.0)
        theirs = pipe.transformer(hidden_states=qwen_image.pack(x), timestep=torch.tensor([0.7]),
                                  encoder_hidden_states=emb["prompt_embeds"],
                                  encoder_hidden_states_mask=emb["prompt_embeds_mask"], img_shapes=[[(1, 4, 4)]],
                                  return_dict=False)[0]
    assert torch.allclose(ours, qwen_image.unpack(theirs, 8, 8), atol=1e-5)


def test_other_families_lora_targets_are_refused(qwen_run, tmp_path):
    code = cli("train", "--rollout", qwen_run / "rollout", "--advantages", qwen_run / "advantages", "--out", tmp_path / "t",
               "--lora-target", "ff.net.2")
    assert code != 0 and not (tmp_path / "t").exists()
