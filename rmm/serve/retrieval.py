"""Batched retrieval: what the retrieve micro-batcher calls with every query it collected.

Every query of the batch is encoded in one encoder call, each user's queries are searched in one
index call, and each reranker scores its queries in one call (Gumbel top-M when exploring, plain
top-M otherwise). The selections are persisted in one transaction before the results are
returned, with everything their update needs as scored (candidate and query embeddings, μ, τ,
weights version, the candidates' lexical feature and further features with their names), so
feedback works even after a restart or a memory's deletion. A query's failure (unknown user, a
user deleted mid-batch) is handed back to that query alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from rmm.errors import UnknownMemoryError, UnknownUserError
from rmm.memory.bank import MemoryBank
from rmm.memory.hybrid import HybridRetriever
from rmm.policy.registry import LearnerRegistry
from rmm.policy.reranker import candidate_subset
from rmm.serve.config import ServeConfig
from rmm.encoders.query.locked import LockedEncoder
from rmm.serve.pending import PendingSelection, SelectionStore
from rmm.serve.records import RetrieveItem, RetrieveResult, ShownMemory
from rmm.serve.tenants import callers_error, reranker_key, scoped, unknown_user
from rmm.types import Candidates, Memory, Selection

__all__ = ["BatchRetriever", "EncodedBatch"]

log = logging.getLogger(__name__)

Results = list[Any]  # per item: RetrieveResult, an Exception for that item alone, or None (not yet done)


@dataclass
class EncodedBatch:
    """What `encode_batch` hands `finish_batch`: the unknown users' errors and the other queries'
    vectors, by position in the batch."""

    results: Results
    vectors: dict[int, torch.Tensor]


class BatchRetriever:
    """Encode → search → rerank → persist, each step once per batch (per user / per reranker)."""

    def __init__(self, config: ServeConfig, bank: MemoryBank, encoder: LockedEncoder, learners: LearnerRegistry,
                 selections: SelectionStore, *, tau: float) -> None:
        self.config, self.bank, self.encoder, self.learners = config, bank, encoder, learners
        self.selections, self.tau = selections, tau
        # the first stage: the dense bank, or BM25 over its memories, fused with it or alone
        # (candidates carry the bank's embeddings, the lexical feature and, unless switched off, the
        # candidate features)
        fusion = config.first_stage_fusion
        self.first_stage = bank if fusion is None else HybridRetriever(
            bank, fusion=fusion, candidate_features=config.candidate_features)
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, key: str) -> torch.Generator:
        """The Gumbel noise stream of one reranker key, seeded from the config's seed and the key:
        what one tenant is shown never depends on another tenant's traffic, and a key's queries draw
        their noise in arrival order whether they came in one micro-batch or one at a time.
        Called under the learners' lock."""
        generator = self._generators.get(key)
        if generator is None:
            digest = hashlib.blake2b(f"{self.config.seed}:{key}".encode(), digest_size=8).digest()
            generator = self._generators[key] = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        return generator

    def retrieve_batch(self, items: list[RetrieveItem]) -> list[RetrieveResult | Exception]:
        """Every query of the batch in one encode; per user one search; per reranker one select."""
        return self.finish_batch(items, self.encode_batch(items))

    def encode_batch(self, items: list[RetrieveItem]) -> EncodedBatch:
        """The first stage: the queries of known users encoded in one call (the micro-batcher runs
        it for the next batch while `finish_batch` runs for this one)."""
        results: Results = [None] * len(items)
        known = {user_id: self.bank.store.has_user(user_id)  # one look-up per user, not per query
                 for user_id in {scoped(item.tenant, item.user) for item in items}}
        live = []
        for i, item in enumerate(items):
            if known[scoped(item.tenant, item.user)]:
                live.append(i)
            else:
                results[i] = unknown_user(item.user)
        vectors = self.encoder.encode_queries([items[i].query for i in live]) if live else []
        return EncodedBatch(results, dict(zip(live, vectors)))

    def finish_batch(self, items: list[RetrieveItem], encoded: EncodedBatch) -> list[RetrieveResult | Exception]:
        """The second stage: search, rerank and persist the encoded queries, in arrival order."""
        results = list(encoded.results)
        if encoded.vectors:
            candidates = self._search(items, encoded.vectors, results)
            selections = self._select(items, candidates)
            self._answer(items, selections, results)
        return [r if r is not None else RuntimeError("query was not processed") for r in results]

    def _key(self, item: RetrieveItem) -> str:
        return reranker_key(self.config.reranker_per, item.tenant, scoped(item.tenant, item.user))

    def _search(self, items: list[RetrieveItem], query_vec: dict[int, torch.Tensor],
                results: Results) -> dict[int, Candidates]:
        by_user: dict[str, list[int]] = defaultdict(list)
        for i in query_vec:
            by_user[scoped(items[i].tenant, items[i].user)].append(i)
        found: dict[int, Candidates] = {}
        for user_id, positions in by_user.items():
            q = torch.stack([query_vec[i] for i in positions])
            search_q = None
            if self.config.scope == "bank":  # the learned query q·A chooses from the whole bank (features stay q's)
                with self.learners.lock:
                    reranker = self.learners.get(self._key(items[positions[0]])).reranker
                    search_q = reranker.transform_queries(q.to(self.bank.device)).cpu()
            k_max = max(items[i].k for i in positions)
            try:
                queries = [items[i].query for i in positions]
                rows = self.first_stage.search_embeddings(q, user_id, k_max, queries=queries, search_with=search_q)
            except (UnknownUserError, UnknownMemoryError) as exc:  # deleted since the batch began
                for i in positions:
                    results[i] = callers_error(exc, items[i].tenant, items[i].user)
                continue
            for i, row in zip(positions, rows):
                k = items[i].k
                found[i] = dataclasses.replace(candidate_subset(row, range(min(k, len(row)))), user_id=user_id)
        return found

    def _select(self, items: list[RetrieveItem], candidates: dict[int, Candidates]) -> dict[int, tuple[Selection, str]]:
        """Each reranker scores all its queries at once; returns (selection, reranker key) per item."""
        groups: dict[tuple[str, bool], list[int]] = defaultdict(list)
        for i in sorted(candidates):  # arrival order: the noise rows are drawn as one query at a time would
            groups[(self._key(items[i]), items[i].explore)].append(i)
        selections: dict[int, tuple[Selection, str]] = {}
        for (key, explore), positions in groups.items():
            m_max = max(items[i].m for i in positions)
            with self.learners.lock:
                picked = self.learners.get(key).reranker.select(
                    [candidates[i] for i in positions], m_max, tau=self.tau, explore=explore,
                    generator=self._generator(key))
            for i, selection in zip(positions, picked):
                # A Gumbel top-m is the first m picks of the top-M_max (same noise): truncation is exact.
                m = items[i].m
                selection.chosen = selection.chosen[:m]
                if selection.logp is not None:
                    selection.logp = selection.logp[:m]
                selections[i] = (selection, key)
        return selections

    def _shown_texts(self, items: list[RetrieveItem], selections: dict[int, tuple[Selection, str]],
                     results: Results) -> dict[str, dict[str, Memory]]:
        """The shown memories' rows, read per user; drops the items whose user or memory is gone."""
        by_user: dict[str, set[str]] = defaultdict(set)
        for selection, _ in selections.values():
            by_user[selection.candidates.user_id].update(selection.memory_ids)
        memories: dict[str, dict[str, Memory]] = {}
        for user_id, ids in by_user.items():
            try:
                memories[user_id] = self._present(user_id, sorted(ids))
            except UnknownUserError as exc:  # the user was deleted between search and now
                for i, (selection, _) in list(selections.items()):
                    if selection.candidates.user_id == user_id:
                        results[i] = callers_error(exc, items[i].tenant, items[i].user)
                        del selections[i]
        return memories

    def _present(self, user_id: str, ids: list[str]) -> dict[str, Memory]:
        """The rows of those of `ids` that still exist: a memory deleted since the search is left
        out (`_answer` drops it), not an error of a retrieve that never named it."""
        if not ids:
            return {}
        try:
            return {m.id: m for m in self.bank.get(user_id, ids)}
        except UnknownMemoryError:  # rare (a concurrent delete): find the survivors one by one
            found: dict[str, Memory] = {}
            for memory_id in ids:
                try:
                    found.update((m.id, m) for m in self.bank.get(user_id, [memory_id]))
                except UnknownMemoryError:
                    log.info("memory %s of %s was deleted during a retrieve; not shown", memory_id, user_id)
            return found

    def _answer(self, items: list[RetrieveItem], selections: dict[int, tuple[Selection, str]],
                results: Results) -> None:
        """Results for the selected items, their selections persisted first (all or none)."""
        memories = self._shown_texts(items, selections, results)
        now = time.time()
        expires = now + self.config.selection_ttl_s
        pending: list[PendingSelection] = []
        for i, (selection, key) in selections.items():
            item, c = items[i], selection.candidates
            _drop_deleted(selection, memories[c.user_id])
            shown = []
            for j, idx in enumerate(selection.chosen):
                row = memories[c.user_id][c.memory_ids[idx]]
                shown.append(ShownMemory(index=j, id=row.id, text=row.text, kind=row.kind, refs=list(row.refs),
                                         score=float(selection.scores[idx]),
                                         retriever_score=float(c.retriever_scores[idx]), time_span=row.time_span))
            has_pick = bool(selection.chosen)
            if has_pick:
                pending.append(PendingSelection(
                    id=selection.id, tenant=item.tenant, user_id=c.user_id, reranker_key=key, query=item.query,
                    memory_ids=list(c.memory_ids), chosen=list(selection.chosen), explore=selection.explore,
                    query_embedding=c.query_embedding, scores=selection.scores, logp=selection.logp,
                    noise=selection.noise, created_at=now, expires_at=expires, embeddings=c.embeddings,
                    tau=selection.tau, version=selection.version, mask=selection.mask, lexical=c.lexical,
                    features=c.features, feature_names=c.feature_names))
            results[i] = RetrieveResult(user=item.user, query=item.query,
                                        selection_id=selection.id if has_pick else None, explore=selection.explore,
                                        expires_at=expires if has_pick else None, memories=shown)
        try:
            self.selections.put_many(pending)
        except Exception as exc:  # no result may carry a selection id that feedback cannot find
            log.exception("could not persist %d selections", len(pending))
            for i in selections:
                results[i] = exc


def _drop_deleted(selection: Selection, present: dict[str, Memory]) -> None:
    """Show the picks made before the first one whose memory was deleted since the search. A
    prefix of a Gumbel top-M is itself the top-m of the same noise, so the stored selection's
    log-probabilities stay exact and its feedback is still learned from."""
    ids = selection.candidates.memory_ids
    keep = next((n for n, idx in enumerate(selection.chosen) if ids[idx] not in present), len(selection.chosen))
    if keep < len(selection.chosen):
        selection.chosen = selection.chosen[:keep]
        if selection.logp is not None:
            selection.logp = selection.logp[:keep]
