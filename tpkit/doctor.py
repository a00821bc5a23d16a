"""`tpkit doctor`: is this environment ready for a (long) run? What is missing, and the fix.

`run(...)` returns a list of `Check`s; `render` prints them as a table, `exit_code` is 1 when any
error-level check failed. Nothing is downloaded, built or written (but for a temporary file that
tests whether a folder is writable), and the only network access is one short TCP connection
attempt to the hub (informational). Everything else is local: package metadata and imports, torch's
CUDA queries, free disk space, and the Hugging Face cache (`huggingface_hub.try_to_load_from_cache`,
which never touches the network).

Checks, in order: Python and tpkit; torch, CUDA, GPUs, bf16; the libraries tpkit needs (installed,
version, import); torchvision (absent, or importable together with transformers' image processors);
the model family's pipeline classes; the recipe (loaded with `tpkit.config.load_recipe`); the run folder (writable,
free space, an estimate of what the recipe writes); the model (tiny-sd3, a local folder or a hub id in
the HF cache, complete); each reward (known, its optional extras, its model files); the hub
(reachable?); $TPKIT_HOME and the HF cache.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tpkit.config import FLUX_MODEL, SHAPES_MODEL, TINY_MODEL

GiB = 1024**3
MiB = 1024**2
LOW_DISK_GIB = 20  # warn when the run folder has less free space than this
HUB_TIMEOUT = 1.5  # seconds for the hub reachability probe
LEVELS = ("error", "warning", "info")

# The libraries every stage needs (pip name, import name); their minimum versions come from tpkit's
# own metadata (pyproject), else from _FALLBACK_MINIMUMS.
CORE_PACKAGES = (("diffusers", "diffusers"), ("transformers", "transformers"), ("peft", "peft"),
                 ("accelerate", "accelerate"), ("pyarrow", "pyarrow"), ("webdataset", "webdataset"),
                 ("huggingface-hub", "huggingface_hub"), ("safetensors", "safetensors"))
_FALLBACK_MINIMUMS = {"torch": "2.4", "diffusers": "0.35", "transformers": "4.45", "peft": "0.13", "accelerate": "1.0",
                      "pyarrow": "15", "webdataset": "0.2.90", "safetensors": "0.4", "rapidocr": "3",
                      "onnxruntime": "1.17", "rapidfuzz": "3", "scipy": "1.10"}
# Optional extras per reward: (pip name, import name), and the extra that installs them.
EXTRAS = {
    "ocr": ("ocr", (("rapidocr", "rapidocr"), ("onnxruntime", "onnxruntime"), ("rapidfuzz", "rapidfuzz"))),
    "geneval": ("geneval", (("scipy", "scipy"),)),
    "geneval-strict": ("geneval", (("scipy", "scipy"),)),
}
WEIGHT_FREE = ("jpeg-compressibility", "jpeg-incompressibility", "brightness")

# Files a model folder must hold, by what tpkit loads from it. Each entry is a group of alternatives;
# "@weights" means weight files (single or sharded, every shard present).
_CONFIG = ("config.json",)
_WEIGHTS = ("@weights",)
_IMAGE_PROC = ("preprocessor_config.json",)
_TOKENIZER = ("tokenizer.json", "vocab.json")
NEEDS = {
    "clip-model": (_CONFIG, _WEIGHTS),  # CLIPModel weights only (PickScore: processor separate)
    "processor": (_IMAGE_PROC, _TOKENIZER),  # CLIPProcessor files only
    "clip": (_CONFIG, _WEIGHTS, _IMAGE_PROC, _TOKENIZER),  # model + its own processor
    "detector": (_CONFIG, _WEIGHTS, _IMAGE_PROC),  # Mask2Former/DETR + image processor
    "bert-tokenizer": (("vocab.txt",),),  # BertTokenizer (ImageReward)
}

# What CLIPProcessor.from_pretrained reads: `hf download REPO FILE...` fetches only these (a repo
# like laion/CLIP-ViT-H-14-laion2B-s32B-b79K otherwise brings several copies of its weights).
PROCESSOR_FILES = ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt")

BUILTIN_MODELS = (TINY_MODEL, SHAPES_MODEL, FLUX_MODEL)  # laptop-sized: CPU is fine


@dataclass
class Check:
    """One line of the doctor's report. `level` is how serious a failure is: an "error" fails the
    doctor (exit 1), a "warning" may cost time or disk, "info" is for the record."""

    name: str
    ok: bool
    detail: str
    fix: str | None = None
    level: str = "error"

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level {self.level!r} is not one of {LEVELS}")


@dataclass
class _Context:
    """What earlier checks found, for later ones."""

    checks: list[Check] = field(default_factory=list)
    torch: Any = None
    cuda: bool = False
    pipeline_imports_ok: bool = False
    hub_ok: bool | None = None

    def add(self, name: str, ok: bool, detail: str, fix: str | None = None, level: str = "error") -> Check:
        c = Check(name, bool(ok), detail, fix if not ok else None, level)
        self.checks.append(c)
        return c


# ---------------------------------------------------------------------------------------------
# Small helpers


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {(text.splitlines()[0] if text else '')[:200]}".rstrip(": ")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _minimums() -> dict[str, str]:
    """Package -> specifier (e.g. '>=2.4') from tpkit's installed metadata, else the fallback list."""
    out = {k: f">={v}" for k, v in _FALLBACK_MINIMUMS.items()}
    try:
        reqs = importlib.metadata.requires("tpkit") or []
    except importlib.metadata.PackageNotFoundError:
        return out
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*([<>=!~][^;]*)?", req)
        if m and m.group(2) and not m.group(1).startswith("tpkit"):
            out[m.group(1).lower()] = m.group(2).strip()
    return out


