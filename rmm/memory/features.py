"""Per-candidate features a hybrid first stage hands the reranker beside Eq. 1 (issue 14).

Eq. 1 reorders candidates by the encoder's geometry only; over hybrid candidates the first stage
knows more than that — where each half ranked a memory, BM25's score, the cosine against the other
candidates', the memory's length, and how many of the query's content words it holds. Each is a
number any dialogue memory system has at retrieval time (nothing benchmark-specific) on a fixed
scale (no learned normalisation), so a weight learned on one user carries to the next. The set
(`CANDIDATE_FEATURES`) was chosen on training data only (`research/reranker_ceiling.py --features`,
`research/reranker_online_features.py`; docs/results/s4/h3/design_note.md). The reranker weighs them
as `features @ feature_weight` (`rmm.policy.reranker`), `feature_weight` starting at 0, so adding
them never changes an untrained ranking.

Pure functions over plain lists, shared with the research scripts (`rmm/bench/reranker_features.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rmm.errors import DataError
from rmm.memory.tokens import content_words

__all__ = [
    "CANDIDATE_FEATURES",
    "candidate_feature_matrix",
    "coverage",
    "feature_columns",
    "jaccard",
    "rank_features",
    "scaled_scores",
]

# The columns of `Candidates.features` a hybrid first stage computes, in this order:
# each half's rank (reciprocal, and log-scaled over the depth; absent = at the depth), BM25's score over
# its list's best, the cosine and its gap to the best cosine of the first stage's depth list, log(1 + whitespace tokens), and
# the query's content-word overlap (Jaccard, share of the query's content words covered; words as BM25 reads
# them: `rmm.memory.tokens`).
CANDIDATE_FEATURES: tuple[str, ...] = (
    "dense_rr", "bm25_rr", "dense_logrank", "bm25_logrank", "bm25_scaled",
    "cosine", "cosine_gap", "log_tokens", "jaccard", "query_coverage",
)

def jaccard(a: set[str], b: set[str]) -> float:
    """|a ∩ b| / |a ∪ b|; 0 when both are empty."""
    union = a | b
    return len(a & b) / len(union) if union else 0.0


def coverage(query: set[str], memory: set[str]) -> float:
    """Share of the query's content words the memory contains; 0 for a query without any."""
    return len(query & memory) / len(query) if query else 0.0


def rank_features(ids: Sequence[str], ranking: Sequence[str], depth: int) -> tuple[list[float], list[float]]:
    """Reciprocal rank 1/(r+1) and log(r+1)/log(depth+1) (r from 0) of each id in `ranking`.

    An id the list did not return counts as ranked `depth` (reciprocal 1/(depth+1), log-rank 1):
    the list's own cut-off is the best that is known about it."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    position = {m: r for r, m in enumerate(ranking)}
    ranks = [min(position.get(m, depth), depth) for m in ids]
    return [1.0 / (r + 1) for r in ranks], [math.log(r + 1) / math.log(depth + 1) for r in ranks]


def scaled_scores(ids: Sequence[str], ranking: Sequence[str], scores: Sequence[float]) -> list[float]:
    """Each id's score divided by the list's best score (0 if absent or the best is not positive)."""
    if len(ranking) != len(scores):
        raise ValueError(f"{len(ranking)} ids but {len(scores)} scores")
    best = max(scores, default=0.0)
    by_id = dict(zip(ranking, scores))
    return [by_id.get(m, 0.0) / best if best > 0 else 0.0 for m in ids]


def feature_columns(query: str, ids: Sequence[str], texts: Sequence[str], cosines: Sequence[float],
                    dense: tuple[Sequence[str], Sequence[float]], bm25: tuple[Sequence[str], Sequence[float]],
                    depth: int, *, top_cosine: float) -> dict[str, list[float]]:
    """Every feature of `CANDIDATE_FEATURES` for one query's candidates (in the candidates' order), by name.

    `dense` and `bm25` are each half's ranked ids and scores, searched at least `depth` deep (an
    empty dense list — BM25 alone — ranks every candidate at the depth); `cosines` the candidates'
    bank embeddings · the query embedding; `texts` what the memories say (their source text).
    `top_cosine` is the best cosine over the first stage's depth list (not over these candidates):
    `cosine_gap` = cosine − top_cosine, so the same memory gets the same gap at any K and in any
    server batch (a batch searched at its largest k would otherwise change a small-k query's gap)."""
    if not len(ids) == len(texts) == len(cosines):
        raise ValueError(f"{len(ids)} ids, {len(texts)} texts and {len(cosines)} cosines: need one per candidate")
    dense_rr, dense_log = rank_features(ids, dense[0], depth)
    bm25_rr, bm25_log = rank_features(ids, bm25[0], depth)
    q_words = content_words(query)
    m_words = [content_words(t) for t in texts]
    return {
        "dense_rr": dense_rr, "bm25_rr": bm25_rr, "dense_logrank": dense_log, "bm25_logrank": bm25_log,
        "bm25_scaled": scaled_scores(ids, bm25[0], bm25[1]),
        "cosine": [float(c) for c in cosines],
        "cosine_gap": [float(c) - float(top_cosine) for c in cosines],
        "log_tokens": [math.log1p(len(t.split())) for t in texts],
        "jaccard": [jaccard(q_words, w) for w in m_words],
        "query_coverage": [coverage(q_words, w) for w in m_words],
    }


def candidate_feature_matrix(query: str, ids: Sequence[str], texts: Sequence[str], cosines: Sequence[float],
                             dense: tuple[Sequence[str], Sequence[float]],
                             bm25: tuple[Sequence[str], Sequence[float]], depth: int, *,
                             top_cosine: float) -> torch.Tensor:
    """`feature_columns` as the `[K, F]` float32 tensor of `Candidates.features` (columns `CANDIDATE_FEATURES`).

    Refuses a non-finite value (a NaN embedding, an infinite score) with `DataError` naming the
    feature: nothing non-finite is stored with a candidate or learned from."""
    columns = feature_columns(query, ids, texts, cosines, dense, bm25, depth, top_cosine=top_cosine)
    if not ids:
        return torch.zeros((0, len(CANDIDATE_FEATURES)), dtype=torch.float32)
    matrix = torch.tensor([columns[name] for name in CANDIDATE_FEATURES], dtype=torch.float32).T.contiguous()
    finite = torch.isfinite(matrix)
    if not bool(finite.all()):
        bad = [name for j, name in enumerate(CANDIDATE_FEATURES) if not bool(finite[:, j].all())]
        raise DataError(f"non-finite candidate feature {', '.join(bad)} for query {query!r}")
    return matrix
