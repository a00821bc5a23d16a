"""Terminal output (Rich): progress and messages on stderr, tables and results on stdout.

Library stages report progress through `track`; `tpkit inspect ... > file` captures only results.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)
# Results on stdout. Not on a terminal (a file, a log, a pipe) Rich would assume 80 columns and cut wide
# tables' headers to "held-…": give them room instead (COLUMNS, when set, still decides).
out = Console() if sys.stdout.isatty() or os.environ.get("COLUMNS") else Console(width=200)


@contextlib.contextmanager
def track(total: int, description: str) -> Iterator[Callable[[int], None]]:
    """A progress bar; yields advance(n). Nothing is drawn for empty work, nor by the other processes of a
    distributed launch (`accelerate launch`, `torchrun`): their bars would interleave with the main one's,
    which counts the main process's share."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if total <= 0 or rank != 0:
        yield lambda n=1: None
        return
    if world > 1:
        description += f" [dim](process 0's share, of {world})"
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)
