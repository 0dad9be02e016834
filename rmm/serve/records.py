"""The service's requests and answers as plain records (no torch, no HTTP).

They are what the micro-batchers carry and what the service returns; the three answers that go
out unchanged (`ShownMemory`, `RetrieveResult`, `FeedbackResult`) are also the HTTP response
models, so each of them is defined once and the API cannot drift from the service.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FeedbackResult", "NewMemory", "QueryError", "RetrieveItem", "RetrieveResult", "ShownMemory",
           "WriteItem"]


@dataclass
class RetrieveItem:
    """One query of a retrieve request: what the retrieval micro-batcher coalesces."""

    tenant: str
    user: str
    query: str
    k: int
    m: int
    explore: bool


@dataclass
class ShownMemory:
    """One memory shown for a query; `index` is what the LLM cites it by."""

    index: int
    id: str
    text: str
    kind: str
    refs: list[str]
    score: float  # reranker score
    retriever_score: float
    time_span: tuple[str | None, str | None] | None


@dataclass
class QueryError:
    """Why one query of a retrieve request failed: the status and error shape it would have
    answered alone."""

    status: int
    code: str
    detail: str


@dataclass
class RetrieveResult:
    """The memories shown for one query, and the selection id its feedback must name; or, for a
    query that failed while others of its request were answered, its `error` (nothing shown)."""

    user: str
    query: str
    selection_id: str | None  # None when nothing was shown (the user has no memories, or `error`)
    explore: bool
    expires_at: float | None
    memories: list[ShownMemory]
    error: QueryError | None = None


@dataclass
class NewMemory:
    """A memory to store, as a caller describes it (the id is generated when not given)."""

    text: str
    kind: str = "turn"
    id: str | None = None
    refs: list[str] = field(default_factory=list)
    source_text: str = ""
    time: str | None = None


@dataclass
class WriteItem:
    """One add-memories request: what the write micro-batcher coalesces."""

    tenant: str
    user: str
    memories: list[NewMemory]


@dataclass
class FeedbackResult:
    """What one feedback taught the learner (and whether the reranker took a step)."""

    selection_id: str
    rewards: list[float] | None  # per shown memory; None = nothing learned (no parseable citation)
    cited: list[int] | None
    no_cite: bool
    warnings: list[str]
    updated: bool  # this feedback completed a batch and the reranker took a step
    loss: float | None
    learner_step: int
    learner_records: int
    learned: bool = True  # the rewards went into the learner (a greedy or uncited feedback is stored only)
    reason: str | None = None  # why not, when `learned` is false
