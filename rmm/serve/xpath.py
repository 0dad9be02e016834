"""Semantic XPath over HTTP (issue 30 item 7): a user's typed tree, its schema Σ, and queries whose
best leaves become a sampled, logged slate the user's reranker learns from.

* **Σ** (`schema`): `rmm.memory.tree.induce_schema` of the user's latest tree — node types with
  counts, attribute names, parent → child type pairs with counts — and its one-line-per-type text
  for a client's LLM prompt.
* **A query** (`query`): parsed (`rmm.memory.xpath_syntax`; a malformed one is a
  `QuerySyntaxError`, answered 422 ``query_syntax`` with its offset, column, what was expected and
  what was found) and executed (`rmm.memory.xpath_exec.execute`) over the user's `TreeView`, which a
  `ViewCache` keeps per user until the user's generation moves (any write), so repeated queries
  never rebuild it. The soft matches are scored by the encoder's cosine or by the user's learned
  reranker (`rmm.policy.xpath_scorer.RerankerScorer`; its weights read under the learners' lock,
  the encoder called outside it).
* **The slate**, exactly as the ``xpath`` controller builds one (`rmm.frontends.xpath`, issue 30
  item 5): the result's best `k` memories (a memory shown by several nodes counts once, at its
  best weight; nodes whose memory has no stored vector are skipped) become `Candidates` with their
  stored embeddings and the XPath weight as the candidate feature ``xpath_weight`` (a reranker that
  weighs it starts it at 0; one that weighs none ignores it and the selection logs it; one that
  weighs other features — the server's default, the hybrid first stage's — gets zeros for them,
  as dense candidates do), reranked for the `question` — given,
  or the query's soft-match texts outside any ``1-P`` — and shown as a Gumbel top-M when exploring
  (behaviour log-probabilities recorded at sampling time). The selection is persisted like a
  retrieve's (`rmm.serve.pending` / `pg_pending`) before the answer is sent, so ``/v1/feedback``
  with its `selection_id` trains the user's reranker; a greedy slate is stored and not learned
  from. Each reranker key draws from its own noise stream (seeded from the config's seed).
* **Tree writes** (`add_nodes`, `edit_nodes`, `remove_node`): the store's own, all or nothing, each
  a new user generation; an edit writes the node's next version (`rmm.memory.tree`).

Execution is deterministic for a given tree and scorer (`rmm.memory.xpath_exec`); executions are
serialised by one lock (the scorers' caches are not thread-safe, and a query costs milliseconds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rmm.frontends.xpath import best_memories, xpath_candidates
from rmm.memory.bank import MemoryBank
from rmm.memory.tree import KEEP, NodeEdit, TreeNode, TreeWriteError, UnknownNodeError, induce_schema
from rmm.memory.xpath_exec import Execution, Scorer, TreeView, ViewCache, execute
from rmm.memory.xpath_scorers import CosineScorer
from rmm.memory.xpath_syntax import Aggregate, Complement, Local, Maximum, Mean, Minimum, Product, Query, parse
from rmm.policy.registry import LearnerRegistry
from rmm.policy.reranker import ResidualLinearReranker
from rmm.policy.xpath_scorer import RerankerScorer
from rmm.encoders.query.locked import LockedEncoder
from rmm.serve.config import ServeConfig
from rmm.serve.pending import PendingSelection, Selections
from rmm.serve.records import (
    ShownMemory,
    StepNode,
    TreeNodeInfo,
    TreeSchema,
    TreeTypeInfo,
    XPathNode,
    XPathResult,
    XPathStep,
)
from rmm.serve.tenants import callers_terms, reranker_key, scoped, unknown_user, unscoped_text

__all__ = ["STEP_NODES", "TreeQueries", "XPathRequest", "node_edit", "question_of"]

log = logging.getLogger(__name__)

STEP_NODES = 5  # best nodes shown per step
SCORERS = 64  # reranker scorers kept (one per reranker key: per user with per-user rerankers)


class _LockedRerankerScorer(RerankerScorer):
    """`RerankerScorer` reading the weights under the learners' lock (a learner steps them in place
    from another thread), and only that: the encoder's call for the query and the nodes' passage
    vectors run outside it, so a query never holds up retrieval or feedback for long."""

    def __init__(self, reranker: ResidualLinearReranker, encoder: LockedEncoder, lock: Any) -> None:
        super().__init__(reranker, encoder)
        self.lock = lock

    def query_vector(self, query: str) -> np.ndarray:
        self.raw_query(query)  # encoded (and cached) outside the lock
        with self.lock:
            return super().query_vector(query)


@dataclass
class XPathRequest:
    """One query call as the service takes it (ids as the tenant sees them)."""

    tenant: str
    user: str
    query: str
    k: int
    m: int
    explore: bool
    scorer: str = "cosine"
    question: str | None = None


def question_of(query: Query) -> str:
    """The query's soft-match texts outside any ``1-P`` (what it asks for, not what it excludes),
    each once, in order, joined by spaces; "" when it has none."""
    texts: list[str] = []

    def walk(relevance: object) -> None:
        if isinstance(relevance, Local):
            texts.append(relevance.text)
        elif isinstance(relevance, Product | Mean | Minimum | Maximum):
            walk(relevance.left)
            walk(relevance.right)
        elif isinstance(relevance, Aggregate):
            if relevance.step.predicate is not None:
                walk(relevance.step.predicate)
        elif not isinstance(relevance, Complement):
            raise TypeError(f"unknown relevance {type(relevance).__name__}")

    for step in query.steps:
        if step.predicate is not None:
            walk(step.predicate)
    return " ".join(dict.fromkeys(" ".join(t.split()) for t in texts))


def _info(node: TreeNode) -> TreeNodeInfo:
    return TreeNodeInfo(id=node.id, type=node.type, parent=node.parent, position=int(node.position or 0),
                        attributes=dict(node.attributes), memory_id=node.memory_id, version=node.version,
                        revision=node.revision, text=node.text)


class TreeQueries:
    """The user's tree, Σ and XPath queries for the service (`RetrievalService.xpath` and friends)."""

    def __init__(self, config: ServeConfig, bank: MemoryBank, encoder: LockedEncoder, learners: LearnerRegistry,
                 selections: Selections, *, tau: float) -> None:
        self.config, self.bank, self.encoder, self.learners = config, bank, encoder, learners
        self.selections, self.tau = selections, tau
        self.views = ViewCache(bank.store)
        self._cosine: CosineScorer | None = None
        self._rerankers: dict[str, _LockedRerankerScorer] = {}  # by reranker key, oldest first
        self._generators: dict[str, torch.Generator] = {}
        self._lock = threading.Lock()  # one execution at a time (the scorers' caches, the view cache)

    # ---- reads ------------------------------------------------------------------------------

    def schema(self, tenant: str, user: str) -> TreeSchema:
        """Σ of the user's latest tree (404 for an unknown user; an empty Σ for a user without a tree)."""
        user_id = scoped(tenant, user)
        with callers_terms(tenant, user):
            if not self.bank.store.has_user(user_id):
                raise unknown_user(user)
            with self._lock:
                generation = self.bank.store.generation(user_id)
                view = self.views.get(user_id)
        nodes = [n for n in view.nodes if n is not None]
        schema = induce_schema(nodes)
        sigma = schema.as_dict()
        types = {t: TreeTypeInfo(count=v["count"], attributes=list(v["attributes"]), children=dict(v["children"]))
                 for t, v in sigma["types"].items()}
        return TreeSchema(user=user, generation=generation, nodes=len(nodes), types=types, roots=dict(sigma["roots"]),
                          text=schema.describe())

    def tree(self, tenant: str, user: str, as_of: int | None = None) -> tuple[int, list[TreeNodeInfo]]:
        """The user's generation now and its tree (latest, or as of generation `as_of`) in tree order."""
        user_id = scoped(tenant, user)
        with callers_terms(tenant, user):
            store = self.bank.store
            generation = store.generation(user_id)
            return generation, [_info(n) for n in store.tree(user_id, as_of)]

    # ---- writes -----------------------------------------------------------------------------
    def add_nodes(self, tenant: str, user: str, nodes: list[TreeNode]) -> int:
        """Insert nodes (all or nothing); returns the user's generation after the write."""
        user_id = scoped(tenant, user)
        with _callers(tenant, user):
            self.bank.store.add_nodes(user_id, nodes)
            return self.bank.store.generation(user_id)

    def edit_nodes(self, tenant: str, user: str, edits: list[NodeEdit]) -> int:
        """Each edit becomes its node's next version (all or nothing); returns the new generation."""
        user_id = scoped(tenant, user)
        with _callers(tenant, user):
            self.bank.store.edit_nodes(user_id, edits)
            return self.bank.store.generation(user_id)

    def remove_node(self, tenant: str, user: str, node_id: str) -> int:
        """Tombstone a node and its subtree (history kept); returns the new generation."""
        user_id = scoped(tenant, user)
        with _callers(tenant, user):
            self.bank.store.remove_nodes(user_id, [node_id])
            return self.bank.store.generation(user_id)

    # ---- queries ----------------------------------------------------------------------------
    def _generator(self, key: str) -> torch.Generator:
        """Each reranker key's own noise stream for XPath slates (called under the learners' lock)."""
        generator = self._generators.get(key)
        if generator is None:
            digest = hashlib.blake2b(f"{self.config.seed}:xpath:{key}".encode(), digest_size=8).digest()
            generator = self._generators[key] = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        return generator

    def _scorer(self, name: str, key: str) -> Scorer:
        """The cosine scorer (one), or the reranker key's scorer (the last `SCORERS` kept: each holds
        a cache of query and passage vectors)."""
        if name == "cosine":
            if self._cosine is None:
                self._cosine = CosineScorer(self.encoder)
            return self._cosine
        if name != "reranker":
            raise ValueError(f"scorer must be 'cosine' or 'reranker', got {name!r}")
        with self.learners.lock:
            reranker = self.learners.get(key).reranker
        scorer = self._rerankers.pop(key, None)
        if scorer is None or scorer.reranker is not reranker:  # new, or a reloaded or promoted reranker
            scorer = _LockedRerankerScorer(reranker, self.encoder, self.learners.lock)
        self._rerankers[key] = scorer
        while len(self._rerankers) > SCORERS:
            self._rerankers.pop(next(iter(self._rerankers)))
        return scorer

    def query(self, request: XPathRequest) -> XPathResult:
        """Execute the query over the user's tree; the best leaves' slate is persisted for feedback."""
        parsed = parse(request.query)  # QuerySyntaxError before any look-up: the 422 names the column
        user_id = scoped(request.tenant, request.user)
        key = reranker_key(self.config.reranker_per, request.tenant, user_id)
        with callers_terms(request.tenant, request.user):
            if not self.bank.store.has_user(user_id):
                raise unknown_user(request.user)
            with self._lock:
                generation = self.bank.store.generation(user_id)
                view = self.views.get(user_id)
                execution = execute(parsed, view, self._scorer(request.scorer, key))
        question = request.question or question_of(parsed) or None
        result = XPathResult(user=request.user, query=str(parsed), question=question, scorer=request.scorer,
                             generation=generation, nodes=self._nodes(execution, request.k),
                             steps=self._steps(execution), candidates=0, selection_id=None, explore=False,
                             expires_at=None, memories=[])
        leaves = _with_vectors(execution)
        ids, _ = best_memories(leaves, request.k)
        if not ids:
            result.reason = "the result shows no memory with a stored vector: nothing to rerank"
        elif question is None:
            result.reason = "the query has no soft match and no `question` was given: nothing to rerank for"
        else:
            self._slate(request, user_id, key, question, leaves, ids, result)
        return result

    def _slate(self, request: XPathRequest, user_id: str, key: str, question: str, execution: Execution,
               ids: list[str], result: XPathResult) -> None:
        with callers_terms(request.tenant, request.user):
            embeddings = self.bank.embeddings(user_id, ids).float()
        query_vector = self.encoder.encode_queries([question])[0].detach().float().cpu()
        with self.learners.lock:
            reranker = self.learners.get(key).reranker
            candidates = xpath_candidates(execution, request.k, question, user_id, embeddings, query_vector,
                                          reranker.feature_names)
            (selection,) = reranker.select([candidates], request.m, tau=self.tau, explore=request.explore,
                                           generator=self._generator(key))
        c = selection.candidates
        shown_ids = [c.memory_ids[i] for i in selection.chosen]
        with callers_terms(request.tenant, request.user):
            rows = {m.id: m for m in self.bank.get(user_id, shown_ids)}
        now = time.time()
        expires = now + self.config.selection_ttl_s
        self.selections.put_many([PendingSelection(
            id=selection.id, tenant=request.tenant, user_id=user_id, reranker_key=key, query=question,
            memory_ids=list(c.memory_ids), chosen=list(selection.chosen), explore=selection.explore,
            query_embedding=c.query_embedding, scores=selection.scores, logp=selection.logp, noise=selection.noise,
            created_at=now, expires_at=expires, embeddings=c.embeddings, tau=selection.tau,
            version=selection.version, mask=selection.mask, lexical=None, features=c.features,
            feature_names=c.feature_names)])
        result.candidates = len(c.memory_ids)
        result.selection_id, result.explore, result.expires_at = selection.id, selection.explore, expires
        result.memories = [ShownMemory(index=j, id=rows[c.memory_ids[i]].id, text=rows[c.memory_ids[i]].text,
                                       kind=rows[c.memory_ids[i]].kind, refs=list(rows[c.memory_ids[i]].refs),
                                       score=float(selection.scores[i]), retriever_score=float(c.retriever_scores[i]),
                                       time_span=rows[c.memory_ids[i]].time_span)
                           for j, i in enumerate(selection.chosen)]

    @staticmethod
    def _nodes(execution: Execution, k: int) -> list[XPathNode]:
        out = []
        for node, weight in execution.ranked(k):
            if node is None:  # the root: only the empty query selects it, and `query` is never blank
                continue
            out.append(XPathNode(**dataclasses.asdict(_info(node)), weight=weight))
        return out

    @staticmethod
    def _steps(execution: Execution) -> list[XPathStep]:
        out = []
        view = execution.view
        for s in execution.steps:
            order = np.lexsort((s.indices, -s.weights))[:STEP_NODES]
            top = []
            for j in order:
                node = view.nodes[int(s.indices[j])]
                top.append(StepNode(id=None if node is None else node.id, type=None if node is None else node.type,
                                    weight=float(s.weights[j])))
            out.append(XPathStep(step=s.step, reached=s.reached, kept=len(s.indices), top=top))
        return out


