"""The advantages stage against an independent reference of docs/design.md section 2.

`reference()` below is a deliberately plain re-implementation (Python loops, no numpy, nothing
from tpkit.formulas); every output row of `tpkit.advantages.run` is compared against it, on
hand-made tables and on hypothesis-generated ones.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpkit import advantages
from tpkit.config import AdvantagesConfig
from tpkit.errors import ConfigError, InputError

EPS = 1e-4
TOL = 1e-9

# --------------------------------------------------------------------------------------------
# The reference (docs/design.md section 2, written out longhand)
# --------------------------------------------------------------------------------------------


def sign(x: float) -> int:
    return (x > 0) - (x < 0)  # sign(0) = 0


def reference(rows, method="tp-grpo", balance="all", std="group"):
    """rows: iterable of (trajectory_id, prompt_id, branch, reward). Returns {(tid, step): dict}."""
    R, prompt = {}, {}
    for tid, pid, k, r in rows:
        R.setdefault(tid, {})[k] = r
        prompt[tid] = pid
    K = max(k for per in R.values() for k in per)

    out = {}
    candidates = []  # (tid, k, agg)
    for tid, per in R.items():
        complete = all(k in per for k in range(K + 1))
        for k in range(1, K + 1):
            row = {"prompt_id": prompt[tid], "final_reward": per[K],
                   "reward_before": per.get(k - 1), "reward_after": per.get(k)}
            if complete:
                d = per[k] - per[k - 1]
                agg = per[K] - per[k - 1]
                delta = per[K] - per[0]
                if k == K:
                    cand = False  # the last step is never one
                elif k == 1:
                    cand = sign(d) * sign(per[K] - per[1]) > 0
                else:
                    d_prev = per[k - 1] - per[k - 2]
                    cand = (sign(d_prev) * sign(delta) < 0 and sign(d) * sign(delta) > 0
                            and sign(d) * sign(per[K] - per[k]) > 0)
            else:
                d = agg = None
                cand = False
            row.update(step_reward=d, aggregated_reward=agg, turning_point_candidate=cand)
            out[(tid, k)] = row
            if cand:
                candidates.append((tid, k, agg))

    # balancing over every turning point of the input
    kept = {(tid, k) for tid, k, _ in candidates}
    if method == "tp-grpo" and balance == "all":
        pos = [c for c in candidates if c[2] > 0]
        neg = [c for c in candidates if c[2] < 0]
        if pos and neg:
            n = min(len(pos), len(neg))
            kept = set()
            for side in (pos, neg):
                side = sorted(side, key=lambda c: (-abs(c[2]), c[0], c[1]))
                kept |= {(tid, k) for tid, k, _ in side[:n]}

    for (tid, k), row in out.items():
        if method == "flow-grpo":
            row["turning_point"] = False
            row["shaped_reward"] = row["final_reward"]
        else:
            row["turning_point"] = (tid, k) in kept
            row["shaped_reward"] = row["aggregated_reward"] if row["turning_point"] else row["step_reward"]
        row["method"] = method

    # advantages: per prompt and per step
    for k in range(1, K + 1):
        all_r = [out[(tid, k)]["shaped_reward"] for tid in R]
        g_mean = sum(all_r) / len(all_r)
        g_std = math.sqrt(sum((x - g_mean) ** 2 for x in all_r) / len(all_r))
        for p in set(prompt.values()):
            tids = [t for t in R if prompt[t] == p]
            vals = [out[(t, k)]["shaped_reward"] for t in tids]
            m = sum(vals) / len(vals)
            s = math.sqrt(sum((x - m) ** 2 for x in vals) / len(vals)) if std == "group" else g_std
            for t in tids:
                out[(t, k)]["advantage"] = (out[(t, k)]["shaped_reward"] - m) / (s + EPS)
    return out


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def score_table(rows, extra: dict | None = None, branch_type=pa.int64()) -> pa.Table:
    cols = {
        "trajectory_id": pa.array([r[0] for r in rows], pa.string()),
        "prompt_id": pa.array([r[1] for r in rows], pa.string()),
        "branch": pa.array([r[2] for r in rows], branch_type),
        "reward": pa.array([r[3] for r in rows], pa.float64()),
    }
    cols.update(extra or {})
    return pa.table(cols)


def write(path: Path, table: pa.Table) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def run_stage(scores: Path, out: Path, **kw) -> pa.Table:
    manifest = advantages.run(AdvantagesConfig(scores=str(scores), out=str(out), **kw))
    assert (out / "manifest.json").is_file()
    assert json.loads((out / "manifest.json").read_text())["stage"] == "advantages"
    table = pq.read_table(out / "advantages.parquet")
    assert manifest["counts"]["rows"] == table.num_rows
    return table


def trajectories(spec: dict) -> list:
    """{prompt: {tid: [R_0, ..., R_K]}} -> rows."""
    return [(tid, p, k, float(r)) for p, group in spec.items() for tid, Rs in group.items() for k, r in enumerate(Rs)]


def close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=TOL, abs_tol=TOL)


def compare(table: pa.Table, ref: dict, method: str):
    got = table.to_pylist()
    keys = [(r["trajectory_id"], r["step"]) for r in got]
    assert len(keys) == len(set(keys)), "duplicate (trajectory, step) rows"
    assert set(keys) == set(ref), f"rows differ: extra {set(keys) - set(ref)}, missing {set(ref) - set(keys)}"
    for r in got:
        e = ref[(r["trajectory_id"], r["step"])]
        where = f"{r['trajectory_id']} step {r['step']}"
        assert r["prompt_id"] == e["prompt_id"], where
        assert r["method"] == method, where
        assert r["turning_point"] is e["turning_point"], f"{where}: turning_point {r['turning_point']} != {e['turning_point']}"
        if method == "tp-grpo":
            assert r["turning_point_candidate"] is e["turning_point_candidate"], f"{where}: candidate"
        for col in ("reward_before", "reward_after", "final_reward", "step_reward", "aggregated_reward",
                    "shaped_reward", "advantage"):
            assert close(r[col], e[col]), f"{where}: {col} = {r[col]}, reference {e[col]}"
        assert r["advantage"] is not None and not math.isnan(r["advantage"]), where


def check_group_means(table: pa.Table):
    sums = {}
    for r in table.to_pylist():
        sums.setdefault((r["prompt_id"], r["step"]), []).append(r["advantage"])
    for key, vals in sums.items():
        assert abs(sum(vals) / len(vals)) < 1e-9, f"{key}: advantages do not average to 0: {vals}"


def check_against_reference(tmp: Path, rows, method="tp-grpo", balance="all", std="group") -> pa.Table:
    src = write(tmp / "scores.parquet", score_table(rows))
    table = run_stage(src, tmp / f"adv-{method}-{balance}-{std}", method=method, balance=balance, std=std)
    compare(table, reference(rows, method, balance, std), method)
    check_group_means(table)
    return table


ALL_MODES = [(m, b, s) for m in ("tp-grpo", "flow-grpo") for b in ("all", "none") for s in ("group", "global")]

# --------------------------------------------------------------------------------------------
# The reference itself, against hand-worked numbers (so that a wrong reference cannot pass)
# --------------------------------------------------------------------------------------------

# K = 4. Trajectory ids chosen so that string order (t10 < t2 < t3) differs from numeric order.
HAND = {
    "p": {
        "t10": [1, 0, 2, 3, 3],     # Delta 2; step 2 is a TP, agg = R_4 - R_1 = 3
        "t2": [0, 1, 0, 2, 3],      # steps 1 (agg 3) and 3 (agg R_4 - R_2 = 3)
        "t3": [0, -1, 1, -2, -3],   # steps 1 (agg -3) and 3 (agg R_4 - R_2 = -4)
    },
    "q": {
        "a": [0, 1, 2, 2, 1],       # d_1 > 0 but R_K - R_1 = 0: no TP (zero kills)
        "b": [1, 2, 0, 3, 1],       # Delta = 0: no TP
        "c": [2, 2, 2, 2, 2],       # equal rewards
    },
}


def test_reference_matches_hand_worked_numbers():
    ref = reference(trajectories(HAND))
    cands = sorted(k for k, r in ref.items() if r["turning_point_candidate"])
    assert cands == [("t10", 2), ("t2", 1), ("t2", 3), ("t3", 1), ("t3", 3)]
    # 3 positive (|agg| 3, 3, 3), 2 negative: keep 2 positive by (trajectory_id, step): t10/2, t2/1.
    kept = sorted(k for k, r in ref.items() if r["turning_point"])
    assert kept == [("t10", 2), ("t2", 1), ("t3", 1), ("t3", 3)]
    assert ref[("t2", 3)]["shaped_reward"] == 2  # dropped: back to d_3
    assert ref[("t10", 2)]["shaped_reward"] == 3
    assert ref[("t3", 3)]["shaped_reward"] == -4
    assert [ref[("t10", k)]["step_reward"] for k in range(1, 5)] == [-1, 2, 1, 0]
    # prompt p, step 1: shaped = [d_1(t10) = -1, agg_1(t2) = 3, agg_1(t3) = -3]
    vals = [-1, 3, -3]
    m = -1 / 3
    s = math.sqrt(sum((x - m) ** 2 for x in vals) / 3)
    assert ref[("t2", 1)]["advantage"] == pytest.approx((3 - m) / (s + 1e-4))
    # q, step 4: shaped = d_4 = [-1, -2, 0]
    assert ref[("c", 4)]["advantage"] == pytest.approx((0 + 1) / (math.sqrt(2 / 3) + 1e-4))


# --------------------------------------------------------------------------------------------
# Hand-made tables: the real stage against the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method,balance,std", ALL_MODES)
def test_hand_table_k4(tmp_path, method, balance, std):
    check_against_reference(tmp_path, trajectories(HAND), method, balance, std)


def test_hand_table_k4_exact_values(tmp_path):
    table = check_against_reference(tmp_path, trajectories(HAND))
    rows = {(r["trajectory_id"], r["step"]): r for r in table.to_pylist()}
    assert rows[("t2", 3)]["turning_point_candidate"] and not rows[("t2", 3)]["turning_point"]
    assert rows[("t2", 3)]["shaped_reward"] == 2.0
    assert rows[("t10", 2)]["turning_point"] and rows[("t10", 2)]["aggregated_reward"] == 3.0
    assert rows[("t3", 3)]["turning_point"] and rows[("t3", 3)]["shaped_reward"] == -4.0
    assert sum(r["turning_point"] for r in rows.values()) == 4
    assert not any(r["turning_point_candidate"] for r in rows.values() if r["step"] == 4)
    # ordered by (prompt_id, trajectory_id, step)
    order = [(r["prompt_id"], r["trajectory_id"], r["step"]) for r in table.to_pylist()]
    assert order == sorted(order)


def test_balance_none_keeps_every_turning_point(tmp_path):
    table = check_against_reference(tmp_path, trajectories(HAND), balance="none")
    rows = table.to_pylist()
    assert all(r["turning_point"] == r["turning_point_candidate"] for r in rows)
    assert sum(r["turning_point"] for r in rows) == 5


def test_one_signed_turning_points_are_all_kept(tmp_path):
    spec = {"p": {"x": [1, 0, 2, 3, 3], "y": [0, 1, 0, 2, 3], "z": [0, 0, 0, 0, 0]},
            "q": {"w": [0, 2, 0, 4, 5]}}
    table = check_against_reference(tmp_path, trajectories(spec))
    tps = sorted((r["trajectory_id"], r["step"]) for r in table.to_pylist() if r["turning_point"])
    assert tps == [("w", 1), ("w", 3), ("x", 2), ("y", 1), ("y", 3)]


def test_balance_ties_break_by_trajectory_then_step(tmp_path):
    # 4 positive TPs with |agg| = 3, one negative (n, step 1: agg -2): keep exactly one positive,
    # the smallest (trajectory_id, step): "t10" sorts before "t9" as a string.
    spec = {"p": {"t9": [0, 1, 0, 2, 3], "t10": [0, 1, 0, 2, 3]}, "q": {"n": [0, -1, -2, -2, -2]}}
    ref = reference(trajectories(spec))
    assert sorted(k for k, r in ref.items() if r["turning_point"]) == [("n", 1), ("t10", 1)]
    check_against_reference(tmp_path, trajectories(spec))


def test_paper_setting_k9_several_prompts(tmp_path):
    rng = random.Random(7)
    spec = {f"prompt-{p}": {f"traj-{p}-{m}": [round(rng.uniform(0, 1), 2) for _ in range(10)] for m in range(6)}
            for p in range(3)}
    spec["prompt-3"] = {"lonely": [0.1, 0.3, 0.2, 0.5, 0.4, 0.6, 0.6, 0.7, 0.65, 0.8]}  # a group of one
    for method, balance, std in ALL_MODES:
        table = check_against_reference(tmp_path / f"{method}-{balance}-{std}", trajectories(spec), method, balance, std)
        assert table.num_rows == 19 * 9
        lonely = [r for r in table.to_pylist() if r["trajectory_id"] == "lonely"]
        assert len(lonely) == 9
        if std == "group":
            assert all(r["advantage"] == 0.0 for r in lonely)


def test_group_of_one_and_global_std_hand_worked(tmp_path):
    # flow-grpo with R_K: p = [1, 3], q = [0, 0, 9], s = [7] (alone)
    spec = {"p": {"p1": [0, 1], "p2": [0, 3]}, "q": {"q1": [5, 0], "q2": [5, 0], "q3": [5, 9]}, "s": {"s1": [2, 7]}}
    rows = trajectories(spec)
    src = write(tmp_path / "s.parquet", score_table(rows))
    grp = {r["trajectory_id"]: r["advantage"] for r in run_stage(src, tmp_path / "g", method="flow-grpo").to_pylist()}
    assert grp["p1"] == pytest.approx(-1 / 1.0001, rel=1e-12)
    assert grp["q3"] == pytest.approx(6 / (math.sqrt(18) + 1e-4), rel=1e-12)
    assert grp["s1"] == 0.0
    glob = {r["trajectory_id"]: r["advantage"]
            for r in run_stage(src, tmp_path / "gl", method="flow-grpo", std="global").to_pylist()}
    vals = [1, 3, 0, 0, 9, 7]
    m = sum(vals) / 6
    gs = math.sqrt(sum((x - m) ** 2 for x in vals) / 6)
    assert glob["p1"] == pytest.approx(-1 / (gs + 1e-4), rel=1e-12)  # group mean 2, global std
    assert glob["q1"] == pytest.approx(-3 / (gs + 1e-4), rel=1e-12)  # group mean 3, global std
    assert glob["s1"] == 0.0
    for method, balance, std in ALL_MODES:
        check_against_reference(tmp_path / f"{method}-{balance}-{std}", rows, method, balance, std)


def test_identical_rewards_give_zero_advantage(tmp_path):
    spec = {"p": {f"t{i}": [0.1] * 5 for i in range(3)}, "q": {f"u{i}": [0.3, 0.7, 0.2, 0.2, 0.9] for i in range(5)}}
    for method, balance, std in ALL_MODES:
        table = check_against_reference(tmp_path / f"{method}-{balance}-{std}", trajectories(spec), method, balance, std)
        for r in table.to_pylist():
            assert r["advantage"] is not None and not math.isnan(r["advantage"])
            assert abs(r["advantage"]) < 1e-9


def test_zeros_everywhere(tmp_path):
    spec = {"p": {"a": [0, 0, 0], "b": [0, 0, 0]}}
    table = check_against_reference(tmp_path, trajectories(spec))
    assert all(r["advantage"] == 0.0 and not r["turning_point"] for r in table.to_pylist())


def test_folder_of_parquet_files(tmp_path):
    rows = trajectories(HAND)
    random.Random(1).shuffle(rows)
    folder = tmp_path / "scores"
    write(folder / "scores-r000-00000.parquet", score_table(rows[:11]))
    write(folder / "scores-r001-00001.parquet", score_table(rows[11:]))
    single = write(tmp_path / "one.parquet", score_table(rows))
    a = run_stage(folder, tmp_path / "a")
    b = run_stage(single, tmp_path / "b")
    assert a.equals(b)
    compare(a, reference(rows), "tp-grpo")


def test_extra_columns_and_foreign_table(tmp_path):
    # not from tpkit: different column order, extra columns, int32 branch, arbitrary ids
    rows = trajectories({"cat photo": {"run7/img-001": [0.5, 0.25, 0.75, 1.0], "run7/img-002": [0.5, 0.5, 0.25, 0.0]},
                         "dog": {"x": [1.0, 1.5, 1.25, 2.0]}})
    base = score_table(rows, branch_type=pa.int32())
    table = pa.table({
        "note": pa.array(["hello"] * len(rows)),
        "reward": base["reward"],
        "pickscore": pa.array([i * 0.5 for i in range(len(rows))], pa.float64()),
        "branch": base["branch"],
        "prompt_id": base["prompt_id"],
        "trajectory_id": base["trajectory_id"],
        "meta": pa.array([{"a": i} for i in range(len(rows))]),
    })
    src = write(tmp_path / "foreign.parquet", table)
    for method, balance, std in ALL_MODES:
        out = run_stage(src, tmp_path / f"{method}-{balance}-{std}", method=method, balance=balance, std=std)
        compare(out, reference(rows, method, balance, std), method)


def test_shuffled_rows_give_identical_output(tmp_path):
    rows = trajectories(HAND)
    a = run_stage(write(tmp_path / "a.parquet", score_table(rows)), tmp_path / "oa")
    random.Random(3).shuffle(rows)
    b = run_stage(write(tmp_path / "b.parquet", score_table(rows)), tmp_path / "ob")
    assert a.equals(b)


# --------------------------------------------------------------------------------------------
# Flow-GRPO on final-branch-only tables
# --------------------------------------------------------------------------------------------


def test_flow_grpo_accepts_final_branch_only(tmp_path):
    K = 4
    rows = [("a", "p", K, 1.0), ("b", "p", K, 3.0), ("c", "q", K, 0.5), ("d", "q", K, 0.5), ("e", "q", K, 2.0)]
    src = write(tmp_path / "final.parquet", score_table(rows))
    table = run_stage(src, tmp_path / "out", method="flow-grpo")
    assert table.num_rows == 5 * K
    got = table.to_pylist()
    for r in got:
        assert r["step_reward"] is None and r["aggregated_reward"] is None
        assert r["reward_before"] is None
        assert r["turning_point"] is False and r["turning_point_candidate"] is False
        assert r["final_reward"] == r["shaped_reward"]
        assert (r["reward_after"] is None) == (r["step"] != K)
    compare(table, reference(rows, "flow-grpo"), "flow-grpo")
    check_group_means(table)
    by = {(r["trajectory_id"], r["step"]): r["advantage"] for r in got}
    assert by[("a", 1)] == pytest.approx(-1 / 1.0001, rel=1e-12)
    for k in range(1, K + 1):
        assert by[("a", k)] == by[("a", 1)]
    glob = run_stage(src, tmp_path / "glob", method="flow-grpo", std="global")
    compare(glob, reference(rows, "flow-grpo", std="global"), "flow-grpo")


def test_tp_grpo_rejects_final_branch_only(tmp_path):
    rows = [("a", "p", 4, 1.0), ("b", "p", 4, 3.0)]
    src = write(tmp_path / "final.parquet", score_table(rows))
    with pytest.raises(InputError, match=r"branches \[4\], expected 0\.\.4"):
        advantages.run(AdvantagesConfig(scores=str(src), out=str(tmp_path / "out")))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_flow_grpo_mixed_complete_and_final_only(tmp_path):
    # Every trajectory is individually acceptable to flow-grpo (complete, or R_K only). Either the
    # stage accepts the table (advantages from R_K) or it refuses it with an InputError; it must not
    # crash with an internal error.
    rows = [("a", "p", 0, 1.0), ("a", "p", 1, 2.0), ("a", "p", 2, 3.0), ("b", "p", 2, 5.0)]
    src = write(tmp_path / "mixed.parquet", score_table(rows))
    try:
        table = advantages.run(AdvantagesConfig(scores=str(src), out=str(tmp_path / "out"), method="flow-grpo"))
    except InputError:
        return
    table = pq.read_table(tmp_path / "out" / "advantages.parquet")
    shaped = {(r["trajectory_id"], r["step"]): r["shaped_reward"] for r in table.to_pylist()}
    assert shaped == {("a", 1): 3.0, ("a", 2): 3.0, ("b", 1): 5.0, ("b", 2): 5.0}


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

GOOD = trajectories({"p": {"a": [0, 1, 2], "b": [1, 1, 0]}})


def expect_input_error(tmp_path, table: pa.Table, pattern: str, method="tp-grpo"):
    src = write(tmp_path / "bad.parquet", table)
    with pytest.raises(InputError, match=pattern) as e:
        advantages.run(AdvantagesConfig(scores=str(src), out=str(tmp_path / "out"), method=method))
    assert e.value.fix  # every error says what to do
    assert not (tmp_path / "out" / "manifest.json").exists()
    return e.value


@pytest.mark.parametrize("column", ["trajectory_id", "prompt_id", "branch", "reward"])
def test_missing_column(tmp_path, column):
    table = score_table(GOOD).drop_columns([column])
    expect_input_error(tmp_path, table, f"lacks column.*{column}")


def test_branch_as_string(tmp_path):
    table = score_table(GOOD)
    table = table.set_column(2, "branch", pa.array([str(r[2]) for r in GOOD], pa.string()))
    expect_input_error(tmp_path, table, r"mistyped column.*branch")


def test_reward_not_a_number(tmp_path):
    table = score_table(GOOD)
    table = table.set_column(3, "reward", pa.array(["good"] * len(GOOD), pa.string()))
    expect_input_error(tmp_path, table, r"mistyped column")


def test_gap_in_branches(tmp_path):
    rows = [r for r in GOOD if not (r[0] == "b" and r[2] == 1)]
    expect_input_error(tmp_path, score_table(rows), r"trajectory b has branches \[0, 2\], expected 0\.\.2")
    expect_input_error(tmp_path / "flow", score_table(rows), r"trajectory b has branches \[0, 2\]", method="flow-grpo")


def test_trajectory_shorter_than_the_others(tmp_path):
    rows = GOOD + [("c", "p", 0, 0.0), ("c", "p", 1, 0.0)]
    expect_input_error(tmp_path, score_table(rows), r"trajectory c has branches \[0, 1\]")


def test_duplicated_branch(tmp_path):
    rows = GOOD + [("a", "p", 1, 5.0)]
    expect_input_error(tmp_path, score_table(rows), r"trajectory a has a branch twice")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None])
def test_nan_reward(tmp_path, bad):
    rows = [(t, p, k, bad if (t, k) == ("b", 2) else r) for t, p, k, r in GOOD]
    expect_input_error(tmp_path, score_table(rows), r"NaN or infinite reward.*\bb\b")


def test_trajectory_with_two_prompts(tmp_path):
    rows = [(t, "other" if (t, k) == ("a", 2) else p, k, r) for t, p, k, r in GOOD]
    expect_input_error(tmp_path, score_table(rows), r"trajectory a has two prompt ids")


def test_empty_table(tmp_path):
    expect_input_error(tmp_path, score_table([]), r"empty")


def test_negative_branch(tmp_path):
    expect_input_error(tmp_path, score_table(GOOD + [("a", "p", -1, 0.0)]), r"negative branch")


def test_only_branch_zero_is_refused(tmp_path):
    # K = 0: there is no step at all; the boundary must say so with an InputError, not crash.
    rows = [("a", "p", 0, 1.0), ("b", "p", 0, 2.0)]
    expect_input_error(tmp_path, score_table(rows), r".")


def test_missing_scores_path(tmp_path):
    with pytest.raises(InputError):
        advantages.run(AdvantagesConfig(scores=str(tmp_path / "nope"), out=str(tmp_path / "out")))


@pytest.mark.parametrize("field,value", [("method", "grpo"), ("balance", "some"), ("std", "batch")])
def test_bad_options(tmp_path, field, value):
    src = write(tmp_path / "s.parquet", score_table(GOOD))
    with pytest.raises(ConfigError):
        advantages.run(AdvantagesConfig(scores=str(src), out=str(tmp_path / "out"), **{field: value}))


# --------------------------------------------------------------------------------------------
# Random tables (hypothesis)
# --------------------------------------------------------------------------------------------


@st.composite
def score_rows(draw):
    """Small integer rewards (ties and zeros everywhere); trajectories often repeat a reward
    sequence from a small pool, so that equal |agg| across and within trajectories is common."""
    K = draw(st.integers(1, 6))
    n_prompts = draw(st.integers(1, 3))
    numbers = draw(st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True))
    tids = [f"t{n}" for n in numbers]  # "t10" < "t9": string order differs from numeric order
    scale = draw(st.sampled_from([1.0, 0.5, 0.25]))
    sequence = st.lists(st.integers(-2, 2).map(float), min_size=K + 1, max_size=K + 1)
    pool = draw(st.lists(sequence, min_size=1, max_size=3))
    rows = []
    for i, tid in enumerate(tids):
        pid = f"p{draw(st.integers(0, n_prompts - 1)) if i else 0}"
        Rs = draw(st.one_of(st.sampled_from(pool), sequence))
        rows.extend((tid, pid, k, r * scale) for k, r in enumerate(Rs))
    return rows


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=score_rows(), mode=st.sampled_from(ALL_MODES), seed=st.integers(0, 2**31 - 1),
       split=st.booleans())
def test_random_tables_match_reference(rows, mode, seed, split):
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        src = write(tmp / "scores.parquet", score_table(rows))
        outputs = {}
        for method, balance, std in ALL_MODES:
            out = run_stage(src, tmp / f"adv-{method}-{balance}-{std}", method=method, balance=balance, std=std)
            compare(out, reference(rows, method, balance, std), method)
            check_group_means(out)
            outputs[(method, balance, std)] = out
        # shuffled row order (and, sometimes, the rows split over a folder of files): identical output
        shuffled = list(rows)
        random.Random(seed).shuffle(shuffled)
        if split and len(shuffled) > 1:
            cut = len(shuffled) // 2
            write(tmp / "sh" / "part-0.parquet", score_table(shuffled[:cut]))
            write(tmp / "sh" / "part-1.parquet", score_table(shuffled[cut:]))
            src = tmp / "sh"
        else:
            src = write(tmp / "shuffled.parquet", score_table(shuffled))
        method, balance, std = mode
        again = run_stage(src, tmp / "again", method=method, balance=balance, std=std)
        assert again.equals(outputs[mode])


@settings(max_examples=40, deadline=None)
@given(rows=score_rows(), std=st.sampled_from(["group", "global"]))
def test_random_final_only_flow_grpo_matches_reference(rows, std):
    K = max(r[2] for r in rows)
    final = [r for r in rows if r[2] == K]
    with tempfile.TemporaryDirectory() as d:
        table = check_against_reference(Path(d), final, "flow-grpo", "all", std)
        assert all(r["step_reward"] is None and r["aggregated_reward"] is None for r in table.to_pylist())


def test_summary_counts_zero_step_rewards_and_mean_abs_step_reward(tmp_path):
    """The diagnostics of why the sign tests fire or not, per step (hand-worked, K = 3)."""
    spec = {"p": {"a": [0.0, 0.0, 1.0, 1.0], "b": [0.0, 0.5, 0.5, 0.0]}}
    # d_1 = (0, 0.5), d_2 = (1, 0), d_3 = (0, -0.5)
    write(tmp_path / "s.parquet", score_table(trajectories(spec)))
    m = advantages.run(AdvantagesConfig(scores=str(tmp_path / "s.parquet"), out=str(tmp_path / "adv")))
    per_step = m["summary"]["per_step"]
    assert [s["zero_step_rewards"] for s in per_step] == [0.5, 0.5, 0.5]
    assert [s["mean_abs_step_reward"] for s in per_step] == [0.25, 0.5, 0.25]
    # Flow-GRPO from R_K alone: no step rewards, so no diagnostics (None, not 0)
    only_final = [r for r in trajectories(spec) if r[2] == 3]
    write(tmp_path / "f.parquet", score_table(only_final))
    m = advantages.run(AdvantagesConfig(scores=str(tmp_path / "f.parquet"), out=str(tmp_path / "adv-f"), method="flow-grpo"))
    assert all(s["zero_step_rewards"] is None and s["mean_abs_step_reward"] is None for s in m["summary"]["per_step"])
