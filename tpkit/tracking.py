"""Experiment tracking (`--log-with tensorboard|wandb`) through accelerate's trackers.

Only the main process tracks. Tracking is a view of the run, never a reason to lose it: a tracker
that is missing is refused up front (one line naming the install), and one that fails later (a full
disk, a dropped connection) is switched off with a warning while the run goes on. Weights & Biases
never blocks on a missing network: without WANDB_MODE set, it runs offline when api.wandb.ai cannot be
reached (sync later with `wandb sync FOLDER/wandb/offline-run-*`), and a run that is continued
continues the same W&B run (its id is kept in FOLDER/wandb-id).

One step axis for everything, the global optimizer step, because W&B needs it monotonic: train
metrics at their step, round metrics at the round's last step, the base evaluation at step 0.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from tpkit.config import TRACKERS as KINDS
from tpkit.errors import ConfigError
from tpkit.runtime import accelerate_on_cpu
from tpkit.ui import console

TENSORBOARD_DIR, WANDB_ID = "tensorboard", "wandb-id"


def check_kind(kind: str) -> None:
    """Refuse an unknown tracker, or one whose package is not installed, before any work."""
    if kind not in KINDS:
        raise ConfigError(f"unknown tracker {kind!r}", f"use --log-with {' | '.join(KINDS)}")
    if kind == "tensorboard":
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
        except ImportError:
            raise ConfigError("--log-with tensorboard needs the tensorboard package",
                              "pip install tensorboard (or tpkit[track])") from None
    if kind == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("--log-with wandb needs the wandb package", "pip install wandb (or tpkit[track])") from None


def flat(config: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as the flat str/int/float/bool values trackers take (lists as text)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[key] = v if v is not None else "none"
        else:
            out[key] = str(v)
    return out


def _reachable(host: str, port: int = 443, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class Tracker:
    """One accelerate tracker writing into `folder` (TensorBoard: folder/tensorboard/; W&B: folder/wandb/)."""

    def __init__(self, kind: str, folder: Path, name: str, config: dict):
        self.kind, self.folder, self._console = kind, Path(folder), console
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            self._start(name)
        except Exception as e:
            if kind != "wandb" or os.environ.get("WANDB_MODE") == "offline":
                raise ConfigError(f"{kind} tracking could not start: {type(e).__name__}: {str(e)[:200]}",
                                  "fix the cause, or run with --log-with none") from None
            # Online W&B that cannot start (no login, a proxy, a server error): log offline instead.
            console.print(f"[yellow]W&B could not start online ({type(e).__name__}: {str(e)[:120]}); logging offline[/]")
            os.environ["WANDB_MODE"] = "offline"
            self._start(name)
        self._guard("store the configuration", "store_init_configuration", flat(config))

    def _start(self, name: str) -> None:
        if self.kind == "tensorboard":
            from accelerate.tracking import TensorBoardTracker

            self._tracker = TensorBoardTracker(TENSORBOARD_DIR, self.folder)
        else:
            self._tracker = self._wandb(name)
        self._tracker.start()

    def _wandb(self, name: str):
        import wandb
        from accelerate.tracking import WandBTracker

        id_file = self.folder / WANDB_ID
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        if "WANDB_MODE" not in os.environ and not _reachable("api.wandb.ai"):
            os.environ["WANDB_MODE"] = "offline"
            self._console.print("[yellow]W&B: api.wandb.ai cannot be reached; logging offline[/] "
                                f"(sync later: wandb sync {self.folder / 'wandb'}/offline-run-*)")
        return WandBTracker(os.environ.get("WANDB_PROJECT", "tpkit"), name=name, id=run_id, resume="allow",
                            dir=str(self.folder), settings=wandb.Settings(init_timeout=60))

    def _guard(self, what: str, method: str, *args, **kwargs) -> None:
        if self._tracker is None:
            return
        try:
            getattr(self._tracker, method)(*args, **kwargs)
        except Exception as e:  # tracking never stops a run
            self._console.print(f"[yellow]{self.kind} could not {what} ({type(e).__name__}: {e}); tracking is off[/]")
            self._tracker = None

    def scalars(self, values: dict[str, float], step: int) -> None:
        values = {k: float(v) for k, v in values.items() if v is not None and np.isfinite(v)}
        if values:
            self._guard("log scalars", "log", values, step=step)

    def images(self, values: dict[str, np.ndarray], step: int) -> None:
        """HWC uint8 arrays."""
        if not values:
            return
        if self.kind == "tensorboard":  # one image as a batch of one
            self._guard("log images", "log_images", {k: v[None] for k, v in values.items()}, step=step,
                        dataformats="NHWC")
        else:
            self._guard("log images", "log_images", {k: [v] for k, v in values.items()}, step=step)

    def close(self) -> None:
        self._guard("finish", "finish")
        self._tracker = None


def open_tracker(kind: str, folder: Path, name: str, config: dict, device: str = "auto") -> Tracker | None:
    """A tracker on the main process for `kind`, or None (kind "none", or another process).

    Every process calls this: accelerate's trackers need its state, which all processes set up
    together, on the device train will use (`device`: train's --device), or train's Accelerator
    would inherit a state without its process group."""
    check_kind(kind)
    if kind == "none":
        return None
    from accelerate import PartialState

    return Tracker(kind, folder, name, config) if PartialState(cpu=accelerate_on_cpu(device)).is_main_process else None


def tile(images: list[np.ndarray], columns: int) -> np.ndarray:
    """Equal-sized HWC images as one grid, row by row (blank cells white)."""
    h, w, c = images[0].shape
    rows = -(-len(images) // columns)
    grid = np.full((rows * h, columns * w, c), 255, dtype=np.uint8)
    for i, im in enumerate(images):
        grid[(i // columns) * h:(i // columns + 1) * h, (i % columns) * w:(i % columns + 1) * w] = im
    return grid


@contextlib.contextmanager
def closing(tracker: Tracker | None):
    """Finish the tracker (flush TensorBoard, end the W&B run) however the block ends."""
    try:
        yield tracker
    finally:
        if tracker is not None:
            tracker.close()


def train_scalars(metrics_line: dict) -> dict[str, float]:
    """A metrics.jsonl line of the train stage as train/* scalars."""
    return {f"train/{k}": float(v) for k, v in metrics_line.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
