"""Where log records go on the command line, and which.

By default the user sees rmm's own INFO lines and everyone's warnings; `-v` adds rmm's DEBUG,
`-vv` every library's DEBUG. Levels alone cannot ensure this: some libraries set DEBUG on their
own logger (bm25s does), and their records reach the root handler whatever the root's level, so
the handler filters by origin as well.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["ByOrigin", "levels", "quiet_progress_bars", "to_file", "to_stderr"]

OURS = "rmm"
SCREEN_FORMAT = "%(levelname)s %(name)s: %(message)s"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def levels(verbosity: int) -> tuple[int, int]:
    """(rmm's level, every other library's level) for `-v` given `verbosity` times."""
    ours = logging.DEBUG if verbosity >= 1 else logging.INFO
    others = logging.DEBUG if verbosity >= 2 else logging.WARNING
    return ours, others


class ByOrigin(logging.Filter):
    """Passes rmm's records from `ours` up and everyone else's from `others` up."""

    def __init__(self, ours: int, others: int) -> None:
        super().__init__()
        self.ours, self.others = ours, others

    def filter(self, record: logging.LogRecord) -> bool:
        mine = record.name == OURS or record.name.startswith(OURS + ".")
        return record.levelno >= (self.ours if mine else self.others)


def _route(handler: logging.Handler, verbosity: int, *, exclusive: bool) -> Callable[[], None]:
    """Send log records to `handler` at the levels `verbosity` asks for (`exclusive`: instead of the
    root's other handlers). Returns the undo, which puts handlers and levels back as they were."""
    ours, others = levels(verbosity)
    handler.addFilter(ByOrigin(ours, others))
    root, mine = logging.getLogger(), logging.getLogger(OURS)
    saved_handlers, saved_levels = list(root.handlers), (root.level, mine.level)
    if exclusive:
        for old in saved_handlers:
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(others)
    mine.setLevel(ours)

    def restore() -> None:
        root.removeHandler(handler)
        handler.close()
        for old in saved_handlers:
            if old not in root.handlers:
                root.addHandler(old)
        root.setLevel(saved_levels[0])
        mine.setLevel(saved_levels[1])

    return restore


def to_stderr(verbosity: int) -> Callable[[], None]:
    """Log to stderr (stdout carries the tables); returns the undo."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(SCREEN_FORMAT))
    return _route(handler, verbosity, exclusive=False)


def to_file(path: Path, verbosity: int) -> Callable[[], None]:
    """Log to `path` only, keeping the screen for a conversation; returns the undo."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    return _route(handler, verbosity, exclusive=True)


def quiet_progress_bars() -> None:
    """Our own progress bars say what is happening; transformers' per-load weight bar is noise."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
