"""Records shared by every layer (DESIGN.md §3).

Plain dataclasses: dialogue (`Turn`, `Session`), what the bank stores (`Memory`), what a
benchmark asks (`Question`, `Dataset`), and what retrieval hands to the reranker and the learner
(`Candidates`, `Selection`), and one chat message for any LLM (`Message`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:  # annotations only: the records load without torch (the HTTP client's schemas use them)
    import torch

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}

MemoryKind = Literal["turn", "session", "topic", "event"]
# "event": a CompassMem event node (rmm.memory.graph): its summary as text, its turn refs, an explicit time
MEMORY_KINDS: tuple[str, ...] = ("turn", "session", "topic", "event")


@dataclass
class Turn:
    id: str
    session_id: str
    speaker: str
    text: str
    time: str | None = None


@dataclass
class Session:
    id: str
    user_id: str
    turns: list[Turn]
    time: str | None = None

    def text(self) -> str:
        """The session as one passage, one `speaker: text` line per turn."""
        return "\n".join(f"{t.speaker}: {t.text}" for t in self.turns)


@dataclass
class Memory:
    """One retrievable entry of a user's bank.

    `text` is what gets embedded; `refs` are the dialogue turn ids it came from, which is how
    session and topic memories are scored against turn-level gold evidence.
    """

    id: str
    user_id: str
    kind: MemoryKind
    text: str
    refs: list[str] = field(default_factory=list)
    source_text: str = ""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    merged_from: list[str] = field(default_factory=list)
    time_span: tuple[str | None, str | None] | None = None

    def __post_init__(self) -> None:
        if self.kind not in MEMORY_KINDS:
            raise ValueError(f"memory kind must be one of {MEMORY_KINDS}, got {self.kind!r}")

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex


@dataclass
class Question:
    """A benchmark question with its gold evidence at turn and session granularity."""

    id: str
    user_id: str
    text: str
    answer: str
    evidence_turns: list[str]
    evidence_sessions: list[str]
    category: int | None = None
    category_name: str = ""
    time: str | None = None
    abstention: bool = False


@dataclass
class Dataset:
    """A benchmark in one in-memory form: users → sessions → turns, plus questions.

    Each user is one retrieval scope: a question is only ever searched against its own user's
    memories (for LoCoMo a user is one conversation, for LongMemEval one question's haystack).
    """

    name: str
    sessions: dict[str, list[Session]]
    questions: list[Question]
    categories: dict[int, str] = field(default_factory=dict)

    @property
    def users(self) -> list[str]:
        return list(self.sessions)

    def turns(self, user_id: str) -> list[Turn]:
        return [t for s in self.sessions[user_id] for t in s.turns]

    def questions_of(self, user_id: str) -> list[Question]:
        return [q for q in self.questions if q.user_id == user_id]


@dataclass
class Candidates:
    """The retriever's top-K for one query: what the reranker rescores.

    `embeddings` is None for retrievers without vectors (BM25); the reranker needs them.
    `lexical` is each candidate's BM25 score scaled to [0, 1] over BM25's depth list (its top 50 by
    default; 0 below it), from a hybrid or bm25:DENSE first stage (`rmm.memory.hybrid`), the reranker's optional learned feature; None
    from a dense or plain BM25 retriever. A Selection keeps its candidates, so the feature is recorded as it was sampled.
    `features` ([K, F], one column per name in `feature_names`) are further per-candidate features a
    hybrid first stage computes while it fuses (ranks, scores, length, query overlap;
    `rmm.memory.features`), weighed by the reranker beside `lexical`; None / () = none.
    """

    query: str
    memory_ids: list[str]
    retriever_scores: torch.Tensor  # [K]
    embeddings: torch.Tensor | None = None  # [K, d]
    query_embedding: torch.Tensor | None = None  # [d]
    user_id: str = ""
    lexical: torch.Tensor | None = None  # [K] in [0, 1]; None = no lexical feature
    features: torch.Tensor | None = None  # [K, F] float32; None = no candidate features
    feature_names: tuple[str, ...] = ()  # the F column names of `features`, in order

    def __len__(self) -> int:
        return len(self.memory_ids)


@dataclass
class Selection:
    """The M memories shown to the generator, kept until their reward arrives.

    It records at sampling time everything its update needs, so a reward arriving any time later
    (another thread, another process, after many updates) is learned from correctly and nothing
    is re-read from the store: the candidates *as scored* (ids, embeddings, query embedding),
    `chosen` (indices into `candidates`, in pick order), the temperature `tau` the picks were
    sampled at, the weights `version` that sampled them (the learner's `stats.step` then), and
    the behaviour log-probability μ: `logp[j]` is the Plackett–Luce log-probability of pick j
    given the picks before it, so `logp.sum()` is log μ of the ordered selection. The learner
    weights the update by the truncated ratio π_θ/μ (`rmm.policy.credit`).

    `explore=False` marks greedy (top-M) picks: they have no sampling probability and are never
    learned from. `mask` ([K] bool, True = could be picked), when set, says which candidates the
    sample was drawn from; the reranker instead drops excluded candidates, so its selections
    carry no mask.
    """

    candidates: Candidates
    chosen: list[int]
    scores: torch.Tensor  # [K] reranker scores at selection time
    logp: torch.Tensor | None = None  # [M] behaviour log-probability of each pick (detached)
    noise: torch.Tensor | None = None  # [K] Gumbel noise used (the paper-literal estimator needs it)
    explore: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tau: float | None = None  # the sampling temperature; None = unknown (the learner assumes its own)
    version: int | None = None  # weights version (learner step) that sampled it; None = unknown
    mask: torch.Tensor | None = None  # [K] bool, True = could be picked; None = all candidates

    @property
    def memory_ids(self) -> list[str]:
        return [self.candidates.memory_ids[i] for i in self.chosen]

    @property
    def behaviour_logp(self) -> float | None:
        """log μ of the ordered picks (the sum of `logp`), or None when it was not recorded."""
        return None if self.logp is None else float(self.logp.sum())


class Retriever(Protocol):
    """Anything that returns each query's top-k memories of one user (dense bank, BM25, …)."""

    def search(self, queries: list[str], user: str, k: int) -> list[Candidates]: ...
