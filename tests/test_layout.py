"""The run-folder contract's building blocks: prompt files, atomic writes, shards, manifests.

Shards here are small synthetic ones written by `layout.ShardWriter` (no model needed).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from tpkit import layout
from tpkit.errors import InputError
from tpkit.layout import PromptRecord, ShardWriter, TrajectoryRecord

# ---------------------------------------------------------------------------------------------
# Prompt files
# ---------------------------------------------------------------------------------------------


def test_txt_prompts_skip_blank_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a red cube\n\n   \n  a blue sphere  \n\t\nthird one")
    prompts = layout.load_prompts(f)
    assert [p.prompt for p in prompts] == ["a red cube", "a blue sphere", "third one"]
    assert [p.prompt_id for p in prompts] == ["p00000", "p00001", "p00002"]
    assert prompts[1].metadata == {"prompt": "a blue sphere"}


def test_jsonl_prompts_carry_metadata_and_ids(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "a photo of a cat", "id": "cat_1", "tag": "single_object", "include": [{"class": "cat", "count": 1}]},
        {"prompt": "two dogs", "prompt_id": "dogs-2", "count": 2},
        {"prompt": "no id here", "extra": None},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    prompts = layout.load_prompts(f)
    assert [p.prompt_id for p in prompts] == ["cat_1", "dogs-2", "p00002"]
    assert [p.prompt for p in prompts] == [r["prompt"] for r in rows]
    assert [p.metadata for p in prompts] == rows  # the whole object reaches the rewards


def test_jsonl_numeric_id_becomes_a_string(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "x", "id": 7}\n')
    assert layout.load_prompts(f)[0].prompt_id == "7"


@pytest.mark.parametrize("content, words", [
    ('{"prompt": "ok"}\n{"prompt": "broken"\n', ["line 2", "json"]),
    ('{"prompt": "ok"}\n[1, 2]\n', ["line 2", "prompt"]),
    ('{"text": "no prompt key"}\n', ["line 1", "prompt"]),
    ('{"prompt": ""}\n', ["line 1", "prompt"]),
    ('{"prompt": 3}\n', ["line 1", "prompt"]),
    ('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n', ["duplicate", "x"]),
    ('{"prompt": "a", "id": "p00001"}\n{"prompt": "b"}\n', ["duplicate", "p00001"]),
])
def test_jsonl_errors(tmp_path, content, words):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(InputError) as err:
        layout.load_prompts(f)
    msg = str(err.value).lower()
    for w in words:
        assert w in msg, (w, msg)


def test_jsonl_error_names_the_line_in_the_file(tmp_path):
    """Blank lines are skipped, but the message must point at the line a user sees in an editor."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n\n\n{"prompt": "broken"\n')
    with pytest.raises(InputError, match="line 4"):
        layout.load_prompts(f)


@pytest.mark.parametrize("bad_id", ["../evil", "a b", "a.b", "x/y", "", "é"])
def test_unsafe_prompt_ids_are_refused(tmp_path, bad_id):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "x", "id": bad_id}) + "\n")
    with pytest.raises(InputError, match="prompt id"):
        layout.load_prompts(f)


@pytest.mark.parametrize("name, content, words", [
    ("missing.txt", None, ["does not exist"]),
    ("prompts.csv", "a,b\n", ["neither .txt nor .jsonl"]),
    ("prompts.json", '[{"prompt": "x"}]', ["neither .txt nor .jsonl"]),
    ("empty.txt", "", ["empty"]),
    ("blank.txt", "\n  \n\t\n", ["empty"]),
    ("empty.jsonl", "\n", ["empty"]),
])
def test_prompt_file_errors(tmp_path, name, content, words):
    f = tmp_path / name
    if content is not None:
        f.write_text(content)
    with pytest.raises(InputError) as err:
        layout.load_prompts(f)
    for w in words:
        assert w in str(err.value)
    assert err.value.fix  # every error names the fix


def test_non_utf8_prompt_file(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"caf\xe9\n")
    with pytest.raises(InputError, match="UTF-8"):
        layout.load_prompts(f)


# ---------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------


def test_atomic_write_leaves_no_temp_files(tmp_path):
    target = tmp_path / "sub" / "out.bin"
    layout.atomic_write(target, b"one")
    layout.atomic_write(target, b"two")
    layout.atomic_write_json(tmp_path / "sub" / "m.json", {"b": 1, "a": [1, 2]})
    assert target.read_bytes() == b"two"
    assert json.loads((tmp_path / "sub" / "m.json").read_text()) == {"a": [1, 2], "b": 1}
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["m.json", "out.bin"]


