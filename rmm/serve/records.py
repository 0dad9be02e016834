"""The service's requests and answers as plain records (no torch, no HTTP).

They are what the micro-batchers carry and what the service returns; the three answers that go
out unchanged (`ShownMemory`, `RetrieveResult`, `FeedbackResult`) are also the HTTP response
models, so each of them is defined once and the API cannot drift from the service.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FeedbackResult", "NeighbourEdge", "NeighboursResult", "NewMemory", "QueryError", "RetrieveItem",
           "RetrieveResult", "ShownMemory", "ShownNeighbour", "StepNode", "TreeNodeInfo", "TreeSchema", "TreeTypeInfo",
           "WriteItem", "XPathNode", "XPathResult", "XPathStep"]


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
    participants: list[str] = field(default_factory=list)  # events only (at most three)


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


@dataclass
class NeighbourEdge:
    """One edge between the node asked about and a neighbour: `direction` "out" (node → neighbour)
    or "in" (neighbour → node), its free-form label and the turn ids supporting it."""

    label: str
    direction: str
    evidence: list[str]


@dataclass
class ShownNeighbour:
    """One neighbour shown in a neighbours slate; `index` is what feedback cites it by."""

    index: int
    id: str
    text: str
    kind: str
    refs: list[str]
    score: float  # reranker score for the query
    retriever_score: float  # cosine of the query and the neighbour's stored vector
    time_span: tuple[str | None, str | None] | None
    participants: list[str]
    edges: list[NeighbourEdge]  # every edge joining it to the node (the first is the label to show)


@dataclass
class NeighboursResult:
    """A slate of an event's unvisited neighbours for a query, and the selection id its feedback
    names (None when nothing was shown). `explore` is true when the slate is a Gumbel top-M sample
    (more unvisited neighbours than `m`); a slate of all of them chose nothing and is greedy."""

    user: str
    event_id: str
    query: str
    selection_id: str | None
    explore: bool
    expires_at: float | None
    neighbours: int  # the node's neighbours in the direction asked
    unvisited: int  # of which not visited (what the slate was drawn from)
    memories: list[ShownNeighbour]


# ---- Semantic XPath: the user's typed tree, its schema and queries over it ----------------------
@dataclass
class TreeTypeInfo:
    """One node type of Σ: how many nodes have it, the attribute names seen on them, and the child
    types found under it (with counts)."""

    count: int
    attributes: list[str]
    children: dict[str, int]


@dataclass
class TreeSchema:
    """Σ of a user's tree as stored (induced from the data, never declared): node types, attribute
    names, allowed parent → child type pairs with counts (`roots`: the types under the implicit
    root), the node count, the user's generation it was read at, and `text`, the same in one line
    per parent type for an LLM prompt (``Session (30) [date] -> Turn (600)``)."""

    user: str
    generation: int
    nodes: int
    types: dict[str, TreeTypeInfo]
    roots: dict[str, int]
    text: str


@dataclass
class TreeNodeInfo:
    """One node of a user's tree (its latest version unless read as of a generation): its memory's
    text at that version (`text`; null for a node that shows no memory)."""

    id: str
    type: str
    parent: str | None
    position: int
    attributes: dict[str, str]
    memory_id: str | None
    version: int
    revision: int
    text: str | None


@dataclass
class XPathNode(TreeNodeInfo):
    """A node of a query's result and its weight (the product of its path's relevances)."""

    weight: float = 0.0


@dataclass
class StepNode:
    id: str | None  # None: the root
    type: str | None
    weight: float


@dataclass
class XPathStep:
    """One step of an executed query: its canonical text, how many nodes its axis reached, how many
    its node test and position kept, and the best of those (`top`) with their weights."""

    step: str
    reached: int
    kept: int
    top: list[StepNode]


@dataclass
class XPathResult:
    """An executed Semantic XPath query: the best `nodes` by weight, each step's scores, and a slate
    of the best leaves' memories reranked for `question` by the user's reranker (a Gumbel top-M
    when exploring; `retriever_score` of a shown memory is its XPath weight) with the
    `selection_id` its feedback names. No slate (`selection_id` null, `reason` says why) when the
    result shows no memory, or the query has no soft match and no `question` was given."""

    user: str
    query: str  # canonical text (parses back to the same query)
    question: str | None
    scorer: str
    generation: int
    nodes: list[XPathNode]
    steps: list[XPathStep]
    candidates: int  # memories handed to the reranker
    selection_id: str | None
    explore: bool
    expires_at: float | None
    memories: list[ShownMemory]
    reason: str | None = None
