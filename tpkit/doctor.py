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
the HF cache, complete); each stage's peak memory per process (`tpkit.memory`: estimated from the
model's configs, or the published ones, against the smallest GPU seen); each reward (known, its optional extras, its model files); the hub
(reachable?); $TPKIT_HOME and the HF cache.

What is checked comes from where it is declared: versions and extras from pyproject (tpkit's
metadata), a model's sizes and pipeline class from its family (`tpkit.models`), a reward's extra
and model files from the reward (`tpkit.rewards.registry.REQUIREMENTS`).
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import tpkit
from tpkit import hub, layout, models
from tpkit.config import load_recipe, parse_reward_options, parse_reward_specs
from tpkit.errors import RewardError, TpkitError
from tpkit.models.names import FLUX_MODEL, SHAPES_MODEL, TINY_MODEL
from tpkit.rewards.registry import BUILTIN, REQUIREMENTS, check_names
from tpkit.runtime import quiet_libraries, tpkit_home
from tpkit.ui import out

GiB = 1024**3
LOW_DISK_GIB = 20  # warn when the run folder has less free space than this
HUB_TIMEOUT = 1.5  # seconds for the hub reachability probe

# The libraries every stage needs (pip names; the import name has _ for -). Their minimum versions
# come from tpkit's requirements (pyproject), as do the packages of the rewards' extras.
CORE_PACKAGES = ("diffusers", "transformers", "peft", "accelerate", "pyarrow", "webdataset", "huggingface-hub",
                 "safetensors")
TORCHVISION_FIX = "pip uninstall torchvision (a torchvision built for another torch breaks transformers/diffusers)"