def test_atomic_write_failure_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "out.bin"
    layout.atomic_write(target, b"old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        layout.atomic_write(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


# ---------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _meta(tid: str, pid: str, member: int, **over) -> dict:
    return {"trajectory_id": tid, "prompt_id": pid, "prompt": "a prompt", "member": member, "seed": 123 + member,
            "window_size": 2, "schema_version": layout.SCHEMA_VERSION, **over}


def _tensors(member: int) -> dict:
    g = torch.Generator().manual_seed(member)
    return {"states": torch.randn(3, 4, 2, 2, generator=g), "velocities": torch.randn(2, 4, 2, 2, generator=g),
            "log_probs": torch.randn(2, generator=g), "final_latent": torch.randn(4, 2, 2, generator=g)}


EMBEDS = ("prompt_embeds", "pooled_prompt_embeds", "text_ids")  # any keys: shards store what the family encodes


def make_shard(path: Path, members: int = 3, **meta_over) -> Path:
    w = ShardWriter()
    w.add_prompt(PromptRecord("p0", "a prompt", {"prompt": "a prompt", "tag": "t"},
                              {k: torch.ones(1, 3, 4) * i for i, k in enumerate(EMBEDS)}))
    for m in range(members):
        w.add_trajectory(TrajectoryRecord(_meta(f"p0-m{m:03d}", "p0", m, **meta_over), _tensors(m), _png()))
    layout.atomic_write(path, w.to_bytes())
    return path


def _offsets(path: Path) -> dict[str, tuple[int, int, int]]:
    """member name -> (header offset, data offset, size)."""
    with tarfile.open(path) as tar:
        return {m.name: (m.offset, m.offset_data, m.size) for m in tar.getmembers()}


def test_shard_round_trip(tmp_path):
    path = make_shard(tmp_path / layout.shard_name(0, 0))
    prompts, trajs = layout.read_shard(path)
    assert list(prompts) == ["p0"]
    assert prompts["p0"].metadata == {"prompt": "a prompt", "tag": "t"}
    assert set(prompts["p0"].embeds) == set(EMBEDS)
    assert [t.trajectory_id for t in trajs] == ["p0-m000", "p0-m001", "p0-m002"]
    for m, t in enumerate(trajs):
        assert t.meta == _meta(t.trajectory_id, "p0", m)
        for k, v in _tensors(m).items():
            assert torch.equal(t.tensors[k], v)
        assert t.final_png == _png()
    # Deterministic bytes: the same records give the same shard.
    assert make_shard(tmp_path / "again.tar").read_bytes() == path.read_bytes()
    # load_tensors=False skips the tensors but keeps metadata.
    _, light = layout.read_shard(path, load_tensors=False)
    assert [t.meta for t in light] == [t.meta for t in trajs] and all(t.tensors == {} for t in light)


def test_shard_writer_refuses_unsafe_keys():
    w = ShardWriter()
    with pytest.raises(ValueError):
        w.add_trajectory(TrajectoryRecord(_meta("../evil", "p0", 0), _tensors(0), _png()))


def _truncate_at(path: Path, where: str) -> int:
    off = _offsets(path)
    if where == "mid-data":
        h, d, size = off["p0-m002.latents.safetensors"]
        return d + size // 2
    if where == "mid-header":
        return off["p0-m001.final.png"][0] + 100
    if where == "mid-sample":  # after a trajectory's meta.json: the sample lacks its tensors
        return off["p0-m002.latents.safetensors"][0]
    if where == "sample-boundary":  # whole trajectories lost, the rest intact
        return off["p0-m002.meta.json"][0]
    if where == "empty":
        return 0
    raise AssertionError(where)


@pytest.mark.parametrize("where", ["mid-data", "mid-header", "mid-sample", "sample-boundary", "empty"])
def test_truncated_shard_raises_input_error(tmp_path, where):
    path = make_shard(tmp_path / "s.tar")
    data = path.read_bytes()
    path.write_bytes(data[:_truncate_at(path, where)])
    with pytest.raises(InputError) as err:
        layout.read_shard(path)
    assert str(path) in str(err.value) and err.value.fix


def test_corrupt_tensors_member_raises_input_error(tmp_path):
    path = make_shard(tmp_path / "s.tar")
    data = bytearray(path.read_bytes())
    h, d, size = _offsets(path)["p0-m001.latents.safetensors"]
    data[d: d + 16] = b"\xff" * 16  # garbles the safetensors header length
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match="safetensors"):
        layout.read_shard(path)


class _Boom:
    """Unpickling this calls os.mkdir(sentinel): proof that something was unpickled."""

    def __init__(self, sentinel: Path):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (os.mkdir, (self.sentinel,))


def test_the_pickle_payload_is_live(tmp_path):
    """Control for the tests below: unpickling the payload does create the sentinel."""
    sentinel = tmp_path / "PWNED"
    pickle.loads(pickle.dumps(_Boom(sentinel)))
    assert sentinel.is_dir()


