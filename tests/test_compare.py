"""`tpkit eval compare`: the base tiny-sd3 against a trained adapter, two rewards and GenEval (shapes
detector) on the same prompts and seeds; the table against each entry's own evaluation; resume; two
ranks equal one; bad entries refused."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def adapter(tiny_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "train"
    assert cli("train", "--rollout", tiny_run / "rollout", "--advantages", tiny_run / "advantages", "--out", out,
               "--lora-rank", "4", "--learning-rate", "0.05", "--optimizer-steps", "2") == 0
    return out / "adapter"


@pytest.fixture(scope="module")
def metadata(tmp_path_factory) -> Path:
    rows = [json.loads(x) for x in (ROOT / "data" / "shapes-test.jsonl").read_text().splitlines()]
    picked = [next(r for r in rows if r["tag"] == t) for t in ("single_object", "colors", "two_object")]
    path = tmp_path_factory.mktemp("meta") / "meta.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in picked))
    return path


def args(out, adapter, metadata, *extra):
    return ["eval", "compare", "--entry", "base=tiny-sd3", "--entry", f"trained=tiny-sd3+{adapter}",
            "--prompts", metadata, "--reward", "brightness", "--reward", "jpeg-compressibility", "--geneval",
            "--detector", "shapes", "--images-per-prompt", "2", "--steps", "4", "--batch-size", "4", "--out", out, *extra]


@pytest.fixture(scope="module")
def compared(adapter, metadata, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cmp") / "out"
    assert cli(*args(out, adapter, metadata)) == 0
    return out


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_table_holds_every_entry_and_metric(compared):
    table = json.loads((compared / "compare.json").read_text())
    assert table["entries"] == ["base", "trained"] and table["base"] == "base"
    assert table["metrics"][:2] == ["reward_brightness", "reward_jpeg_compressibility"]
    assert "geneval_overall" in table["metrics"] and "geneval_single_object" in table["metrics"]
    rows = list(csv.DictReader(io.StringIO((compared / "compare.csv").read_text())))
    assert len(rows) == 2 * len(table["metrics"])
    md = (compared / "compare.md").read_text()
    assert "| base | tiny-sd3 |" in md and "| trained | tiny-sd3 + " in md and "Difference from `base`" in md


def test_cells_agree_with_each_entrys_own_evaluation(compared):
    table = json.loads((compared / "compare.json").read_text())
    for name in ("base", "trained"):
        summary = json.loads((compared / "entries" / name / "summary.json").read_text())
        cell = table["cells"][name]["reward_brightness"]
        assert cell["mean"] == pytest.approx(summary["overall"]["reward_brightness"]["mean"])
        results = jsonl(compared / "entries" / name / "results.jsonl")
        per_prompt = [np.mean([r["reward_brightness"] for r in results if r["index"] == i]) for i in range(3)]
        assert cell["n"] == 3 and cell["se"] == pytest.approx(np.std(per_prompt, ddof=1) / np.sqrt(3))
        geneval = json.loads((compared / "geneval" / name / "summary.json").read_text())
        assert table["cells"][name]["geneval_overall"]["mean"] == pytest.approx(geneval["overall"])


def test_entries_share_prompts_and_seeds_and_differ(compared):
    base = jsonl(compared / "entries" / "base" / "results.jsonl")
    trained = jsonl(compared / "entries" / "trained" / "results.jsonl")
    assert [(r["prompt"], r["seed"]) for r in base] == [(r["prompt"], r["seed"]) for r in trained]
    assert [r["reward_brightness"] for r in base] != [r["reward_brightness"] for r in trained]
    table = json.loads((compared / "compare.json").read_text())
    delta = table["cells"]["trained"]["reward_brightness"]["delta"]
    assert delta == pytest.approx(np.mean([t["reward_brightness"] - b["reward_brightness"] for b, t in zip(base, trained)]))
    assert "delta" not in table["cells"]["base"]["reward_brightness"]


def test_grid_shows_each_prompt_across_entries(compared):
    grid = Image.open(compared / "grid.png")
    assert grid.size == (220 + 2 * 128, 18 + 3 * 128)


def test_rerun_resumes_without_generating_again(compared, adapter, metadata):
    images = sorted((compared / "entries").rglob("samples/*.png"))
    before = {p: p.stat().st_mtime_ns for p in images}
    table = (compared / "compare.json").read_text()
    assert cli(*args(compared, adapter, metadata)) == 0
    assert {p: p.stat().st_mtime_ns for p in images} == before
    assert (compared / "compare.json").read_text() == table


def test_two_ranks_write_the_same_table_as_one(compared, adapter, metadata, tmp_path):
    out = tmp_path / "two"
    env = dict(os.environ, WORLD_SIZE="2", TPKIT_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "tpkit", *map(str, args(out, adapter, metadata))],
                              env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-2000:]
    one, two = (json.loads((d / "compare.json").read_text()) for d in (compared, out))
    for name in one["entries"]:
        for m in one["metrics"]:
            assert two["cells"][name][m]["mean"] == pytest.approx(one["cells"][name][m]["mean"], abs=1e-6)


@pytest.mark.parametrize("entries, message", [
    (["base"], "is not NAME=MODEL"),
    (["a=tiny-sd3", "a=tiny-sd3"], "each with its own name"),
    (["a b=tiny-sd3"], "is not NAME=MODEL"),
    (["a=tiny-sd3+"], "is not NAME=MODEL"),
])
def test_bad_entries_are_refused(entries, message, tmp_path, capsys, two_prompts):
    argv = ["eval", "compare", "--prompts", two_prompts, "--reward", "brightness", "--out", tmp_path / "x"]
    for e in entries:
        argv += ["--entry", e]
    assert cli(*argv) != 0
    assert message in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_nothing_to_measure_is_refused(tmp_path, capsys, two_prompts):
    assert cli("eval", "compare", "--entry", "a=tiny-sd3", "--prompts", two_prompts, "--out", tmp_path / "x") != 0
    assert "nothing to measure" in capsys.readouterr().err


def test_rerun_with_other_options_is_refused_then_redone_with_overwrite(compared, adapter, metadata, capsys):
    changed = [a if a != "jpeg-compressibility" else "brightness" for a in args(compared, adapter, metadata)]
    changed = changed[:changed.index("--reward") + 2] + changed[changed.index("--reward") + 4:]  # brightness only
    table = (compared / "compare.json").read_text()
    assert cli(*changed) != 0
    assert "--overwrite" in capsys.readouterr().err
    assert (compared / "compare.json").read_text() == table  # nothing written over
    assert cli(*changed, "--overwrite") == 0
    assert json.loads((compared / "compare.json").read_text())["metrics"][0] == "reward_brightness"
    assert "reward_jpeg_compressibility" not in json.loads((compared / "compare.json").read_text())["metrics"]
    assert cli(*args(compared, adapter, metadata), "--overwrite") == 0  # as the other tests found it


def test_a_file_as_out_is_refused(tmp_path, capsys, two_prompts):
    (tmp_path / "f").write_text("x")
    assert cli("eval", "compare", "--entry", "a=tiny-sd3", "--prompts", two_prompts, "--reward", "brightness",
               "--out", tmp_path / "f") != 0
    assert "is a file, not a folder" in capsys.readouterr().err
