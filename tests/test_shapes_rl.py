"""End-to-end RL smoke on the pretrained `tiny-shapes`: the main job's recipe, shrunk to one round.

Rollout (CPS window), score with the dense GenEval reward of the weight-free shapes detector,
turning-point advantages, a LoRA update, and the held-out GenEval evaluation of the adapter: the
same code path as `tpkit run pipelines/shapes-tpgrpo.toml`, on a few prompts, in well under a minute.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tpkit import layout
from tpkit.config import load_recipe

RECIPE = Path(__file__).resolve().parents[1] / "pipelines" / "shapes-tpgrpo.toml"
SMOKE = ["rollout.prompts_per_round=4", "rollout.group_size=4", "rollout.prompts_per_shard=2", "rollout.batch_size=16",
         "eval_every=1", "eval.images_per_prompt=1", "eval.steps=8"]


def test_one_round_of_the_main_job(tmp_path):
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
    # the run evaluated the base model once, then the round's adapter, on the held-out prompts
    base = run.base_eval(tmp_path / "run")
    assert base is not None and 0 <= base["geneval_overall"] <= 1
    assert line["eval"] is not None and 0 <= line["eval"]["geneval_overall"] <= 1
    train = json.loads((tmp_path / "run" / "round-0000" / "train" / layout.MANIFEST).read_text())
    assert train["counts"]["optimizer_steps"] >= 1
    assert (tmp_path / "run" / "report.png").is_file()
