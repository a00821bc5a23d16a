"""tpkit against an independent port of the authors' release (TP-GRPO, a fork of Flow-GRPO).

The `release_*` functions below are written the way the release computes, step for step, on the
scheduler's sigma table indexed by timestep (not with tpkit's helpers): the SDE/CPS step with its
log-prob, the KL term of the training loss, the clipped loss, per-prompt per-step advantages, and
the set of modules its LoRA config adapts. tpkit's defaults must agree with them on random inputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tpkit import formulas as F
from tpkit.config import TrainConfig
from tpkit.models.sd3 import LORA_TARGETS, LORA_TARGETS_ATTN2, LORA_TARGETS_FF

NOISE_LEVEL = 0.7


# --------------------------------------------------------------------------------------------
# The port
# --------------------------------------------------------------------------------------------


def release_sigmas(steps: int) -> torch.Tensor:
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps)
    return sched.sigmas.float()


def release_step(sigmas, step_index, model_output, sample, noise_level, noise, sde_type, prev_sample=None):
    """The release's `sde_step_with_logprob`: (prev_sample, log_prob, prev_sample_mean, std_dev_t);
    draws prev_sample with `noise` unless it is given (training re-scores the stored one)."""
    model_output, sample = model_output.float(), sample.float()
    sigma = sigmas[step_index].view(-1, 1, 1, 1)
    sigma_prev = sigmas[step_index + 1].view(-1, 1, 1, 1)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        prev_sample_mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                            + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
        if prev_sample is None:
            prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * noise
        log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                    - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    else:  # cps
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        pred_original_sample = sample - sigma * model_output
        noise_estimate = sample + model_output * (1 - sigma)
        prev_sample_mean = pred_original_sample * (1 - sigma_prev) + noise_estimate * torch.sqrt(sigma_prev**2 - std_dev_t**2)
        if prev_sample is None:
            prev_sample = prev_sample_mean + std_dev_t * noise
        log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


def release_kl(prev_sample_mean, prev_sample_mean_ref, std_dev_t):
    """Per sample, as the release's training loop before its batch mean."""
    kl = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
    return kl.reshape(-1)


def release_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip_max, beta, kl):
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    return policy_loss + beta * torch.mean(kl)


def release_advantages(prompts: np.ndarray, rewards: np.ndarray) -> np.ndarray:
    """Per-prompt stat tracking, one column (step) at a time: (r - mean) / (std + 1e-4)."""
    out = np.empty_like(rewards)
    for step in range(rewards.shape[1]):
        for prompt in np.unique(prompts):
            rows = prompts == prompt
            r = rewards[rows, step]
            out[rows, step] = (r - np.mean(r)) / (np.std(r) + 1e-4)
    return out


RELEASE_LORA_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                        "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]


# --------------------------------------------------------------------------------------------
# Sampler, log-prob, KL, loss
# --------------------------------------------------------------------------------------------


def _inputs(seed: int, batch: int = 3):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, 16, 8, 8)
    return [torch.randn(shape, generator=g) for _ in range(4)]  # x, v, v_ref, eps


