"""The RMM dialogue agent — Algorithm 1 of the paper.

    respond(user, q):  M_K ← retrieve(q)  →  M_M ← rerank(q, M_K)  →  a, R ← LLM(q, S, M_M)
                       →  reranker ← RL_Update(R)  →  S.append(q, a)
    end_session(user): M ← extract(S); for m in M: B ← update(B, m); S ← []

Everything persists beside the bank: the open sessions (`sessions.sqlite`) and the reranker
checkpoint (`reranker/`, or `reranker/users/<user>/` with one reranker per user), saved
atomically every `checkpoint_every` rewarded answers and on `close()`.

Hyper-parameters: `recipe="auto"` takes the paper's (τ 0.5, b 0.5, lr 1e-3) for dot-product
encoders and the `normalized` recipe (τ 0.05, running-mean baseline, lr 3e-4) for L2-normalised
ones such as the default MiniLM, whose cosines τ = 0.5 would flatten into near-uniform sampling
(see `rmm.policy.learner.RECIPES`); `tau=` or `learner_config=` override it.

A first stage other than the bank's own dense search (`first_stage=HybridRetriever(bank)`, BM25 +
dense fused, `rmm.memory.hybrid`) only chooses the K candidates: the reflector still writes into
the dense bank, and BM25 reads the bank's store, rebuilding a user's index whenever that user's
store generation moved, so a memory added by `end_session` is found lexically by the next query.
Hybrid candidates carry their lexical feature; the Selection keeps it as scored, so the update
(now or delayed) learns the lexical weight from what was sampled. `Agent.over(retriever, llm)` takes
either kind of first stage as one argument (what the evaluation drivers hold).

Decisions where the paper is silent: `end_session` stores topic memories only, as the paper
does (`store_turns=True` also stores each raw turn as a turn memory); extraction is asked about
the user only (the whole session is shown, but memories about the assistant help nobody).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rmm.errors import RmmError
from rmm.memory.bank import MemoryBank
from rmm.memory.hybrid import HybridRetriever
from rmm.memory.sessions import SessionLog
from rmm.policy.learner import (
    Learner,
    LearnerConfig,
    is_normalized_encoder,
    recipe_config,
)
from rmm.policy.registry import SHARED, LearnerRegistry
from rmm.policy.retrieve import RerankedRetriever
from rmm.reflection import CitationFeedback, ProspectiveReflector, reflect_citations
from rmm.types import Memory, Selection, Turn

if TYPE_CHECKING:
    from rmm.llm.base import LLM

__all__ = ["ASSISTANT", "Agent", "Response"]

log = logging.getLogger(__name__)

ASSISTANT = "assistant"
CHECKPOINT_DIR = "reranker"
SESSIONS_FILE = "sessions.sqlite"


@dataclass
class Response:
    answer: str
    cited: list[Memory]  # the shown memories the answer cites
    shown: list[Memory]  # the M memories given to the LLM, in shown order
    selection: Selection | None  # None when the user has no memories yet
    raw_text: str
    feedback: CitationFeedback


class Agent:
    def __init__(self, bank: MemoryBank, llm: LLM, *, first_stage: HybridRetriever | None = None,
                 learner: Learner | None = None, per_user: bool = False,
                 reflector: ProspectiveReflector | None = None, k: int = 20, m: int = 5, tau: float | None = None,
                 learn: bool = True, structured: bool = False, sessions: SessionLog | None = None,
                 checkpoint_dir: str | Path | None = None, checkpoint_every: int = 10, store_turns: bool = False,
                 learner_config: LearnerConfig | None = None, max_tokens: int = 512, seed: int = 0,
                 recipe: str = "auto") -> None:
        if m > k:
            raise ValueError(f"cannot show M={m} memories out of K={k} candidates")
        bank, first_stage = _split_first_stage(bank, first_stage)
        if learner_config is None:  # `auto`: the paper's for dot products, sharper for cosines
            learner_config = recipe_config(recipe, is_normalized_encoder(bank.encoder), tau=tau)
        tau = learner_config.tau if tau is None else tau
        self.bank, self.llm = bank, llm
        self.first_stage: MemoryBank | HybridRetriever = first_stage if first_stage is not None else bank
        self.k, self.m, self.tau = k, m, tau
        self.learn, self.structured, self.store_turns = learn, structured, store_turns
        self.max_tokens = max_tokens
        self.per_user = per_user
        self.reflector = reflector or ProspectiveReflector(bank, llm, structured=structured)
        self.sessions = sessions if sessions is not None else SessionLog(Path(bank.path) / SESSIONS_FILE)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else Path(bank.path) / CHECKPOINT_DIR
        self.checkpoint_every = checkpoint_every
        self.learner_config = learner_config
        self.generator = torch.Generator().manual_seed(seed)
        self.learners = LearnerRegistry(bank.dim, learner_config, encoder_name=bank.encoder.fingerprint,
                                        device=bank.device, root=self.checkpoint_dir, subdir="users",
                                        checkpoint_every=checkpoint_every)
        if learner is not None:
            if per_user:
                raise ValueError("a given learner is shared by every user; do not also ask for per_user")
            self.learners.put(SHARED, learner)

    # ---- Algorithm 1 --------------------------------------------------------------------
    def respond(self, user: str, query: str, *, remember: bool = True) -> Response:
        """Answer `query` from the user's memories and learn from what the answer cites.

        `remember=False` keeps the exchange out of the session (e.g. benchmark questions).
        """
        history = self.sessions.current(user).turns
        selection, shown = self.select(user, query)
        raw = self.generate(query, shown, history)
        feedback = reflect_citations(raw, selection, self.learner(user), structured=self.structured, learn=self.learn)
        if remember:
            self.sessions.append(user, [(user, query), (ASSISTANT, feedback.citation.answer)])
        self.checkpoint_if_due(user)
        cited = [shown[i] for i in feedback.citation.cited or []]
        return Response(feedback.citation.answer, cited, shown, selection, raw, feedback)

    def end_session(self, user: str) -> list[Memory]:
        """Prospective reflection on the user's open session; returns the memories it touched."""
        session = self.sessions.current(user)
        if not session.turns:
            return []
        touched = self.reflector.reflect(session, speakers=[user])
        if self.store_turns:
            turns = [Memory(id=t.id, user_id=user, kind="turn", text=f"{t.speaker}: {t.text}", refs=[t.id],
                            source_text=t.text, time_span=(t.time, t.time)) for t in session.turns]
            self.bank.add(user, turns)
            touched += turns
        self.sessions.clear(user)
        return touched

    # ---- the steps ------------------------------------------------------------------------
    def select(self, user: str, query: str) -> tuple[Selection | None, list[Memory]]:
        """Retrieve K through the first stage, rerank to M (Gumbel-sampled when learning, greedy otherwise)."""
        if not self.bank.store.has_user(user):
            return None, []
        (selection,) = self.retriever(user).select([query], user, explore=self.learn, generator=self.generator)
        return selection, self.bank.get(user, selection.memory_ids) if selection.chosen else []

    def retriever(self, user: str, *, k: int | None = None, m: int | None = None) -> RerankedRetriever:
        """The first stage → `user`'s reranker, as every front end over this agent selects."""
        return RerankedRetriever(self.first_stage, self.learner(user).reranker,  # type: ignore[arg-type]
                                 k=self.k if k is None else k, m=self.m if m is None else m, tau=self.tau)

    def generate(self, query: str, shown: list[Memory], history: list[Turn]) -> str:
        from rmm.prompts import ANSWER_SCHEMA, answer_messages

        messages = answer_messages(query, shown, history, structured=self.structured)
        (raw,) = self.llm.generate([messages], json_schema=ANSWER_SCHEMA if self.structured else None,
                                   max_tokens=self.max_tokens, shown=[shown])
        return raw

    # ---- rerankers and checkpoints ----------------------------------------------------------
    def learner(self, user: str) -> Learner:
        """The reranker's learner for `user`: one per bank, or one per user; loaded when saved."""
        return self.learners.get(self._key(user))

    def save(self) -> None:
        """Checkpoint every reranker (atomic: a crash mid-save keeps the previous checkpoint)."""
        self.learners.save(only_changed=False)

    def close(self) -> None:
        """Save the rerankers and close the session log (the bank belongs to the caller)."""
        self.save()
        self.sessions.close()

    @classmethod
    def over(cls, retriever: MemoryBank | HybridRetriever, llm: LLM, **options: Any) -> Agent:
        """An agent whose first stage is `retriever`: a dense bank, or a `HybridRetriever` (hybrid or
        bm25:DENSE) over the dense bank the agent then writes into."""
        if isinstance(retriever, HybridRetriever):
            return cls(retriever.bank, llm, first_stage=retriever, **options)
        return cls(retriever, llm, **options)

    def checkpoint_if_due(self, user: str) -> None:
        """Save the user's reranker once `checkpoint_every` rewarded selections have come in since the
        last save — one count per learner, whichever front end (direct, goal, MemR³) they came through."""
        self.learners.maybe_save(self._key(user))

    def _key(self, user: str) -> str:
        return user if self.per_user else SHARED


def _split_first_stage(bank: MemoryBank, first_stage: HybridRetriever | None) -> tuple[MemoryBank, HybridRetriever | None]:
    """(the dense bank written into, the first stage or None). A given first stage must search the
    bank the agent writes into, or new memories would never be found."""
    if isinstance(bank, HybridRetriever):
        raise RmmError("give a hybrid or bm25:DENSE first stage as first_stage= over its dense bank "
                       "(Agent(bank, llm, first_stage=retriever)), or use Agent.over(retriever, llm)")
    if first_stage is not None and first_stage.bank is not bank:
        raise RmmError("the first stage must search the agent's own bank (HybridRetriever(bank)): memories the "
                       "reflector writes would otherwise never be retrieved")
    return bank, first_stage
