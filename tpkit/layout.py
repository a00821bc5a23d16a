"""The run-folder contract between stages (docs/design.md section 3), declared once.

File names, shard members, Parquet schemas and manifests live here; stages read and write
their files only through these functions. Every file is written under a temporary name and
renamed into place, and a stage's manifest.json is written last: a folder without one is
incomplete. Nothing here unpickles or executes what it reads.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from tpkit import __version__
from tpkit.errors import InputError
from tpkit.ui import console

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
PRUNED = "pruned.json"  # a finished rollout folder whose shards `tpkit run` deleted (keep_rounds): what and why
STAGE_FILE = "stage.json"  # a stage folder's identity, written before any output (see `stage_lock`)
ADVANTAGES_FILE = "advantages.parquet"
METRICS_FILE = "metrics.jsonl"
ROUNDS_FILE = "rounds.jsonl"

# Shard members: prompt samples carry PROMPT_JSON + EMBEDS, trajectory samples TRAJ_JSON + TENSORS + FINAL_PNG.
PROMPT_JSON, EMBEDS = "prompt.json", "embeds.safetensors"
TRAJ_JSON, TENSORS, FINAL_PNG = "meta.json", "latents.safetensors", "final.png"
TENSOR_KEYS = ("states", "velocities", "log_probs", "final_latent")
INDEX_KEY = "_index"  # last member of every shard: the prompt and trajectory ids it holds

# Columns every scores table must have (anything else is carried along); advantages output columns.
SCORE_KEY_COLUMNS = ("trajectory_id", "prompt_id", "branch", "reward")
ADVANTAGE_COLUMNS = (
    "trajectory_id", "prompt_id", "step", "reward_before", "reward_after", "final_reward",
    "step_reward", "aggregated_reward", "turning_point_candidate", "turning_point", "shaped_reward",
    "advantage", "method",
)

_SAFE_KEY = re.compile(r"^[A-Za-z0-9_\-]+$")


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:03d}-{index:05d}.tar"


def shard_index(path: Path) -> int:
    """The global shard index in a shard or scores file name (the part after the rank)."""
    m = re.search(r"-r\d{3}-(\d{5})\.", Path(path).name)
    if not m:
        raise InputError(f"{path}: not a tpkit shard or scores file name", "do not rename files in a run folder")
    return int(m.group(1))


def scores_name(shard: Path) -> str:
    """Scores of shard-rRRR-IIIII.tar go to scores-rRRR-IIIII.parquet."""
    return Path(shard).name.replace("shard-", "scores-").replace(".tar", ".parquet")


def list_shards(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("shard-r*-*.tar"), key=shard_index)


def stats_name(output: Path) -> str:
    """Sidecar with an output file's counts and timings (kept apart so the output's bytes are deterministic)."""
    return Path(output).name.rsplit(".", 1)[0] + ".stats.json"


def seconds_name(rank: int) -> str:
    """Seconds per phase that rank spent in a stage whose outputs are not files of their own (eval)."""
    return f"seconds-r{rank:03d}.json"


RUN_TOML, ROUND_JSON = "run.toml", "round.json"  # a run folder's resolved recipe; a finished round's summary
BASE_EVAL = "eval-base"  # a run folder's held-out evaluation of the starting model, before the first round


def round_dir(run_dir: Path, round_index: int) -> Path:
    return Path(run_dir) / f"round-{round_index:04d}"


def eval_dir(run_dir: Path, round_index: int) -> Path:
    """The held-out evaluation of a round's adapter."""
    return round_dir(run_dir, round_index) / "eval"


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # OSError errnos of a disk (or a quota) that is full


def file_on_the_way(path: Path) -> Path | None:
    """The file among `path` and its parents that keeps `path` from being (or being created as) a folder."""
    for p in [Path(path), *Path(path).parents]:
        if p.exists():
            return p if p.is_file() else None
    return None


def nearest_existing(path: Path) -> Path:
    """path, or its nearest parent that exists (a folder a stage has not created yet lives on its disk)."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int | None:
    """Free bytes on the disk of path (or of its nearest existing parent); None if unreadable."""
    try:
        return shutil.disk_usage(nearest_existing(path)).free
    except OSError:
        return None


def human_bytes(n: float) -> str:
    """1.5 GiB, 3.2 MiB, 1.1 TiB."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1024**2:.1f} MiB"


