"""`tpkit trajectory`: one trajectory's branch images recomputed with the score stage's code, checked
against the stored R_k, drawn with its step rewards, turning points and advantages."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
from conftest import cli
from PIL import Image

from tpkit import layout, trajectory
from tpkit.rewards.registry import BUILTIN


def test_the_images_shown_are_what_was_scored(tiny_run, tmp_path):
    r = trajectory.run(tiny_run / "rollout", tiny_run / "score", tiny_run / "advantages", None, tmp_path / "t.png")
    # the default: the trajectory with the most turning points
    adv = layout.read_parquet_tables(tiny_run / "advantages", "advantages").to_pylist()
    most = max(Counter(a["trajectory_id"] for a in adv if a["turning_point"]).values())
    assert sum(s["turning_point"] for s in r["steps"]) == most
    # R_0..R_K recomputed = stored, and each is the reward of the image drawn for it
    K = len(r["recomputed"]) - 1
    stored = [r["stored"][k] for k in range(K + 1)]
    assert r["max_difference"] <= trajectory.STORED_TOLERANCE
    assert np.allclose(r["recomputed"], stored, atol=trajectory.STORED_TOLERANCE)
    jpeg = BUILTIN["jpeg-compressibility"][0]({})
    shown = jpeg([Image.fromarray(im) for im in r["images"]], [""] * (K + 1), [{}] * (K + 1))
    assert np.allclose(shown, stored, atol=trajectory.STORED_TOLERANCE)
    # steps 1..K with d_k = R_k - R_(k-1)
    assert [s["step"] for s in r["steps"]] == list(range(1, K + 1))
    assert all(abs(s["step_reward"] - (stored[s["step"]] - stored[s["step"] - 1])) < 1e-9 for s in r["steps"])
    assert Image.open(io.BytesIO((tmp_path / "t.png").read_bytes())).size[0] > 500


def test_cli(tiny_run, tmp_path, capsys):
    assert cli("trajectory", tiny_run, "--id", "p00001-m003", "--out", tmp_path / "one.png") == 0
    text = capsys.readouterr()
    assert "trajectory p00001-m003" in text.out and "the images are what was scored" in text.err + text.out
    assert (tmp_path / "one.png").read_bytes().startswith(b"\x89PNG")
    # an id the scores do not hold; no folder at all: one-line errors naming the fix, nothing written
    assert cli("trajectory", tiny_run, "--id", "p09999-m000", "--out", tmp_path / "none.png") != 0
    assert "no trajectory 'p09999-m000'" in capsys.readouterr().err
    assert cli("trajectory", "--out", tmp_path / "none.png") != 0
    assert "pass a round folder" in capsys.readouterr().err
    assert cli("trajectory", tiny_run / "rollout", "--out", tmp_path / "none.png") != 0  # a stage folder, not a round
    assert "is not a round folder" in capsys.readouterr().err
    assert not (tmp_path / "none.png").exists()
    # --out a folder, or a file already there: refused before any work; --overwrite replaces the file
    assert cli("trajectory", tiny_run, "--out", tmp_path) != 0
    assert "is a folder" in capsys.readouterr().err
    before = (tmp_path / "one.png").read_bytes()
    assert cli("trajectory", tiny_run, "--id", "p00000-m000", "--out", tmp_path / "one.png") != 0
    assert "already exists" in capsys.readouterr().err and (tmp_path / "one.png").read_bytes() == before
    assert cli("trajectory", tiny_run, "--id", "p00000-m000", "--out", tmp_path / "one.png", "--overwrite") == 0
    assert (tmp_path / "one.png").read_bytes() != before


def test_flow_grpo_scores_hold_r_k_only(tiny_run, tmp_path, capsys):
    """Scores of R_K alone (Flow-GRPO): the other R_k are computed and shown, marked as unchecked."""
    from tpkit import score
    from tpkit.config import ScoreConfig

    score.run(ScoreConfig(rollout=str(tiny_run / "rollout"), out=str(tmp_path / "final"), branches="final"))
    r = trajectory.run(tiny_run / "rollout", tmp_path / "final", None, "p00000-m000", tmp_path / "f.png")
    K = len(r["recomputed"]) - 1
    assert list(r["stored"]) == [K] and r["max_difference"] <= trajectory.STORED_TOLERANCE
    full = {x["branch"]: x["reward"] for x in layout.read_parquet_tables(tiny_run / "score", "score").to_pylist()
            if x["trajectory_id"] == "p00000-m000"}
    assert np.allclose(r["recomputed"], [full[k] for k in range(K + 1)], atol=trajectory.STORED_TOLERANCE)
    assert cli("trajectory", "--rollout", tiny_run / "rollout", "--scores", tmp_path / "final", "--id", "p00000-m000",
               "--out", tmp_path / "g.png") == 0
    assert "computed now" in capsys.readouterr().out
