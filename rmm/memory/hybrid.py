"""Hybrid first stage: BM25 and a dense bank searched separately, their rankings fused.

Lexical and dense retrieval miss different things (BM25 finds the rare name or date a small
encoder blurs; the encoder finds the paraphrase BM25 cannot), so the union of their top lists
holds more gold than either. Both lists are fused into one ranking and cut to k.

Fusion is reciprocal-rank fusion by default (`score(d) = Σ_r 1 / (rrf_k + rank_r(d))`, ranks from
1, Cormack et al. 2009), with rrf_k = 10. `fusion="convex"` is the alternative: per query, each
retriever's scores are min-max normalised over its own top list (a document a retriever did not
return gets 0 from it) and mixed as `alpha · dense + (1 − alpha) · lexical`. On LoCoMo's training
conversations (`research/choose_fusion.py`, MiniLM) the best of each tie within half a point
(R@5 / R@20: RRF k=10 48.2 / 67.4, convex α=0.5 48.7 / 67.3); RRF is the default because it reads
ranks only, so it needs no calibration between cosines, dot products and BM25's per-query scale
and carries to encoders and benchmarks it was not chosen on. `docs/results.md` has the figures.

Every candidate carries its bank embedding (the dense bank is asked for the vectors of memories
only BM25 found), and the query embedding is the encoder's, so the reranker rescores hybrid
candidates exactly as it rescores dense ones. The BM25 index is built over the bank's own store,
so both halves always see the same memories.

Every candidate also carries a lexical feature in [0, 1] for the reranker's learned lexical term
(`Candidates.lexical`, `rmm.policy.reranker`): BM25's own score min-max scaled over
its top `depth` (1 = BM25's best, 0 for its last and for a candidate BM25 did not return), the same
for every fusion (`LEXICAL_DEFINITION`); a memory BM25 ranks below the depth (searched when K
exceeds it) gets 0 too. Not the fused score: the reranker already adds the dense
evidence as q·m, so a fused score counts the dense rank twice, and RRF's ranks compress BM25's
evidence into a narrow band. On LoCoMo's training conversations, with w0 = 0.3, the fused score
(scaled by its largest value or over the depth list) left the reranker ordering ~20-turn session
memories nearly by cosine, 14–19 points of recall@5 below the first stage; BM25's scaled score
makes `q·m + w0·f` a convex mix of dense and lexical evidence that starts and stays above the fused
order at turn, session and topic granularity (`rmm/bench/lexical_spread.py`,
`rmm/bench/ablations.py`, `docs/results.md`). A fixed depth, not K,
sets the scale, so the same memory has the same feature whatever K is.

`fusion="lexical"` fuses nothing: the ranking is BM25's alone (same ids, same order, same scores
as `BM25Retriever` over the bank's store), and the dense bank only supplies each candidate's
embedding and the query's, so the reranker can rescore a BM25 first stage (`--retriever
bm25:DENSE`). Its lexical feature is the same BM25 score scaled over BM25's top `depth`.

With `candidate_features=True` every candidate list also carries `rmm.memory.features`'
`CANDIDATE_FEATURES` (`Candidates.features` [K, F], `feature_names`): each half's ranks, BM25's
scaled score, the cosine and its gap, the memory's length and its content-word overlap with the
query, computed here from the two lists `_fuse` already holds (depth `depth`; with
`fusion="lexical"` the dense list is empty, so every dense rank is the depth) and the memories'
texts (one store read per query). Off by default: only a reranker that weighs them needs them.
The features describe the query and the memory, never how the candidate was chosen: a search
with the reranker's learned query (`search_embeddings(q, ..., search_with=q·A)`, `scope: bank`)
fuses the dense list of q·A, but every candidate's features come from q's own dense list and
cosines, the numbers the reranker was trained on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

from rmm.encoders.protocol import EncoderLike
from rmm.memory.bank import MemoryBank
from rmm.memory.bm25 import BM25Retriever
from rmm.memory.features import CANDIDATE_FEATURES, candidate_feature_matrix
from rmm.memory.storage import MemoryStorage
from rmm.types import Candidates, Memory

__all__ = ["FUSIONS", "LEXICAL_DEFINITION", "OVER_DENSE", "HybridRetriever", "convex_fuse", "min_max", "rrf_fuse"]

log = logging.getLogger(__name__)

Fusion = Literal["rrf", "convex", "lexical"]
FUSIONS: tuple[str, ...] = ("rrf", "convex", "lexical")  # lexical: BM25's ranking alone (module docstring)
# A first-stage name → the fusion it runs over a dense bank (`rmm eval --retriever hybrid:DENSE`,
# `bm25:DENSE`, `rmm serve`'s `retriever:`): the one place these names are mapped.
OVER_DENSE: dict[str, Fusion] = {"hybrid": "rrf", "bm25": "lexical"}
# What `Candidates.lexical` means, recorded with every reranker trained on it (rmm.policy.checkpoint).
LEXICAL_DEFINITION = "bm25-minmax-depth"


def rrf_fuse(rankings: Sequence[Sequence[str]], rrf_k: float = 60.0) -> dict[str, float]:
    """Reciprocal-rank fusion of ranked id lists: id → Σ 1/(rrf_k + rank), rank counted from 1."""
    if rrf_k < 0:
        raise ValueError(f"rrf_k must be >= 0, got {rrf_k}")
    fused: dict[str, float] = {}
    for ranking in rankings:
        for rank, memory_id in enumerate(ranking, start=1):
            fused[memory_id] = fused.get(memory_id, 0.0) + 1.0 / (rrf_k + rank)
    return fused


def min_max(ids: Sequence[str], scores: Sequence[float]) -> dict[str, float]:
    """Scores mapped to [0, 1] over one list (all equal → all 1: each was returned, none is worse)."""
    if not ids:
        return {}
    lo, hi = min(scores), max(scores)
    span = hi - lo
    return {i: (1.0 if span == 0 else (s - lo) / span) for i, s in zip(ids, scores)}


def convex_fuse(dense: tuple[Sequence[str], Sequence[float]], lexical: tuple[Sequence[str], Sequence[float]],
                alpha: float) -> dict[str, float]:
    """alpha · normalised dense + (1 − alpha) · normalised lexical; a missing score counts as 0."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return _convex_mix(min_max(*dense), min_max(*lexical), alpha)


