"""How good is `tiny-shapes-pickscore`, the testbed's learned preference model, on prompts it never read?

    python bench/shapes/reward_quality.py [--model tiny-shapes-pickscore] [--per-task 200] [--samples 4]
                                          [--out bench/shapes/reward]

Everything goes through the `pickscore` reward exactly as `tpkit score --reward pickscore` builds it
(`logit_scale.exp() * cos`), on **test-split** prompts only (the model trained on train-split ones):

1. Rendered scenes (`tpkit.shapes.scenes`, seed 1234), crisp and blurred (Gaussian sigma 1 px): per
   GenEval task, how often the matching caption scores above a caption with one detail wrong (a
   class, a colour, the count, the relation, the colour binding), checked false for the scene by
   GenEval's judge on its true boxes. Beside the tasks, the position scenes against their relation
   flipped (same shapes): most of position's one-detail-wrong captions change a shape, so its column
   can be well above chance for a model that does not see where things are; this one cannot. It is
   split by whether the flipped caption is a train prompt (the model contrasted it with this one's
   arrangement, on other scenes) or a test one (it never read either): a model that learned each
   trained caption's arrangement, and not the relation, is right only on the first.
2. `tiny-shapes` samples (ODE with CFG; `--samples` per test prompt), with the eval sampler's 40 steps
   and with the rollout's 10 (the images the reward judges during RL); and half as many of every train
   prompt at 40 steps, from other noise than the training bank's (its captions seen, its images not):
   the shapes detector says what is drawn. Pairwise accuracy on the samples it judges correct
   (the own caption against a one-detail-wrong caption its detections make false), and the
   Spearman correlation of the reward with GenEval's dense score, over all samples, within each
   prompt (mean over prompts whose samples differ) and per task (samples per task in brackets: the
   test split's prompts are mostly colour binding, so that task weighs most in the overall figure).
3. Along SDE trajectories of test prompts (`--branches` a prompt, the rollout's sampler: 10 steps, CPS at noise
   level 0.7, window (0, 9)): the ODE completion from every state s_0..s_9, as the score stage judges them, and
   the step rewards d_k = R_{k+1} - R_k of both the reward and GenEval's dense score. Where the dense score's d_k
   is not 0, how often the reward's has the same sign (chance 0.5: what TP-GRPO's step credit needs of a reward);
   the reward's d_k = 0 share (ties); and the Spearman correlation of R_k with the dense score within a trajectory
   (mean over trajectories where both vary). The images and dense scores are the same for every model.

Writes OUT/results.json and OUT/RESULTS.md (tables) and prints them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tpkit.config import RolloutConfig
from tpkit.geneval import detectors
from tpkit.geneval.judge import judge
from tpkit.models.names import SHAPES_MODEL, SHAPES_PICKSCORE
from tpkit.rewards.registry import load_rewards, score_images
from tpkit.shapes import model as shapes_model
from tpkit.shapes import preference
from tpkit.shapes import scenes as shapes


SAMPLE_STEPS = (40, 10)  # the eval sampler's steps, the rollout's


def reward(model: str):
    rewards = load_rewards({"pickscore": 1.0}, {"pickscore": {"model": model, "processor": model}})
    return lambda images, prompts: score_images(rewards, images, prompts, [{}] * len(images))["reward"]


def ranks(x) -> np.ndarray:
    """Ranks from 0, tied values sharing their mean rank (Spearman's definition: the dense score ties a lot,
    and ranking ties by input order would invent differences between equal scores)."""
    _, where, counts = np.unique(np.asarray(x, dtype=float), return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts
    return (first + (counts - 1) / 2)[where]


def spearman(a, b) -> float:
    """Spearman's rho (= scipy.stats.spearmanr); nan when either side is constant."""
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def seeded_batches(m, metas: list[dict], per_prompt: int, seed: int):
    """Batches of 8 prompts, `per_prompt` images each: (metas, their encodings, the starting noise, the generator that
    drew it, for a sampler's further noise), one generator a batch, so a batch's images do not depend on the rest."""
    for b in range(0, len(metas), 8):
        batch = [meta for meta in metas[b: b + 8] for _ in range(per_prompt)]
        emb = m.encode([meta["prompt"] for meta in batch], shapes_model.TEXT_LENGTH)
        g = torch.Generator().manual_seed(seed * 1_000_003 + b)
        yield batch, emb, torch.randn(len(batch), *m.latent_shape(shapes_model.RESOLUTION), generator=g), g


