"""tpkit.formulas against hand-worked numbers and invariants (docs/design.md section 2).

Every expected value here is computed by hand in the test (plain Python `math`), never by
calling another tpkit function, so a mistake in one formula cannot hide behind another.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tpkit import formulas as F

# A scalar-latent batch: B = 1, C = h = w = 1 unless a test says otherwise.
X, V = 0.5, -1.2
SIG, SIG_NEXT, A, SIG_1 = 0.8, 0.6, 0.7, 0.95


def scalar(val: float, dtype=torch.float32) -> torch.Tensor:
    return torch.full((1, 1, 1, 1), val, dtype=dtype)


def item(t: torch.Tensor) -> float:
    return float(t.reshape(-1)[0])


def rand(shape=(2, 3, 4, 4), seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


# --------------------------------------------------------------------------------------------
# ODE step
# --------------------------------------------------------------------------------------------


def test_ode_step_hand_worked():
    # x' = x + v * (sigma_next - sigma) = 0.5 + (-1.2)(-0.2) = 0.74
    out = F.ode_step(scalar(X), scalar(V), SIG, SIG_NEXT)
    assert out.dtype == torch.float32
    assert item(out) == pytest.approx(0.74, abs=1e-6)


def test_ode_step_to_zero_gives_x0_prediction():
    # last step (sigma_next = 0): x' = x - sigma v, the x0 prediction.
    x, v = rand(seed=1), rand(seed=2)
    torch.testing.assert_close(F.ode_step(x, v, 0.3, 0.0), x - 0.3 * v, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Flow-GRPO SDE step
# --------------------------------------------------------------------------------------------


def sde_by_hand(x, v, sigma, sigma_next, a, sigma_1):
    """docs/design.md section 2: s = a sqrt(sigma / (1 - sigma)), sigma = 1 replaced by sigma_1 inside (1 - sigma)."""
    dt = sigma_next - sigma
    s = a * math.sqrt(sigma / (1.0 - (sigma_1 if sigma == 1.0 else sigma)))
    mu = x * (1 + s**2 / (2 * sigma) * dt) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
    return mu, s * math.sqrt(-dt)


def test_flow_sde_mean_std_hand_worked():
    # sigma = 0.8: s = 0.7 sqrt(0.8 / 0.2) = 1.4, s^2 = 1.96, dt = -0.2
    # mu = x (1 + 1.96 / 1.6 (-0.2)) + v (1 + 1.96 * 0.2 / 1.6)(-0.2) = 0.755 x - 0.249 v
    # std = 1.4 sqrt(0.2)
    mean, std = F.flow_sde_mean_std(scalar(X), scalar(V), SIG, SIG_NEXT, A, SIG_1)
    assert mean.dtype == torch.float32 and std.dtype == torch.float32
    assert item(mean) == pytest.approx(0.755 * X - 0.249 * V, rel=1e-6)
    assert item(std) == pytest.approx(1.4 * math.sqrt(0.2), rel=1e-6)
    mu_h, std_h = sde_by_hand(X, V, SIG, SIG_NEXT, A, SIG_1)
    assert item(mean) == pytest.approx(mu_h, rel=1e-6)
    assert item(std) == pytest.approx(std_h, rel=1e-6)


def test_flow_sde_sigma_one_uses_sigma_1():
    # sigma = 1, sigma_next = 0.9, sigma_1 = 0.95: s = 0.7 sqrt(1 / (1 - 0.95)) = 0.7 sqrt(20),
    # s^2 = 9.8, dt = -0.1; mu = x (1 + 9.8 / 2 (-0.1)) + v (1 + 9.8 * 0 / 2)(-0.1) = 0.51 x - 0.1 v
    # (the (1 - sigma) in the mean keeps the real sigma = 1); std = 0.7 sqrt(20) sqrt(0.1) = 0.7 sqrt(2).
    mean, std = F.flow_sde_mean_std(scalar(X), scalar(V), 1.0, 0.9, A, SIG_1)
    assert math.isfinite(item(mean)) and math.isfinite(item(std))
    assert item(mean) == pytest.approx(0.51 * X - 0.1 * V, rel=1e-6)
    assert item(std) == pytest.approx(0.7 * math.sqrt(2.0), rel=1e-6)
    mu_h, std_h = sde_by_hand(X, V, 1.0, 0.9, A, SIG_1)
    assert item(mean) == pytest.approx(mu_h, rel=1e-6)
    assert item(std) == pytest.approx(std_h, rel=1e-6)


def test_flow_sde_sigma_1_only_matters_at_sigma_one():
    a = F.flow_sde_mean_std(scalar(X), scalar(V), SIG, SIG_NEXT, A, 0.95)
    b = F.flow_sde_mean_std(scalar(X), scalar(V), SIG, SIG_NEXT, A, 0.5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.8, 0.6), (0.3, 0.0)])
def test_flow_sde_noise_level_zero_is_ode(sigma, sigma_next):
    x, v = rand(seed=3), rand(seed=4)
    mean, std = F.flow_sde_mean_std(x, v, sigma, sigma_next, 0.0, SIG_1)
    torch.testing.assert_close(mean, F.ode_step(x, v, sigma, sigma_next), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mean, x + v * (sigma_next - sigma), rtol=1e-6, atol=1e-6)
    assert torch.all(std == 0)


def test_flow_sde_log_prob_gaussian_by_hand():
    # x' = [0.1, -0.4, 0.9] under N(mu = [0.0, 0.2, 0.5], 0.3^2), averaged over the 3 elements.
    xs, mus, sd = [0.1, -0.4, 0.9], [0.0, 0.2, 0.5], 0.3
    by_hand = sum(-((a - m) ** 2) / (2 * sd**2) - math.log(sd) - 0.5 * math.log(2 * math.pi)
                  for a, m in zip(xs, mus)) / 3
    sample = torch.tensor(xs).reshape(1, 3, 1, 1)
    mean = torch.tensor(mus).reshape(1, 3, 1, 1)
    lp = F.flow_sde_log_prob(sample, mean, torch.full((1, 1, 1, 1), sd))
    assert lp.shape == (1,)
    assert float(lp[0]) == pytest.approx(by_hand, rel=1e-6)


def test_flow_sde_log_prob_at_the_mean():
    # x' = mu: only the constants remain, -log(std) - log sqrt(2 pi).
    mean = rand(seed=5)
    std = torch.tensor([0.5, 2.0]).reshape(2, 1, 1, 1)
    lp = F.flow_sde_log_prob(mean.clone(), mean, std)
    for b, s in enumerate([0.5, 2.0]):
        assert float(lp[b]) == pytest.approx(-math.log(s) - 0.5 * math.log(2 * math.pi), rel=1e-6)


def test_stochastic_sde_step_hand_worked():
    # a known eps: x' = mu + std * eps; log-prob = -eps^2 / 2 - log std - log sqrt(2 pi) for one element.
    eps = 0.37
    st = F.stochastic_step("sde", scalar(X), scalar(V), SIG, SIG_NEXT, A, SIG_1, noise=scalar(eps))
    mu_h, std_h = sde_by_hand(X, V, SIG, SIG_NEXT, A, SIG_1)
    assert item(st.mean) == pytest.approx(mu_h, rel=1e-6)
    assert item(st.std) == pytest.approx(std_h, rel=1e-6)
    assert item(st.sample) == pytest.approx(mu_h + std_h * eps, rel=1e-6)
    lp_h = -(eps**2) / 2 - math.log(std_h) - 0.5 * math.log(2 * math.pi)
    assert item(st.log_prob) == pytest.approx(lp_h, rel=1e-5)
    assert st.log_prob.shape == (1,)


# --------------------------------------------------------------------------------------------
# CPS step
# --------------------------------------------------------------------------------------------


def cps_by_hand(x, v, sigma, sigma_next, a):
    s = sigma_next * math.sin(a * math.pi / 2)
    x0, x1 = x - sigma * v, x + (1 - sigma) * v
    return x0 * (1 - sigma_next) + x1 * math.sqrt(sigma_next**2 - s**2), s


def test_cps_mean_std_hand_worked():
    # s = 0.6 sin(0.35 pi); x0_hat = 0.5 + 0.96 = 1.46; x1_hat = 0.5 - 0.24 = 0.26;
    # mu = 1.46 * 0.4 + 0.26 * sqrt(0.36 - s^2) = 1.46 * 0.4 + 0.26 * 0.6 cos(0.35 pi)
    mean, std = F.cps_mean_std(scalar(X), scalar(V), SIG, SIG_NEXT, A)
    s = 0.6 * math.sin(0.35 * math.pi)
    assert item(std) == pytest.approx(s, rel=1e-6)
    assert item(mean) == pytest.approx(1.46 * 0.4 + 0.26 * 0.6 * math.cos(0.35 * math.pi), rel=1e-6)
    mu_h, s_h = cps_by_hand(X, V, SIG, SIG_NEXT, A)
    assert item(mean) == pytest.approx(mu_h, rel=1e-6)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.8, 0.6), (0.3, 0.0)])
def test_cps_noise_level_zero_is_ode(sigma, sigma_next):
    # a = 0: s = 0 and mu = (x - sigma v)(1 - sigma') + (x + (1 - sigma) v) sigma' = x + v (sigma' - sigma).
    x, v = rand(seed=6), rand(seed=7)
    mean, std = F.cps_mean_std(x, v, sigma, sigma_next, 0.0)
    torch.testing.assert_close(mean, F.ode_step(x, v, sigma, sigma_next), rtol=1e-6, atol=1e-6)
    assert torch.all(torch.as_tensor(std) == 0)


def test_cps_noise_level_one_is_finite():
    # a = 1: s = sigma', sqrt(sigma'^2 - s^2) = 0 (no NaN from rounding), mu = x0_hat (1 - sigma').
    x, v = rand(seed=8), rand(seed=9)
    mean, std = F.cps_mean_std(x, v, 0.7, 0.3, 1.0)
    assert torch.isfinite(mean).all()
    torch.testing.assert_close(mean, (x - 0.7 * v) * 0.7, rtol=1e-5, atol=1e-6)


def test_cps_log_prob_is_negative_mean_square():
    xs, mus = [0.1, -0.4, 0.9, 2.0], [0.0, 0.2, 0.5, 1.0]
    by_hand = -sum((a - m) ** 2 for a, m in zip(xs, mus)) / 4
    lp = F.cps_log_prob(torch.tensor(xs).reshape(1, 2, 2, 1), torch.tensor(mus).reshape(1, 2, 2, 1))
    assert lp.shape == (1,)
    assert float(lp[0]) == pytest.approx(by_hand, rel=1e-6)  # -(0.01 + 0.36 + 0.16 + 1) / 4


def test_stochastic_cps_step_hand_worked():
    eps = -0.8
    st = F.stochastic_step("cps", scalar(X), scalar(V), SIG, SIG_NEXT, A, SIG_1, noise=scalar(eps))
    mu_h, s_h = cps_by_hand(X, V, SIG, SIG_NEXT, A)
    assert item(st.sample) == pytest.approx(mu_h + s_h * eps, rel=1e-6)
    assert item(st.log_prob) == pytest.approx(-((s_h * eps) ** 2), rel=1e-5)


# --------------------------------------------------------------------------------------------
# stochastic_step: zero noise, draw vs score, dtypes, per-sample schedules
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_zero_noise_tensor_gives_the_mean(sampler):
    x, v = rand(seed=10), rand(seed=11)
    st = F.stochastic_step(sampler, x, v, SIG, SIG_NEXT, A, SIG_1, noise=torch.zeros_like(x))
    assert torch.equal(st.sample, st.mean)
    if sampler == "cps":
        assert torch.all(st.log_prob == 0)
    else:
        std_h = sde_by_hand(0.0, 0.0, SIG, SIG_NEXT, A, SIG_1)[1]
        expect = -math.log(std_h) - 0.5 * math.log(2 * math.pi)
        torch.testing.assert_close(st.log_prob, torch.full((2,), expect), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_noise_level_zero_step_is_ode(sampler):
    # a = 0: the step is the ODE step whatever eps is drawn.
    x, v = rand(seed=12), rand(seed=13)
    st = F.stochastic_step(sampler, x, v, SIG, SIG_NEXT, 0.0, SIG_1, noise=rand(seed=14))
    torch.testing.assert_close(st.sample, F.ode_step(x, v, SIG, SIG_NEXT), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sampler", ["sde", "cps"])
@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.8, 0.6)])
def test_scoring_a_sample_reproduces_its_log_prob(sampler, sigma, sigma_next):
    x, v, eps = rand(seed=15), rand(seed=16), rand(seed=17)
    drawn = F.stochastic_step(sampler, x, v, sigma, sigma_next, A, SIG_1, noise=eps)
    scored = F.stochastic_step(sampler, x, v, sigma, sigma_next, A, SIG_1, sample=drawn.sample)
    assert torch.equal(scored.mean, drawn.mean)
    assert torch.equal(scored.std, drawn.std)
    torch.testing.assert_close(scored.log_prob, drawn.log_prob, rtol=0, atol=0)
    assert drawn.log_prob.shape == (2,)


def test_stochastic_step_argument_checks():
    x = rand(seed=18)
    with pytest.raises(ValueError):
        F.stochastic_step("sde", x, x, SIG, SIG_NEXT, A, SIG_1)
    with pytest.raises(ValueError):
        F.stochastic_step("sde", x, x, SIG, SIG_NEXT, A, SIG_1, noise=x, sample=x)
    with pytest.raises(ValueError):
        F.stochastic_step("ddim", x, x, SIG, SIG_NEXT, A, SIG_1, noise=x)


def test_log_prob_gradient_flows_through_the_mean_only():
    x, eps = rand(seed=19), rand(seed=20)
    v = rand(seed=21).requires_grad_(True)
    sample = rand(seed=22).requires_grad_(True)
    st = F.stochastic_step("cps", x, v, SIG, SIG_NEXT, A, SIG_1, sample=sample)
    st.log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0
    assert sample.grad is None


@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_bf16_inputs_give_float32_outputs(sampler):
    x, v, eps = rand(seed=23, dtype=torch.bfloat16), rand(seed=24, dtype=torch.bfloat16), rand(seed=25, dtype=torch.bfloat16)
    assert F.ode_step(x, v, SIG, SIG_NEXT).dtype == torch.float32
    for mean, std in (F.flow_sde_mean_std(x, v, SIG, SIG_NEXT, A, SIG_1), F.cps_mean_std(x, v, SIG, SIG_NEXT, A)):
        assert mean.dtype == torch.float32
        assert torch.as_tensor(std).dtype == torch.float32
    st = F.stochastic_step(sampler, x, v, SIG, SIG_NEXT, A, SIG_1, noise=eps)
    for t in st:
        assert t.dtype == torch.float32
    # the float32 result equals the float32 computation on the upcast inputs
    st32 = F.stochastic_step(sampler, x.float(), v.float(), SIG, SIG_NEXT, A, SIG_1, noise=eps.float())
    torch.testing.assert_close(st.sample, st32.sample, rtol=0, atol=0)
    torch.testing.assert_close(st.log_prob, st32.log_prob, rtol=0, atol=0)
    lp = F.stochastic_step(sampler, x, v, SIG, SIG_NEXT, A, SIG_1, sample=st.sample.bfloat16()).log_prob
    assert lp.dtype == torch.float32
    assert F.cps_log_prob(x, v).dtype == torch.float32
    assert F.flow_sde_log_prob(x, v, torch.full((2, 1, 1, 1), 0.5)).dtype == torch.float32


@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_per_sample_sigmas_broadcast(sampler):
    # a batch of 2 with different sigmas (one of them the sigma = 1 first step) equals two calls.
    x, v, eps = rand(seed=26), rand(seed=27), rand(seed=28)
    sig, sig_next = torch.tensor([1.0, 0.8]), torch.tensor([0.9, 0.6])
    batched = F.stochastic_step(sampler, x, v, sig, sig_next, A, SIG_1, noise=eps)
    assert batched.sample.shape == x.shape and batched.log_prob.shape == (2,)
    assert batched.std.shape == (2, 1, 1, 1)
    for b in range(2):
        one = F.stochastic_step(sampler, x[b:b + 1], v[b:b + 1], float(sig[b]), float(sig_next[b]), A, SIG_1,
                                noise=eps[b:b + 1])
        torch.testing.assert_close(batched.sample[b:b + 1], one.sample, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(batched.mean[b:b + 1], one.mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(batched.std[b:b + 1], one.std.reshape(1, 1, 1, 1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(batched.log_prob[b:b + 1], one.log_prob, rtol=1e-6, atol=1e-6)
    ode = F.ode_step(x, v, sig, sig_next)
    for b in range(2):
        torch.testing.assert_close(ode[b:b + 1], F.ode_step(x[b:b + 1], v[b:b + 1], float(sig[b]), float(sig_next[b])))


def test_per_sample_sde_hand_worked():
    # [B] sigmas with scalar latents: each sample gets its own hand-worked mean and std.
    x = torch.tensor([X, X]).reshape(2, 1, 1, 1)
    v = torch.tensor([V, V]).reshape(2, 1, 1, 1)
    mean, std = F.flow_sde_mean_std(x, v, torch.tensor([1.0, 0.8]), torch.tensor([0.9, 0.6]), A, SIG_1)
    assert float(mean[0]) == pytest.approx(0.51 * X - 0.1 * V, rel=1e-6)
    assert float(mean[1]) == pytest.approx(0.755 * X - 0.249 * V, rel=1e-6)
    assert float(std.reshape(-1)[0]) == pytest.approx(0.7 * math.sqrt(2.0), rel=1e-6)
    assert float(std.reshape(-1)[1]) == pytest.approx(1.4 * math.sqrt(0.2), rel=1e-6)


# --------------------------------------------------------------------------------------------
# SDE window and cost
# --------------------------------------------------------------------------------------------


def test_window_start_paper_setting_is_always_zero():
    for u in np.linspace(0.0, 1.0, 101, endpoint=False).tolist() + [0.999999999]:
        assert F.window_start(0, 9, 9, u) == 0


@pytest.mark.parametrize("lo,hi,K", [(0, 9, 4), (2, 8, 3), (0, 5, 1), (1, 9, 5)])
def test_window_start_spreads_uniformly(lo, hi, K):
    n = hi - K - lo + 1  # integers lo..hi-K
    per = 40
    us = [(i + 0.5) / (n * per) for i in range(n * per)] + [0.0, 1.0 - 1e-12]
    starts = [F.window_start(lo, hi, K, u) for u in us]
    assert min(starts) == lo and max(starts) == hi - K
    assert all(isinstance(a, int) for a in starts)
    counts = {a: 0 for a in range(lo, hi - K + 1)}
    for a in starts[:-2]:
        counts[a] += 1
    assert set(counts.values()) == {per}  # exactly uniform on an even grid of u
    # monotone in u
    grid = [F.window_start(lo, hi, K, u) for u in np.linspace(0, 1, 200, endpoint=False)]
    assert grid == sorted(grid)


def test_window_start_rejects_a_window_that_does_not_fit():
    with pytest.raises(ValueError):
        F.window_start(0, 5, 9, 0.5)


def test_branch_calls():
    assert F.branch_calls(10, 0, 9) == 45  # 9 + 8 + ... + 1
    assert 10 + F.branch_calls(10, 0, 9) == 55  # docs/design.md section 2: 55 calls per trajectory instead of 64
    # T = 10, a = 2, K = 3: branches from steps 2, 3, 4 need 8 + 7 + 6 calls, minus the reused first = 7 + 6 + 5
    assert F.branch_calls(10, 2, 3) == 18
    assert F.branch_calls(10, 0, 0) == 0


# --------------------------------------------------------------------------------------------
# Loss and KL
# --------------------------------------------------------------------------------------------


def test_equal_log_probs_give_ratio_one_and_loss_minus_advantage():
    lp = torch.tensor([-0.3, 1.7, -12.25, 0.0], dtype=torch.float32)
    adv = torch.tensor([1.5, -0.25, 0.0, -4.0])
    for clip in (1e-5, 0.2):
        loss, ratio = F.clipped_policy_loss(lp, lp.clone(), adv, clip)
        assert torch.equal(ratio, torch.ones(4))
        assert torch.equal(loss, -adv)
    loss, ratio = F.clipped_policy_loss(lp.bfloat16(), lp.bfloat16(), adv.bfloat16(), 1e-5)
    assert loss.dtype == torch.float32 and ratio.dtype == torch.float32
    assert torch.equal(ratio, torch.ones(4))


def test_clipped_policy_loss_hand_worked():
    # eps = 0.2. ratio 1.5 -> clipped 1.2; ratio 0.5 -> clipped 0.8.
    # A =  2, r = 1.5: max(-3.0, -2.4) = -2.4     A = -2, r = 1.5: max(3.0, 2.4) = 3.0
    # A =  2, r = 0.5: max(-1.0, -1.6) = -1.0     A = -2, r = 0.5: max(1.0, 1.6) = 1.6
    # A =  1, r = 1.1 (inside the range): -1.1
    ratios = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1], dtype=torch.float64)
    old = torch.tensor([-1.0, 0.5, 2.0, -3.0, 0.0])
    new = old + torch.log(ratios).float()
    adv = torch.tensor([2.0, -2.0, 2.0, -2.0, 1.0])
    loss, ratio = F.clipped_policy_loss(new, old, adv, 0.2)
    torch.testing.assert_close(ratio, ratios.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, torch.tensor([-2.4, 3.0, -1.0, 1.6, -1.1]), rtol=1e-6, atol=1e-6)


def test_advantage_is_clamped_at_five():
    lp = torch.zeros(4)
    adv = torch.tensor([10.0, -7.0, 5.0, -4.9])
    loss, _ = F.clipped_policy_loss(lp, lp, adv, 1e-5)
    torch.testing.assert_close(loss, torch.tensor([-5.0, 5.0, -5.0, 4.9]))
    loss, _ = F.clipped_policy_loss(lp, lp, adv, 1e-5, adv_clip=2.0)
    torch.testing.assert_close(loss, torch.tensor([-2.0, 2.0, -2.0, 2.0]))
    # with a ratio of 2 and a clip range of 1e-5, A = 10 -> clamp 5: max(-10, -5 (1 + 1e-5))
    loss, _ = F.clipped_policy_loss(torch.tensor([math.log(2.0)]), torch.zeros(1), torch.tensor([10.0]), 1e-5)
    assert float(loss[0]) == pytest.approx(-5.0 * (1 + 1e-5), rel=1e-6)


def test_kl_to_reference_hand_worked():
    # sample 0: diffs [0.1, -0.2, 0.3, 0.0] -> mean sq = 0.14 / 4 = 0.035, std 0.5 -> 0.035 / 0.5 = 0.07
    # sample 1: diffs [1, 1, -1, 1]        -> mean sq = 1,            std 2   -> 1 / 8 = 0.125
    ref = torch.zeros(2, 1, 2, 2)
    mean = torch.tensor([[0.1, -0.2, 0.3, 0.0], [1.0, 1.0, -1.0, 1.0]]).reshape(2, 1, 2, 2)
    std = torch.tensor([0.5, 2.0]).reshape(2, 1, 1, 1)
    kl = F.kl_to_reference(mean, ref, std)
    assert kl.shape == (2,) and kl.dtype == torch.float32
    torch.testing.assert_close(kl, torch.tensor([0.07, 0.125]), rtol=1e-6, atol=1e-7)
    assert torch.equal(F.kl_to_reference(mean, mean.clone(), std), torch.zeros(2))
    kl16 = F.kl_to_reference(mean.bfloat16(), ref.bfloat16(), std.bfloat16())
    assert kl16.dtype == torch.float32


def test_kl_uses_the_step_std():
    # KL between the SDE transitions of two velocities equals mean((mu1 - mu2)^2) / (2 std^2) with the step's std.
    x, v1, v2 = rand(seed=29), rand(seed=30), rand(seed=31)
    st1 = F.stochastic_step("sde", x, v1, SIG, SIG_NEXT, A, SIG_1, noise=torch.zeros_like(x))
    st2 = F.stochastic_step("sde", x, v2, SIG, SIG_NEXT, A, SIG_1, noise=torch.zeros_like(x))
    kl = F.kl_to_reference(st1.mean, st2.mean, st1.std)
    std_h = sde_by_hand(0.0, 0.0, SIG, SIG_NEXT, A, SIG_1)[1]
    expect = ((st1.mean - st2.mean) ** 2).mean(dim=(1, 2, 3)) / (2 * std_h**2)
    torch.testing.assert_close(kl, expect, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------
# Reward-side pure functions (hand-worked; the stage is checked against a reference elsewhere)
# --------------------------------------------------------------------------------------------


def test_step_and_aggregated_rewards_hand_worked():
    R = np.array([[1.0, 0.0, 2.0, 3.0, 3.0]])
    np.testing.assert_array_equal(F.step_rewards(R), [[-1.0, 2.0, 1.0, 0.0]])
    np.testing.assert_array_equal(F.aggregated_rewards(R), [[2.0, 3.0, 1.0, 0.0]])


def test_turning_points_hand_worked():
    R = np.array([
        [1, 0, 2, 3, 3],    # Delta > 0; d = [-1, 2, 1, 0]: step 2 turns with the trend -> TP
        [0, 1, 0, 2, 3],    # first step TP (d_1 > 0, R_K - R_1 > 0) and step 3
        [0, -1, 1, -2, -3],  # the same, downwards: steps 1 and 3
        [0, 1, 2, 2, 1],    # zeros kill: d_1 > 0 but R_K - R_1 = 0
        [1, 2, 0, 3, 1],    # Delta = 0: nothing
        [0, -1, 1, 1, 1],   # step 2: d_2 > 0 but R_K - R_2 = 0 -> no
    ], dtype=float)
    expect = np.array([
        [False, True, False, False],
        [True, False, True, False],
        [True, False, True, False],
        [False, False, False, False],
        [False, False, False, False],
        [False, False, False, False],
    ])
    np.testing.assert_array_equal(F.turning_points(R), expect)


def test_balance_and_shaping_hand_worked():
    tp = np.array([True, True, True, True, True, False])
    agg = np.array([3.0, 3.0, 3.0, -3.0, -4.0, 9.0])
    tids = np.array(["t2", "t10", "t2", "t3", "t3", "t1"])
    steps = np.array([3, 2, 1, 1, 3, 1])
    kept = F.balance_turning_points(tp, agg, tids, steps)
    # 3 positive (all |agg| = 3), 2 negative: keep 2 of each; ties by (trajectory_id, step): t10/2, t2/1.
    np.testing.assert_array_equal(kept, [False, True, True, True, True, False])
    # one sign only: all kept
    np.testing.assert_array_equal(F.balance_turning_points(tp, np.abs(agg), tids, steps), tp)
    d = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    np.testing.assert_array_equal(F.shaped_rewards(d, agg, kept), [1.0, 3.0, 3.0, -3.0, -4.0, 6.0])


def test_group_advantages_hand_worked():
    r = np.array([[1.0], [3.0], [0.0], [0.0], [9.0], [7.0]])
    groups = np.array(["p", "p", "q", "q", "q", "s"])
    a = F.group_advantages(r, groups)
    # p: mean 2, std 1; q: mean 3, std sqrt(18) ; s: group of one -> 0
    np.testing.assert_allclose(a[:, 0], [-1 / 1.0001, 1 / 1.0001, -3 / (math.sqrt(18) + 1e-4),
                                         -3 / (math.sqrt(18) + 1e-4), 6 / (math.sqrt(18) + 1e-4), 0.0], rtol=1e-12)
    g = F.group_advantages(r, groups, std="global")
    vals = [1, 3, 0, 0, 9, 7]
    m = sum(vals) / 6
    gs = math.sqrt(sum((x - m) ** 2 for x in vals) / 6)
    np.testing.assert_allclose(g[:, 0], [-1 / (gs + 1e-4), 1 / (gs + 1e-4), -3 / (gs + 1e-4),
                                         -3 / (gs + 1e-4), 6 / (gs + 1e-4), 0.0], rtol=1e-12)


# --- --branch-steps: coarser branch schedules ---------------------------------------------


def test_branch_schedule_exact_by_default_and_capped_otherwise():
    s = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0]
    assert F.branch_schedule(s, 3) == s[3:]
    assert F.branch_schedule(s, 7, 5) == s[7:]  # 3 steps left <= 5: exact
    coarse = F.branch_schedule(s, 0, 3)
    assert coarse[0] == 1.0 and coarse[-1] == 0.0 and len(coarse) == 4  # starts at sigma_j (reuses v(s_k))
    assert coarse == sorted(coarse, reverse=True) and set(coarse) <= set(s)


def test_branch_calls_with_a_cap():
    assert F.branch_calls(10, 0, 9, 3) == 2 * 8 + 1  # k = 0..7: min(10 - k, 3) - 1 = 2; k = 8: 2 - 1 = 1
    assert F.branch_calls(10, 0, 9, 10) == F.branch_calls(10, 0, 9) == 45


def test_heun_step_hand_worked_and_exact_for_a_linear_velocity():
    """x' = x + (v + v_pred) / 2 * dt. For dx/dsigma = -x (v = -x) from sigma 1 to 0.5 (dt = -0.5):
    v = -2 at x = 2, predictor 2 + 0.5 * 2 = 3, v_pred = -3, x' = 2 + (-2 - 3) / 2 * (-0.5) = 3.25;
    the true solution 2 e^{0.5} = 3.2974, Euler's 3.0: Heun's error 0.047 against Euler's 0.297."""
    x = torch.full((1, 1, 1, 1), 2.0)
    v = -x
    pred = F.ode_step(x, v, 1.0, 0.5)
    assert pred.item() == 3.0
    out = F.heun_step(x, v, -pred, 1.0, 0.5)
    assert out.item() == 3.25
    assert abs(out.item() - 2 * math.exp(0.5)) < abs(pred.item() - 2 * math.exp(0.5)) / 6
    # a velocity constant in sigma (a straight flow): Heun is Euler, both exact
    c = torch.randn(2, 3, 4, 4)
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(F.heun_step(x, c, c, torch.tensor([1.0, 0.8]), torch.tensor([0.6, 0.0])),
                               F.ode_step(x, c, torch.tensor([1.0, 0.8]), torch.tensor([0.6, 0.0])))