# Files a model folder must hold, by the kind of model a reward loads (see tpkit.rewards.registry.REQUIREMENTS).
# Each entry is a group of alternatives; "@weights" means weight files (single or sharded, every shard present).
_CONFIG = ("config.json",)
_WEIGHTS = ("@weights",)
_IMAGE_PROC = ("preprocessor_config.json",)
_TOKENIZER = ("tokenizer.json", "vocab.json")
FOLDER_FILES = {
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
GATED = ("stabilityai/", "black-forest-labs/")  # SD3.5 and FLUX.1-dev: licence accepted on the hub first


@dataclass
class Check:
    """One line of the doctor's report. `level` is how serious a failure is: an "error" fails the
    doctor (exit 1), a "warning" may cost time or disk, "info" is for the record."""

    name: str
    ok: bool
    detail: str
    fix: str | None = None
    level: str = "error"  # error | warning | info


@dataclass
class _Context:
    """What earlier checks found, for later ones."""

    checks: list[Check] = field(default_factory=list)
    torch: Any = None
    cuda: bool = False
    pipeline_imports_ok: bool = False
    hub_ok: bool | None = None

    def add(self, name: str, ok: bool, detail: str, fix: str | None = None, level: str = "error") -> None:
        self.checks.append(Check(name, bool(ok), detail, fix if not ok else None, level))


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


def _requirements(dist: str = "tpkit") -> dict[str, dict[str, str]]:
    """A package's requirements as {extra ("" for the core ones): {pip name: specifier such as '>=2.4'}},
    from its installed metadata; tpkit's, when it is not pip-installed, from pyproject.toml beside it."""
    try:
        reqs = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        reqs = _pyproject_requirements() if dist == "tpkit" else []
    out: dict[str, dict[str, str]] = {}
    for req in reqs:
        m = re.match(r"\s*([\w.-]+)\s*([<>=!~][^;]*)?(?:;.*extra\s*==\s*[\"']([\w-]+))?", req)
        if m and m.group(1) != dist:  # not tpkit[ocr,...] (tpkit's dev extra)
            name, spec = m.group(1).lower().replace("_", "-"), (m.group(2) or "").strip()
            out.setdefault(m.group(3) or "", {})[name] = spec
    return out


def _pyproject_requirements() -> list[str]:
    """pyproject.toml's requirements, written as the installed metadata writes them."""
    try:
        import tomllib

        project = tomllib.loads((Path(tpkit.__file__).parents[1] / "pyproject.toml").read_text())["project"]
    except (ImportError, OSError, ValueError, KeyError):
        return []
    extras = project.get("optional-dependencies", {})
    return project.get("dependencies", []) + [f'{r}; extra == "{e}"' for e, rs in extras.items() for r in rs]


def _satisfies(version: str, spec: str | None) -> bool:
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        return Version(version) in SpecifierSet(spec)
    except Exception:  # packaging missing or an odd local version: do not cry wolf
        return True


def _package(dist: str, spec: str) -> tuple[str | None, str | None]:
    """(installed version, what is wrong with it or None): not installed, does not import, too old."""
    version = _version(dist)
    if version is None:
        return None, "not installed"
    try:
        importlib.import_module(dist.replace("-", "_"))
    except Exception as e:
        return version, f"does not import: {_first_line(e)}"
    return version, (None if _satisfies(version, spec) else f"tpkit needs {spec}")


def _writable(path: Path) -> tuple[bool, str]:
    """Can files be created at path (or, if it does not exist yet, in its nearest existing parent)?
    Tested by creating and removing a temporary file; nothing else is written."""
    where = layout.nearest_existing(path)
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
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _is_hub_id(s: str) -> bool:
    return re.fullmatch(r"[\w.-]+/[\w.-]+", s) is not None


def _cached(repo: str, filename: str) -> Path | None:
    """The file's path in the HF cache (revision main), or None; never touches the network."""
    try:
        from huggingface_hub import try_to_load_from_cache

        p = try_to_load_from_cache(repo, filename, cache_dir=str(hub_cache()))
    except Exception:  # no huggingface_hub, an invalid repo id and the like
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
            missing.append(f"{prefix}{' or '.join(group)} missing")
    return missing


def _pipeline_missing(root: Path) -> list[str]:
    """What a diffusers pipeline folder (model_index.json at root) lacks, component by component."""
    if not (root / "model_index.json").is_file():
        return ["no model_index.json (not a diffusers pipeline folder)"]
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
            missing.append(f"{name}/ missing")
        elif "Scheduler" in cls:
            missing += _missing_in(folder, [("scheduler_config.json",)], f"{name}/")
        elif any(k in cls for k in ("Tokenizer", "Processor", "FeatureExtractor")):
            if not any(p.is_file() for p in folder.iterdir()):
                missing.append(f"{name}/ empty")
        else:
            missing += _missing_in(folder, [_CONFIG, _WEIGHTS], f"{name}/")
    return missing


def _short(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


def _download_fix(ctx: _Context, repo: str, alternative: str, files: str = "") -> str:
    fix = f"hf download {repo}{files}"
    if ctx.hub_ok is False:
        fix += " (where the hub is reachable)"
    return f"{fix}, or {alternative}"


def _snapshot(repo: str, first_files: Iterable[str]) -> Path | None:
    """repo's folder in the HF cache: where the first of first_files found there lies (None: none is)."""
    for f in first_files:
        hit = _cached(repo, f)
        if hit is not None:
            return hit.parent
    return None


def _check_folder(ctx: _Context, label: str, id_or_path: str, first_files: Iterable[str],
                  missing: Callable[[Path], list[str]], alternative: str, local_fix: str, download_fix: str) -> None:
    """Is a model folder there (a local one, or a hub id's in the HF cache), and complete (`missing(folder)`
    lists what it lacks)?"""
    path = Path(id_or_path).expanduser()
    local = path.exists()
    if not local and not _is_hub_id(id_or_path):
        ctx.add(label, False, f"{id_or_path!r}: no such folder, and not a hub id (org/name)", alternative)
        return
    folder = path if local else _snapshot(id_or_path, first_files)
    if folder is None:
        ctx.add(label, False, f"{id_or_path} is not in the HF cache ({hub_cache()})", download_fix)
    elif not folder.is_dir():
        ctx.add(label, False, f"{folder} is not a folder", alternative)
    else:
        lacks = missing(folder)
        where = "(local folder)" if local else "in the HF cache"
        if lacks:
            ctx.add(label, False, f"{id_or_path} {where} is incomplete: {_short(lacks)}",
                    local_fix if local else download_fix)
        else:
            ctx.add(label, True, f"{id_or_path} {where}" + ("" if local else f" ({folder})"))


# ---------------------------------------------------------------------------------------------
# Environment


def _check_python(ctx: _Context) -> None:
    v = sys.version_info
    ctx.add("python", v >= (3, 10), f"Python {v.major}.{v.minor}.{v.micro} ({sys.executable})",
            "use Python 3.10 or newer")
    installed = _version("tpkit")
    detail = f"tpkit {tpkit.__version__} ({Path(tpkit.__file__).resolve().parent})"
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
    spec = mins.get("torch", "")
    version, problem = _package("torch", spec)
    if version is None:
        ctx.add("torch", False, "not installed",
                "install PyTorch first: pip install torch (the CUDA build matching your driver on GPU machines)")
        return
    if problem and problem.startswith("does not import"):
        ctx.add("torch", False, f"torch {version} {problem}", "reinstall PyTorch: pip install --force-reinstall torch")
        return
    import torch

    ctx.torch = torch
    hip = getattr(torch.version, "hip", None)
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else (f"ROCm {hip}" if hip else "CPU build")
    ctx.add("torch", not problem, f"torch {torch.__version__} ({build})" + (f", {problem}" if problem else ""),
            f"pip install 'torch{spec}'")
    _check_cuda(ctx, torch, big_model)


def _gpu(torch, i: int) -> str:
    """'NVIDIA H200 140 GiB (139 free)' for GPU i."""
    try:
        props = torch.cuda.get_device_properties(i)
    except Exception as e:
        return f"GPU {i}: {_first_line(e)}"
    text = f"{props.name} {props.total_memory / GiB:.0f} GiB"
    try:
        free, _ = torch.cuda.mem_get_info(i)
        text += f" ({free / GiB:.0f} free)"
    except Exception:
        pass
    return text


def _check_cuda(ctx: _Context, torch, big_model: bool) -> None:
    try:
        ctx.cuda = torch.cuda.is_available()
    except Exception:
        ctx.cuda = False
    if ctx.cuda:
        gpus = Counter(_gpu(torch, i) for i in range(torch.cuda.device_count()))
        ctx.add("cuda", True, f"{gpus.total()} GPU(s): " + "; ".join(f"{n} x {g}" if n > 1 else g for g, n in gpus.items()),
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
    for dist in CORE_PACKAGES:
        module, spec = dist.replace("-", "_"), mins.get(dist, "")
        version, problem = _package(dist, spec)
        if version is None:
            ctx.add(module, False, "not installed", "pip install -e . (installs tpkit's requirements)")
        elif problem and problem.startswith("does not import"):
            fix = TORCHVISION_FIX if "torchvision" in problem else f"pip install --force-reinstall '{dist}{spec}'"
            ctx.add(module, False, f"{module} {version} {problem}", fix)
        else:
            ctx.add(module, not problem, f"{module} {version}" + (f", {problem}" if problem else ""),
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
    pin = _requirements("torchvision").get("", {}).get("torch", "")
    if pin.startswith("==") and torch_version and not _satisfies(torch_version, pin):
        ctx.add("torchvision", False,
                f"torchvision {version} is built for torch {pin[2:]}, but torch {torch_version} is installed",
                fix, level="warning")
        return
    try:
        import torchvision  # noqa: F401
        from transformers import AutoImageProcessor, CLIPImageProcessor  # noqa: F401
    except Exception as e:
        ctx.add("torchvision", False, f"torchvision {version} breaks imports: {_first_line(e)}", fix, level="warning")
        return
    ctx.add("torchvision", True, f"torchvision {version}, imports with transformers' image processors", level="info")


def _check_pipeline_imports(ctx: _Context, model: str, mins: dict[str, str]) -> None:
    """The model family's pipeline classes, which every stage loads (and the tiny models' builders)."""
    if ctx.torch is None:
        ctx.add("pipeline", False, "skipped: torch does not import", "fix torch first")
        return
    try:
        quiet_libraries()  # as every stage does: no info notices from the libraries
        cls = models.family(models.family_of(model)).MODEL.PIPELINE
        import diffusers
        import transformers  # noqa: F401

        getattr(diffusers, cls)
    except Exception as e:
        packages = f"'diffusers{mins.get('diffusers', '')}' 'transformers{mins.get('transformers', '')}'"
        fix = TORCHVISION_FIX if "torchvision" in str(e) else f"pip install -U {packages}"
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


def estimate_round_bytes(recipe, cuda: bool) -> tuple[int, int, str] | None:
    """Rough bytes one round of `tpkit run` writes, those of them keep_rounds deletes later (rollout shards;
    with finetune = full also the optimizer state and, but in evaluated rounds, model/), and how they add
    up (None: prompts unknown).

    Per trajectory: (K + 1 states + K velocities + final latent) x C x h x w float32 plus the final
    PNG (at most 3 bytes a pixel); per prompt, its and the empty prompt's embeddings (77 + T5 tokens) in
    the model's dtype; per round, the LoRA adapter with its optimizer (2x) and EMA state, or with
    finetune = full the float32 model/ and AdamW's moments (`tpkit.memory.transformer_params`)."""
    ro, tr = recipe.rollout, recipe.train
    n = count_prompts(ro.prompts) if ro.prompts else None
    if not n:
        return None
    prompts = min(ro.prompts_per_round, n) if ro.prompts_per_round else n
    trajectories = prompts * ro.group_size
    sz = models.default(ro.model, "sizes", ro.family)  # the family's (SD3.5-Medium, FLUX.1-dev) or a tiny model's
    res, k = int(ro.resolution), ro.window_size
    latent = sz["latent_channels"] * (res // sz["vae_factor"]) ** 2 * 4
    per_traj = (2 * k + 2) * latent + res * res * 3 + 200 * (k + 1)  # + its score rows
    dtype_bytes = 4 if (ro.dtype in ("float32", "fp32") or (ro.dtype == "auto" and not cuda)) else 2
    per_prompt = sz["prompt_sets"] * ((sz["clip_tokens"] + ro.max_sequence_length) * sz["text_dim"] + sz["pooled_dim"]) * dtype_bytes
    train, what = tr.lora_rank * sz["lora_bytes_per_rank"] * (3 + (1 if tr.ema else 0)), "adapter/optimizer"
    prunable = trajectories * (2 * k + 2) * latent + trajectories * res * res * 3  # the shards
    if tr.finetune == "full":
        from tpkit import memory

        arch = memory.architecture(ro.model, ro.family)
        params = memory.transformer_params(arch) if arch else 0
        moments = params * (2 if tr.optimizer == "adamw8bit" else 8)
        train = params * 4 + moments
        what = "model/ (float32) and optimizer state" if arch else "model/ (size unknown: no configs here)"
        # keep_rounds deletes them too, but an evaluated round's model/ (one in eval_every) stays
        prunable += moments + params * 4 * (1 - (1 / recipe.eval_every if recipe.eval_every else 0))
    total = trajectories * per_traj + prompts * per_prompt + train
    how = (f"{trajectories} trajectories x {layout.human_bytes(per_traj)} + {prompts} prompts x {layout.human_bytes(per_prompt)} embeddings"
           f" + {layout.human_bytes(train)} {what}")
    return total, int(prunable), how


# What to lower when a stage's estimated memory exceeds the GPU's.
_MEMORY_FIX = {
    "rollout": "lower rollout.batch_size",
    "score": "lower score.batch_size and score.decode_batch_size",
    "train": "set train.gradient_checkpointing = true, lower train.micro_batch_size, or use optimizer = \"adamw8bit\"",
    "eval": "lower eval.batch_size",
}


def _check_memory(ctx: _Context, recipe, processes: int = 1) -> None:
    """Each stage's estimated peak memory per process (`tpkit.memory`; train's sharded over `processes`
    with train.fsdp), against the smallest GPU seen. Without a GPU the estimate is for one (bf16) when
    the model is not a built-in tiny one."""
    from tpkit import memory

    model = recipe.rollout.model
    arch = memory.architecture(model, recipe.rollout.family)
    if arch is None:
        ctx.add("memory", True, f"no estimate: {model}'s configs are not on this machine (nor published ones tpkit knows)",
                level="info")
        return
    cuda = ctx.cuda or model not in BUILTIN_MODELS
    gpu = min((ctx.torch.cuda.get_device_properties(i).total_memory for i in range(ctx.torch.cuda.device_count())),
              default=None) if ctx.cuda else None
    for s in memory.estimate(recipe, arch, cuda=cuda, processes=processes):
        parts = " + ".join(f"{k} {layout.human_bytes(v)}" for k, v in s.parts.items())
        fits = gpu is None or s.total <= gpu
        where = f" of {layout.human_bytes(gpu)}" if gpu else (" (estimated for a GPU, bf16)" if not ctx.cuda and cuda else "")
        ctx.add(f"memory: {s.stage}", fits, f"{layout.human_bytes(s.total)} per process{where}: {parts}",
                f"{_MEMORY_FIX[s.stage]} (per-process estimate; reward models and the CUDA context come on top)",
                level="warning" if not fits else "info")


def _check_run_folder(ctx: _Context, run_dir: Path, recipe) -> None:
    ok, where = _writable(run_dir)
    ctx.add("run folder", ok, f"{run_dir} ({'exists' if run_dir.exists() else 'created on start'}; writable)"
            if ok else f"{run_dir}: {where}", "choose a writable --out folder")
    base, free = layout.nearest_existing(run_dir), layout.free_bytes(run_dir)
    if free is None:
        ctx.add("disk space", False, f"cannot read the free space of {base}", None, level="warning")
        return
    detail = f"{layout.human_bytes(free)} free in {base}"
    estimate = estimate_round_bytes(recipe, ctx.cuda) if recipe is not None else None
    if estimate is not None:
        per_round, shards, how = estimate
        left = sum(1 for r in range(recipe.rounds) if not (layout.round_dir(run_dir, r) / layout.ROUND_JSON).is_file())
        need = per_round * left
        if recipe.keep_rounds:  # round 0's shards and the last keep_rounds rounds stay; older rounds' are deleted
            need -= shards * max(0, left - recipe.keep_rounds - 1)
        detail += (f"; the recipe writes ≈ {layout.human_bytes(per_round)} per round ({how}), "
                   f"≈ {layout.human_bytes(need)} for the {left} round(s) to go"
                   + (f" with keep_rounds = {recipe.keep_rounds}" if recipe.keep_rounds else ""))
        if left and free < per_round:
            ctx.add("disk space", False, detail + ": not enough for one round",
                    "free space, or put the run on a bigger disk (--out DIR)")
            return
        if free < need:
            ctx.add("disk space", False, detail + ": it will fill up before the last round",
                    "free space, put the run on a bigger disk (--out DIR), run fewer rounds (--rounds N), or keep "
                    "fewer rounds' rollout shards and weights (keep_rounds = N in the recipe)", level="warning")
            return
    if free < LOW_DISK_GIB * GiB:
        ctx.add("disk space", False, detail + f" (under {LOW_DISK_GIB} GiB)",
                "free space, or put the run on a bigger disk (--out DIR)", level="warning")
        return
    ctx.add("disk space", True, detail, level="warning")


# ---------------------------------------------------------------------------------------------
# The model and the rewards' models


def _check_model(ctx: _Context, model: str, where: str) -> None:
    if model in BUILTIN_MODELS:
        _check_builtin_model(ctx, model)
        return
    alternative = f"a local folder ({where})"
    gated = ("; gated: accept its licence on huggingface.co and `hf auth login` first"
             if model.startswith(GATED) else "")
    _check_folder(ctx, "model", model, ["model_index.json"], _pipeline_missing, alternative,
                  "copy the complete pipeline folder (save_pretrained: every component with its weights), "
                  "or pass a hub id", _download_fix(ctx, model, alternative) + gated)


def _check_builtin_model(ctx: _Context, model: str) -> None:
    """tiny-shapes ships inside the package; tiny-sd3, tiny-flux and tiny-qwen-image are built on first use."""
    try:
        path = models.family(models.family_of(model)).location(model)
    except Exception as e:
        ctx.add("model", False, f"{model}: cannot import tpkit.models: {_first_line(e)}", "fix torch/diffusers first")
        return
    shipped = model == SHAPES_MODEL
    fix = ("reinstall tpkit (its weights ship inside the package)" if shipped
           else f"delete {path}; it is rebuilt on first use (nothing downloaded)")
    if (path / "model_index.json").is_file():
        missing = _pipeline_missing(path)
        ctx.add("model", not missing, f"{model} at {path}" + (f" is incomplete: {_short(missing)}" if missing else ""),
                fix)
    elif shipped:
        ctx.add("model", False, f"{model}: no weights at {path}", fix)
    else:
        ok, why = _writable(path.parent)
        buildable = ok and ctx.pipeline_imports_ok
        ctx.add("model", buildable, f"{model}: built on first use under {path.parent} (nothing downloaded)" if buildable
                else f"{model} cannot be built: {why if not ok else 'the pipeline classes do not import'}",
                "set TPKIT_HOME to a writable folder" if not ok else "fix the pipeline check above")


def _check_extras(ctx: _Context, reward: str, extra: str, packages: dict[str, str]) -> bool:
    """The packages of tpkit[extra] that the reward needs: installed, importable, recent enough?"""
    problems, versions = [], []
    for dist, spec in packages.items():
        version, problem = _package(dist, spec)
        if problem:
            problems.append(f"{dist} {problem}" if version is None else f"{dist} {version} {problem}")
        else:
            versions.append(f"{dist} {version}")
    if not packages:
        problems.append(f"the packages of tpkit[{extra}] are unknown (no tpkit metadata, no pyproject.toml)")
    ctx.add(f"reward {reward}: extras", not problems, "; ".join(problems) or ", ".join(versions),
            f"pip install 'tpkit[{extra}]'")
    return not problems


def _check_file(ctx: _Context, label: str, spec: str, alternative: str) -> None:
    """A weight file: a local path, or repo_id:filename in the HF cache."""
    path = Path(spec).expanduser()
    repo, _, filename = spec.partition(":")
    if path.is_file():
        ctx.add(label, True, f"{path}")
    elif path.exists() or not filename or not _is_hub_id(repo):
        ctx.add(label, False, f"{spec!r}: not a file, and not repo_id:filename", alternative)
    elif _cached(repo, filename) is not None:
        ctx.add(label, True, f"{spec} in the HF cache")
    else:
        ctx.add(label, False, f"{spec} is not in the HF cache ({hub_cache()})",
                _download_fix(ctx, repo, alternative, f" {filename}"))


def _check_reward(ctx: _Context, name: str, source: str, requirements: dict[str, dict[str, str]]) -> bool:
    """Is the reward known (built in, or module:function whose module imports), are its extras there?
    True when its model files are worth checking."""
    try:
        check_names({name: 1.0})
    except RewardError as e:
        ctx.add(f"reward {name}", False, f"{e.message} ({source})", e.fix)
        return False
    if name not in BUILTIN:
        module = name.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
            why = "" if found else "not found"
        except Exception as e:
            found, why = False, _first_line(e)
        ctx.add(f"reward {name}", found, f"your own reward, module {module} " + ("found" if found else why),
                f"make {module} importable (install it or add its folder to PYTHONPATH)")
        return False
    extra, model_files = REQUIREMENTS.get(name, (None, None))
    if extra:
        return _check_extras(ctx, name, extra, requirements.get(extra, {}))
    if model_files is None:
        ctx.add(f"reward {name}", True, "needs nothing", level="info")
    return True


def _check_rewards(ctx: _Context, wanted: list[tuple[str, dict, str]], requirements: dict[str, dict[str, str]]) -> None:
    """wanted: (reward name, its options, where it comes from: 'recipe', 'eval', '--reward').

    Each reward is checked once (its extras), its model files each time it is named (the options may
    differ); a model that several rewards use is checked once, with everything they need."""
    usable: dict[str, bool] = {}  # reward -> known, and its extras are fine
    models: dict[tuple, dict] = {}  # (id or path, a file?) -> {"kinds": [...], "users": [...], "option": str | None}
    for name, options, source in wanted:
        if name not in usable:
            usable[name] = _check_reward(ctx, name, source, requirements)
        if not usable[name] or name not in REQUIREMENTS:
            continue
        try:
            entries = REQUIREMENTS[name][1](options)
        except Exception as e:
            ctx.add(f"reward {name}", False, f"cannot read its model files: {_first_line(e)}",
                    getattr(e, "fix", None) or "fix torch first")
            continue
        for role, id_or_path, kind, option in entries:
            m = models.setdefault((id_or_path, kind == "file"),
                                  {"kinds": [], "users": [], "option": option and f"{name}.{option}"})
            m["kinds"].append(kind)
            if f"{name}: {role}" not in m["users"]:
                m["users"].append(f"{name}: {role}")
    for (id_or_path, is_file), m in models.items():
        label = "reward " + "; ".join(m["users"])
        alternative = f"point {m['option']} at a local copy" if m["option"] else "reinstall the package that ships it"
        if is_file:
            _check_file(ctx, label, id_or_path, alternative)
            continue
        needs = list(dict.fromkeys(group for kind in m["kinds"] for group in FOLDER_FILES[kind]))
        first = [f for group in needs if group != _WEIGHTS for f in group]
        files = " " + " ".join(PROCESSOR_FILES) if set(m["kinds"]) == {"processor"} else ""  # no weights
        _check_folder(ctx, label, id_or_path, first, lambda folder: _missing_in(folder, needs), alternative,
                      "copy the complete model folder there (save_pretrained)",
                      _download_fix(ctx, id_or_path, alternative, files))


# ---------------------------------------------------------------------------------------------
# Hub, caches


def _probe_hub() -> bool:
    """hub.hub_reachable, also bounded when name resolution itself hangs (no network at all)."""
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
    ctx.hub_ok = _probe_hub()
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if ctx.hub_ok:
        ctx.add("hub", True, f"{endpoint} reachable", level="info")
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    ctx.add("hub", False, "HF_HUB_OFFLINE is set: only local files are used" if offline else
            f"{endpoint} not reachable: only local files are used (fine when every model is present)",
            "download missing models on a machine with internet and copy the HF cache folder here", level="info")


def _check_homes(ctx: _Context, need_downloads: bool) -> None:
    try:
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
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        detail += ", from $HF_HUB_CACHE"
    elif os.environ.get("HF_HOME"):
        detail += ", from $HF_HOME"
    free = layout.free_bytes(cache)
    detail += f"; {layout.human_bytes(free)} free" if free is not None else ""
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
        reward_opts: list[str] = (), overrides: list[str] = (), processes: int = 1) -> list[Check]:
    """Check this environment for a run of `recipe` (or of --model/--reward) writing into `out`.

    rewards: NAME[=WEIGHT] as for --reward; reward_opts: NAME.OPTION=VALUE as for --reward-opt;
    overrides: KEY=VALUE as `tpkit run --set`; processes: how many the run will start (memory per
    process of a sharded train). Never raises for a problem it finds: every problem is a failed Check."""
    ctx = _Context()
    requirements = _requirements()
    mins = requirements.get("", {})

    # The recipe first (cheap; it decides what else to check), reported after the environment.
    loaded, recipe_check = None, None
    if recipe is not None:
        try:
            # --model replaces the recipe's model (as `--set rollout.model=...`: its default resolution follows)
            replaced = [f"rollout.model={json.dumps(model)}"] if model else []
            loaded = load_recipe(recipe, overrides=[*overrides, *replaced], out=out)
            recipe_check = Check("recipe", True, f"{recipe}: {loaded.name}, {loaded.method}, {loaded.rounds} round(s), "
                                 f"model {loaded.rollout.model}")
        except TpkitError as e:
            recipe_check = Check("recipe", False, e.message, e.fix or f"fix {recipe}")
        except Exception as e:  # a bug or an odd value the loader did not anticipate
            recipe_check = Check("recipe", False, f"{recipe}: {_first_line(e)}", f"fix {recipe}")
    the_model = model or (loaded.rollout.model if loaded is not None else None) or TINY_MODEL

    _guarded(ctx, "python", _check_python)
    _guarded(ctx, "torch", _check_torch, mins, big_model=the_model not in BUILTIN_MODELS)
    _guarded(ctx, "packages", _check_packages, mins)
    _guarded(ctx, "torchvision", _check_torchvision)
    _guarded(ctx, "pipeline", _check_pipeline_imports, the_model, mins)
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
    if loaded is not None:
        _guarded(ctx, "memory", _check_memory, loaded, processes)

    wanted: list[tuple[str, dict, str]] = []  # (reward, its options, where it comes from)
    if loaded is not None:
        score, ev = loaded.score, loaded.eval
        wanted += [(name, dict(score.reward_options.get(name, {})), "recipe") for name in score.rewards]
        if loaded.eval_every:
            names = ["geneval"] if ev.kind == "geneval" else list(ev.rewards)
            wanted += [(name, dict(ev.reward_options.get(name, {})), "eval") for name in names]
    try:
        cli_opts = parse_reward_options(list(reward_opts))
        for name in parse_reward_specs(list(rewards)):
            wanted.append((name, cli_opts.get(name, {}), "--reward"))
    except TpkitError as e:
        ctx.add("rewards", False, e.message, e.fix)
    if wanted:
        _guarded(ctx, "rewards", _check_rewards, wanted, requirements)
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


def exit_code(checks: list[Check]) -> int:
    """1 if any error-level check failed, else 0."""
    return int(any(not c.ok and c.level == "error" for c in checks))


# (symbol, Rich style) of a failed check by level; a passed one is a green ✓
_STATUS = {"error": ("✗", "bold red"), "warning": ("!", "bold yellow"), "info": ("·", "dim")}


def render(checks: list[Check]) -> None:
    """The checks as a table on stdout (tpkit.ui.out), then a one-line verdict."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="tpkit doctor", title_justify="left", show_lines=False)
    t.add_column("", no_wrap=True)
    t.add_column("check", style="bold", no_wrap=True)
    t.add_column("detail", overflow="fold")
    t.add_column("fix", overflow="fold")
    for c in checks:
        symbol, style = ("✓", "green") if c.ok else _STATUS[c.level]
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
