"""Simulated attribution: a citer with the paper's measured precision/recall (DESIGN.md §4).

No LLM weights exist on our machines, so online learning is measured with a citer that knows
which shown memories hit gold evidence: each gold-hitting memory is cited with probability
`recall`, and non-evidence memories are cited at the rate that makes the expected precision
`precision` (Table 3 of the paper: 0.876 / 0.858). Its output is always labelled "simulated".

Precision here is micro precision, `E[true cites] / E[all cites]`: expected true cites are
`recall·n_gold`, so expected false cites are `recall·n_gold·(1−p)/p`, spread uniformly over the
non-gold shown memories (a per-memory rate capped at 1 — with few non-gold memories shown the
target precision may be unreachable from below, never from above).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from rmm.citations import format_response

__all__ = ["SimulatedCiter"]


@dataclass
class SimulatedCiter:
    precision: float = 0.876
    recall: float = 0.858
    seed: int = 0
    label: ClassVar[str] = "simulated"
    _generator: torch.Generator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.precision <= 1:
            raise ValueError(f"precision must be in (0, 1], got {self.precision}")
        if not 0 <= self.recall <= 1:
            raise ValueError(f"recall must be in [0, 1], got {self.recall}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        self.reset()

    def reset(self, seed: int | None = None) -> None:
        """Restart the random stream (from `seed`, else the configured one)."""
        if seed is not None:
            self.seed = seed
        self._generator = torch.Generator().manual_seed(self.seed)

    def false_cite_rate(self, n_gold: int, n_other: int) -> float:
        """Per-memory probability of citing a non-evidence memory."""
        if n_gold == 0 or n_other == 0:
            return 0.0
        expected_false = self.recall * n_gold * (1.0 - self.precision) / self.precision
        return min(1.0, expected_false / n_other)

    def cite(self, gold_hits: Sequence[bool]) -> list[int]:
        """Indices (into the shown list, ascending) the simulated generator cites."""
        hits = [bool(h) for h in gold_hits]
        n_gold = sum(hits)
        if n_gold == 0:
            return []
        rate = self.false_cite_rate(n_gold, len(hits) - n_gold)
        draws = torch.rand(len(hits), generator=self._generator).tolist()
        return [i for i, (hit, u) in enumerate(zip(hits, draws)) if u < (self.recall if hit else rate)]

    def respond(self, gold_hits: Sequence[bool]) -> str:
        """A reply in the paper's format: `[simulated answer] [0, 2]` or `… [NO_CITE]`."""
        return format_response("[simulated answer]", self.cite(gold_hits))