def test_ab2_step_hand_worked_and_exact_for_a_velocity_linear_in_sigma():
    """x' = x + h ((1 + r/2) v - (r/2) v_prev), r = h / h'. From sigma 0.5 (previous 1.0) to 0.2: h = -0.3,
    h' = -0.5, r = 0.6; v = 1, v_prev = 3, x = 2: x' = 2 - 0.3 (1.3 * 1 - 0.3 * 3) = 2 - 0.3 * 0.4 = 1.88."""
    x = torch.full((1, 1, 1, 1), 2.0)
    out = F.ab2_step(x, torch.ones_like(x), torch.full_like(x, 3.0), 1.0, 0.5, 0.2)
    assert out.item() == pytest.approx(1.88, abs=1e-6)
    # dx/dsigma = a sigma + b (here a = 4, b = 1): the integral of the line through the last two velocities
    # is the exact x(sigma') - x(sigma) = a (sigma'^2 - sigma^2) / 2 + b (sigma' - sigma), per sample
    sp, s, sn = torch.tensor([1.0, 0.9]), torch.tensor([0.6, 0.7]), torch.tensor([0.25, 0.0])
    v = lambda sig: (4 * sig + 1).reshape(2, 1, 1, 1).expand(2, 3, 2, 2)  # noqa: E731
    x = torch.randn(2, 3, 2, 2)
    exact = x + (2 * (sn ** 2 - s ** 2) + (sn - s)).reshape(2, 1, 1, 1)
    torch.testing.assert_close(F.ab2_step(x, v(s), v(sp), sp, s, sn), exact)


