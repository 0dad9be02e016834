"""The simulated generator: an attribution model with the paper's measured precision/recall,
and the LLM backend that answers with its citations (DESIGN.md §4).

No LLM weights exist on our machines, so online learning is measured with a citer that knows
which shown memories hit gold evidence: each gold-hitting memory is cited with probability
`recall`, and non-evidence memories are cited at the rate that makes the expected precision
`precision` (Table 3 of the paper: 0.876 / 0.858). Its output is always labelled "simulated".

Precision here is micro precision, `E[true cites] / E[all cites]`: expected true cites are
`recall·n_gold`, so expected false cites are `recall·n_gold·(1−p)/p`, spread uniformly over the
non-gold shown memories (a per-memory rate capped at 1 — with few non-gold memories shown the
target precision may be unreachable from below, never from above).

`SimulatedLLM` puts the citer behind the LLM interface. No prompt says which shown memories hit
gold evidence, so the caller passes the shown memories themselves (`generate(…, shown=…)`, as
every answer call site does) and the evaluator, which knows the question's gold, supplies an
`oracle`: a callable from those `Memory` records (in shown order) to one bool per memory —
`gold_evidence_oracle(turn_ids)` marks the memories whose `refs` name a gold turn. Every reply is
labelled "[simulated answer]"; a request without `shown=` (extraction, update, judging) raises
LLMError.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from rmm.errors import LLMError
from rmm.llm.base import LLM, Message, Shown, Usage
from rmm.policy.citations import format_response
from rmm.types import Memory

__all__ = ["Oracle", "SimulatedCiter", "SimulatedLLM", "gold_evidence_oracle"]


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


Oracle = Callable[[Sequence[Memory]], Sequence[bool]]

ANSWER_LABEL = "[simulated answer]"


def gold_evidence_oracle(gold_turn_ids: Iterable[str]) -> Oracle:
    """The oracle of a question whose evidence is these turns: a memory hits when it refers to one."""
    gold = frozenset(gold_turn_ids)
    return lambda memories: [not gold.isdisjoint(m.refs) for m in memories]


class SimulatedLLM(LLM):
    """`generate` for answer prompts only: `[simulated answer] [0, 2]` (or JSON when asked)."""

    reads_shown = True

    def __init__(self, citer: SimulatedCiter | None = None, oracle: Oracle | None = None) -> None:
        super().__init__("simulated")
        self.citer = citer if citer is not None else SimulatedCiter()
        self.oracle = oracle

    def _hits(self, memories: Sequence[Memory]) -> list[bool]:
        if self.oracle is None:
            raise LLMError(
                "the simulated LLM needs an oracle (shown memories → gold hits): set llm.oracle first"
            )
        hits = [bool(h) for h in self.oracle(memories)]
        if len(hits) != len(memories):
            raise LLMError(f"oracle returned {len(hits)} hits for {len(memories)} shown memories")
        return hits

    def _generate(self, batch: list[list[Message]], *, json_schema: dict | None = None, max_tokens: int = 512,
                  temperature: float = 0.0, shown: Shown | None = None) -> list[str]:
        if shown is None:
            raise LLMError(
                "the simulated backend only answers with citations: it needs the memories an answer prompt "
                "showed (generate(..., shown=...)); extraction, update and judging need a real LLM "
                "(hf:, openai:, vllm:)"
            )
        started = time.perf_counter()
        replies: list[str] = []
        for memories in shown:
            hits = self._hits(memories)
            if json_schema is not None:
                replies.append(json.dumps({"answer": ANSWER_LABEL, "citations": self.citer.cite(hits)}))
            else:
                replies.append(self.citer.respond(hits))
        self._record(Usage(calls=len(batch), seconds=time.perf_counter() - started))
        return replies