def _hostile_shard(tmp_path: Path, sentinel: Path) -> Path:
    """A valid shard plus members that would write outside or execute code if used naively."""
    good = make_shard(tmp_path / "good.tar", members=2)
    payload = pickle.dumps(_Boom(sentinel))
    path = tmp_path / "shards" / "hostile.tar"
    path.parent.mkdir()
    with tarfile.open(good) as src, tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m))

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))

        add("../evil.json", b'{"prompt_id": "p0", "prompt": "x", "schema_version": 1}')
        add("../../evil2.prompt.json", b'{"prompt_id": "p0", "prompt": "x", "schema_version": 1}')
        add(str(tmp_path / "abs_evil.json"), b"{}")
        add("p0-m000.pyd", payload)
        add("p0-m001.pickle", payload)
        add("evil.pth", payload)
        link = tarfile.TarInfo("link.json")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        dst.addfile(link)
        hard = tarfile.TarInfo("hard.meta.json")
        hard.type, hard.linkname = tarfile.LNKTYPE, "../evil.json"
        dst.addfile(hard)
    return path


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_hostile_members_are_ignored_and_never_executed(tmp_path, monkeypatch):
    sentinel = tmp_path / "PWNED"
    path = _hostile_shard(tmp_path, sentinel)
    work = tmp_path / "shards" / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    outside = [tmp_path / "evil.json", tmp_path / "shards" / "evil.json", tmp_path.parent / "evil2.prompt.json",
               tmp_path / "abs_evil.json"]
    try:
        prompts, trajs = layout.read_shard(path)
    except InputError:
        prompts, trajs = None, None  # refusing the shard is fine too; what matters is below
    assert not sentinel.exists(), "a pickle member was unpickled"
    assert _tree(tmp_path) == before, "reading a shard wrote files"
    assert not any(p.exists() for p in outside)
    if prompts is not None:
        assert list(prompts) == ["p0"]
        assert [t.trajectory_id for t in trajs] == ["p0-m000", "p0-m001"]


def test_pickle_in_place_of_tensors_is_reported_not_executed(tmp_path):
    sentinel = tmp_path / "PWNED"
    good = make_shard(tmp_path / "good.tar", members=1)
    payload = pickle.dumps(_Boom(sentinel))
    path = tmp_path / "s.tar"
    with tarfile.open(good) as src, tarfile.open(path, "w") as dst:
        for m in src.getmembers():
            data = payload if m.name.endswith(layout.TENSORS) else src.extractfile(m).read()
            m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    with pytest.raises(InputError, match="safetensors"):
        layout.read_shard(path)
    assert not sentinel.exists()


def test_shard_from_a_newer_schema_asks_for_an_upgrade(tmp_path):
    path = make_shard(tmp_path / "s.tar", members=1, schema_version=999)
    with pytest.raises(InputError, match="upgrade"):
        layout.read_shard(path)


# ---------------------------------------------------------------------------------------------
# Manifests
# ---------------------------------------------------------------------------------------------


def test_manifest_round_trip(tmp_path):
    m = layout.write_manifest(tmp_path, "rollout", {"seed": 0}, {"prompts": "x"}, {"shards": 1}, extra_key=5)
    assert layout.read_manifest(tmp_path, "rollout") == m
    assert m["schema_version"] == layout.SCHEMA_VERSION and m["extra_key"] == 5 and m["tpkit_version"]


def test_manifest_from_a_newer_schema_asks_for_an_upgrade(tmp_path):
    (tmp_path / layout.MANIFEST).write_text(json.dumps({"stage": "rollout", "schema_version": 999}))
    with pytest.raises(InputError) as err:
        layout.read_manifest(tmp_path, "rollout")
    assert "999" in str(err.value) and "upgrade" in str(err.value).lower()


@pytest.mark.parametrize("setup, words", [
    ("no-folder", ["no such folder"]),
    ("no-manifest", ["did not finish"]),
    ("bad-json", ["not valid json"]),
    ("wrong-stage", ["'score'", "expected 'rollout'"]),
    ("string-version", ["schema version"]),
])
def test_manifest_errors(tmp_path, setup, words):
    folder = tmp_path / "stage"
    if setup != "no-folder":
        folder.mkdir()
    if setup == "bad-json":
        (folder / layout.MANIFEST).write_text("{not json")
    elif setup == "wrong-stage":
        (folder / layout.MANIFEST).write_text(json.dumps({"stage": "score", "schema_version": 1}))
    elif setup == "string-version":
        (folder / layout.MANIFEST).write_text(json.dumps({"stage": "rollout", "schema_version": "1"}))
    with pytest.raises(InputError) as err:
        layout.read_manifest(folder, "rollout")
    for w in words:
        assert w in str(err.value).lower(), (w, str(err.value))