def draw_samples(score, per_prompt: int, steps: int = 40, seed: int = 0, split: str = "test") -> list[dict]:
    """`per_prompt` tiny-shapes samples of every prompt of `split` (ODE with CFG, noise seeded by `seed`), each
    judged: rows {tag, prompt, meta, image, detections, correct, dense (GenEval's dense score), reward, wrong (a
    one-detail-wrong prompt its detections make false, or None)}."""
    metas = [m for tag in shapes.TAGS for m in shapes.split_prompts(tag, split)]
    m = shapes_model.models.load(SHAPES_MODEL, device="cpu")
    detector, _ = detectors.load_models("shapes")
    rng = np.random.default_rng(seed)
    rows = []
    for batch, emb, x, _ in seeded_batches(m, metas, per_prompt, seed):
        images = [Image.fromarray(a) for a in shapes_model.ode_images(m, emb, x, steps, shapes_model.GUIDANCE)]
        dets = detector(images)
        own = score(images, [meta["prompt"] for meta in batch])
        for meta, im, d, s in zip(batch, images, dets, own):
            j = judge(meta, d)
            wrong = [w for w in preference.one_detail_wrong(meta) if not judge(w, d).correct]
            w = wrong[int(rng.integers(len(wrong)))] if wrong else None
            rows.append({"tag": meta["tag"], "prompt": meta["prompt"], "meta": meta, "image": im, "detections": d,
                         "correct": j.correct, "dense": j.score, "reward": s, "wrong": w["prompt"] if w else None})
    return rows


def within_prompt(rows: list[dict], a: str, b: str) -> tuple[float | None, int]:
    """Spearman's rho of fields a and b within each prompt, averaged over the prompts where it is defined
    (both sides vary), and how many those are."""
    rhos = []
    for p in {r["prompt"] for r in rows}:
        rs = [r for r in rows if r["prompt"] == p]
        rho = spearman([r[a] for r in rs], [r[b] for r in rs])
        if np.isfinite(rho):
            rhos.append(rho)
    return (float(np.mean(rhos)) if rhos else None), len(rhos)


def num(x: float | None) -> str:
    """A within-prompt correlation, or "-" where no prompt's values vary on both sides (one sample a prompt)."""
    return "-" if x is None else f"{x:.3f}"


def on_samples(score, per_prompt: int, steps: int = 40, seed: int = 0, split: str = "test") -> dict:
    rows = draw_samples(score, per_prompt, steps, seed, split)
    pairs = [r for r in rows if r["correct"] and r["wrong"]]
    wrong_scores = score([r["image"] for r in pairs], [r["wrong"] for r in pairs])
    acc: dict[str, list] = {}
    for r, ws in zip(pairs, wrong_scores):
        acc.setdefault(r["tag"], []).append(r["reward"] > ws)
    within, spread = within_prompt(rows, "reward", "dense")
    per_task = {t: float(np.mean(v)) for t, v in acc.items()}
    return {"samples": len(rows), "judged_correct": len(pairs),
            "pairwise": {"overall": float(np.mean(list(per_task.values()))), **per_task},
            "pairwise_n": {t: len(v) for t, v in acc.items()},
            "spearman_dense": spearman([r["reward"] for r in rows], [r["dense"] for r in rows]),
            "spearman_dense_within_prompt": within,
            "spearman_dense_by_task": {t: spearman([r["reward"] for r in rows if r["tag"] == t],
                                                   [r["dense"] for r in rows if r["tag"] == t]) for t in shapes.TAGS},
            "samples_by_task": {t: sum(r["tag"] == t for r in rows) for t in shapes.TAGS},
            "prompts_with_spread": spread}