@contextmanager
def _callers(tenant: str, user: str) -> Iterator[None]:
    """`callers_terms`, and the tree's own errors told without the tenant-scoped user id."""
    try:
        with callers_terms(tenant, user):
            yield
    except (TreeWriteError, UnknownNodeError) as exc:
        raise type(exc)(unscoped_text(tenant, str(exc))) from exc


def _with_vectors(execution: Execution) -> Execution:
    """The execution's result without the nodes whose memory has no stored vector (the reranker
    scores stored embeddings; the index leaves such a memory out of every search as well)."""
    view = execution.view

    def kept(i: int) -> bool:
        node = view.nodes[i]
        return bool(view.has_vector[i]) or node is None or node.memory_id is None

    keep = np.array([kept(int(i)) for i in execution.indices], dtype=bool)
    if keep.all():
        return execution
    return dataclasses.replace(execution, indices=execution.indices[keep], weights=execution.weights[keep])


def node_edit(fields: dict[str, object]) -> NodeEdit:
    """A `NodeEdit` of the fields a request sent (`KEEP` for the others)."""
    return NodeEdit(id=str(fields["id"]), attributes=fields.get("attributes", KEEP), parent=fields.get("parent", KEEP),
                    position=fields.get("position", KEEP), memory_id=fields.get("memory_id", KEEP))