def test_branch_calls_per_solver():
    """Heun: two calls a step, the first of the first step reused from the rollout: 2 n_k - 1; AB2 as Euler."""
    assert F.branch_calls(10, 0, 9, 3, "heun") == 5 * 8 + 3  # k = 0..7: 3 steps -> 5; k = 8: 2 steps -> 3
    assert F.branch_calls(10, 0, 9, 3, "euler") == F.branch_calls(10, 0, 9, 3) == F.branch_calls(10, 0, 9, 3, "ab2")
    from tpkit.config import BRANCH_SOLVERS

    assert set(F.CALLS_PER_STEP) == set(BRANCH_SOLVERS)


def test_kl_of_a_deterministic_transition_is_zero_not_nan():
    mean, ref = torch.ones(2, 1, 2, 2), torch.zeros(2, 1, 2, 2)
    std = torch.tensor([0.0, 0.5]).reshape(2, 1, 1, 1)
    kl = F.kl_to_reference(mean, ref, std)
    assert kl.tolist() == [0.0, pytest.approx(1.0 / (2 * 0.25))]


def test_round_learning_rate_halves_every_half_life_and_is_constant_without_one():
    assert [F.round_learning_rate(3e-3, r, 0) for r in range(4)] == [3e-3] * 4
    assert [F.round_learning_rate(4e-3, r, 2) for r in (0, 2, 4, 6)] == [4e-3, 2e-3, 1e-3, 5e-4]
    assert F.round_learning_rate(4e-3, 1, 2) == pytest.approx(4e-3 / math.sqrt(2), rel=1e-15)