def wait_for(path: Path, what: str, poll: float = 2.0) -> None:
    """File barrier between processes (works across nodes on a shared file system): another rank
    finishes the stage and writes this manifest."""
    if path.is_file():
        return
    console.print(f"waiting for the other processes to finish {what} ({path})")
    while not path.is_file():
        time.sleep(poll)


# --------------------------------------------------------------------------------------------
# Atomic writes and manifests
# --------------------------------------------------------------------------------------------


def umask() -> int:
    """This process's umask, read from /proc: unlike os.umask() that does not change it meanwhile
    for other threads."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def file_mode() -> int:
    """The mode open() gives a new file under the umask (mkstemp makes 0600 whatever it is)."""
    return 0o666 & ~umask()


def atomic_write(path: Path, data: bytes) -> None:
    """Write bytes to a temporary file in the same folder, fsync, then rename into place. The file
    gets the mode a plain open() would give it under the process's umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def write_manifest(folder: Path, stage: str, config: dict, inputs: dict, counts: dict,
                   identity: dict | None = None, **extra: Any) -> dict:
    """The last file a stage writes: resolved config, inputs, counts, schema and tpkit versions, and
    the folder's identity (`stage_identity`: what downstream stages check)."""
    manifest = {
        "stage": stage, "schema_version": SCHEMA_VERSION, "tpkit_version": __version__,
        "config": config, "inputs": inputs, "counts": counts, **({"identity": identity} if identity else {}), **extra,
    }
    atomic_write_json(Path(folder) / MANIFEST, manifest)
    (Path(folder) / PRUNED).unlink(missing_ok=True)  # the stage wrote its outputs again
    return manifest


