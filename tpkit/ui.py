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
    """A progress bar; yields advance(n). Nothing is drawn for empty work, nor by a distributed launch's
    (`accelerate launch`, `torchrun`) processes other than each machine's first: their bars would
    interleave with its bar in the machine's log. That bar counts its own process's share."""
    env = os.environ.get
    if total <= 0 or int(env("LOCAL_RANK", "0")) != 0:
        yield lambda n=1: None
        return
    if int(env("WORLD_SIZE", "1")) > 1:
        description += f" [dim](process {env('RANK', '0')}'s share, of {env('WORLD_SIZE')})"
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)
