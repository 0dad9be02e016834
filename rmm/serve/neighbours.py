"""Neighbour slates of the event graph: a client-side explorer's step, learned from like a retrieve.

`POST /v1/users/{user}/events/{id}/neighbours` answers with the event's unvisited neighbours
(`rmm.memory.graph` edges, in the direction and of the label asked) reranked for the query by the
user's reranker — the one `/v1/retrieve` ranks with — as CompassMem's explorers see them
(issue 33 item 5): when more than `m` neighbours are unvisited, the slate is a Gumbel top-M of
them with the visited ones masked *before* the draw (`ResidualLinearReranker.select(exclude=)`),
so its behaviour log-probabilities are the Plackett–Luce ones over the unvisited candidates; when
`m` or fewer are left, all of them are shown in score order, which chose nothing and is greedy
(exactly as `rmm.frontends.compass` does: neither learns from a slate that was not a sample).

The slate is persisted as a pending selection like a retrieve's (`rmm.serve.pending` /
`rmm.serve.pg_pending`: candidate and query embeddings, scores, μ, τ, weights version, noise),
before the answer is sent, so `/v1/feedback` with its `selection_id` claims it once and the
learner updates from the stored row alone. Neighbour candidates carry no lexical feature and no
candidate features (there is no first-stage ranking of a node's neighbours): they score f = 0,
which changes no order, as the controller's neighbour slates do. The retriever score shown is the
cosine of the query and the neighbour's stored vector.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import torch

from rmm.errors import UnknownMemoryError
from rmm.memory.bank import MemoryBank
from rmm.policy.registry import LearnerRegistry
from rmm.serve.config import ServeConfig
from rmm.serve.errors import BadRequestError
from rmm.encoders.query.locked import LockedEncoder
from rmm.serve.pending import PendingSelection, Selections
from rmm.serve.records import NeighbourEdge, NeighboursResult, ShownNeighbour
from rmm.serve.tenants import callers_terms, reranker_key, scoped, unknown_user
from rmm.types import Candidates, Memory

__all__ = ["NeighbourRequest", "NeighbourSlates"]

log = logging.getLogger(__name__)


@dataclass
class NeighbourRequest:
    """One neighbours call as the service takes it (ids as the tenant sees them)."""

    tenant: str
    user: str
    event_id: str
    query: str
    m: int
    explore: bool
    visited: list[str] = field(default_factory=list)
    direction: str = "both"
    label: str | None = None


class NeighbourSlates:
    """Reads a node's edges, reranks its unvisited neighbours, persists the slate's selection."""

    def __init__(self, config: ServeConfig, bank: MemoryBank, encoder: LockedEncoder, learners: LearnerRegistry,
                 selections: Selections, *, tau: float) -> None:
        self.config, self.bank, self.encoder, self.learners = config, bank, encoder, learners
        self.selections, self.tau = selections, tau
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, key: str) -> torch.Generator:
        """Each reranker key's own noise stream for neighbour slates (seeded from the config's seed
        and the key; called under the learners' lock)."""
        generator = self._generators.get(key)
        if generator is None:
            digest = hashlib.blake2b(f"{self.config.seed}:neighbours:{key}".encode(), digest_size=8).digest()
            generator = self._generators[key] = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        return generator

    def slate(self, request: NeighbourRequest) -> NeighboursResult:
        """The slate for one request: 404 for an unknown user or memory id, 422 for a memory that is
        not an event."""
        user_id = scoped(request.tenant, request.user)
        store = self.bank.store
        with callers_terms(request.tenant, request.user):
            if not store.has_user(user_id):
                raise unknown_user(request.user)
            (node,) = self.bank.get(user_id, [request.event_id])
            if node.kind != "event":
                raise BadRequestError(f"memory {request.event_id!r} is a {node.kind} memory, not an event: only "
                                      "events have neighbours")
            edges = store.neighbours(user_id, request.event_id, request.direction, request.label)  # type: ignore[arg-type]
        joined: dict[str, list[NeighbourEdge]] = {}
        for edge in edges:
            outgoing = edge.source == request.event_id
            other = edge.target if outgoing else edge.source
            joined.setdefault(other, []).append(NeighbourEdge(edge.label, "out" if outgoing else "in",
                                                              list(edge.evidence)))
        visited = set(request.visited) | {request.event_id}
        unvisited = [i for i in joined if i not in visited]
        result = NeighboursResult(user=request.user, event_id=request.event_id, query=request.query,
                                  selection_id=None, explore=False, expires_at=None, neighbours=len(joined),
                                  unvisited=len(unvisited), memories=[])
        if not unvisited:
            return result
        ids, vectors = self._vectors(user_id, list(joined))
        masked = {i for i in ids if i in visited}
        if len(ids) == len(masked):  # the unvisited ones have no stored vector: nothing can be ranked
            return result
        query_vector = self.encoder.encode_queries([request.query])[0].detach().float().cpu()
        candidates = Candidates(query=request.query, memory_ids=ids, retriever_scores=vectors @ query_vector,
                                embeddings=vectors, query_embedding=query_vector, user_id=user_id)
        key = reranker_key(self.config.reranker_per, request.tenant, user_id)
        sampled = request.explore and len(ids) - len(masked) > request.m
        with self.learners.lock:
            (selection,) = self.learners.get(key).reranker.select(
                [candidates], request.m, tau=self.tau, explore=sampled, generator=self._generator(key),
                exclude=[masked] if masked else None)
        c = selection.candidates
        shown_ids = [c.memory_ids[i] for i in selection.chosen]
        with callers_terms(request.tenant, request.user):
            rows = {m.id: m for m in self.bank.get(user_id, shown_ids)}
            people = store.participants(user_id, shown_ids)
        now = time.time()
        expires = now + self.config.selection_ttl_s
        self.selections.put_many([PendingSelection(
            id=selection.id, tenant=request.tenant, user_id=user_id, reranker_key=key, query=request.query,
            memory_ids=list(c.memory_ids), chosen=list(selection.chosen), explore=selection.explore,
            query_embedding=c.query_embedding, scores=selection.scores, logp=selection.logp, noise=selection.noise,
            created_at=now, expires_at=expires, embeddings=c.embeddings, tau=selection.tau,
            version=selection.version, mask=selection.mask, lexical=None, features=None, feature_names=None)])
        scores = {memory_id: float(selection.scores[i]) for i, memory_id in enumerate(c.memory_ids)}
        cosines = {memory_id: float(c.retriever_scores[i]) for i, memory_id in enumerate(c.memory_ids)}
        result.selection_id, result.explore, result.expires_at = selection.id, selection.explore, expires
        result.memories = [_shown(j, rows[i], scores[i], cosines[i], people.get(i, ()), joined[i])
                           for j, i in enumerate(shown_ids)]
        return result

    def _vectors(self, user_id: str, ids: list[str]) -> tuple[list[str], torch.Tensor]:
        """The neighbours' stored vectors, in `ids` order; one without a vector (an event written
        without an embedding) is left out, as the index leaves it out of every search."""
        try:
            return ids, self.bank.embeddings(user_id, ids).float()
        except UnknownMemoryError:
            kept, rows = [], []
            for memory_id in ids:
                try:
                    rows.append(self.bank.embeddings(user_id, [memory_id]).float())
                    kept.append(memory_id)
                except UnknownMemoryError:
                    log.info("event %s of %s has no stored vector; not shown as a neighbour", memory_id, user_id)
            return kept, torch.cat(rows) if rows else torch.zeros(0, self.bank.dim)


def _shown(index: int, memory: Memory, score: float, cosine: float, participants: tuple[str, ...],
           edges: list[NeighbourEdge]) -> ShownNeighbour:
    return ShownNeighbour(index=index, id=memory.id, text=memory.text, kind=memory.kind, refs=list(memory.refs),
                          score=score, retriever_score=cosine, time_span=memory.time_span,
                          participants=list(participants), edges=edges)