def read_jsonl(path: Path) -> list[dict]:
    """One object per non-empty line (rounds.jsonl, metrics.jsonl, results.jsonl)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_manifest(folder: Path, stage: str, pruned_ok: bool = False) -> dict:
    """The manifest of a finished stage folder, checked for stage and schema version. A rollout whose
    shards keep_rounds deleted is refused unless pruned_ok (reading its identity needs no shards)."""
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir():
        raise InputError(f"{folder}: no such folder", f"run `tpkit {stage}` first or check the path")
    if not path.is_file():
        raise InputError(f"{folder}: no {MANIFEST}, so the {stage} stage there did not finish",
                         f"rerun `tpkit {stage}` with the same options to complete it")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})", f"rerun `tpkit {stage}` to rewrite it") from None
    if manifest.get("stage") != stage:
        raise InputError(f"{folder}: holds a {manifest.get('stage')!r} stage, expected {stage!r}",
                         "pass the folder written by the right stage")
    check_schema_version(manifest.get("schema_version"), path)
    if not pruned_ok and (Path(folder) / PRUNED).is_file():
        raise InputError(f"{folder}: its shards were deleted by `tpkit run` (keep_rounds) once its round was trained",
                         f"rerun `tpkit {stage}` into that folder with the options in its {MANIFEST}: it writes the same "
                         "shards again (or set keep_rounds = 0 in the recipe to keep every round's)")
    return manifest


WEIGHT_SUFFIXES = (".safetensors", ".pt", ".bin")  # what `prune_weights` deletes (not configs, notes, links)


def prune_weights(folder: Path, digest, why: str) -> int:
    """Delete a finished round's weights in `folder` (a fully fine-tuned model/'s transformer, a state/'s
    optimizer moments: 12 bytes a parameter a round), keeping its configs, notes and links. PRUNED
    records `digest()`, the content digest the folder had, which identities computed from it use from
    then on (`pruned_digest`), so a continued run still recognises its finished rounds. PRUNED is written
    first: a crash midway leaves the record, and the next call deletes the rest. Returns the bytes freed."""
    folder = Path(folder)
    files = [Path(root) / name for root, _, names in os.walk(folder) for name in names  # links not followed:
             if Path(name).suffix in WEIGHT_SUFFIXES and not (Path(root) / name).is_symlink()]  # the base's components
    if not files:
        return 0
    if not (folder / PRUNED).is_file():
        atomic_write_json(folder / PRUNED, {"deleted": "weights", "why": why, "digest": digest(),
                                            "files": [f.relative_to(folder).as_posix() for f in files]})
    freed = sum(f.stat().st_size for f in files)
    for f in files:
        f.unlink(missing_ok=True)
    return freed


def pruned_digest(folder: Path) -> str | None:
    """The content digest a folder had before `prune_weights` deleted its weights; None if it was not pruned."""
    path = Path(folder) / PRUNED
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("digest")


def prune_shards(folder: Path, why: str) -> int:
    """Delete a finished rollout folder's shards (the cached latents and final images: nearly all of a
    round's bytes); its manifest, shard stats and every later stage's files stay. PRUNED is written
    first, so a crash midway leaves the record and the next call finishes. Returns the bytes freed."""
    folder = Path(folder)
    shards = list_shards(folder)
    if not shards:
        return 0
    freed = sum(p.stat().st_size for p in shards)
    if not (folder / PRUNED).is_file():
        atomic_write_json(folder / PRUNED, {"deleted": "shards", "why": why, "shards": len(shards)})
    for p in shards:
        p.unlink(missing_ok=True)
    return freed


def check_schema_version(version: Any, where: Path | str) -> None:
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise InputError(f"{where}: schema version {version!r}, this tpkit reads up to {SCHEMA_VERSION}",
                         "upgrade tpkit (pip install -U tpkit) to read files from a newer version")


# --------------------------------------------------------------------------------------------
# Identity: a folder knows what it holds
# --------------------------------------------------------------------------------------------

# Options that say where or how a stage runs, not what it computes: never part of an identity.
WHERE_OPTIONS = ("out", "rank", "world_size", "overwrite", "device")
# ... and such options of one stage (stage -> option names); `tpkit run` lets a continued run change
# them too (after a crash, on another machine). `on_nan`: a score file written under `stop` is the
# same under `drop`, so a run stopped by a NaN reward resumes with drop.
RUN_ONLY = {"score": ("reward_workers", "on_nan"),
            "train": ("checkpoint_every", "max_bad_steps", "allow_no_op", "log_with",
                      "fsdp")}  # how the processes split the work, like their number: the same result within rounding
# ... and reward options of that kind: `workers` spreads the shapes detector over processes, which
# find the same objects (tests/test_shapes_detect.py). Not batch sizes: another batch shape may round
# differently.
REWARD_RUN_ONLY = ("workers",)


def result_reward_options(options: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Reward options (reward name -> its options) without REWARD_RUN_ONLY: what an identity holds."""
    return {name: {k: v for k, v in o.items() if k not in REWARD_RUN_ONLY} for name, o in options.items()}


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sampled_digest(folder: Path, sample: int = 1 << 16) -> str:
    """A cheap content fingerprint of a big folder (a local model's weights): every visible file's name,
    size and sha256 of its first, middle and last `sample` bytes. Not mtimes (a copy keeps its identity),
    and not every byte (tens of GB): retraining weights in place changes all three samples in practice."""
    h = hashlib.sha256()
    folder = Path(folder)
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and not any(x.startswith(".") for x in p.relative_to(folder).parts)):
        size = f.stat().st_size
        h.update(f"{f.relative_to(folder)}\0{size}\0".encode())
        with open(f, "rb") as fh:
            for start in sorted({0, max(0, size // 2 - sample // 2), max(0, size - sample)}):
                fh.seek(start)
                h.update(fh.read(sample))
    return h.hexdigest()


def tree_digest(path: str | Path | None, flag: str = "") -> str | None:
    """Content digest of a file, or of a folder's visible files (names and contents); None for no path.
    flag: the option that named the path, for the error when it does not exist."""
    if not path:
        return None
    path = Path(path)
    if path.is_file():
        return file_digest(path)
    if not path.is_dir():
        raise InputError(f"{flag + ' ' if flag else ''}{path}: no such file or folder", "check the path")
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not any(x.startswith(".") for x in p.relative_to(path).parts)):
        h.update(f"{f.relative_to(path)}\0{_content_digest(f)}\0".encode())
    return h.hexdigest()


def _content_digest(path: Path) -> str:
    """A file's digest; for safetensors, of its tensors (names, dtypes, shapes, values), not its bytes:
    the same weights saved twice may order their header differently."""
    if path.suffix != ".safetensors":
        return file_digest(path)
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in sorted(f.keys()):
                t = f.get_tensor(key).contiguous()
                h.update(f"{key}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    except Exception:  # not readable as safetensors: its bytes then
        return file_digest(path)
    return h.hexdigest()


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def json_ready(obj: Any) -> Any:
    """`obj` as it reads back from JSON (tuples as lists, other objects as str): how identities compare."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def stage_identity(stage: str, config: dict, inputs: dict, leave_out: tuple[str, ...] = ()) -> dict:
    """What a stage folder holds: the stage, the options that change its output, and the identity of
    its inputs (ids and content digests, not paths: a moved input is the same input). `leave_out`:
    config keys naming inputs (`inputs` stands for them) or not changing the output (beyond WHERE_OPTIONS,
    the stage's RUN_ONLY and REWARD_RUN_ONLY, left out always); `id` is a digest of the rest."""
    options = {k: v for k, v in config.items()
               if k not in WHERE_OPTIONS and k not in RUN_ONLY.get(stage, ()) and k not in leave_out}
    if options.get("reward_options"):
        options["reward_options"] = result_reward_options(options["reward_options"])
    body = {"stage": stage, "options": options, "inputs": inputs}
    return {**json_ready(body), "id": _digest(body)}


def _visible(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if not p.name.startswith(".")] if folder.is_dir() else []


def folder_identity(folder: Path) -> dict | None:
    """What a folder says it holds: its stage.json, else (written by an older tpkit) its manifest's
    stage; None for a missing or empty folder; {"stage": None} for files tpkit did not write."""
    folder = Path(folder)
    for name in (STAGE_FILE, MANIFEST):
        try:
            body = json.loads((folder / name).read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(body, dict) and body.get("stage"):
            return body if name == STAGE_FILE else body.get("identity") or {"stage": body["stage"]}
    return {"stage": None} if _visible(folder) else None


def _mismatch(folder: Path, held: dict, want: dict, defaults: dict | None = None) -> str | None:
    """Why a folder's content is not what this stage run would write (None: it is). `defaults` (option ->
    default, as JSON): options the folder does not name because the tpkit that wrote it did not have
    them yet count as the same when this run has them at their defaults, the behaviour it had."""
    if held.get("stage") is None:
        return f"{folder} already holds files that tpkit did not write (no {STAGE_FILE})"
    if held["stage"] != want["stage"]:
        name = lambda stage: str(stage).replace("eval-", "eval ")  # noqa: E731  (eval-reward is `tpkit eval reward`)
        return f"{folder} holds the output of `tpkit {name(held['stage'])}`, not of `tpkit {name(want['stage'])}`"
    if held.get("id") == want["id"]:
        return None
    if "options" not in held:
        return f"{folder} holds {want['stage']} output of unknown options (written by an older tpkit)"
    added = {k for k in set(want["options"]) - set(held["options"])
             if defaults is not None and k in defaults and want["options"][k] == defaults[k]}
    # Inputs the writing tpkit did not record yet (the model's content, the resolved family) are unknown,
    # not different: accepted like added options, on finished folders only.
    added_inputs = set(want["inputs"]) - set(held.get("inputs", {})) if defaults is not None else set()
    options = sorted(f"--{k.replace('_', '-')}" for k in (set(held["options"]) | set(want["options"])) - added
                     if held["options"].get(k) != want["options"].get(k))
    inputs = sorted(k for k in (set(held.get("inputs", {})) | set(want["inputs"])) - added_inputs
                    if held.get("inputs", {}).get(k) != want["inputs"].get(k))
    if (added or added_inputs) and not options and not inputs:
        return None
    diff = "; ".join([", ".join(options)] * bool(options) + [f"inputs: {', '.join(inputs)}"] * bool(inputs))
    return f"{folder} holds {want['stage']} output of other options or inputs (differs in: {diff or 'version'})"


def check_out(folder: Path, identity: dict, overwrite: bool, inputs: tuple = (), defaults: dict | None = None) -> None:
    """Refuse, before anything is written, an output folder that is (or contains) one of the stage's
    inputs, that holds something else than this stage's output of these inputs and options (unless
    `overwrite`), or that `overwrite` would clear although tpkit did not write it. `defaults`: see
    `_mismatch` (only for finished folders: a resumed one would mix two identities)."""
    folder = Path(folder).resolve()
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out {folder} is a file, not a folder", "pass a folder for --out")
    for inp in inputs:
        if inp and (folder == Path(inp).resolve() or folder in Path(inp).resolve().parents):
            raise InputError(f"--out {folder} is (or contains) this stage's input {inp}",
                             "write to a new --out folder")
    held = folder_identity(folder)
    if held is None:
        return
    if overwrite:
        if held.get("stage") is None:
            raise InputError(f"{folder} holds files that tpkit did not write, so --overwrite will not delete them",
                             "pass a new or empty --out folder")
        return
    why = _mismatch(folder, held, identity, defaults)
    if why:
        raise InputError(why, "pass --overwrite to replace that folder's content, or a new --out folder"
                         if held.get("stage") else "pass a new or empty --out folder")


@contextlib.contextmanager
def stage_lock(folder: Path, rank: int = 0, overwrite: bool = False, world_size: int = 1,
               identity: dict | None = None, inputs: tuple = ()) -> Iterator[None]:
    """Hold this rank's exclusive lock on a stage folder while the stage runs, and claim the folder.

    A second process started on the same folder and rank by mistake stops at once instead of
    interleaving files with the first (ranks of one launch lock different files). The kernel drops
    the lock when the process dies, kill -9 included, so a crash never leaves a stale lock.
    identity (`stage_identity`): checked against what the folder holds (`check_out`) before
    anything is written, then written to stage.json before any output, so that a half-finished
    folder also knows what it holds; a rerun resumes only with the same identity.
    overwrite: clear the folder first (everything but the locks; one process), to redo a stage on purpose.
    """
    import fcntl

    folder = Path(folder)
    if overwrite and world_size > 1:
        raise InputError("--overwrite with several processes could delete other ranks' fresh files",
                         "run once with --overwrite in one process, or delete the folder first")
    if identity is not None:
        check_out(folder, identity, overwrite, inputs)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / f".lock-r{rank:03d}"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InputError(f"{folder} is in use by another tpkit process (rank {rank})",
                         "wait for it to finish, or write to another --out") from None
    try:
        if identity is not None:
            check_out(folder, identity, overwrite, inputs)  # again, now that no other process writes here
        if overwrite:
            _clear(folder)
        if identity is not None and not (folder / STAGE_FILE).is_file():
            atomic_write_json(folder / STAGE_FILE, identity)
        remove_stale_temps(folder, rank, world_size)
        yield
    except BaseException:
        if created and sorted(p.name for p in folder.iterdir()) in ([lock.name], sorted([lock.name, STAGE_FILE])):
            shutil.rmtree(folder)  # failed before writing any output: leave no trace
        raise
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _clear(folder: Path) -> None:
    """Remove everything in a stage folder but the lock files (no old file survives --overwrite)."""
    for p in folder.iterdir():
        if p.name.startswith(".lock-"):
            continue
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def write_output(path: Path, data: bytes, stats: dict) -> None:
    """An output file and its stats sidecar: the sidecar first, so that every output that exists
    has its stats (a kill between the two leaves only a sidecar, rewritten by the rerun)."""
    atomic_write_json(Path(path).with_name(stats_name(path)), stats)
    atomic_write(path, data)


def remove_stale_temps(folder: Path, rank: int, world_size: int) -> None:
    """Delete temporary files and folders (`.NAME.*.tmp`) that a killed run of this stage left.

    Called with the stage lock held; with several ranks only names carrying this rank are touched
    (the others' may be in progress)."""
    import shutil

    for p in Path(folder).rglob(".*.tmp"):
        if world_size > 1 and f"-r{rank:03d}-" not in p.name:
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def read_seconds(folder: Path, rank: int | None = None) -> dict[str, float]:
    """Seconds per phase from `seconds_name(rank)` files: one rank's, or (rank None) summed over every
    rank's, which is compute time, not wall-clock (ranks run side by side)."""
    paths = [Path(folder) / seconds_name(rank)] if rank is not None else sorted(Path(folder).glob("seconds-r*.json"))
    total: dict[str, float] = {}
    for path in paths:
        if path.is_file():
            for k, v in json.loads(path.read_text()).items():
                total[k] = round(total.get(k, 0.0) + v, 3)
    return total


def sum_stats(outputs: list[Path]) -> dict:
    """Add up the numeric fields of the outputs' stats sidecars (counts and seconds per phase)."""
    total: dict = {}
    for out in outputs:
        side = Path(out).with_name(stats_name(out))
        stats = json.loads(side.read_text()) if side.is_file() else {}
        for group, values in stats.items():
            if not isinstance(values, dict):
                continue
            for k, v in values.items():
                total.setdefault(group, {})
                total[group][k] = round(total[group].get(k, 0) + v, 3)
    return total


# --------------------------------------------------------------------------------------------
# Shards (WebDataset tar format: members KEY.EXT grouped by KEY)
# --------------------------------------------------------------------------------------------


def _tensors_to_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def _tensors_from_bytes(data: bytes, where: str) -> dict:
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise InputError(f"{where}: corrupt safetensors member ({e})", "rerun the stage that wrote this shard") from None


@dataclass
class PromptRecord:
    prompt_id: str
    prompt: str
    metadata: dict
    embeds: dict = field(repr=False)  # the model family's encodings (Model.encode) -> tensors (batch dim 1)


@dataclass
class TrajectoryRecord:
    meta: dict  # see rollout.trajectory_meta
    tensors: dict = field(repr=False)  # TENSOR_KEYS -> float32 tensors
    final_png: bytes = field(repr=False)

    @property
    def trajectory_id(self) -> str:
        return self.meta["trajectory_id"]


class ShardWriter:
    """Writes one shard as a deterministic tar (fixed mtimes and owners: same inputs, same bytes)."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._tar = tarfile.open(fileobj=self._buf, mode="w", format=tarfile.USTAR_FORMAT)
        self._prompts: list[str] = []
        self._trajs: list[str] = []

    def _add(self, key: str, ext: str, data: bytes) -> None:
        if not _SAFE_KEY.match(key):
            raise ValueError(f"unsafe shard key {key!r}")
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        self._tar.addfile(info, io.BytesIO(data))

    def add_prompt(self, rec: PromptRecord) -> None:
        body = {"prompt_id": rec.prompt_id, "prompt": rec.prompt, "metadata": rec.metadata,
                "schema_version": SCHEMA_VERSION}
        self._add(rec.prompt_id, PROMPT_JSON, json.dumps(body, sort_keys=True).encode())
        self._add(rec.prompt_id, EMBEDS, _tensors_to_bytes(rec.embeds))
        self._prompts.append(rec.prompt_id)

    def add_trajectory(self, rec: TrajectoryRecord) -> None:
        key = rec.trajectory_id
        self._add(key, TRAJ_JSON, json.dumps(rec.meta, sort_keys=True).encode())
        self._add(key, TENSORS, _tensors_to_bytes(rec.tensors))
        self._add(key, FINAL_PNG, rec.final_png)
        self._trajs.append(key)

    def to_bytes(self) -> bytes:
        # Last member: what the shard holds. A tar cut at a member boundary still reads cleanly,
        # so readers require this index and check it against what they found.
        self._add(INDEX_KEY, "json", json.dumps({"prompts": self._prompts, "trajectories": self._trajs}).encode())
        self._tar.close()
        return self._buf.getvalue()


def _members(path: Path, only: str | None = None) -> Iterator[tuple[str, str, bytes]]:
    """(key, extension, bytes) for each regular member (`only`: of that extension; the others' bytes are
    skipped, not read); names are never used as paths."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                name = m.name
                key, _, ext = name.partition(".")
                if only is not None and ext != only:
                    continue
                f = tar.extractfile(m)
                yield key, ext, f.read() if f else b""
    except (tarfile.TarError, EOFError, OSError) as e:
        raise InputError(f"{path}: truncated or corrupt shard ({e})",
                         "delete it and rerun `tpkit rollout` with the same options to rewrite it") from None


def check_shard(path: Path, rollout_manifest: dict) -> None:
    """A shard must still be the one its rollout wrote (the manifest records each shard's sha256)."""
    want = (rollout_manifest.get("shard_sha256") or {}).get(Path(path).name)
    if want and file_digest(path) != want:
        raise InputError(f"{path}: changed since `tpkit rollout` wrote it (its sha256 is not the manifest's)",
                         "rerun `tpkit rollout` with --overwrite, or put the rollout's own shard back")


def check_files(folder: Path, manifest: dict, files: list[Path], stage: str) -> None:
    """A finished folder's tables must still be the ones its stage wrote: the manifest records each file's
    sha256 (`files_sha256`; folders written before it was recorded are not checked)."""
    want = manifest.get("files_sha256") or {}
    for f in files:
        if f.name in want and file_digest(f) != want[f.name]:
            raise InputError(f"{f}: changed since `tpkit {stage}` wrote it (its sha256 is not the one in "
                             f"{Path(folder) / MANIFEST})",
                             f"rerun `tpkit {stage}` with --overwrite, or put the stage's own file back")


def shard_prompts(path: Path) -> list[tuple[str, dict]]:
    """(prompt, metadata) of every prompt sample of a shard, reading nothing else (a check before the work)."""
    return [(body["prompt"], body.get("metadata") or {}) for key, ext, data in _members(Path(path), PROMPT_JSON)
            if ext == PROMPT_JSON for body in [_json(data, f"{path}:{key}")]]


def read_shard(path: Path, load_tensors: bool = True) -> tuple[dict[str, PromptRecord], list[TrajectoryRecord]]:
    """Prompts (by prompt_id) and trajectories of one shard, validated against the schema."""
    path = Path(path)
    groups: dict[str, dict[str, bytes]] = {}
    for key, ext, data in _members(path):
        groups.setdefault(key, {})[ext] = data
    prompts: dict[str, PromptRecord] = {}
    trajectories: list[TrajectoryRecord] = []
    for key, g in groups.items():
        where = f"{path}:{key}"
        if PROMPT_JSON in g:
            body = _json(g[PROMPT_JSON], where)
            check_schema_version(body.get("schema_version"), where)
            if EMBEDS not in g:
                raise InputError(f"{where}: prompt sample without {EMBEDS}", "rerun `tpkit rollout` to rewrite the shard")
            embeds = _tensors_from_bytes(g[EMBEDS], where) if load_tensors else {}
            _check_finite(embeds, f"{where}.{EMBEDS}")
            prompts[body["prompt_id"]] = PromptRecord(body["prompt_id"], body["prompt"], body.get("metadata", {}), embeds)
        elif TRAJ_JSON in g:
            meta = _json(g[TRAJ_JSON], where)
            check_schema_version(meta.get("schema_version"), where)
            missing = [m for m in (TENSORS, FINAL_PNG) if m not in g]
            if missing:
                raise InputError(f"{where}: trajectory sample without {', '.join(missing)}",
                                 "rerun `tpkit rollout` to rewrite the shard")
            tensors = _tensors_from_bytes(g[TENSORS], where) if load_tensors else {}
            _check_finite(tensors, f"{where}.{TENSORS}")
            trajectories.append(TrajectoryRecord(meta, tensors, g[FINAL_PNG]))
    index = groups.get(INDEX_KEY, {}).get("json")
    if index is None:
        raise InputError(f"{path}: truncated shard (no {INDEX_KEY}.json member at its end)",
                         "delete it and rerun `tpkit rollout` with the same options to rewrite it")
    index = _json(index, f"{path}:{INDEX_KEY}")
    if sorted(index.get("prompts", [])) != sorted(prompts) or \
            sorted(index.get("trajectories", [])) != sorted(t.trajectory_id for t in trajectories):
        raise InputError(f"{path}: its members do not match its index (damaged or edited shard)",
                         "delete it and rerun `tpkit rollout` with the same options to rewrite it")
    for t in trajectories:
        if t.meta["prompt_id"] not in prompts:
            raise InputError(f"{path}: trajectory {t.trajectory_id} has no prompt sample", "rerun `tpkit rollout`")
    return prompts, trajectories


def _check_finite(tensors: dict, where: str) -> None:
    """Non-finite numbers in a valid file would turn into NaN losses or meaningless rewards downstream."""
    import torch

    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise InputError(f"{where}: {name} holds NaN or infinite values",
                             "delete the shard and rerun the stage that wrote it (`tpkit rollout` with the same options)")


def _json(data: bytes, where: str) -> dict:
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{where}: member is not valid JSON ({e})", "rerun the stage that wrote it") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: JSON member is not an object", "rerun the stage that wrote it")
    return obj


# --------------------------------------------------------------------------------------------
# Parquet
# --------------------------------------------------------------------------------------------


PARQUET_META = b"tpkit"  # Parquet schema metadata: what a file was computed from (stage, rollout_id ...)


def parquet_bytes(table, meta: dict | None = None) -> bytes:
    """A table as Parquet bytes; `meta` goes into the schema metadata, so that a single file, copied
    or passed on its own, still says which rollout it belongs to."""
    import pyarrow.parquet as pq

    if meta is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                               PARQUET_META: json.dumps(meta, sort_keys=True).encode()})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def write_parquet(path: Path, table, meta: dict | None = None) -> None:
    atomic_write(path, parquet_bytes(table, meta))


def _unreadable_fix(path: Path, stage: str) -> str:
    """A file that is not Parquet by its name was given by mistake; one that is was damaged."""
    if Path(path).suffix != ".parquet":
        return f"pass the folder {stage} wrote, or one of its .parquet files"
    return f"rerun {stage} to rewrite it"


def parquet_files(path: Path, what: str) -> list[Path]:
    """One Parquet file, or every *.parquet in a folder."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.parquet"))
        if not files:
            raise InputError(f"{path}: no .parquet files", f"pass the folder written by `tpkit {what}` or one .parquet file")
        return files
    if path.is_file():
        return [path]
    if any(c in str(path) for c in "*?["):  # a quoted glob pattern
        import glob

        files = sorted(Path(f) for f in glob.glob(str(path)) if Path(f).is_file())
        if files:
            return files
    raise InputError(f"{path}: no such file or folder", "check the path")


def digests(files: list[Path]) -> dict[str, str]:
    """{name: sha256} of input files (the path where names repeat, as a glob over folders gives)."""
    names = [f.name for f in files]
    return {(f.name if names.count(f.name) == 1 else str(f)): file_digest(f) for f in files}


def parquet_meta(path: Path) -> dict:
    """The tpkit metadata of a Parquet file ({} for a table tpkit did not write)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        raw = (pq.read_schema(path).metadata or {}).get(PARQUET_META)
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})", _unreadable_fix(path, "the stage")) from None
    try:
        meta = json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        meta = {}
    return meta if isinstance(meta, dict) else {}


