"""Retrieve K, rerank to M: steps 2–3 of the RMM loop as one object the agent and server share.

`scope="topk"` reranks the retriever's top-K (the paper); `scope="bank"` first searches the whole
bank with the reranker's folded query `q @ A` — for a dot-product retriever that is exactly the
reranker's ordering over every memory, so a memory the base retriever ranked below K can still
surface once the reranker has learned to want it. (A hybrid first stage fuses that search with
BM25, `rmm.memory.hybrid`; candidates carry their lexical feature either way, and their features
are computed from the query q, not q @ A, as at `scope="topk"`.)

`select(..., exclude=)` reranks the top-K of the memories *not* excluded (MemR³'s
`Retrieve(q, M \\ M^ret)`): it fetches K + |excluded| so that K unseen candidates remain, keeps the
excluded ones among them for the reranker to mask before its Gumbel top-M (see
`rmm.policy.reranker`), and drops unseen ones ranked below the K-th.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal

import torch

from rmm.memory.bank import MemoryBank
from rmm.policy.reranker import ResidualLinearReranker, candidate_subset
from rmm.policy.stacking import features_of
from rmm.types import Candidates, Selection

__all__ = ["RerankedRetriever", "Scope", "reranked"]

Scope = Literal["topk", "bank"]


class RerankedRetriever:
    def __init__(self, bank: MemoryBank, reranker: ResidualLinearReranker, *, k: int = 20, m: int = 5,
                 tau: float = 0.5, scope: Scope = "topk") -> None:
        if scope not in ("topk", "bank"):
            raise ValueError(f"scope must be 'topk' or 'bank', got {scope!r}")
        if m > k:
            raise ValueError(f"cannot select M={m} memories out of K={k} candidates")
        self.bank, self.reranker = bank, reranker
        self.k, self.m, self.tau, self.scope = k, m, tau, scope

    @property
    def store(self):  # lets the evaluator map ids back to memories
        return self.bank.store

    def candidates(self, queries: list[str], user: str, k: int | None = None) -> list[Candidates]:
        k = k or self.k
        if self.scope == "topk":
            return self.bank.search(queries, user, k)
        q = self.bank.encoder.encode_queries(queries)
        # q·A only chooses the candidates; they carry q, and a hybrid's features are q's (the
        # reranker rescoring them applies A itself, and was trained on features of q).
        return self.bank.search_embeddings(q, user, k, queries=queries, search_with=self.reranker.transform_queries(q))

    def select(self, queries: list[str], user: str, *, explore: bool = False,
               generator: torch.Generator | None = None,
               exclude: Sequence[Collection[str]] | None = None) -> list[Selection]:
        """The M memories to show for each query: sampled when exploring, the top-M otherwise.

        `exclude[i]`: memory ids query i must not show (fewer than M come back once too few remain).
        """
        if exclude is None:
            return self.reranker.select(self.candidates(queries, user), self.m, tau=self.tau, explore=explore,
                                        generator=generator)
        if isinstance(exclude, (str, bytes)) or len(exclude) != len(queries):
            raise ValueError(f"exclude needs one collection of memory ids per query ({len(queries)})")
        found = self.candidates(queries, user, self.k + max((len(e) for e in exclude), default=0))
        found = [_unseen_top_k(c, e, self.k) for c, e in zip(found, exclude)]
        return self.reranker.select(found, self.m, tau=self.tau, explore=explore, generator=generator,
                                    exclude=exclude)

    def search(self, queries: list[str], user: str, k: int) -> list[Candidates]:
        """The Retriever protocol: each query's candidates in reranked order, truncated to k."""
        return [reranked(self.reranker, c, k) for c in self.candidates(queries, user, max(k, self.k))]


def reranked(reranker: ResidualLinearReranker, candidates: Candidates, k: int | None = None) -> Candidates:
    """`candidates` in the reranker's deterministic order (its fast scores, no Gumbel noise), cut to
    `k`, each with its reranker score as `retriever_scores`: what `RerankedRetriever.search` shows,
    and what `rmm eval --reranker` scores from the base run's own search."""
    if len(candidates) == 0:
        return candidates
    lexical = None if candidates.lexical is None else candidates.lexical[None]
    features = None  # checked against the names the reranker weighs, as select checks them
    if reranker.feature_names and candidates.features is not None:
        (checked,) = features_of([candidates], reranker.feature_names)
        features = None if checked is None else checked[None]
    scores = reranker.fast_scores(candidates.query_embedding[None], candidates.embeddings[None], lexical, features)[0]
    idx = torch.argsort(scores, descending=True)[:k]
    ranked = candidate_subset(candidates, idx.tolist())
    ranked.retriever_scores = scores[idx]
    return ranked


def _unseen_top_k(candidates: Candidates, excluded: Collection[str], k: int) -> Candidates:
    """The excluded candidates (for the reranker to mask) and the first `k` others, in retrieval order."""
    keep, unseen = [], 0
    for position, memory_id in enumerate(candidates.memory_ids):
        if memory_id in excluded:
            keep.append(position)
        elif unseen < k:
            keep.append(position)
            unseen += 1
    return candidates if len(keep) == len(candidates) else candidate_subset(candidates, keep)
