"""End-to-end RL smoke on the pretrained `tiny-shapes`: the testbed's recipes, shrunk to one round.

The main job (`tpkit run pipelines/shapes-tpgrpo-pickscore.toml`): rollout (CPS window), score with
the learned preference model through the `pickscore` reward, turning-point advantages, a LoRA update,
and the held-out evaluation of the adapter on the learned reward with GenEval accuracy beside it.
The GenEval recipe (`pipelines/shapes-tpgrpo.toml`): the same with the dense GenEval reward of the
weight-free shapes detector. Each on a few prompts, in well under a minute.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tpkit import evaluate, layout, report
from tpkit.config import load_recipe

RECIPE = Path(__file__).resolve().parents[1] / "pipelines" / "shapes-tpgrpo.toml"
MAIN_JOB = RECIPE.with_name("shapes-tpgrpo-pickscore.toml")  # the README's main job
SMOKE = ["rollout.prompts_per_round=4", "rollout.group_size=4", "rollout.prompts_per_shard=2", "rollout.batch_size=16",
         "eval_every=1", "eval.images_per_prompt=1", "eval.steps=8"]


def test_one_round_of_the_main_job(tmp_path):
    """The learned reward through the PickScore code path: continuous rewards, so step rewards are seldom
    tied and turning points fire; the verdict is on the learned reward, with GenEval accuracy beside it."""
    from tpkit import run

    recipe = load_recipe(MAIN_JOB, SMOKE, rounds=1, out=str(tmp_path / "run"))
    assert recipe.score.rewards == {"pickscore": 1.0} and recipe.score.reward_options["pickscore"]["model"] == "tiny-shapes-pickscore"
    readme = (MAIN_JOB.parents[1] / "README.md").read_text()
    assert readme.index(f"tpkit run pipelines/{MAIN_JOB.name}") < readme.index("python -m pytest -q")  # the first command
    as_shipped = load_recipe(MAIN_JOB)
    assert as_shipped.eval.steps == as_shipped.rollout.steps  # evaluated with the sampler the policy is trained on
    line = run.run(recipe)[0]
    scores = layout.read_parquet_tables(tmp_path / "run" / "round-0000" / "score", "score")
    rewards = np.asarray(scores["reward"].to_pylist())
    assert np.isfinite(rewards).all() and rewards.std() > 0.1  # logit_scale.exp() * cos: a wide, continuous scale
    assert len(np.unique(rewards)) > 0.9 * len(rewards)  # continuous: hardly any two branches score the same
    zero = line["zero_step_rewards_per_step"]
    assert len(zero) == recipe.rollout.window_size and max(zero[:-1]) < 0.25  # GenEval's dense score: ~0.5 at step 1
    assert line["turning_point_rate"] > 0
    change = evaluate.heldout_change(tmp_path / "run", [line])
    assert change["metric"] == "reward" and change["geneval"]["metric"] == "geneval_overall"
    assert np.isfinite(change["delta"]) and 0 < change["delta_se"] < 2
    assert line["eval"]["reward"] == pytest.approx(line["eval"]["reward_pickscore"])
    # report.png's held-out bars are the verdict's paired interval, not each evaluation's own (far wider)
    held_out = [(0, evaluate.base_eval(tmp_path / "run")), (1, line["eval"])]
    widths, what = report._heldout_half_widths(tmp_path / "run", held_out, "reward")
    assert widths == [0.0, pytest.approx(1.96 * change["delta_se"])] and "paired" in what
    assert widths[1] < 1.96 * line["eval"]["reward_se"]


def test_one_round_of_the_geneval_recipe(tmp_path):
    from tpkit import run

    recipe = load_recipe(RECIPE, SMOKE, rounds=1, out=str(tmp_path / "run"))
    assert recipe.rollout.model == "tiny-shapes" and recipe.eval.kind == "geneval"
    lines = run.run(recipe)
    assert len(lines) == 1
    line = lines[0]
    # real, varied rewards from the detector (Flow-GRPO's dense GenEval score: at most 1, negative when
    # far more objects are found than asked for): the model draws shapes, not noise
    scores = layout.read_parquet_tables(tmp_path / "run" / "round-0000" / "score", "score")
    rewards = np.asarray(scores["reward"].to_pylist())
    assert np.isfinite(rewards).all() and rewards.max() <= 1
    assert rewards.max() > 0 and rewards.std() > 0
    # R_K per GenEval task (the round's mix of tasks varies): recomputed from the scores and the prompt file
    tags = {p.prompt_id: p.metadata["tag"] for p in layout.load_prompts(Path(recipe.rollout.prompts))}
    last = max(scores["branch"].to_pylist())
    by_task: dict = {}
    for pid, b, r in zip(scores["prompt_id"].to_pylist(), scores["branch"].to_pylist(), rewards):
        if b == last:
            by_task.setdefault(tags[pid], []).append(r)
    assert line["reward_by_task"] == pytest.approx({t: np.mean(v) for t, v in by_task.items()}, abs=1e-3)
    assert sum(len(v) for v in by_task.values()) == line["n"]
    # the run evaluated the base model once, then the round's adapter, on the held-out prompts
    base = evaluate.base_eval(tmp_path / "run")
    assert base is not None and 0 <= base["geneval_overall"] <= 1
    assert 0 < base["geneval_overall_se"] < 0.2  # over 96 prompts: report.png's error bars
    assert line["eval"] is not None and 0 <= line["eval"]["geneval_overall"] <= 1
    # and the run's verdict pairs the two evaluations over the same prompts
    change = evaluate.heldout_change(tmp_path / "run", lines)
    assert change["round"] == 1 and change["metric"] == "geneval_overall"
    assert change["base"] == base["geneval_overall"] and change["last"] == line["eval"]["geneval_overall"]
    assert abs(change["delta"] - (change["last"] - change["base"])) < 1e-12
    # report.png's images: the same held-out prompts and seeds before and after, with GenEval's verdicts
    from tpkit import report

    before, after = report.eval_cells(tmp_path / "run" / layout.BASE_EVAL), report.eval_cells(layout.eval_dir(tmp_path / "run", 0))
    assert len(before) == len(after) == report.GRID_IMAGES and [c[1] for c in before] == [c[1] for c in after]
    rows = sorted((r for r in layout.read_jsonl(tmp_path / "run" / layout.BASE_EVAL / "results.jsonl") if r["sample"] == 0),
                  key=lambda r: r["index"])
    picked = [rows[i * len(rows) // report.GRID_IMAGES] for i in range(report.GRID_IMAGES)]  # evenly over the file
    assert [(c[1], c[2]) for c in before] == [(r["prompt"], r["correct"]) for r in picked]
    assert len({r["tag"] for r in picked}) == 6  # every GenEval task shows
    assert report.image_rows([before, after]).shape[:2] == (2 * (128 + 3 * 12 + 4), report.GRID_IMAGES * 128)
    train = json.loads((tmp_path / "run" / "round-0000" / "train" / layout.MANIFEST).read_text())
    assert train["counts"]["optimizer_steps"] >= 1
    from PIL import Image

    # GenEval-style prompts: report.png has the per-task row (train reward, held-out accuracy per task)
    assert Image.open(tmp_path / "run" / "report.png").size == (12 * 90, round((11 + 3.2) * 90))


def _eval_folder(folder: Path, correct: list[int]) -> None:
    """A finished GenEval evaluation of one prompt per entry of `correct` (one image each, task colors)."""
    folder.mkdir(parents=True)
    rows = [{"index": i, "sample": 0, "tag": "colors", "correct": bool(c)} for i, c in enumerate(correct)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    layout.atomic_write_json(folder / layout.MANIFEST, {"stage": "eval-geneval", "summary": {}})


def test_heldout_verdict_by_hand(tmp_path):
    from tpkit.show import heldout_verdict

    # base right on prompt 0 only, the round on prompts 0-2: paired differences 0, 1, 1, 0
    _eval_folder(tmp_path / layout.BASE_EVAL, [1, 0, 0, 0])
    _eval_folder(layout.eval_dir(tmp_path, 2), [1, 1, 1, 0])
    lines = [{"round": r, "eval": {"geneval_overall": 0.75} if r == 3 else None} for r in (1, 2, 3)]
    c = evaluate.heldout_change(tmp_path, lines)
    se = np.std([0, 1, 1, 0], ddof=1) / 2  # sqrt(1/3) / 2 = 0.289: the 95 % half-width 0.566 exceeds +0.5
    assert c["round"] == 3 and c["base"] == 0.25 and c["last"] == 0.75 and c["delta"] == 0.5
    assert abs(c["delta_se"] - se) < 1e-12
    assert "+0.500 ± 0.566" in heldout_verdict(c) and "not distinguishable" in heldout_verdict(c)
    assert "after 3 rounds" in heldout_verdict(c)
    # all four prompts fixed: a clear gain; all four broken: worse than the base model
    assert "noise" not in heldout_verdict(dict(c, delta=1.0, delta_se=0.0))
    assert "worse than the base" in heldout_verdict(dict(c, delta=-1.0, delta_se=0.0))
    assert evaluate.heldout_change(tmp_path, lines[:2]) is None  # no evaluated round yet


def test_a_learned_reward_beside_geneval_says_when_they_disagree(tmp_path):
    """An evaluation with a reward measured beside GenEval: the headline is the reward (what the run optimises),
    GenEval's change is given beside it, and a reward that rose while accuracy fell is called reward hacking."""
    from tpkit.show import heldout_verdict

    def folder(path: Path, reward: list[float], correct: list[int]) -> None:
        path.mkdir(parents=True)
        rows = [{"index": i, "sample": 0, "tag": "colors", "correct": bool(c), "reward": r, "reward_pickscore": r}
                for i, (r, c) in enumerate(zip(reward, correct))]
        (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        layout.atomic_write_json(path / layout.MANIFEST, {"stage": "eval-geneval", "summary": {
            "overall": float(np.mean(correct)), "tasks": {"colors": {"accuracy": float(np.mean(correct))}},
            "reward_overall": {"reward": {"mean": float(np.mean(reward))}}}})

    folder(tmp_path / layout.BASE_EVAL, [1.0, 2.0, 3.0, 4.0], [1, 1, 1, 1])
    folder(layout.eval_dir(tmp_path, 0), [2.0, 3.1, 3.9, 5.0], [0, 0, 0, 0])  # +1 +-0.1 reward, every image now wrong
    summary = evaluate.summary(layout.eval_dir(tmp_path, 0))
    assert evaluate.eval_key(summary) == "reward" and summary["geneval_overall"] == 0.0
    c = evaluate.heldout_change(tmp_path, [{"round": 1, "eval": summary}])
    assert c["metric"] == "reward" and abs(c["delta"] - 1.0) < 1e-12
    assert c["geneval"]["metric"] == "geneval_overall" and c["geneval"]["delta"] == -1.0
    verdict = heldout_verdict(c)
    assert "held-out reward" in verdict and "reward hacking" in verdict and "held-out geneval_overall" in verdict
    assert "reward hacking" not in heldout_verdict(dict(c, geneval=dict(c["geneval"], delta=0.5, delta_se=0.0)))


def test_task_rows_by_hand():
    from tpkit.show import task_rows

    lines = [{"round": 1, "reward_by_task": {"colors": 0.5, "counting": 0.25}, "eval": None},
             {"round": 2, "reward_by_task": {"colors": 0.75}, "eval": {"geneval_overall": 0.5, "geneval_overall_se": 0.1,
                                                                       "geneval_colors": 0.9, "geneval_position": 0.1}}]
    base = {"geneval_overall": 0.4, "geneval_colors": 0.8, "geneval_position": 0.0}
    assert task_rows(lines, base) == [("colors", 0.5, 0.75, 0.8, 0.9), ("counting", 0.25, None, None, None),
                                      ("position", None, None, 0.0, 0.1)]
    assert task_rows([{"round": 1, "reward_by_task": None, "eval": {"pickscore": 0.2}}], None) == []  # no GenEval task
