"""Tables, trees and progress bars drawn for a terminal with ``rich``, and the plain text
they degrade to when the output is not one (a pipe, a file, a script), so that what
scripts parse never changes.

``rich`` is imported only when something is drawn for a terminal: a command whose output
goes to a pipe never imports it, and neither does ``eventflow demo``.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import time
from typing import Any, TextIO

__all__ = ["RichProgress", "progress_for", "terminal", "terminal_table", "terminal_tree"]

_STYLES = {"DEGRADED": "bold yellow", "FAILED": "bold red", "ok": "green", "stale": "yellow"}
"""Cells drawn in colour: health words, so the eye finds what is not well."""


def terminal(stream: TextIO | None = None) -> bool:
    """True when ``stream`` (default stdout) is a terminal a person reads: draw for it.
    ``TERM=dumb`` and ``EVENTFLOW_PLAIN=1`` ask for plain text on a terminal too."""
    stream = stream if stream is not None else sys.stdout
    if os.environ.get("EVENTFLOW_PLAIN") == "1" or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or a fake stream
        return False


def _console(file: TextIO, min_width: int = 0) -> Any:
    from rich.console import Console

    width = max(shutil.get_terminal_size((120, 24)).columns, min_width)
    return Console(file=file, force_terminal=True, width=width, highlight=False)


def _render(renderable: Any, min_width: int = 0) -> str:
    buffer = io.StringIO()
    _console(buffer, min_width).print(renderable)
    return buffer.getvalue().rstrip("\n")


def terminal_table(headers: list[str], rows: list[list[str]]) -> str:
    """``rows`` under ``headers`` as a rich table (a rule under the header, health words in
    colour), rendered to a string for the terminal."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    # Ids, names and times keep their width (a folded id cannot be copied); only the last
    # column, the free text (data, error, stats), folds to fit the terminal. Where even
    # that does not fit, the lines are drawn longer than the terminal (which wraps them, as
    # it does plain text) rather than cropped.
    widths = [
        max([len(h), *(len(r[n]) for r in rows if n < len(r))]) for n, h in enumerate(headers)
    ]
    for n, header in enumerate(headers):
        if n == len(headers) - 1:
            grid.add_column(header, overflow="fold", min_width=min(widths[n], _FOLDED_WIDTH))
        else:
            grid.add_column(header, no_wrap=True, min_width=widths[n])
    for row in rows:
        cells = []
        for cell in row:
            word = cell.split(" ", 1)[0]
            style = _STYLES.get(cell) or (_STYLES["stale"] if cell.endswith(" stale") else None)
            cells.append(Text(cell, style=style or _STYLES.get(word, "")))
        grid.add_row(*cells)
    needed = sum(widths[:-1]) + min(widths[-1], _FOLDED_WIDTH) + _GAP * (len(widths) - 1)
    return _render(grid, needed)


_FOLDED_WIDTH = 24
"""The least width of a table's last column (its free text folds into it)."""
_GAP = 3
"""Spaces between the columns of a drawn table."""


def terminal_tree(label: str, roots: list[tuple[str, list[Any]]]) -> str:
    """A tree of ``(text, children)`` pairs under ``label``, rendered for the terminal."""
    from rich.text import Text
    from rich.tree import Tree

    top = Tree(Text(label, style="bold"), guide_style="dim")

    def add(parent: Any, nodes: list[tuple[str, list[Any]]]) -> None:
        for text, children in nodes:
            head, _, rest = text.partition("\n")
            branch = parent.add(Text(head) + (Text("\n" + rest, style="dim") if rest else ""))
            add(branch, children)

    add(top, roots)
    return _render(top)


class RichProgress:
    """A rich progress bar with the same calls as the plain one (``bar(position, end)``,
    ``bar.finish()``), drawn on a terminal's stderr."""

    def __init__(self, stream: TextIO, label: str) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=_console(stream),
        )
        self._task = self._progress.add_task(label, total=None, rate="")
        self._started = time.monotonic()
        self._progress.start()

    def __call__(self, position: int, end: int) -> None:
        """Record progress (events replayed up to ``position`` of ``end``)."""
        rate = position / max(time.monotonic() - self._started, 1e-9)
        self._progress.update(self._task, completed=position, total=end, rate=f"{rate:,.0f} ev/s")

    def finish(self) -> None:
        """Stop drawing, leaving the final bar on the screen."""
        self._progress.stop()


def progress_for(stream: TextIO, label: str, plain: Any) -> Any:
    """A progress bar for ``stream``: rich's on a terminal, else ``plain(stream, label)``."""
    if terminal(stream):
        return RichProgress(stream, label)
    return plain(stream, label)
