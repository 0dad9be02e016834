"""Tables of figures that stay whole in a terminal, a file or a pipe.

Left to itself, rich fits a table to the console (80 columns when the output is not a terminal)
by shrinking every column and cutting cells with "…", which loses digits and can squeeze a
column to nothing. A `Figures` table is laid out compactly, wraps its headers onto two lines
before anything else gives, then wraps the label column; figures themselves are never cut. When
even that does not fit and the output is not a terminal, the table is printed at the width it
needs (a file has no right edge). `--json` stays the machine format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

__all__ = ["Figures", "headroom_cell", "print_figures", "question_set"]

_UNBOUNDED = 100_000


@dataclass
class Figures:
    """A title, column headers and rows of already formatted cells (rich markup allowed)."""

    title: str
    columns: list[str]
    caption: str | None = None
    label: bool = True  # the first column is a text label (left-aligned, may wrap), not a figure
    rows: list[list[str]] = field(default_factory=list)

    def add_row(self, *cells: str) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(list(cells))

    def table(self, *, wrap_headers: bool = False) -> Table:
        """The rich table; `wrap_headers` splits each multi-word header over two lines."""
        table = Table(title=self.title, caption=self.caption, box=box.SIMPLE_HEAD, show_edge=False,
                      pad_edge=False, collapse_padding=True)
        for i, header in enumerate(self.columns):
            if i == 0 and self.label:
                table.add_column(header, overflow="fold")
            else:
                table.add_column(_two_lines(header) if wrap_headers else header, justify="right", no_wrap=True)
        for row in self.rows:
            table.add_row(*row)
        return table


def headroom_cell(share: float | None) -> str:
    """A share of headroom captured (`rmm.eval.retrieval.headroom_captured`) as a table cell."""
    return "n/a (no headroom)" if share is None else f"{100 * share:.0f}%"


def question_set(dataset: Any, no_dedup: bool) -> str:
    """For a caption: how many questions the dataset holds, and for one with repeated questions
    (LoCoMo) whether they were dropped — the count tells a reader which set the figures come from."""
    from rmm.data import DATASETS

    count = f"{len(dataset.questions):,} {dataset.name} questions"
    spec = DATASETS.get(dataset.name)
    if spec is None or not spec.dedups:
        return count
    kept = " (repeated ones kept: --no-dedup)" if no_dedup else " (repeated ones dropped; --no-dedup keeps them)"
    return count + kept


def _two_lines(header: str) -> str:
    """`header` split at the space that makes its longer line shortest ("session R@10" → "session\\nR@10")."""
    words = header.split(" ")
    if len(words) < 2:
        return header
    splits = [(" ".join(words[:i]), " ".join(words[i:])) for i in range(1, len(words))]
    first, second = min(splits, key=lambda pair: max(len(pair[0]), len(pair[1])))
    return f"{first}\n{second}"


def _measure(out: Console, table: Table) -> Measurement:
    return Measurement.get(out, out.options.update_width(_UNBOUNDED), table)


def print_figures(figures: Figures, out: Console) -> None:
    """Print `figures` on `out`: one-line headers if the whole table fits, else two-line headers
    and a wrapped label column; when even that does not fit and `out` is not a terminal, the whole
    table at its natural width, wider than the console, with nothing cut."""
    table = figures.table()
    natural = _measure(out, table).maximum
    if natural <= out.width:
        out.print(table)
        return
    wrapped = figures.table(wrap_headers=True)
    if _measure(out, wrapped).minimum <= out.width or out.is_terminal:
        out.print(wrapped)
        return
    table.width = natural
    out.print(table, crop=False)
