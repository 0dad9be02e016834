"""Per-candidate features a reranker could weigh beside Eq. 1, for `scripts/reranker_ceiling.py --features`.

Each feature is one any dialogue memory system has at retrieval time — nothing benchmark-specific:
where each half of the hybrid first stage ranked the memory, its BM25 score, its cosine, its
length, where its session sits in the user's history, who said it, and how many content words it
shares with the query. They are grouped so a supervised fit can add one group at a time and ask
which group lets a shared reranker generalise to users it never saw.

Pure functions over plain lists (no rmm import), so they are tested in isolation
(`tests/test_reranker_features.py`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

# Generic English function words plus question scaffolding ("what do you know about"): words that
# say nothing about which memory answers. Deliberately short — content words are what is compared.
STOPWORDS: frozenset[str] = frozenset("""
a about above after again all am an and any are as at be been before being below between both but
by can could did do does doing down during each few for from had has have having he her here hers
herself him himself his how i if in into is it its itself just know like me more most my myself no
nor not now of off on once only or other our ours out over own same she should so some such than
that the their theirs them then there these they this those through to too under until up very was
we were what when where which while who whom why will with would you your yours yourself
""".split())  # noqa: SIM905 — one readable block of words

FEATURE_GROUPS: dict[str, tuple[str, ...]] = {
    # the RRF fused score / its largest value, in [0, 1] (the reranker's `lexical` feature until eb20cc6)
    "fused": ("fused",),
    # each half's first-stage rank separately: reciprocal and log-scaled (absent from a list = worst)
    "ranks": ("dense_rr", "bm25_rr", "dense_logrank", "bm25_logrank"),
    # BM25 score divided by the list's best, and min-max scaled over the list (the library's `lexical`
    # feature since eb20cc6); 0 = not returned by BM25
    "bm25": ("bm25_scaled", "bm25_minmax"),
    # the cosine as its own weight (a learned temperature of the base) and its gap to the top cosine
    "cosine": ("cosine", "cosine_gap"),
    "length": ("log_tokens",),
    # the memory's session position in the user's history (0 = first, 1 = latest) and turn position in it
    "recency": ("session_position", "turn_position"),
    # the speaker who speaks most in the user's history; share of the top fused candidates by the same speaker
    "speaker": ("speaker_major", "speaker_share"),
    # content-word overlap with the query: Jaccard and the share of the query's content words covered
    "overlap": ("jaccard", "query_coverage"),
}

TOKEN = re.compile(r"[a-z0-9]+")


def content_words(text: str) -> set[str]:
    """Lower-cased alphanumeric tokens minus stopwords and one-letter tokens."""
    return {t for t in TOKEN.findall(text.lower()) if len(t) > 1 and t not in STOPWORDS}


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


def min_max_scores(ids: Sequence[str], ranking: Sequence[str], scores: Sequence[float]) -> list[float]:
    """Each id's score min-max scaled over the list (all equal → 1), 0 if absent."""
    if len(ranking) != len(scores):
        raise ValueError(f"{len(ranking)} ids but {len(scores)} scores")
    lo, hi = min(scores, default=0.0), max(scores, default=0.0)
    by_id = dict(zip(ranking, scores))
    return [0.0 if m not in by_id else (1.0 if hi == lo else (by_id[m] - lo) / (hi - lo)) for m in ids]


def rrf_feature(ids: Sequence[str], rankings: Sequence[Sequence[str]], rrf_k: float) -> list[float]:
    """Reciprocal-rank fusion Σ 1/(rrf_k + rank) (ranks from 1) over `rankings`, divided by its
    largest possible value len(rankings)/(rrf_k + 1): 1 = first in every list."""
    fused: dict[str, float] = {}
    for ranking in rankings:
        for rank, m in enumerate(ranking, start=1):
            fused[m] = fused.get(m, 0.0) + 1.0 / (rrf_k + rank)
    top = len(rankings) / (rrf_k + 1.0)
    return [fused.get(m, 0.0) / top for m in ids]


def scaled_scores(ids: Sequence[str], ranking: Sequence[str], scores: Sequence[float]) -> list[float]:
    """Each id's score divided by the list's best score (0 if absent or the best is not positive)."""
    if len(ranking) != len(scores):
        raise ValueError(f"{len(ranking)} ids but {len(scores)} scores")
    best = max(scores, default=0.0)
    by_id = dict(zip(ranking, scores))
    return [by_id.get(m, 0.0) / best if best > 0 else 0.0 for m in ids]


@dataclass
class TurnPlace:
    """Where a memory's dialogue turn sits: its session's index among the user's, its position, its speaker."""

    session: int
    sessions: int  # how many sessions the user has
    position: int  # 0-based within its session
    turns: int  # turns in its session
    speaker: str


def speaker_share(speakers: Sequence[str], top: int) -> list[float]:
    """Per candidate: share of the first `top` candidates spoken by the same speaker."""
    head = Counter(speakers[:top])
    n = min(top, len(speakers))
    return [head[s] / n if n else 0.0 for s in speakers]


def candidate_features(query: str, ids: Sequence[str], texts: Sequence[str], places: Sequence[TurnPlace],
                       fused: Sequence[float], cosines: Sequence[float],
                       dense: tuple[Sequence[str], Sequence[float]], bm25: tuple[Sequence[str], Sequence[float]],
                       depth: int, majority_speaker: str, speaker_top: int = 5) -> dict[str, list[float]]:
    """Every feature of FEATURE_GROUPS for one query's K candidates (in the candidates' order)."""
    if not len(ids) == len(texts) == len(places) == len(fused) == len(cosines):
        raise ValueError("ids, texts, places, fused and cosines must have one entry per candidate")
    dense_rr, dense_log = rank_features(ids, dense[0], depth)
    bm25_rr, bm25_log = rank_features(ids, bm25[0], depth)
    q_words = content_words(query)
    m_words = [content_words(t) for t in texts]
    top_cos = max(cosines, default=0.0)
    return {
        "fused": [float(f) for f in fused],
        "dense_rr": dense_rr, "bm25_rr": bm25_rr, "dense_logrank": dense_log, "bm25_logrank": bm25_log,
        "bm25_scaled": scaled_scores(ids, bm25[0], bm25[1]),
        "bm25_minmax": min_max_scores(ids, bm25[0], bm25[1]),
        "cosine": [float(c) for c in cosines],
        "cosine_gap": [float(c) - top_cos for c in cosines],
        "log_tokens": [math.log1p(len(t.split())) for t in texts],
        "session_position": [p.session / (p.sessions - 1) if p.sessions > 1 else 1.0 for p in places],
        "turn_position": [p.position / (p.turns - 1) if p.turns > 1 else 0.0 for p in places],
        "speaker_major": [1.0 if p.speaker == majority_speaker else 0.0 for p in places],
        "speaker_share": speaker_share([p.speaker for p in places], speaker_top),
        "jaccard": [jaccard(q_words, w) for w in m_words],
        "query_coverage": [coverage(q_words, w) for w in m_words],
    }


def feature_names(groups: Sequence[str]) -> list[str]:
    """The features of the named groups, in group order, each once (`all` = every group)."""
    if "all" in groups:
        groups = list(FEATURE_GROUPS)
    unknown = [g for g in groups if g not in FEATURE_GROUPS]
    if unknown:
        raise ValueError(f"unknown feature group(s) {unknown}; known: {sorted(FEATURE_GROUPS)} or 'all'")
    names: list[str] = []
    for g in groups:
        names.extend(n for n in FEATURE_GROUPS[g] if n not in names)
    return names