@pytest.mark.parametrize("sampler", ["sde", "cps"])
@pytest.mark.parametrize("j", range(9))
def test_step_log_prob_and_kl_match_the_release(sampler, j):
    sigmas = release_sigmas(10)
    x, v, v_ref, eps = _inputs(j)
    idx = torch.full((x.shape[0],), j)
    rel_sample, rel_lp, rel_mean, rel_std = release_step(sigmas, idx, v, x, NOISE_LEVEL, eps, sampler)
    _, _, rel_mean_ref, _ = release_step(sigmas, idx, v_ref, x, NOISE_LEVEL, eps, sampler)

    sig, sig_next, sigma_1 = float(sigmas[j]), float(sigmas[j + 1]), float(sigmas[1])
    step = F.stochastic_step(sampler, x, v, sig, sig_next, NOISE_LEVEL, sigma_1, noise=eps)
    ref = F.stochastic_step(sampler, x, v_ref, sig, sig_next, NOISE_LEVEL, sigma_1, sample=step.sample)
    tol = dict(rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(step.sample, rel_sample, **tol)
    torch.testing.assert_close(step.mean, rel_mean, **tol)
    torch.testing.assert_close(step.log_prob, rel_lp, **tol)
    # tpkit's default KL (`kl = "release"`) is the release's, for both samplers.
    assert TrainConfig().kl == "release"
    torch.testing.assert_close(F.kl_to_reference(step.mean, ref.mean, step.noise_scale),
                               release_kl(rel_mean, rel_mean_ref, rel_std), rtol=1e-5, atol=0)


def test_exact_sde_kl_is_the_release_kl_divided_by_minus_dt():
    sigmas = release_sigmas(10)
    x, v, v_ref, eps = _inputs(0)
    j = 3
    sig, sig_next = float(sigmas[j]), float(sigmas[j + 1])
    a = F.stochastic_step("sde", x, v, sig, sig_next, NOISE_LEVEL, float(sigmas[1]), noise=eps)
    b = F.stochastic_step("sde", x, v_ref, sig, sig_next, NOISE_LEVEL, float(sigmas[1]), sample=a.sample)
    exact = F.kl_to_reference(a.mean, b.mean, a.std)
    release = F.kl_to_reference(a.mean, b.mean, a.noise_scale)
    torch.testing.assert_close(exact * (sig - sig_next), release, rtol=1e-5, atol=0)
    # CPS: both conventions are the same number.
    c = F.stochastic_step("cps", x, v, sig, sig_next, NOISE_LEVEL, float(sigmas[1]), noise=eps)
    assert torch.equal(c.noise_scale, c.std)


@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_loss_matches_the_release(sampler):
    sigmas = release_sigmas(10)
    x, v, v_ref, eps = _inputs(7, batch=6)
    j = 2
    sig, sig_next, sigma_1 = float(sigmas[j]), float(sigmas[j + 1]), float(sigmas[1])
    old = F.stochastic_step(sampler, x, v, sig, sig_next, NOISE_LEVEL, sigma_1, noise=eps)
    new = F.stochastic_step(sampler, x, v * 1.001, sig, sig_next, NOISE_LEVEL, sigma_1, sample=old.sample)
    ref = F.stochastic_step(sampler, x, v_ref, sig, sig_next, NOISE_LEVEL, sigma_1, sample=old.sample)
    adv = torch.tensor([-7.0, -1.0, -0.1, 0.0, 0.5, 6.0])
    cfg = TrainConfig()
    kl = F.kl_to_reference(new.mean, ref.mean, new.noise_scale)
    policy, _ = F.clipped_policy_loss(new.log_prob, old.log_prob, adv, cfg.clip_range, cfg.adv_clip)
    ours = (policy + cfg.beta * kl).mean()
    idx = torch.full((6,), j)
    stored, rel_old_lp, _, _ = release_step(sigmas, idx, v, x, NOISE_LEVEL, eps, sampler)
    _, rel_new_lp, rel_new_mean, rel_std = release_step(sigmas, idx, v * 1.001, x, NOISE_LEVEL, None, sampler, stored)
    _, _, rel_ref_mean, _ = release_step(sigmas, idx, v_ref, x, NOISE_LEVEL, None, sampler, stored)
    rel_kl = release_kl(rel_new_mean, rel_ref_mean, rel_std)
    theirs = release_loss(rel_new_lp, rel_old_lp, adv, cfg.clip_range, cfg.adv_clip, cfg.beta, rel_kl)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def test_per_prompt_per_step_advantages_match_the_release():
    rng = np.random.default_rng(0)
    prompts = np.repeat(np.array(["a", "b", "c"]), [5, 4, 1])
    rewards = rng.normal(size=(10, 9))
    rewards[5:9, 4] = 0.25  # a constant column in a group: zero advantages, not NaN
    ours = F.group_advantages(rewards, prompts)
    np.testing.assert_allclose(ours, release_advantages(prompts, rewards), rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------------------------------------
# LoRA targets on an SD3.5-Medium-shaped transformer
# --------------------------------------------------------------------------------------------


def sd35_medium_shaped_transformer():
    """SD3.5-Medium's layout in miniature: 24 MMDiT blocks, the first 13 with dual attention
    (MMDiT-X, a second image-only `attn2`), the last one context-pre-only; tiny widths."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=24, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16,
        pos_embed_max_size=16, qk_norm="rms_norm", dual_attention_layers=tuple(range(13)),
    )


def adapted_modules(transformer) -> set[str]:
    return {name for name, module in transformer.named_modules() if hasattr(module, "lora_A")}


def test_lora_lands_on_the_release_modules_of_sd35_medium():
    from peft import LoraConfig

    from tpkit.models import base

    ours = sd35_medium_shaped_transformer()
    base.add_trainable_lora(ours, 4, 8, LORA_TARGETS)
    theirs = sd35_medium_shaped_transformer()
    theirs.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=RELEASE_LORA_TARGETS))
    # by hand: 8 joint-attention projections per block, no to_add_out in the context-pre-only last block
    by_hand = {f"transformer_blocks.{i}.{t}" for i in range(24) for t in RELEASE_LORA_TARGETS
               if not (i == 23 and t == "attn.to_add_out")}
    assert adapted_modules(ours) == adapted_modules(theirs) == by_hand
    assert len(by_hand) == 191
    assert not any(".attn2." in name for name in adapted_modules(ours))


def test_second_attention_is_opt_in():
    from tpkit.models import base

    model = sd35_medium_shaped_transformer()
    base.add_trainable_lora(model, 4, 8, list(LORA_TARGETS) + list(LORA_TARGETS_ATTN2))
    names = adapted_modules(model)
    assert len(names) == 191 + 13 * 4
    assert {n for n in names if ".attn2." in n} == {f"transformer_blocks.{i}.attn2.{t}" for i in range(13)
                                                   for t in ("to_q", "to_k", "to_v", "to_out.0")}


def test_feed_forward_layers_are_opt_in():
    """The image stream's two FF linears in every block, the text stream's in all but the context-pre-only
    last block (it has no ff_context); `ff.net.2` does not also catch `ff_context.net.2`."""
    from tpkit.config import lora_targets
    from tpkit.models import base

    model = sd35_medium_shaped_transformer()
    base.add_trainable_lora(model, 4, 8, lora_targets(list(LORA_TARGETS) + list(LORA_TARGETS_FF), "sd3"))
    ff = {n for n in adapted_modules(model) if ".ff" in n}
    assert ff == ({f"transformer_blocks.{i}.ff.{t}" for i in range(24) for t in ("net.0.proj", "net.2")}
                  | {f"transformer_blocks.{i}.ff_context.{t}" for i in range(23) for t in ("net.0.proj", "net.2")})
    assert len(adapted_modules(model)) == 191 + len(ff)