def rollout_of(files: list[Path], table=None) -> str | None:
    """The one rollout_id that Parquet files were computed from (their metadata, else a `rollout_id`
    column); None if they name none. Files of different rollouts are an error."""
    ids = {parquet_meta(f).get("rollout_id") for f in files}
    if table is not None and None in ids and "rollout_id" in table.column_names:
        ids = (ids - {None}) | set(table["rollout_id"].cast("string").to_pylist())
    named = ids - {None}
    if len(named) > 1 or (named and None in ids):
        raise InputError(f"{files[0].parent}: files computed from different rollouts ({', '.join(sorted(map(str, ids)))})",
                         "pass the files of one rollout only")
    return named.pop() if named else None


def read_parquet_tables(path: Path, what: str) -> "Any":
    """One Parquet file, or every *.parquet in a folder, concatenated into one pyarrow Table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    files = parquet_files(path, what)
    tables = []
    for f in files:
        try:
            tables.append(pq.read_table(f))
        except (pa.ArrowInvalid, OSError) as e:
            raise InputError(f"{f}: not a readable Parquet file ({e})", _unreadable_fix(f, f"`tpkit {what}`")) from None
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise InputError(f"{path}: Parquet files with incompatible columns ({e})", "pass files from one stage run") from None


# --------------------------------------------------------------------------------------------
# Prompt files
# --------------------------------------------------------------------------------------------


@dataclass
class Prompt:
    prompt_id: str
    prompt: str
    metadata: dict  # the whole JSONL object (or {"prompt": text} for .txt), passed to rewards


def load_prompts(path: Path) -> list[Prompt]:
    """A .txt file (one prompt a line, blank lines skipped) or .jsonl (objects with "prompt").

    prompt_id is the object's "prompt_id" or "id" if given, else p + the prompt's index.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompts file {path} " + ("is a folder" if path.is_dir() else "does not exist"),
                         "pass --prompts FILE (.txt, one prompt a line, or .jsonl)")
    if path.suffix not in (".txt", ".jsonl"):
        raise InputError(f"prompts file {path} is neither .txt nor .jsonl", "use a .txt (one prompt a line) or .jsonl file")
    try:
        lines = [(n, ln) for n, ln in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if ln.strip()]
    except UnicodeDecodeError:
        raise InputError(f"prompts file {path} is not UTF-8 text", "save it as UTF-8") from None
    prompts = []
    for i, (lineno, line) in enumerate(lines):
        if path.suffix == ".txt":
            obj = {"prompt": line.strip()}
        else:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}: line {lineno} is not JSON ({e.msg})", "write one JSON object per line") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
                raise InputError(f"{path}: line {lineno} has no \"prompt\" string", 'each line needs {"prompt": "...", ...}')
        pid = str(obj.get("prompt_id", obj.get("id", f"p{i:05d}")))
        if not _SAFE_KEY.match(pid):
            raise InputError(f"{path}: line {lineno}: prompt id {pid!r} may only use letters, digits, _ and -", "rename the id")
        prompts.append(Prompt(pid, obj["prompt"], obj))
    if not prompts:
        raise InputError(f"prompts file {path} is empty", "add prompts, one per line (.txt) or one JSON object per line (.jsonl)")
    dup = [pid for pid, n in Counter(p.prompt_id for p in prompts).items() if n > 1]
    if dup:
        raise InputError(f"{path}: duplicate prompt ids {', '.join(sorted(dup)[:5])}", "give every prompt a unique id")
    return prompts
