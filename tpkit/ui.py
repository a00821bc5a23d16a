"""Progress bars and tables on stderr (Rich). Library stages report progress through `track`."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


@contextlib.contextmanager
def track(total: int, description: str) -> Iterator[Callable[[int], None]]:
    """A progress bar; yields advance(n)."""
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)
