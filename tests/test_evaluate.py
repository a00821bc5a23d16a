"""`tpkit eval reward` end to end on tiny-sd3: layout, summary, resume, ranks, --images."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from conftest import DATA, OFFICIAL_GENEVAL
from tpkit import evaluate
from tpkit.config import EvalConfig
from tpkit.errors import ConfigError
from tpkit.rewards.registry import load_rewards, score_images

STEPS = 6  # a short ODE keeps the tests quick; the default is 40
BATCH = 2  # one prompt (2 images) per generation batch, so that 2 ranks both get work


def _cfg(tmp_path, prompts, name, **kw) -> EvalConfig:
    base = dict(kind="reward", prompts=str(prompts), out=str(tmp_path / name), rewards={"brightness": 1.0},
                images_per_prompt=2, steps=STEPS, batch_size=BATCH)
    return EvalConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def one_eval(tmp_path_factory, two_prompts):
    tmp = tmp_path_factory.mktemp("eval")
    manifest = evaluate.run(_cfg(tmp, two_prompts, "single", rewards={"brightness": 1.0, "jpeg-compressibility": 0.5}))
    return tmp, manifest


def test_layout_results_and_summary(one_eval):
    tmp, manifest = one_eval
    out = tmp / "single"
    # the protocol's model work (a CFG pair counts once) and seconds per phase of this one process
    assert manifest["counts"] == {"prompts": 2, "images": 4, "transformer_calls": 4 * STEPS, "decodes": 4,
                                  "reward_calls": 4}
    assert set(manifest["seconds"]) == {"load", "encode", "sample", "decode", "write", "read", "reward"}
    assert manifest["seconds"]["sample"] > 0 and all(v >= 0 for v in manifest["seconds"].values())
    assert manifest["seconds"] == json.loads((out / "seconds-r000.json").read_text())
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert (out / "images" / f"{r['index']:05d}" / "samples" / f"{r['sample']:04d}.png").is_file()
        assert r["reward"] == pytest.approx(r["reward_brightness"] + 0.5 * r["reward_jpeg_compressibility"])
        assert isinstance(r["seed"], int)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overall"]["reward"]["mean"] == pytest.approx(np.mean([r["reward"] for r in rows]))
    assert summary["per_prompt"]["p00000"]["n"] == 2
    assert (out / "grid.png").is_file()
    meta = json.loads((out / "images" / "00000" / "metadata.jsonl").read_text())
    assert meta["prompt"] == rows[0]["prompt"]


def test_scores_equal_direct_reward_on_the_images(one_eval):
    tmp, _ = one_eval
    out = tmp / "single"
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    images = [Image.open(r["image"]).convert("RGB") for r in rows]
    direct = score_images(load_rewards({"brightness": 1.0}), images, [r["prompt"] for r in rows], [{}] * len(rows))
    assert direct["reward_brightness"] == pytest.approx([r["reward_brightness"] for r in rows])


def test_two_ranks_give_the_same_results_as_one(one_eval, two_prompts):
    tmp, _ = one_eval
    cfg = dict(rewards={"brightness": 1.0, "jpeg-compressibility": 0.5})
    assert evaluate.run(_cfg(tmp, two_prompts, "ranks", rank=0, world_size=2, **cfg)) is None  # rank 1 still missing
    manifest = evaluate.run(_cfg(tmp, two_prompts, "ranks", rank=1, world_size=2, **cfg))
    assert manifest is not None
    # seconds: both ranks' own files, added up (compute time); counts: the same work as one process
    per_rank = [json.loads((tmp / "ranks" / f"seconds-r00{r}.json").read_text()) for r in (0, 1)]
    assert manifest["seconds"] == {k: pytest.approx(per_rank[0][k] + per_rank[1][k], abs=2e-3) for k in per_rank[0]}
    assert manifest["counts"] == json.loads((tmp / "single" / "manifest.json").read_text())["counts"]
    a = [json.loads(x) for x in (tmp / "single" / "results.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp / "ranks" / "results.jsonl").read_text().splitlines()]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "image"} for r in rows]  # noqa: E731
    assert strip(a) == strip(b)


def test_prompt_batches_do_not_depend_on_ranks_or_resume():
    cfg = EvalConfig(kind="reward", images_per_prompt=3, batch_size=8)
    assert evaluate.prompt_batches(5, cfg) == [[0, 1], [2, 3], [4]]
    assert evaluate.prompt_batches(2, EvalConfig(kind="reward", images_per_prompt=9, batch_size=4)) == [[0], [1]]


def test_interrupted_run_resumes_to_identical_images(one_eval, two_prompts, monkeypatch):
    """A killed run leaves a prompt with some images and no results.json; the rerun recomputes
    them in the same transformer batch as the uninterrupted run: same bytes, same rewards."""
    from tpkit.models import sd3

    tmp, _ = one_eval
    sizes = []
    velocity = sd3.SD3.velocity
    monkeypatch.setattr(sd3.SD3, "velocity", lambda self, x, *a, **kw: sizes.append(len(x)) or velocity(self, x, *a, **kw))
    cfg = dict(rewards={"brightness": 1.0, "jpeg-compressibility": 0.5}, batch_size=4)
    evaluate.run(_cfg(tmp, two_prompts, "whole", **cfg))
    evaluate.run(_cfg(tmp, two_prompts, "killed", **cfg))
    killed = tmp / "killed"
    for f in (killed / "manifest.json", killed / "results.jsonl", killed / "images" / "00001" / "results.json",
              killed / "images" / "00001" / "samples" / "0001.png"):
        f.unlink()
    sizes.clear()
    evaluate.run(_cfg(tmp, two_prompts, "killed", **cfg))
    assert sizes == [4] * STEPS  # the whole batch again, not the one missing image alone
    for png in sorted((tmp / "whole" / "images").rglob("*.png")):
        assert png.read_bytes() == (killed / png.relative_to(tmp / "whole")).read_bytes()
    rows = lambda d: [{k: v for k, v in json.loads(x).items() if k != "image"}  # noqa: E731
                      for x in (d / "results.jsonl").read_text().splitlines()]
    assert rows(tmp / "whole") == rows(killed)


def test_rerun_resumes_without_redoing(one_eval, two_prompts):
    tmp, _ = one_eval
    out = tmp / "single"
    marker = out / "images" / "00001" / "results.json"
    before = {p: p.stat().st_mtime_ns for p in (out / "images").rglob("*") if p.is_file()}
    (out / "manifest.json").unlink()
    evaluate.run(_cfg(tmp, two_prompts, "single", rewards={"brightness": 1.0, "jpeg-compressibility": 0.5}))
    after = {p: p.stat().st_mtime_ns for p in (out / "images").rglob("*") if p.is_file()}
    assert before == after and marker.is_file() and (out / "manifest.json").is_file()


def test_scoring_an_existing_image_folder(one_eval):
    tmp, _ = one_eval
    m = evaluate.run(EvalConfig(kind="reward", images=str(tmp / "single" / "images"), out=str(tmp / "rescored"),
                                rewards={"brightness": 1.0}))
    a = [json.loads(x) for x in (tmp / "single" / "results.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp / "rescored" / "results.jsonl").read_text().splitlines()]
    assert [r["reward_brightness"] for r in a] == [r["reward_brightness"] for r in b]
    assert all(r["seed"] is None for r in b) and m["counts"]["images"] == 4
    assert (m["counts"]["transformer_calls"], m["counts"]["decodes"], m["counts"]["reward_calls"]) == (0, 0, 4)
    assert set(m["seconds"]) == {"read", "reward"}


def test_bad_inputs(tmp_path, two_prompts):
    with pytest.raises(ConfigError, match="reward"):
        evaluate.run(EvalConfig(kind="reward", prompts=str(two_prompts), out=str(tmp_path / "x")))
    with pytest.raises(ConfigError, match="images_per_prompt"):
        evaluate.run(_cfg(tmp_path, two_prompts, "y", images_per_prompt=0))


# --------------------------------------------------------------------------------------------
# tpkit eval geneval with tiny random detector and CLIP models given by local path
# --------------------------------------------------------------------------------------------

def _one_per_tag(lines: list[str]) -> list[str]:
    seen, out = set(), []
    for line in lines:
        tag = json.loads(line)["tag"]
        if tag not in seen:
            seen.add(tag)
            out.append(line)
    return out


@pytest.fixture(scope="module")
def geneval_models(tmp_path_factory):
    from test_geneval import _tiny_clip, _tiny_mask2former

    root = tmp_path_factory.mktemp("geneval-models")
    return {"detector": str(_tiny_mask2former(root / "m2f")), "clip": str(_tiny_clip(root / "clip"))}


@pytest.mark.parametrize("source", ["tpkit", "official"])
def test_eval_geneval_end_to_end(tmp_path, geneval_models, source):
    path = OFFICIAL_GENEVAL
    if source == "official" and not path.is_file():
        pytest.skip(f"GenEval's official metadata is not at {path} (set GENEVAL_METADATA)")
    src = path if source == "official" else DATA / "geneval-style.jsonl"
    meta = tmp_path / "meta.jsonl"
    meta.write_text("".join(_one_per_tag(src.read_text().splitlines(keepends=True))))
    m = evaluate.run(EvalConfig(kind="geneval", prompts=str(meta), out=str(tmp_path / "out"), images_per_prompt=1,
                                steps=STEPS, reward_options={"geneval": geneval_models}))
    rows = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(isinstance(r["correct"], bool) and 0 <= r["strict"] <= 1 for r in rows)
    summary = m["summary"]
    assert set(summary["tasks"]) == set(evaluate.GENEVAL_TASKS)
    assert summary["overall"] == pytest.approx(np.mean([v["accuracy"] for v in summary["tasks"].values()]))
    assert all((tmp_path / "out" / f"grid-{t}.png").is_file() for t in evaluate.GENEVAL_TASKS)


def test_eval_geneval_rejects_prompts_without_geneval_metadata(tmp_path, two_prompts, geneval_models):
    from tpkit.errors import InputError

    with pytest.raises(InputError, match="GenEval"):
        evaluate.run(EvalConfig(kind="geneval", prompts=str(two_prompts), out=str(tmp_path / "o"),
                                reward_options={"geneval": geneval_models}))


def test_geneval_defaults_to_genevals_own_prompts(tmp_path):
    """Without --metadata, `tpkit eval geneval` evaluates GenEval's 553 prompts (regenerated, so an
    installed tpkit needs no data file)."""
    from tpkit.geneval.prompts import official_like_test_set

    prompts, folders = evaluate._load_prompts(EvalConfig(kind="geneval", out=str(tmp_path / "g")).validate())
    official = official_like_test_set()
    assert len(prompts) == len(folders) == 553
    assert [p.prompt for p in prompts] == [o["prompt"] for o in official]
    assert prompts[0].metadata["tag"] == "single_object" and prompts[0].prompt_id == "p00000"
