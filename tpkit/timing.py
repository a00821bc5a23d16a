"""Seconds per phase of a stage, for its manifest ("seconds": {"transformer": ..., "decode": ...}).

On a GPU, kernels run asynchronously: a clock read right after a call measures only the launch,
and the next phase that waits for a result is charged the work. So on CUDA each timed block
synchronises the device before and after (one synchronisation per transformer batch, decode
batch or optimizer step: negligible next to the work it times).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


class Phases:
    """Accumulates wall seconds per named phase: `with phases("decode"): ...`."""

    def __init__(self, device=None, seconds: dict[str, float] | None = None) -> None:
        self.seconds: dict[str, float] = dict(seconds or {})  # starting totals, e.g. an interrupted run's
        self._cuda = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"

    def _sync(self) -> None:
        if self._cuda:
            import torch

            torch.cuda.synchronize()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def rounded(self, digits: int = 3) -> dict[str, float]:
        return {k: round(v, digits) for k, v in self.seconds.items()}
