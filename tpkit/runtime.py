"""What every stage needs from its process, whatever the model family: the device and dtype, CPU
threads and allocator, the home folder, quiet libraries, PNG bytes.

torch is imported inside the functions that use it: `tpkit doctor` imports this module, and must run
(and say what to fix) where torch is missing or broken."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from tpkit.errors import ModelError, OutOfMemory

if TYPE_CHECKING:
    import torch


def quiet_libraries() -> None:
    """tpkit draws its own Rich progress; the libraries' tqdm bars and info logs would interleave."""
    import transformers

    # transformers first: importing diffusers' pipelines logs a torchvision notice we do not need.
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    import diffusers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()


def tpkit_home() -> Path:
    return Path(os.environ.get("TPKIT_HOME", "~/.cache/tpkit")).expanduser()


def tune_cpu_allocator() -> bool:
    """Keep glibc malloc from handing big tensors back to the kernel after every op (CPU only).

    By default glibc serves allocations above a (dynamic, at most 32 MiB) threshold with fresh
    mmap()s and trims the heap top on free, so every transformer call on CPU page-faults and
    zeroes its large temporaries anew. Raising both thresholds (what MALLOC_MMAP_THRESHOLD_ /
    MALLOC_TRIM_THRESHOLD_ do, or jemalloc/tcmalloc, which PyTorch recommends for CPU inference)
    measured 1.4-1.8x faster tiny-sd3 calls on 2-core machines; the cost is that freed memory
    stays with the process (its RSS keeps its high-water mark). Skipped where the user chose for
    themselves (those variables, GLIBC_TUNABLES, an LD_PRELOAD allocator, TPKIT_CPU_MALLOC=0) and
    outside glibc. Returns whether it changed anything; idempotent."""
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED is not None:
        return _ALLOCATOR_TUNED
    _ALLOCATOR_TUNED = False
    env = os.environ
    if env.get("TPKIT_CPU_MALLOC", "1") == "0" or any(
            k in env for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only (musl's mallopt ignores these)
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    mmap_ok = libc.mallopt(m_mmap_threshold, 1 << 30) or libc.mallopt(m_mmap_threshold, 32 << 20)  # older glibc caps it
    _ALLOCATOR_TUNED = bool(mmap_ok and libc.mallopt(m_trim_threshold, 1 << 30))
    return _ALLOCATOR_TUNED


_ALLOCATOR_TUNED: bool | None = None


def set_cpu_threads() -> int:
    """Give this process its share of the cores for CPU work; returns torch's intra-op thread count.

    TPKIT_THREADS (`tpkit --threads N`) if set; else the cores this process may use divided by the
    processes started beside it (LOCAL_WORLD_SIZE under `accelerate launch` / torchrun). torch's
    default, one thread per core in every process, oversubscribes the cores as soon as two run at
    once (measured on 2 cores: 4-11x slower rounds instead of 2x; bench/speed/side_by_side.py)."""
    import torch

    want = os.environ.get("TPKIT_THREADS")
    if want:
        threads = int(want)
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = cores // max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)
    threads = max(threads, 1)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


@contextlib.contextmanager
def memory_options(stage: str, *options: tuple[str, int], also: str = "",
                   fits: Callable[[str, int], int | None] | None = None) -> Iterator[None]:
    """Turn torch's out-of-memory error inside a stage into one line that names the options setting the
    peak (`options`: (recipe key, value)), each with the value to try: fits(key, value), the largest the
    memory model says fits this GPU (`tpkit.memory.suggest_batch`), else half; and `also` (another
    remedy). Nothing is retried with smaller batches behind the user's back: the work already written is
    kept, and a rerun with the lowered option continues it."""
    import torch

    def value_to_try(key: str, value: int) -> str:
        try:  # an estimate must never hide the error it explains
            fitting = fits(key, value) if fits else None
        except Exception:
            fitting = None
        return f"e.g. {fitting}: the memory model's largest that fits" if fitting else f"e.g. {max(value // 2, 1)}"

    try:
        yield
    except torch.OutOfMemoryError as e:
        tried = " or ".join(f"{key} = {value} ({value_to_try(key, value)})" for key, value in options)
        raise OutOfMemory(f"{stage} ran out of accelerator memory: {str(e).splitlines()[0][:120]}",
                          f"lower {tried}{also}; finished work is kept, rerun to continue") from None


def close_distributed() -> None:
    """Destroy the default process group, if this process joined one (train under `accelerate launch` or
    `torchrun`). Called only after a command succeeded: destroying waits for every rank, and would hang
    beside a rank that failed. Left to the interpreter's exit, gloo's worker threads can outlive it and
    abort the process (SIGABRT, "terminate called without an active exception") after the work is done."""
    import sys

    dist = getattr(sys.modules.get("torch"), "distributed", None)  # never import torch just to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pick_device(device: str = "auto") -> torch.device:
    import torch

    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # one GPU per process under accelerate launch / torchrun
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device(device)


def accelerate_on_cpu(device: str) -> bool:
    """Whether accelerate runs on the CPU for this --device: cpu=True also when no GPU exists, since
    only then does accelerate set up gloo DDP under torchrun (train and the tracker must agree)."""
    import torch

    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if dtype not in table:
        raise ModelError(f"unknown dtype {dtype!r}", f"use one of auto, {', '.join(table)}")
    return table[dtype]


def png_bytes(image: np.ndarray) -> bytes:
    """uint8 [H, W, 3] -> PNG bytes (lossless, deterministic)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()