def on_branches(score, per_prompt: int, seed: int = 0) -> dict:
    """Section 3 of the module's docstring, on `per_prompt` trajectories of every test prompt."""
    metas = [m for tag in shapes.TAGS for m in shapes.split_prompts(tag, "test")]
    m = shapes_model.models.load(SHAPES_MODEL, device="cpu")
    detector, _ = detectors.load_models("shapes")
    cfg = RolloutConfig  # its defaults are the main job's sampler
    R, D, tags = [], [], []  # [trajectories, T]
    for batch, emb, x, g in seeded_batches(m, metas, per_prompt, seed):
        along = shapes_model.branch_images(m, emb, x, cfg.steps, shapes_model.GUIDANCE, cfg.sampler, cfg.noise_level, g)
        T = along.shape[1]
        images = [Image.fromarray(a) for a in along.reshape(-1, *along.shape[2:])]
        judged = [meta for meta in batch for _ in range(T)]  # trajectory-major, as `along`
        dense = [judge(meta, d).score for meta, d in zip(judged, detector(images))]
        R += np.asarray(score(images, [meta["prompt"] for meta in judged]), dtype=float).reshape(len(batch), T).tolist()
        D += np.asarray(dense, dtype=float).reshape(len(batch), T).tolist()
        tags += [meta["tag"] for meta in batch]
    R, D = np.asarray(R), np.asarray(D)
    dR, dD = np.diff(R, axis=1), np.diff(D, axis=1)
    moved = dD != 0
    agree = np.sign(dR) == np.sign(dD)
    rhos = [x for x in (spearman(r, d) for r, d in zip(R, D)) if np.isfinite(x)]
    tag = np.asarray(tags)[:, None]

    def agreement(where: np.ndarray) -> float | None:
        return float(agree[where].mean()) if where.any() else None

    return {"trajectories": len(R), "transitions": int(dR.size), "dense_moves": int(moved.sum()),
            "sign_agreement": agreement(moved),
            "sign_agreement_by_task": {t: agreement(moved & (tag == t)) for t in shapes.TAGS},
            "dense_moves_by_task": {t: int((moved & (tag == t)).sum()) for t in shapes.TAGS},
            "reward_ties": float((dR == 0).mean()), "dense_ties": float((dD == 0).mean()),
            "spearman_within_trajectory": float(np.mean(rhos)) if rhos else None, "trajectories_with_spread": len(rhos)}