def _satisfies(version: str, spec: str | None) -> bool:
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        return Version(version) in SpecifierSet(spec)
    except Exception:  # packaging missing or an odd local version: do not cry wolf
        return True


def _gib(n: float) -> str:
    if n >= 1024 * GiB:
        return f"{n / 1024 / GiB:.1f} TiB"
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.1f} MiB"


def _nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path.expanduser()))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(path: Path) -> tuple[bool, str]:
    """Can files be created at path (or, if it does not exist yet, in its nearest existing parent)?
    Tested by creating and removing a temporary file; nothing else is written."""
    where = _nearest_existing(path)
    if not where.is_dir():
        return False, f"{where} is not a folder"
    try:
        fd, name = tempfile.mkstemp(dir=where, prefix=".tpkit-doctor-")
        os.close(fd)
        os.unlink(name)
        return True, str(where)
    except OSError as e:
        return False, f"cannot write in {where}: {e.strerror or e}"


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, as huggingface_hub resolves it (read from the environment now)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    return hf_home() / "hub"


def hf_home() -> Path:
    env = os.environ
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser()
    return Path(env.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "huggingface"


def _is_hub_id(s: str) -> bool:
    return re.fullmatch(r"[\w.-]+/[\w.-]+", s) is not None


def _cached(repo: str, filename: str) -> Path | None:
    """The file's path in the HF cache (revision main), or None; never touches the network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except Exception:
        return None
    try:
        p = try_to_load_from_cache(repo, filename, cache_dir=str(hub_cache()))
    except Exception:  # an invalid repo id and the like
        return None
    return Path(p) if isinstance(p, str) and Path(p).is_file() else None


def _weights_present(folder: Path) -> tuple[bool, str]:
    """Weight files in folder: an index whose shards are all there, or a single .safetensors/.bin file."""
    indexes = sorted(folder.glob("*.index.json"))
    for index in indexes:
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return False, f"{len(missing)} of {len(shards)} shards of {index.name} missing"
        return True, index.name
    files = [p for p in folder.glob("*") if p.suffix in (".safetensors", ".bin", ".pth", ".pt") and p.is_file()]
    if files:
        return True, files[0].name
    return False, "no weight files (.safetensors/.bin)"


def _missing_in(folder: Path, needs: Iterable[tuple[str, ...]], prefix: str = "") -> list[str]:
    """Which of the required file groups folder lacks (human-readable)."""
    missing = []
    for group in needs:
        if group == _WEIGHTS:
            ok, why = _weights_present(folder)
            if not ok:
                missing.append(f"{prefix}{why}")
        elif not any((folder / f).is_file() for f in group):
            missing.append(prefix + " or ".join(group))
    return missing


def _pipeline_missing(root: Path) -> list[str]:
    """What a diffusers pipeline folder (model_index.json at root) lacks, component by component."""
    try:
        index = json.loads((root / "model_index.json").read_text())
    except (OSError, ValueError) as e:
        return [f"model_index.json unreadable ({_first_line(e)})"]
    missing = []
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, (list, tuple)) or len(spec) != 2 or spec[0] is None:
            continue
        cls, folder = str(spec[1]), root / name
        if not folder.is_dir():
            missing.append(f"{name}/")
        elif "Scheduler" in cls:
            missing += _missing_in(folder, [("scheduler_config.json",)], f"{name}/")
        elif any(k in cls for k in ("Tokenizer", "Processor", "FeatureExtractor")):
            if not any(p.is_file() for p in folder.iterdir()):
                missing.append(f"{name}/ (empty)")
        else:
            missing += _missing_in(folder, [_CONFIG, _WEIGHTS], f"{name}/")
    return missing


def _locate(id_or_path: str, first_files: Iterable[str]) -> tuple[str, Path | None]:
    """('local', folder) | ('hub', snapshot folder or None) | ('bad', None)."""
    p = Path(id_or_path).expanduser()
    if p.exists():
        return "local", p
    if not _is_hub_id(id_or_path):
        return "bad", None
    for f in first_files:
        hit = _cached(id_or_path, f)
        if hit is not None:
            return "hub", hit.parent
    return "hub", None


def _short(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


# ---------------------------------------------------------------------------------------------
# Environment


def _check_python(ctx: _Context) -> None:
    import tpkit

    v = sys.version_info
    ctx.add("python", v >= (3, 10), f"Python {v.major}.{v.minor}.{v.micro} ({sys.executable})",
            "use Python 3.10 or newer")
    where = Path(tpkit.__file__).resolve().parent
    installed = _version("tpkit")
    detail = f"tpkit {tpkit.__version__} ({where})"
    if installed and installed != tpkit.__version__:
        ctx.add("tpkit", False, f"{detail}, but the installed metadata says {installed}",
                "reinstall: pip install -e . (in the tpkit checkout)", level="warning")
    else:
        ctx.add("tpkit", True, detail + ("" if installed else ", not pip-installed (imported from the source tree)"),
                level="info")


def _nvidia_present() -> bool:
    gpus = Path("/proc/driver/nvidia/gpus")
    try:
        return (gpus.is_dir() and any(gpus.iterdir())) or shutil.which("nvidia-smi") is not None
    except OSError:
        return False


def _check_torch(ctx: _Context, mins: dict[str, str], big_model: bool) -> None:
    version = _version("torch")
    if version is None:
        ctx.add("torch", False, "not installed",
                "install PyTorch first: pip install torch (the CUDA build matching your driver on GPU machines)")
        return
    try:
        import torch
    except Exception as e:
        ctx.add("torch", False, f"torch {version} is installed but does not import: {_first_line(e)}",
                "reinstall PyTorch: pip install --force-reinstall torch")
        return
    ctx.torch = torch
    spec = mins.get("torch")
    hip = getattr(torch.version, "hip", None)
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else (f"ROCm {hip}" if hip else "CPU build")
    ok = _satisfies(torch.__version__.split("+")[0], spec)
    ctx.add("torch", ok, f"torch {torch.__version__} ({build})" + ("" if ok else f", tpkit needs {spec}"),
            f"pip install 'torch{spec}'")

    # CUDA and the GPUs
    try:
        available = torch.cuda.is_available()
    except Exception:
        available = False
    ctx.cuda = available
    if available:
        gpus = []
        for i in range(torch.cuda.device_count()):
            try:
                props = torch.cuda.get_device_properties(i)
                text = f"{props.name} {props.total_memory / GiB:.0f} GiB"
                try:
                    free, _ = torch.cuda.mem_get_info(i)
                    text += f" ({free / GiB:.0f} free)"
                except Exception:
                    pass
            except Exception as e:
                text = f"GPU {i}: {_first_line(e)}"
            gpus.append(text)
        counts: dict[str, int] = {}
        for g in gpus:
            counts[g] = counts.get(g, 0) + 1
        ctx.add("cuda", True, f"{len(gpus)} GPU(s): " + "; ".join(f"{n} x {g}" if n > 1 else g for g, n in counts.items()),
                level="info")
        try:
            bf16 = bool(torch.cuda.is_bf16_supported())
        except Exception:
            bf16 = False
        ctx.add("bf16", bf16, "supported on this GPU (dtype auto uses it)" if bf16 else
                "this GPU has no native bf16, but dtype auto and mixed_precision bf16 would use it",
                'set rollout.dtype / score.dtype = "fp16" or "float32" and train.mixed_precision = "fp16" or "no"',
                level="warning")
        return
    if torch.version.cuda is None and _nvidia_present():
        ctx.add("cuda", False, "an NVIDIA GPU is present but this torch is a CPU build",
                "install the CUDA build of torch (see pytorch.org for the command matching your driver)",
                level="warning")
        return
    reason = "no GPU found"
    if torch.version.cuda is not None:
        try:
            torch.cuda.init()
        except Exception as e:
            reason = _first_line(e)
    level = "warning" if big_model else "info"
    ctx.add("cuda", False, f"not available ({reason}): everything runs on the CPU"
            + (", far too slow for SD3.5 or FLUX" if big_model else " (fine for the tiny models)"),
            "run on a machine with a CUDA GPU and the CUDA build of torch", level=level)


def _check_packages(ctx: _Context, mins: dict[str, str]) -> None:
    for dist, module in CORE_PACKAGES:
        version = _version(dist)
        spec = mins.get(dist) or mins.get(dist.replace("-", "_"))
        if version is None:
            ctx.add(module, False, "not installed", "pip install -e . (installs tpkit's requirements)")
            continue
        try:
            importlib.import_module(module)
        except Exception as e:
            fix = ("pip uninstall torchvision (a torchvision built for another torch breaks transformers/diffusers)"
                   if "torchvision" in str(e) else f"pip install --force-reinstall '{dist}{spec or ''}'")
            ctx.add(module, False, f"{module} {version} does not import: {_first_line(e)}", fix)
            continue
        ok = _satisfies(version, spec)
        ctx.add(module, ok, f"{module} {version}" + ("" if ok else f", tpkit needs {spec}"),
                f"pip install -U '{dist}{spec}'")


def _check_torchvision(ctx: _Context) -> None:
    """torchvision is optional; a broken one (built for another torch) breaks transformers' image
    processors at import time, i.e. every CLIP-based reward, in a way that looks like a transformers bug."""
    version = _version("torchvision")
    if version is None:
        ctx.add("torchvision", True, "not installed (not needed)", level="info")
        return
    fix = "pip uninstall torchvision (tpkit does not need it), or install the torchvision built for your torch"
    torch_version = _version("torch")
    pinned = None
    try:
        requirements = importlib.metadata.requires("torchvision") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    for req in requirements:
        m = re.match(r"\s*torch\s*==\s*([\w.+]+)", req)
        if m:
            pinned = m.group(1)
    if pinned and torch_version and pinned.split("+")[0] != torch_version.split("+")[0]:
        ctx.add("torchvision", False,
                f"torchvision {version} is built for torch {pinned}, but torch {torch_version} is installed",
                fix, level="warning")
        return
    try:
        import torchvision  # noqa: F401
        from transformers import AutoImageProcessor, CLIPImageProcessor  # noqa: F401
    except Exception as e:
        ctx.add("torchvision", False, f"torchvision {version} breaks imports: {_first_line(e)}", fix, level="warning")
        return
    ctx.add("torchvision", True, f"torchvision {version}, imports with transformers' image processors", level="info")


def _check_pipeline_imports(ctx: _Context, model: str) -> None:
    """The model family's pipeline classes, which every stage loads (and the tiny models' builders)."""
    if ctx.torch is None:
        ctx.add("pipeline", False, "skipped: torch does not import", "fix torch first")
        return
    try:
        from tpkit import models
        from tpkit.runtime import quiet_libraries

        quiet_libraries()  # as every stage does: no info notices from the libraries
        cls = models.family(models.family_of(model)).MODEL.PIPELINE
        import diffusers
        import transformers  # noqa: F401

        getattr(diffusers, cls)
    except Exception as e:
        fix = ("pip uninstall torchvision (a torchvision built for another torch breaks these imports)"
               if "torchvision" in str(e) else "pip install -U 'diffusers>=0.35' 'transformers>=4.45'")
        ctx.add("pipeline", False, f"cannot import the model's diffusers pipeline: {_first_line(e)}", fix)
        return
    ctx.pipeline_imports_ok = True
    ctx.add("pipeline", True, f"{cls} and its text encoders import", level="info")


# ---------------------------------------------------------------------------------------------
# Recipe, run folder and disk


def count_prompts(path: str | Path) -> int | None:
    """Non-empty lines of a .txt/.jsonl prompt file (None if unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return None


def estimate_round_bytes(recipe, cuda: bool) -> tuple[int, str] | None:
    """Rough bytes one round of `tpkit run` writes, and how they add up (None: prompts unknown).

    Per trajectory: (K + 1 states + K velocities + final latent) x C x h x w float32 plus the final
    PNG (at most 3 bytes a pixel); per prompt, its and the empty prompt's embeddings (77 + T5 tokens) in
    the model's dtype; per round, the LoRA adapter with its optimizer (2x) and EMA state."""
    ro, tr = recipe.rollout, recipe.train
    n = count_prompts(ro.prompts) if ro.prompts else None
    if not n:
        return None
    prompts = min(ro.prompts_per_round, n) if ro.prompts_per_round else n
    trajectories = prompts * ro.group_size
    from tpkit import models

    sz = models.default(ro.model, "sizes", ro.family)  # the family's (SD3.5-Medium, FLUX.1-dev) or a tiny model's
    res, k = int(ro.resolution), ro.window_size
    latent = sz["latent_channels"] * (res // sz["vae_factor"]) ** 2 * 4
    per_traj = (2 * k + 2) * latent + res * res * 3 + 200 * (k + 1)  # + its score rows
    dtype_bytes = 4 if (ro.dtype in ("float32", "fp32") or (ro.dtype == "auto" and not cuda)) else 2
    per_prompt = sz["prompt_sets"] * ((sz["clip_tokens"] + ro.max_sequence_length) * sz["text_dim"] + sz["pooled_dim"]) * dtype_bytes
    train = tr.lora_rank * sz["lora_bytes_per_rank"] * (3 + (1 if tr.ema else 0))
    total = trajectories * per_traj + prompts * per_prompt + train
    how = (f"{trajectories} trajectories x {_gib(per_traj)} + {prompts} prompts x {_gib(per_prompt)} embeddings"
           f" + {_gib(train)} adapter/optimizer")
    return total, how


def _finished_rounds(run_dir: Path, rounds: int) -> int:
    return sum(1 for r in range(rounds) if (run_dir / f"round-{r:04d}" / "round.json").is_file())


def _check_run_folder(ctx: _Context, run_dir: Path, recipe) -> None:
    ok, where = _writable(run_dir)
    ctx.add("run folder", ok, f"{run_dir} ({'exists' if run_dir.exists() else 'created on start'}; writable)"
            if ok else f"{run_dir}: {where}", "choose a writable --out folder")
    base = _nearest_existing(run_dir)
    try:
        free = shutil.disk_usage(base).free
    except OSError as e:
        ctx.add("disk space", False, f"cannot read the free space of {base}: {e}", None, level="warning")
        return
    detail = f"{_gib(free)} free in {base}"
    estimate = estimate_round_bytes(recipe, ctx.cuda) if recipe is not None else None
    if estimate is not None:
        per_round, how = estimate
        left = max(recipe.rounds - _finished_rounds(run_dir, recipe.rounds), 0)
        need = per_round * left
        detail += (f"; the recipe writes ≈ {_gib(per_round)} per round ({how}), "
                   f"≈ {_gib(need)} for the {left} round(s) to go")
        if left and free < per_round:
            ctx.add("disk space", False, detail + ": not enough for one round",
                    "free space, or put the run on a bigger disk (--out DIR)")
            return
        if free < need:
            ctx.add("disk space", False, detail + ": it will fill up before the last round",
                    "free space, put the run on a bigger disk (--out DIR), or run fewer rounds (--rounds N)",
                    level="warning")
            return
    if free < LOW_DISK_GIB * GiB:
        ctx.add("disk space", False, detail + f" (under {LOW_DISK_GIB} GiB)",
                "free space, or put the run on a bigger disk (--out DIR)", level="warning")
        return
    ctx.add("disk space", True, detail, level="warning")


# ---------------------------------------------------------------------------------------------
# The model and the rewards' models


def _download_fix(ctx: _Context, repo: str, alternative: str, files: str = "") -> str:
    fix = f"hf download {repo}{files}"
    if ctx.hub_ok is False:
        fix += " (where the hub is reachable)"
    return f"{fix}, or {alternative}"


def _check_model(ctx: _Context, model: str, where: str) -> None:
    alternative = f"a local folder ({where})"
    if model in BUILTIN_MODELS:
        try:
            from tpkit import models

            path = models.family(models.family_of(model)).location(model)
        except Exception as e:
            ctx.add("model", False, f"{model}: cannot import tpkit.models: {_first_line(e)}", "fix torch/diffusers first")
            return
        if (path / "model_index.json").is_file():
            missing = _pipeline_missing(path)
            ctx.add("model", not missing, f"{model} at {path}" if not missing else f"{model} at {path} is incomplete: "
                    f"{_short(missing)}", f"delete {path}; it is rebuilt on first use (nothing downloaded)"
                    if model != SHAPES_MODEL else "reinstall tpkit (its weights ship inside the package)")
            return
        if model == SHAPES_MODEL:
            ctx.add("model", False, f"{model}: no weights at {path}", "reinstall tpkit (its weights ship inside the package)")
            return
        ok, why = _writable(path.parent)
        buildable = ok and ctx.pipeline_imports_ok
        ctx.add("model", buildable, f"{model}: built on first use under {path.parent} (nothing downloaded)" if buildable
                else f"{model} cannot be built: {why if not ok else 'the pipeline classes do not import'}",
                "set TPKIT_HOME to a writable folder" if not ok else "fix the pipeline check above")
        return
    kind, folder = _locate(model, ["model_index.json"])
    if kind == "bad":
        ctx.add("model", False, f"{model!r}: no such folder, and not a hub id (org/name)", alternative)
        return
    if kind == "local":
        if not (folder / "model_index.json").is_file():
            ctx.add("model", False, f"{folder} has no model_index.json (not a diffusers pipeline folder)",
                    "pass a folder saved by the pipeline's save_pretrained (or a hub id)")
            return
        missing = _pipeline_missing(folder)
        ctx.add("model", not missing, f"{model} (local folder)" + (f" is incomplete: {_short(missing)}" if missing else ""),
                "copy the complete pipeline folder (every component with its weights)")
        return
    gated = ("; gated: accept its licence on huggingface.co and `hf auth login` first"
             if model.startswith("stabilityai/") else "")
    if folder is None:
        ctx.add("model", False, f"{model} is not in the HF cache ({hub_cache()})",
                _download_fix(ctx, model, alternative) + gated)
        return
    missing = _pipeline_missing(folder)
    ctx.add("model", not missing, f"{model} in the HF cache ({folder})" if not missing else
            f"{model} in the HF cache is incomplete: {_short(missing)}",
            _download_fix(ctx, model, alternative) + gated)


def reward_models(name: str, options: dict) -> list[tuple[str, str, str, str]]:
    """(role, id or path, kind, option) for each model file set a built-in reward loads.
    kind: a NEEDS key, or 'file' (a weight file path or repo_id:filename)."""
    if name == "pickscore":
        from tpkit.clip_rewards import PICKSCORE_MODEL, PICKSCORE_PROCESSOR

        return [("model", str(options.get("model", PICKSCORE_MODEL)), "clip-model", "model"),
                ("processor", str(options.get("processor", PICKSCORE_PROCESSOR)), "processor", "processor")]
    if name == "clipscore":
        from tpkit.clip_rewards import CLIP_L14

        return [("model", str(options.get("model", CLIP_L14)), "clip", "model")]
    if name == "aesthetic":
        from tpkit.clip_rewards import AESTHETIC_HEAD, CLIP_L14

        return [("model", str(options.get("model", CLIP_L14)), "clip", "model"),
                ("head", str(options.get("head", AESTHETIC_HEAD)), "file", "head")]
    if name == "imagereward":
        from tpkit.image_reward import CHECKPOINT, TOKENIZER

        return [("checkpoint", str(options.get("checkpoint", CHECKPOINT)), "file", "checkpoint"),
                ("tokenizer", str(options.get("tokenizer", TOKENIZER)), "bert-tokenizer", "tokenizer")]
    if name in ("geneval", "geneval-strict"):
        from tpkit.geneval import DEFAULT_CLIP, DEFAULT_DETECTOR

        return [("detector", str(options.get("detector", DEFAULT_DETECTOR)), "detector", "detector"),
                ("clip", str(options.get("clip", DEFAULT_CLIP)), "clip", "clip")]
    return []


def _check_extras(ctx: _Context, reward: str, mins: dict[str, str]) -> None:
    extra, packages = EXTRAS[reward]
    problems, versions = [], []
    for dist, module in packages:
        version = _version(dist)
        if version is None:
            problems.append(f"{dist} not installed")
            continue
        try:
            importlib.import_module(module)
        except Exception as e:
            problems.append(f"{dist} {version} does not import ({_first_line(e)})")
            continue
        spec = mins.get(dist)
        if not _satisfies(version, spec):
            problems.append(f"{dist} {version} (needs {spec})")
        versions.append(f"{dist} {version}")
    fix = f"pip install 'tpkit[{extra}]'"
    if problems:
        ctx.add(f"reward {reward}: extras", False, "; ".join(problems), fix)
        return
    detail = ", ".join(versions)
    if reward == "ocr":
        try:
            import rapidocr

            from tpkit.ocr import _wheel_models

            det, rec = _wheel_models(rapidocr)
            detail += f"; PP-OCR weights in the wheel ({det.name}, {rec.name})"
        except Exception as e:
            ctx.add(f"reward {reward}: extras", False, f"{detail}; {getattr(e, 'message', None) or _first_line(e)}",
                    "pip install --force-reinstall 'tpkit[ocr]'")
            return
    ctx.add(f"reward {reward}: extras", True, detail)


def _check_head_file(ctx: _Context, label: str, spec: str, option: str) -> None:
    alternative = f"point {option} at a local copy"
    path = Path(spec).expanduser()
    if path.is_file():
        ctx.add(label, True, f"{path}")
        return
    repo, sep, filename = spec.partition(":")
    if not sep or not filename or not _is_hub_id(repo) or path.exists():
        ctx.add(label, False, f"{spec!r}: not a file, and not repo_id:filename", alternative.capitalize())
        return
    hit = _cached(repo, filename)
    ctx.add(label, hit is not None, f"{spec} in the HF cache" if hit else f"{spec} is not in the HF cache ({hub_cache()})",
            _download_fix(ctx, repo, alternative, f" {filename}"))


def _check_model_files(ctx: _Context, label: str, id_or_path: str, needs: list[tuple[str, ...]], option: str,
                       processor_only: bool) -> None:
    alternative = f"point {option} at a local copy"
    first = [f for group in needs if group != _WEIGHTS for f in group]
    kind, folder = _locate(id_or_path, first)
    if kind == "bad":
        ctx.add(label, False, f"{id_or_path!r}: no such folder, and not a hub id (org/name)", alternative.capitalize())
        return
    if kind == "local" and not folder.is_dir():
        ctx.add(label, False, f"{folder} is not a folder", alternative.capitalize())
        return
    files = " " + " ".join(PROCESSOR_FILES) if processor_only else ""  # the processor without the weights
    if folder is None:
        ctx.add(label, False, f"{id_or_path} is not in the HF cache ({hub_cache()})",
                _download_fix(ctx, id_or_path, alternative, files))
        return
    missing = _missing_in(folder, needs)
    where = "local folder" if kind == "local" else f"HF cache, {folder}"
    if not missing:
        ctx.add(label, True, f"{id_or_path} ({where})")
    elif kind == "local":
        ctx.add(label, False, f"{id_or_path} lacks {_short(missing)}",
                "copy the complete model folder there (save_pretrained)")
    else:
        ctx.add(label, False, f"{id_or_path} in the HF cache lacks {_short(missing)}",
                _download_fix(ctx, id_or_path, alternative, files))


def _check_rewards(ctx: _Context, wanted: list[tuple[str, dict, str]], mins: dict[str, str]) -> None:
    """wanted: (reward name, its options, where it comes from: 'recipe', 'eval', '--reward')."""
    from tpkit.rewards import BUILTIN

    seen_names: set[str] = set()
    models: dict[str, dict] = {}  # id -> {"needs": [...], "users": [...], "option": str, "processor_only": bool}
    for name, options, source in wanted:
        if name in seen_names and name not in ("pickscore", "clipscore", "aesthetic", "imagereward", "geneval",
                                                "geneval-strict"):
            continue
        first_time = name not in seen_names
        seen_names.add(name)
        if name not in BUILTIN:
            if ":" not in name:
                ctx.add(f"reward {name}", False, f"unknown reward ({source})",
                        f"use one of {', '.join(BUILTIN)} (see `tpkit rewards`) or module:function for your own")
                continue
            module = name.partition(":")[0]
            try:
                found = importlib.util.find_spec(module) is not None
                why = "" if found else "not found"
            except Exception as e:
                found, why = False, _first_line(e)
            ctx.add(f"reward {name}", found, f"your own reward, module {module} " + ("found" if found else why),
                    f"make {module} importable (install it or add its folder to PYTHONPATH)")
            continue
        if first_time:
            if name in WEIGHT_FREE:
                ctx.add(f"reward {name}", True, "needs nothing", level="info")
            if name in EXTRAS:
                _check_extras(ctx, name, mins)
        try:
            entries = reward_models(name, options)
        except Exception as e:
            ctx.add(f"reward {name}", False, f"cannot read its default models: {_first_line(e)}", "fix torch first")
            continue
        for role, id_or_path, kind, option in entries:
            label = f"reward {name}: {role}"
            opt = f"{name}.{option}"
            if kind == "file":
                _check_head_file(ctx, label, id_or_path, opt)
                continue
            m = models.setdefault(id_or_path, {"needs": [], "users": [], "option": opt, "processor_only": True})
            for group in NEEDS[kind]:
                if group not in m["needs"]:
                    m["needs"].append(group)
            if f"{name}: {role}" not in m["users"]:
                m["users"].append(f"{name}: {role}")
            m["processor_only"] = m["processor_only"] and kind == "processor"
    for id_or_path, m in models.items():
        label = "reward " + "; ".join(m["users"])
        _check_model_files(ctx, label, id_or_path, m["needs"], m["option"], m["processor_only"])


# ---------------------------------------------------------------------------------------------
# Hub, caches


def _probe_hub() -> bool:
    """hub.hub_reachable, also bounded when name resolution itself hangs (no network at all)."""
    from tpkit import hub

    result: dict[str, bool] = {}

    def probe() -> None:
        try:
            result["ok"] = bool(hub.hub_reachable(timeout=HUB_TIMEOUT))
        except Exception:
            result["ok"] = False

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(HUB_TIMEOUT + 1.0)
    return result.get("ok", False)


def _check_hub(ctx: _Context) -> None:
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    ok = _probe_hub()
    ctx.hub_ok = ok
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if ok:
        ctx.add("hub", True, f"{endpoint} reachable", level="info")
    else:
        ctx.add("hub", False, "HF_HUB_OFFLINE is set: only local files are used" if offline else
                f"{endpoint} not reachable: only local files are used (fine when every model is present)",
                "download missing models on a machine with internet and copy the HF cache folder here", level="info")


def _check_homes(ctx: _Context, need_downloads: bool) -> None:
    try:
        from tpkit.runtime import tpkit_home

        home = tpkit_home()
    except Exception:
        home = Path(os.environ.get("TPKIT_HOME", "~/.cache/tpkit")).expanduser()
    ok, why = _writable(home)
    ctx.add("TPKIT_HOME", ok, f"{home} (writable; tiny-sd3 and tpkit's caches)" if ok else f"{home}: {why}",
            "set TPKIT_HOME to a writable folder")
    cache = hub_cache()
    exists = cache.is_dir()
    repos = sum(1 for p in cache.glob("models--*")) if exists else 0
    detail = f"{cache} ({repos} model repo(s) cached)" if exists else f"{cache} (does not exist yet)"
    if os.environ.get("HF_HOME"):
        detail += ", from $HF_HOME"
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        detail += ", from $HF_HUB_CACHE"
    try:
        free = shutil.disk_usage(_nearest_existing(cache)).free
        detail += f"; {_gib(free)} free"
    except OSError:
        free = None
    if need_downloads:
        writable, why = _writable(cache)
        if not writable:
            ctx.add("HF cache", False, f"{detail}; {why}", "set HF_HOME (or HF_HUB_CACHE) to a writable folder")
            return
        if free is not None and free < LOW_DISK_GIB * GiB:
            ctx.add("HF cache", False, f"{detail}: models still to download need room (SD3.5-Medium alone is > 10 GiB)",
                    "free space or set HF_HOME to a folder on a bigger disk", level="warning")
            return
    ctx.add("HF cache", True, detail, level="info")


# ---------------------------------------------------------------------------------------------
# Entry points


def run(recipe: str | None = None, out: str | None = None, model: str | None = None, rewards: list[str] = (),
        reward_opts: list[str] = ()) -> list[Check]:
    """Check this environment for a run of `recipe` (or of --model/--reward) writing into `out`.

    rewards: NAME[=WEIGHT] as for --reward; reward_opts: NAME.OPTION=VALUE as for --reward-opt.
    Never raises for a problem it finds: every problem is a failed Check."""
    from tpkit.errors import TpkitError

    ctx = _Context()
    mins = _minimums()

    # The recipe first (cheap; it decides what else to check), reported after the environment.
    loaded, recipe_check = None, None
    if recipe is not None:
        try:
            from tpkit.config import load_recipe

            # --model replaces the recipe's model (as `--set rollout.model=...`: its default resolution follows)
            overrides = [f"rollout.model={json.dumps(model)}"] if model else []
            loaded = load_recipe(recipe, overrides=overrides, out=out)
            recipe_check = Check("recipe", True, f"{recipe}: {loaded.name}, {loaded.method}, {loaded.rounds} round(s), "
                                 f"model {loaded.rollout.model}", None, "error")
        except TpkitError as e:
            recipe_check = Check("recipe", False, f"{e.message}", e.fix or f"fix {recipe}", "error")
        except Exception as e:  # a bug or an odd value the loader did not anticipate
            recipe_check = Check("recipe", False, f"{recipe}: {_first_line(e)}", f"fix {recipe}", "error")
    the_model = model or (loaded.rollout.model if loaded is not None else None) or TINY_MODEL

    _guarded(ctx, "python", _check_python)
    _guarded(ctx, "torch", _check_torch, mins, big_model=the_model not in BUILTIN_MODELS)
    _guarded(ctx, "packages", _check_packages, mins)
    _guarded(ctx, "torchvision", _check_torchvision)
    _guarded(ctx, "pipeline", _check_pipeline_imports, the_model)
    if recipe_check is not None:
        ctx.checks.append(recipe_check)
        if loaded is not None:
            _guarded(ctx, "prompts", _check_recipe_details, loaded)

    # Storage
    run_dir = Path(out) if out else (Path(loaded.out) if loaded is not None else Path.cwd())
    _guarded(ctx, "disk space", _check_run_folder, run_dir, loaded)

    # Models (the hub probe first: a missing model's fix depends on it)
    _guarded(ctx, "hub", _check_hub)
    where = "--model DIR, or rollout.model in the recipe" if recipe else "--model DIR"
    _guarded(ctx, "model", _check_model, the_model, where)

    wanted: list[tuple[str, dict, str]] = []
    if loaded is not None:
        for name in loaded.score.rewards:
            wanted.append((name, dict(loaded.score.reward_options.get(name, {})), "recipe"))
        if loaded.eval_every:
            ev = loaded.eval
            if ev.kind == "geneval":
                wanted.append(("geneval", dict(ev.reward_options.get("geneval", {})), "eval"))
            else:
                for name in ev.rewards:
                    wanted.append((name, dict(ev.reward_options.get(name, {})), "eval"))
    try:
        from tpkit.config import parse_reward_options, parse_reward_specs

        cli_opts = parse_reward_options(list(reward_opts))
        for name in parse_reward_specs(list(rewards)):
            wanted.append((name, cli_opts.get(name, {}), "--reward"))
    except TpkitError as e:
        ctx.add("rewards", False, e.message, e.fix)
    if wanted:
        _guarded(ctx, "rewards", _check_rewards, wanted, mins)
    elif recipe is None:
        ctx.add("rewards", True, "none given (pass --reward NAME or a recipe to check a reward's models)", level="info")

    need_downloads = any(not c.ok and c.fix and "hf download" in c.fix for c in ctx.checks)
    _guarded(ctx, "caches", _check_homes, need_downloads)
    return ctx.checks


def _guarded(ctx: _Context, name: str, check, *args, **kwargs) -> None:
    """Run one check; a failure of the check itself (a doctor bug, an odd file system) becomes a warning."""
    try:
        check(ctx, *args, **kwargs)
    except Exception as e:
        ctx.add(name, False, f"the check itself failed: {_first_line(e)}",
                "the check was skipped (rerun with --debug and report it)", level="warning")


def _check_recipe_details(ctx: _Context, recipe) -> None:
    """The recipe's prompt files, and settings that do not fit this machine."""
    files = [("prompts", recipe.rollout.prompts, "rollout.prompts")]
    if recipe.eval_every and recipe.eval.prompts:
        files.append(("eval prompts", recipe.eval.prompts, "eval.prompts"))
    for name, path, key in files:
        n = count_prompts(path) if path else None
        ctx.add(name, bool(n), f"{path}: {n} prompt(s)" if n else f"{path or '(none)'}: missing or empty",
                f"set {key} to a .txt (one prompt a line) or .jsonl file")
    if recipe.train.mixed_precision == "bf16" and not ctx.cuda:
        ctx.add("precision", False, "train.mixed_precision = bf16 without a GPU (bf16 autocast on the CPU is slow)",
                'set train.mixed_precision = "no" on CPU machines', level="warning")


def exit_code(checks: list[Check]) -> int:
    """1 if any error-level check failed, else 0."""
    return int(any(not c.ok and c.level == "error" for c in checks))


_STATUS = {"error": ("✗", "bold red"), "warning": ("!", "bold yellow"), "info": ("·", "dim")}


def status(check: Check) -> tuple[str, str]:
    """(symbol, Rich style): ✓ passed, ✗ error, ! warning, · informational and not ok."""
    return ("✓", "green") if check.ok else _STATUS[check.level]


def render(checks: list[Check]) -> None:
    """The checks as a table on stdout (tpkit.ui.out), then a one-line verdict."""
    from rich.markup import escape
    from rich.table import Table

    from tpkit.ui import out

    t = Table(title="tpkit doctor", title_justify="left", show_lines=False)
    t.add_column("", no_wrap=True)
    t.add_column("check", style="bold", no_wrap=True)
    t.add_column("detail", overflow="fold")
    t.add_column("fix", overflow="fold")
    for c in checks:
        symbol, style = status(c)
        t.add_row(f"[{style}]{symbol}[/]", escape(c.name), escape(c.detail), escape(c.fix or ""))
    out.print(t)
    errors = sum(1 for c in checks if not c.ok and c.level == "error")
    warnings = sum(1 for c in checks if not c.ok and c.level == "warning")
    if errors:
        out.print(f"[bold red]{errors} problem(s) to fix[/] before a run" + (f", {warnings} warning(s)" if warnings else ""))
    elif warnings:
        out.print(f"[green]ready[/], with [yellow]{warnings} warning(s)[/]")
    else:
        out.print("[green]ready[/]")