def _convex_mix(d: dict[str, float], b: dict[str, float], alpha: float) -> dict[str, float]:
    """alpha · d + (1 − alpha) · b over already-normalised scores; a missing one counts as 0."""
    return {i: alpha * d.get(i, 0.0) + (1.0 - alpha) * b.get(i, 0.0) for i in {**d, **b}}


class HybridRetriever:
    """BM25 + a dense `MemoryBank`, fused (or BM25 alone over the bank, `fusion="lexical"`); quacks
    like the bank for everything the trainer reads."""

    def __init__(self, bank: MemoryBank, *, fusion: Fusion = "rrf", rrf_k: float = 10.0, alpha: float = 0.5,
                 depth: int = 50, lexical: BM25Retriever | None = None, candidate_features: bool = False) -> None:
        if fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive integer, got {depth!r}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if rrf_k < 0:
            raise ValueError(f"rrf_k must be >= 0, got {rrf_k}")
        self.bank = bank
        self.lexical = lexical if lexical is not None else BM25Retriever(bank.store)
        if type(candidate_features) is not bool:
            raise ValueError(f"candidate_features must be true or false, got {candidate_features!r}")
        self.fusion, self.rrf_k, self.alpha, self.depth = fusion, rrf_k, alpha, depth
        self.candidate_features = candidate_features  # fill `Candidates.features` (module docstring)

    def over(self, bank: MemoryBank) -> HybridRetriever:
        """The same first stage (fusion, depth, BM25's parameters, features) over another bank, e.g.
        a copy of some of this one's memories (the bank as it stood earlier, `rmm.training.online`)."""
        lex = self.lexical
        return HybridRetriever(bank, fusion=self.fusion, rrf_k=self.rrf_k, alpha=self.alpha, depth=self.depth,
                               lexical=BM25Retriever(bank.store, k1=lex.k1, b=lex.b, method=lex.method),
                               candidate_features=self.candidate_features)

    # -- what callers of a dense bank read ------------------------------------------------------
    @property
    def store(self) -> MemoryStorage:  # evaluators map ids back to memories through it
        return self.bank.store

    @property
    def encoder(self) -> EncoderLike:
        return self.bank.encoder

    @property
    def dim(self) -> int:
        return self.bank.dim

    @property
    def device(self) -> torch.device:
        return self.bank.device

    @property
    def path(self) -> Path | None:
        return self.bank.path

    def users(self) -> list[str]:
        return self.bank.users()

    def memories(self, user: str) -> list[Memory]:
        return self.bank.memories(user)

    def get(self, user: str, ids: list[str]) -> list[Memory]:
        return self.bank.get(user, ids)

    def embeddings(self, user: str, ids: list[str]) -> torch.Tensor:
        return self.bank.embeddings(user, ids)

    def search_embeddings(self, query_embs: torch.Tensor, user: str, k: int, queries: list[str] | None = None,
                          search_with: torch.Tensor | None = None) -> list[Candidates]:
        """`search` with given query vectors: a fusion searches its dense half with them;
        `fusion="lexical"` ranks by BM25 over `queries`' text and only carries them as each
        candidate's query vector. The dense search alone when no text is given.

        `search_with` (e.g. the reranker's learned `q @ A`, `scope: bank`) only chooses the
        candidates: the dense half is searched with it, but every candidate carries `query_embs`
        and its features are those of `query_embs` — dense ranks and `top_cosine` from the dense
        list `query_embs` gets, cosines against it — the same numbers the reranker was trained on
        over `search`'s candidates. (`fusion="lexical"` chooses by BM25, so it searches nothing with it.)"""
        MemoryBank._check_k(k)
        if queries is None:
            return self.bank.search_embeddings(query_embs, user, k, search_with=search_with)
        queries = list(queries)
        if self.fusion == "lexical":
            vectors = self.bank.query_matrix(query_embs, len(queries)).cpu()
            if search_with is not None:
                self.bank.query_matrix(search_with, len(queries))  # the same shape check as a fusion's
            self.bank.store.require_user(user)
            return self._fused(self._no_dense(vectors, queries, user), queries, user, k)
        depth = max(k, self.depth)
        dense = self.bank.search_embeddings(query_embs, user, depth, queries=queries, search_with=search_with)
        featured = None
        if search_with is not None and self.candidate_features:  # the features' dense list: the query's own
            featured = self.bank.search_embeddings(query_embs, user, depth, queries=queries)
        return self._fused(dense, queries, user, k, featured)

    # -- search ---------------------------------------------------------------------------------
    def search(self, queries: list[str], user: str, k: int) -> list[Candidates]:
        """Each query's top-k by fused score, with bank embeddings; `retriever_scores` = fused scores
        (BM25's own with `fusion="lexical"`)."""
        if isinstance(queries, str):
            raise TypeError("queries must be a list of strings (got one string)")
        MemoryBank._check_k(k)
        queries = list(queries)
        if not queries:
            return []
        if self.fusion == "lexical":  # the dense half is not searched: only the query vectors are needed
            self.bank.store.require_user(user)
            vectors = self.bank._encode(queries, queries=True)  # the bank's shape check included
            return self._fused(self._no_dense(vectors, queries, user), queries, user, k)
        return self._fused(self.bank.search(queries, user, max(k, self.depth)), queries, user, k)

    def _no_dense(self, q: torch.Tensor, queries: list[str], user: str) -> list[Candidates]:
        """Empty dense lists carrying only each query's vector (what `fusion="lexical"` fuses with)."""
        empty = torch.zeros((0, self.bank.dim), dtype=torch.float32)
        return [Candidates(query=text, memory_ids=[], retriever_scores=torch.zeros(0), embeddings=empty,
                           query_embedding=q[i].clone(), user_id=user) for i, text in enumerate(queries)]

    def _fused(self, dense: list[Candidates], queries: list[str], user: str, k: int,
               featured: list[Candidates] | None = None) -> list[Candidates]:
        """Each query's dense list (searched `max(k, depth)` deep, or empty for `fusion="lexical"`)
        fused with BM25's at the same depth; `featured`: the dense lists the features are computed
        from when they are not the ones fused (a search with a learned query, `search_embeddings`)."""
        lexical = self.lexical.search(queries, user, max(k, self.depth))
        featured_lists = featured if featured is not None else dense
        return [self._fuse(d, b, k, user, f) for d, b, f in zip(dense, lexical, featured_lists)]

    def fused_scores(self, dense: Candidates, lexical: Candidates,
                     scaled: dict[str, float] | None = None) -> dict[str, float]:
        """id → fused score for every id of either list (the fusion rule alone, for tests and tuning);
        `scaled` is `scaled_bm25(lexical)` when the caller already has it. With `fusion="lexical"` the
        dense list is empty and the score is the scaled BM25 score (0 below the depth): ties broken
        by BM25's rank in `_fuse` keep BM25's order exactly."""
        if self.fusion == "rrf":
            return rrf_fuse([dense.memory_ids, lexical.memory_ids], self.rrf_k)
        scaled = self.scaled_bm25(lexical) if scaled is None else scaled
        if self.fusion == "lexical":
            return {m: scaled.get(m, 0.0) for m in lexical.memory_ids}
        # convex: each list scaled over all it returned (one scaling when BM25 was searched `depth` deep)
        b = scaled if len(lexical) <= self.depth else min_max(lexical.memory_ids, lexical.retriever_scores.tolist())
        return _convex_mix(min_max(dense.memory_ids, dense.retriever_scores.tolist()), b, self.alpha)

    def _fuse(self, dense: Candidates, lexical: Candidates, k: int, user: str,
              featured: Candidates | None = None) -> Candidates:
        """`dense` and `lexical` fused into the top k; the features from `featured` (default `dense`)."""
        scaled = self.scaled_bm25(lexical)  # once per query: the feature, and the fusion's lexical half
        fused = self.fused_scores(dense, lexical, scaled)
        dense_rank = {m: i for i, m in enumerate(dense.memory_ids)}
        lexical_rank = {m: i for i, m in enumerate(lexical.memory_ids)}
        # Ties (equal fused score) go to the better dense rank, then the better lexical rank: deterministic.
        far = len(dense.memory_ids) + len(lexical.memory_ids)
        order = sorted(fused, key=lambda m: (-fused[m], dense_rank.get(m, far), lexical_rank.get(m, far)))[:k]
        embeddings = self._embeddings(dense, order, user)
        # BM25 alone reports BM25's own scores (as `BM25Retriever` does); a fusion reports the fused ones
        if self.fusion == "lexical":
            bm25 = dict(zip(lexical.memory_ids, lexical.retriever_scores.tolist()))
            ranked = torch.tensor([bm25[m] for m in order], dtype=torch.float32)
        else:
            ranked = torch.tensor([fused[m] for m in order], dtype=torch.float32)
        features, names = None, ()
        if self.candidate_features:
            features = self.features_of(dense if featured is None else featured, lexical, order, embeddings, user)
            names = CANDIDATE_FEATURES
        return Candidates(
            query=dense.query,
            memory_ids=order,
            retriever_scores=ranked,
            embeddings=embeddings,
            query_embedding=dense.query_embedding,
            user_id=user,
            lexical=self.lexical_feature(lexical, order, scaled),
            features=features,
            feature_names=names,
        )

    def features_of(self, dense: Candidates, lexical: Candidates, order: list[str], embeddings: torch.Tensor,
                    user: str) -> torch.Tensor:
        """`CANDIDATE_FEATURES` of the memories of `order` ([K, F]): from both halves' lists (each searched
        at least `depth` deep), the candidates' bank `embeddings` · the query's, and their texts.
        `cosine_gap` is taken to the best cosine over the depth list — the dense half's top `depth`
        rows, or for `fusion="lexical"` (no dense search) BM25's top `depth` ids' bank vectors — never
        over the K candidates, so a memory's features do not depend on K or on a server batch's k."""
        texts = [m.source_text or m.text for m in self.bank.get(user, order)] if order else []
        query = dense.query_embedding
        if query is None:
            cosines, top = [0.0] * len(order), 0.0
        else:
            q = query.reshape(-1).to(torch.float32)
            cosines = (embeddings.to(torch.float32) @ q).tolist()
            if self.fusion == "lexical":
                ids = lexical.memory_ids[:self.depth]
                pool = self.bank.embeddings(user, list(ids)) if ids else torch.zeros((0, q.numel()))
            else:
                pool = dense.embeddings[:self.depth]
            top = float((pool.to(torch.float32) @ q).max()) if len(pool) else 0.0
        return candidate_feature_matrix(
            dense.query, order, texts, cosines,
            (dense.memory_ids, dense.retriever_scores.tolist()),
            (lexical.memory_ids, lexical.retriever_scores.tolist()), self.depth, top_cosine=top)

    def scaled_bm25(self, lexical: Candidates) -> dict[str, float]:
        """BM25's score min-max scaled over its top `depth` of `lexical` (BM25's list, searched at least
        that deep), clamped to [0, 1] for what BM25 returned below the depth: 0 for a lower score, and
        1 for one tying the depth list when that list's scores are all equal (its span 0 → all 1, so a
        deeper memory with the same score is no worse). A fixed depth, not the search's k, sets the
        scale: the same memory gets the same number at any k, in any batch."""
        top = self.depth
        scores = lexical.retriever_scores.tolist()
        if not scores:
            return {}
        lo, hi = min(scores[:top]), max(scores[:top])
        span = hi - lo
        return {m: (1.0 if s >= lo else 0.0) if span == 0 else min(1.0, max(0.0, (s - lo) / span))
                for m, s in zip(lexical.memory_ids, scores)}

    def lexical_feature(self, lexical: Candidates, order: Sequence[str],
                        scaled: dict[str, float] | None = None) -> torch.Tensor:
        """`LEXICAL_DEFINITION` for the memories of `order`: `scaled_bm25(lexical)`, 0 for a memory
        BM25 did not return within the depth (module docstring)."""
        scaled = self.scaled_bm25(lexical) if scaled is None else scaled
        return torch.tensor([scaled.get(m, 0.0) for m in order], dtype=torch.float32)

    def _embeddings(self, dense: Candidates, order: list[str], user: str) -> torch.Tensor:
        """The bank vectors of `order`: taken from the dense hits, fetched from the bank for BM25-only ones."""
        dim = self.bank.dim
        out = torch.zeros((len(order), dim), dtype=torch.float32)
        position = {m: i for i, m in enumerate(dense.memory_ids)}
        missing = [m for m in order if m not in position]
        fetched = dict(zip(missing, self.bank.embeddings(user, missing))) if missing else {}
        assert dense.embeddings is not None  # a MemoryBank's candidates always carry them
        for row, m in enumerate(order):
            out[row] = dense.embeddings[position[m]] if m in position else fetched[m]
        return out
