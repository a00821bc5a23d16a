"""Every formula of TP-GRPO and Flow-GRPO, as small pure functions (docs/design.md section 2).

No I/O, no config objects, no models. Sampler functions take torch tensors and compute in
float32 whatever dtype comes in; reward/advantage functions take numpy arrays and compute in
float64. Shapes use: B batch, C/h/w latent channels and size, N trajectories, K window steps.

Paper symbols: sigma_j is the noise level entering step j (sigma_0 = 1 > ... > sigma_T = 0),
v the CFG velocity at (x, sigma_j), dt = sigma_{j+1} - sigma_j < 0, a the noise level of the
stochastic sampler, R_k the reward of the ODE completion from window state s_k.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

# --------------------------------------------------------------------------------------------
# Sampler steps (float32)
# --------------------------------------------------------------------------------------------


class Step(NamedTuple):
    """One stochastic transition x -> x'.

    sample: x' [B, C, h, w]; mean: mu [B, C, h, w]; std: the standard deviation of x' around mu
    ([B, 1, 1, 1]); log_prob: [B], averaged over non-batch elements; noise_scale: the release's
    `std_dev_t` ([B, 1, 1, 1]): s = a sqrt(sigma / (1 - sigma)) for "sde" (std = s sqrt(-dt)),
    s = std for "cps". The release's KL divides by it (see `kl_to_reference`).
    """

    sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor
    noise_scale: torch.Tensor


def _per_sample(t: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A scalar or [B] tensor as float32 [B, 1, 1, 1] that broadcasts against `like` [B, ...]."""
    t = torch.as_tensor(t, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        t = t.expand(like.shape[0])
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def _mean_over_elements(t: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B]: the average over every non-batch element."""
    return t.mean(dim=tuple(range(1, t.ndim)))


def ode_step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """Euler step of the flow ODE: x' = x + v * (sigma_{j+1} - sigma_j).

    x, v: [B, C, h, w]; sigma, sigma_next: scalars or [B] (per-sample schedules). Returns float32.
    """
    x, v = x.float(), v.float()
    return x + v * (_per_sample(sigma_next, x) - _per_sample(sigma, x))


def flow_sde_mean_std(x, v, sigma, sigma_next, noise_level: float, sigma_1) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-GRPO SDE transition: mean mu and std s*sqrt(-dt) of x'.

    s = a * sqrt(sigma / (1 - sigma)), where sigma = 1 is replaced by sigma_1 inside (1 - sigma)
    (otherwise s is infinite at the first step);
    mu = x (1 + s^2 / (2 sigma) dt) + v (1 + s^2 (1 - sigma) / (2 sigma)) dt.
    """
    x, v = x.float(), v.float()
    sig, sig_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    dt = sig_next - sig
    s = flow_sde_noise_scale(sigma, noise_level, sigma_1, x)
    mean = x * (1.0 + s**2 / (2.0 * sig) * dt) + v * (1.0 + s**2 * (1.0 - sig) / (2.0 * sig)) * dt
    return mean, s * torch.sqrt(-dt)


def flow_sde_noise_scale(sigma, noise_level: float, sigma_1, like: torch.Tensor) -> torch.Tensor:
    """s = a * sqrt(sigma / (1 - sigma)) of the Flow-GRPO SDE, [B, 1, 1, 1] float32 (like: [B, ...]).

    sigma = 1 is replaced by sigma_1 inside (1 - sigma) (otherwise s is infinite at the first step).
    The transition's std is s * sqrt(-dt); the release calls s `std_dev_t`.
    """
    sig = _per_sample(sigma, like)
    denom_sigma = torch.where(sig == 1.0, _per_sample(sigma_1, like), sig)
    return noise_level * torch.sqrt(sig / (1.0 - denom_sigma))


def flow_sde_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Gaussian log-density of x' under N(mu, std^2), averaged over non-batch elements [B].

    Constants included: -(x' - mu)^2 / (2 std^2) - log std - log sqrt(2 pi).
    """
    sample, mean = sample.float(), mean.float()
    lp = -((sample - mean) ** 2) / (2.0 * std**2) - torch.log(std) - 0.5 * math.log(2.0 * math.pi)
    return _mean_over_elements(lp)


def cps_mean_std(x, v, sigma, sigma_next, noise_level: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients-preserving sampling: mean mu and std s of x'.

    s = sigma_{j+1} sin(a pi / 2); x0_hat = x - sigma v; x1_hat = x + (1 - sigma) v;
    mu = x0_hat (1 - sigma_{j+1}) + x1_hat sqrt(sigma_{j+1}^2 - s^2).
    """
    x, v = x.float(), v.float()
    sig, sig_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    s = sig_next * math.sin(noise_level * math.pi / 2.0)
    x0_hat = x - sig * v
    x1_hat = x + (1.0 - sig) * v
    # clamp: sigma_{j+1}^2 - s^2 can round to a tiny negative number when a = 1.
    mean = x0_hat * (1.0 - sig_next) + x1_hat * torch.sqrt((sig_next**2 - s**2).clamp_min(0.0))
    return mean, s


def cps_log_prob(sample: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """CPS log-prob as the reference computes it: -mean((x' - mu)^2) over non-batch elements [B].

    Constants and the variance are dropped on purpose, so that the published clip range (1e-5)
    means the same thing here as in the authors' runs.
    """
    return _mean_over_elements(-((sample.float() - mean.float()) ** 2))


def stochastic_step(
    sampler: str, x, v, sigma, sigma_next, noise_level: float, sigma_1, noise: torch.Tensor | None = None,
    sample: torch.Tensor | None = None,
) -> Step:
    """One SDE ("sde") or CPS ("cps") step with its log-prob.

    Give `noise` (eps ~ N(0, I), [B, C, h, w]) to draw x' = mu + std * eps, or `sample` to score an
    existing transition x -> x' (training recomputes l_new this way). Exactly one of the two.
    """
    if (noise is None) == (sample is None):
        raise ValueError("give exactly one of noise= or sample=")
    if sampler == "sde":
        mean, std = flow_sde_mean_std(x, v, sigma, sigma_next, noise_level, sigma_1)
        noise_scale = flow_sde_noise_scale(sigma, noise_level, sigma_1, mean)
    elif sampler == "cps":
        mean, std = cps_mean_std(x, v, sigma, sigma_next, noise_level)
        noise_scale = std
    else:
        raise ValueError(f"unknown sampler {sampler!r}")
    std = std.expand(mean.shape[0], *([1] * (mean.ndim - 1)))
    noise_scale = noise_scale.expand(mean.shape[0], *([1] * (mean.ndim - 1)))
    if sample is None:
        sample = mean + std * noise.float()
    # log-prob of x' is computed on a detached sample: gradients flow through mu only.
    sample = sample.detach().float()
    log_prob = flow_sde_log_prob(sample, mean, std) if sampler == "sde" else cps_log_prob(sample, mean)
    return Step(sample, mean, std, log_prob, noise_scale)


def window_start(lo: int, hi: int, window_size: int, u: float) -> int:
    """First SDE step a, uniform on the integers of [lo, hi - K] given u ~ U[0, 1).

    Steps [a, a + K) are stochastic, all others ODE. Paper (T = 10, K = 9, range (0, 9)): a = 0.
    """
    n = hi - window_size - lo + 1
    if n < 1:
        raise ValueError(f"window range ({lo}, {hi}) cannot hold a window of {window_size} steps")
    return lo + min(int(u * n), n - 1)


def branch_schedule(sigmas: list[float], j: int, max_steps: int = 0) -> list[float]:
    """The noise levels an ODE branch from step j visits: sigma_j, ..., sigma_T = 0.

    Exact (max_steps = 0, or when T - j <= max_steps): every remaining step of the schedule.
    Otherwise max_steps steps on a coarser sub-schedule of it, whose points are evenly spaced in
    step index (rounded) and keep sigma_j first, so the rollout's v(s_k) still serves step one.
    """
    rest = sigmas[j:]
    if not max_steps or len(rest) - 1 <= max_steps:
        return list(rest)
    idx = sorted({round(i * (len(rest) - 1) / max_steps) for i in range(max_steps + 1)})
    return [rest[i] for i in idx]


def heun_step(x: torch.Tensor, v: torch.Tensor, v_pred: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """Heun (trapezoidal) step of the flow ODE: x' = x + (v + v_pred) / 2 * (sigma_{j+1} - sigma_j), where
    v = v(x, sigma_j) and v_pred = v(x_e, sigma_{j+1}) at the Euler predictor x_e = ode_step(x, v, ...).

    Second order: its local error is O(dt^3) against Euler's O(dt^2), for two velocity calls a step.
    x, v, v_pred: [B, C, h, w]; sigma, sigma_next: scalars or [B]. Returns float32.
    """
    x, v, v_pred = x.float(), v.float(), v_pred.float()
    return x + (v + v_pred) * 0.5 * (_per_sample(sigma_next, x) - _per_sample(sigma, x))


def ab2_step(x: torch.Tensor, v: torch.Tensor, v_prev: torch.Tensor, sigma_prev, sigma, sigma_next) -> torch.Tensor:
    """Two-step Adams-Bashforth step of the flow ODE on a non-uniform schedule: with h = sigma_{j+1} - sigma_j,
    h' = sigma_j - sigma_{j-1} and r = h / h',

        x' = x + h ((1 + r / 2) v - (r / 2) v_prev),    v = v(x, sigma_j), v_prev = v(x_{j-1}, sigma_{j-1}):

    the step integrates the line through the last two velocities (exact when v is linear in sigma along
    the path), second order for one velocity call a step, as Euler's cost (the multistep family of
    DPM-Solver++(2M) and UniPC). x, v, v_prev: [B, C, h, w]; sigmas: scalars or [B]. Returns float32."""
    x, v, v_prev = x.float(), v.float(), v_prev.float()
    h = _per_sample(sigma_next, x) - _per_sample(sigma, x)
    r = h / (_per_sample(sigma, x) - _per_sample(sigma_prev, x))
    return x + h * ((1 + r / 2) * v - (r / 2) * v_prev)


# velocity calls a step of each branch solver (config.BRANCH_SOLVERS); ab2's first step is Euler's
CALLS_PER_STEP = {"euler": 1, "heun": 2, "ab2": 1}


def branch_calls(steps: int, start: int, window_size: int, max_steps: int = 0, solver: str = "euler") -> int:
    """Transformer calls to complete branches k = 0..K-1 by ODE, reusing the rollout's v(s_k).

    Branch k runs from step a + k to T: n_k = T - a - k steps (min(n_k, N) with max_steps = N), each one
    velocity call with Euler and AB2 and two with Heun, the first of which the rollout already made:
    Euler and AB2 n_k - 1, Heun 2 n_k - 1. Euler: sum_{k=0}^{K-1} (T - a - k - 1); T = 10, a = 0, K = 9 gives 45.
    """
    return sum(CALLS_PER_STEP[solver] * min(steps - start - k, max_steps or steps) - 1 for k in range(window_size))


# --------------------------------------------------------------------------------------------
# Rewards along a trajectory and advantages (float64, numpy)
# --------------------------------------------------------------------------------------------


def step_rewards(R: np.ndarray) -> np.ndarray:
    """d_k = R_k - R_{k-1}, k = 1..K.  R: [N, K+1] -> [N, K]."""
    R = np.asarray(R, dtype=np.float64)
    return R[:, 1:] - R[:, :-1]


def aggregated_rewards(R: np.ndarray) -> np.ndarray:
    """agg_k = R_K - R_{k-1}, k = 1..K: the reward of everything from step k to the end. [N, K+1] -> [N, K]."""
    R = np.asarray(R, dtype=np.float64)
    return R[:, -1:] - R[:, :-1]


def turning_points(R: np.ndarray) -> np.ndarray:
    """Turning points by sign tests (sign(0) = 0 fails every test). R: [N, K+1] -> bool [N, K].

    Global trend Delta = R_K - R_0; step k (1-based) with d_k = R_k - R_{k-1}:
      k = 1:  sign(d_1) sign(R_K - R_1) > 0
      k >= 2: sign(d_{k-1}) sign(Delta) < 0  and  sign(d_k) sign(Delta) > 0  and  sign(d_k) sign(R_K - R_k) > 0
    The last step is never one (R_K - R_K = 0).
    """
    R = np.asarray(R, dtype=np.float64)
    sd = np.sign(step_rewards(R))  # [N, K]
    s_rest = np.sign(R[:, -1:] - R[:, 1:])  # sign(R_K - R_k), k = 1..K
    s_trend = np.sign(R[:, -1:] - R[:, :1])  # sign(Delta), [N, 1]
    tp = np.zeros(sd.shape, dtype=bool)
    tp[:, 0] = sd[:, 0] * s_rest[:, 0] > 0
    tp[:, 1:] = (sd[:, :-1] * s_trend < 0) & (sd[:, 1:] * s_trend > 0) & (sd[:, 1:] * s_rest[:, 1:] > 0)
    return tp


def balance_turning_points(
    tp: np.ndarray, agg: np.ndarray, trajectory_ids: np.ndarray, steps: np.ndarray
) -> np.ndarray:
    """Keep min(#pos, #neg) turning points of each sign of agg, the largest |agg| first.

    All arguments are flat [M] arrays over (trajectory, step) pairs. Ties in |agg| are broken by
    (trajectory_id, step) ascending. If only one sign occurs, every turning point is kept.
    Returns the kept mask [M]; dropped turning points fall back to normal steps.
    """
    tp, agg = np.asarray(tp, dtype=bool), np.asarray(agg, dtype=np.float64)
    pos, neg = np.flatnonzero(tp & (agg > 0)), np.flatnonzero(tp & (agg < 0))
    if len(pos) == 0 or len(neg) == 0:
        return tp.copy()
    n = min(len(pos), len(neg))
    kept = np.zeros_like(tp)
    for idx in (pos, neg):
        # lexsort sorts by the last key first: -|agg|, then trajectory_id, then step.
        order = np.lexsort((np.asarray(steps)[idx], np.asarray(trajectory_ids)[idx], -np.abs(agg[idx])))
        kept[idx[order[:n]]] = True
    return kept


def shaped_rewards(d: np.ndarray, agg: np.ndarray, tp: np.ndarray) -> np.ndarray:
    """r_k = agg_k at a (kept) turning point, else d_k. Any matching shapes."""
    return np.where(np.asarray(tp, dtype=bool), agg, d).astype(np.float64)


def group_advantages(
    r: np.ndarray, groups: np.ndarray, std: str = "group", eps: float = 1e-4
) -> np.ndarray:
    """A = (r - mean_group) / (std + eps), per step over each prompt's group.

    r: [N, K] shaped rewards; groups: [N] prompt ids. std "group" uses the group's population std
    (ddof 0), "global" the std over all N trajectories at that step (upstream Flow-GRPO's default).
    A group of one, or with identical rewards, gets advantage 0.
    """
    r = np.asarray(r, dtype=np.float64)
    groups = np.asarray(groups)
    out = np.zeros_like(r)
    global_std = r.std(axis=0, keepdims=True)
    for g in np.unique(groups):
        rows = groups == g
        rg = r[rows]
        s = rg.std(axis=0, keepdims=True) if std == "group" else global_std
        centred = rg - rg.mean(axis=0, keepdims=True)
        centred[:, (rg == rg[:1]).all(axis=0)] = 0.0  # identical rewards: exactly 0, not rounding noise / 1e-4
        out[rows] = centred / (s + eps)
    return out


# --------------------------------------------------------------------------------------------
# GRPO loss (torch)
# --------------------------------------------------------------------------------------------


def clipped_policy_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float,
    adv_clip: float = 5.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip objective of GRPO, per sample.

    ratio = exp(l_new - l_old); A clamped to [-adv_clip, adv_clip];
    loss = max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)). All [B]; returns (loss [B], ratio [B]).
    """
    adv = advantages.float().clamp(-adv_clip, adv_clip)
    ratio = torch.exp(log_prob.float() - old_log_prob.float())
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL term between the policy's and the reference's transitions (equal std), per sample [B].

    KL = mean((mu_theta - mu_ref)^2) / (2 std^2); mu: [B, C, h, w], std: [B, 1, 1, 1].
    Two conventions, chosen by which std is passed (`Step` has both):
    - `step.noise_scale` (tpkit's default, `kl = "release"`): what the release divides by, so that
      published KL weights mean the same. For "sde" that is s = a sqrt(sigma / (1 - sigma)), not
      the transition's std s sqrt(-dt): the release's KL is (-dt) times the exact one (Flow-GRPO's
      SD3 configs use beta 0.01-0.04 on this scale). For "cps" it is the transition's std.
    - `step.std` (`kl = "exact"`): the exact KL of the two Gaussians N(mu, std^2 I), averaged over
      elements.
    A deterministic transition (std 0) contributes 0 rather than inf/NaN.
    """
    var = std.reshape(-1).float() ** 2
    sq = _mean_over_elements((mean.float() - ref_mean.float()) ** 2)
    return torch.where(var > 0, sq / (2.0 * var.clamp_min(torch.finfo(torch.float32).tiny)), torch.zeros_like(sq))


# --------------------------------------------------------------------------------------------
# Schedule over rounds
# --------------------------------------------------------------------------------------------


def round_learning_rate(learning_rate: float, r: int, half_life: int) -> float:
    """Round r's learning rate under `tpkit run`'s exponential decay: lr_r = lr 2^(-r / half_life),
    constant for half_life 0. Exponential, not cosine: a round's rate does not depend on how many
    rounds the run will have, so `--rounds` may grow when a run is continued without changing the
    rounds already trained."""
    return learning_rate * 0.5 ** (r / half_life) if half_life else learning_rate