def write_results(out: Path | None, result: dict, md: list[str]) -> None:
    """OUT/results.json and OUT/RESULTS.md (the lines of `md`; out None: neither), and the page printed."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "RESULTS.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def table(title: str, accs: dict[str, dict]) -> str:
    relation = {"relation": "position, relation flipped", "relation_flipped_train": "... the flipped caption a train prompt",
                "relation_flipped_test": "... a test prompt"}
    cols = ["overall", *shapes.TAGS] + [c for c in relation if any(c in a for a in accs.values())]
    head = [relation.get(c, c) for c in cols]
    lines = [f"**{title}**", "", "| | " + " | ".join(head) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, a in accs.items():
        lines.append(f"| {name} | " + " | ".join(f"{a[c]:.3f}" if a.get(c) is not None else "-" for c in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=SHAPES_PICKSCORE, help="CLIP preference model (built-in name or folder).")
    ap.add_argument("--per-task", type=int, default=200, help="Rendered scenes per GenEval task.")
    ap.add_argument("--samples", type=int, default=4, help="tiny-shapes samples per test prompt (0: skip).")
    ap.add_argument("--branches", type=int, default=2, help="SDE trajectories per test prompt, judged at every "
                    "state (0: skip).")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "reward")
    ap.add_argument("--where", action="store_true", help="Also where a single shape is (a model pretrained with "
                    "--absolute-pairs: its tokenizer has the words).")
    a = ap.parse_args()
    t0 = time.time()
    score = reward(a.model)
    rendered = {"crisp": preference.pairwise_accuracy(score, "test", a.per_task),
                "blurred (sigma 1 px)": preference.pairwise_accuracy(score, "test", a.per_task, blur=1.0),
                "train prompts, crisp": preference.pairwise_accuracy(score, "train", a.per_task)}
    result = {"model": a.model, "per_task": a.per_task, "rendered": rendered}
    if a.where:
        result["where"] = preference.where_accuracy(score, a.per_task)
    if a.samples:
        result["tiny_shapes_samples"] = {steps: on_samples(score, a.samples, steps) for steps in SAMPLE_STEPS}
        # train prompts, fresh samples (noise seed 1; the training bank's is 0): is a low correlation the
        # unseen captions, or the unseen images?
        result["train_prompt_samples"] = on_samples(score, max(1, a.samples // 2), 40, seed=1, split="train")
    if a.branches:
        result["branches"] = on_branches(score, a.branches)
    result["seconds"] = round(time.time() - t0, 1)
    md = ["# tiny-shapes-pickscore: quality on held-out prompts\n",
          f"`python bench/shapes/reward_quality.py --model {a.model} --per-task {a.per_task} --samples {a.samples}"
          + f" --branches {a.branches}"
          + " --where" * a.where + f"` ({result['seconds']} s).\n",
          table("Pairwise accuracy on rendered scenes (own caption > one-detail-wrong caption)", rendered)]
    if a.where:
        md += ["", f"Where a single shape is (own caption over the other half's, {2 * a.per_task} scenes an axis, "
                   f"any shape): left / right **{result['where']['x']:.3f}**, top / bottom **{result['where']['y']:.3f}**."]
    if a.samples:
        by_steps = result["tiny_shapes_samples"]
        named = {f"{steps} ODE steps": s for steps, s in by_steps.items()}
        named["train prompts (fresh samples), 40 ODE steps"] = result["train_prompt_samples"]
        md += ["", table("Pairwise accuracy on tiny-shapes samples the detector judges correct",
                         {f"{name} ({s['judged_correct']} of {s['samples']})": s["pairwise"]
                          for name, s in named.items()}), ""]
        for name, s in named.items():
            md.append(f"- {name}: Spearman correlation with GenEval's dense score on all {s['samples']} "
                      f"samples **{s['spearman_dense']:.3f}**; within a prompt (mean over {s['prompts_with_spread']} "
                      f"prompts whose samples differ) {num(s['spearman_dense_within_prompt'])}; by task "
                      + ", ".join(f"{t} {s['spearman_dense_by_task'][t]:.3f} ({s['samples_by_task'][t]})" for t in shapes.TAGS)
                      + ".")
    if a.branches:
        b = result["branches"]
        md += ["", f"**Along SDE trajectories of test prompts** ({b['trajectories']} trajectories, {b['transitions']} "
                   f"transitions s_k -> s_k+1; the dense score moves on {b['dense_moves']}, ties on "
                   f"{b['dense_ties']:.1%}): where it moves, the reward's step reward d_k has its sign "
                   f"**{num(b['sign_agreement'])}** of the time (chance 0.5); by task "
                   + ", ".join(f"{t} {num(b['sign_agreement_by_task'][t])} ({b['dense_moves_by_task'][t]})"
                               for t in shapes.TAGS)
                   + f". The reward's d_k = 0 on {b['reward_ties']:.1%} of transitions. Spearman correlation of R_k with "
                   f"the dense score within a trajectory (mean over {b['trajectories_with_spread']} where both vary): "
                   f"{num(b['spearman_within_trajectory'])}."]
    write_results(a.out, result, md)


if __name__ == "__main__":
    main()
