"""Per-candidate features a reranker could weigh beside Eq. 1, for `research/reranker_ceiling.py --features`.

Each feature is one any dialogue memory system has at retrieval time — nothing benchmark-specific:
where each half of the hybrid first stage ranked the memory, its BM25 score, its cosine, its
length, where its session sits in the user's history, who said it, and how many content words it
shares with the query. They are grouped so a supervised fit can add one group at a time and ask
which group lets a shared reranker generalise to users it never saw.

Pure functions over plain lists, tested in isolation (`tests/test_reranker_features.py`). The
features the library computes (`rmm.memory.features.CANDIDATE_FEATURES`) and their building blocks
live there; this script adds the groups only the research fits use (`fused`, `bm25_minmax`,
`recency`, `speaker`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from rmm.memory.features import (  # noqa: F401 — re-exported for the research scripts and their tests
    coverage,
    feature_columns,
    jaccard,
    rank_features,
    scaled_scores,
)
from rmm.memory.hybrid import min_max, rrf_fuse
from rmm.memory.tokens import content_words  # noqa: F401 — re-exported for the scripts' tests


def min_max_scores(ids: Sequence[str], ranking: Sequence[str], scores: Sequence[float]) -> list[float]:
    """Each id's score min-max scaled over the list (`rmm.memory.hybrid.min_max`: all equal → 1), 0 if absent."""
    if len(ranking) != len(scores):
        raise ValueError(f"{len(ranking)} ids but {len(scores)} scores")
    scaled = min_max(ranking, scores)
    return [scaled.get(m, 0.0) for m in ids]


def rrf_feature(ids: Sequence[str], rankings: Sequence[Sequence[str]], rrf_k: float) -> list[float]:
    """`rmm.memory.hybrid.rrf_fuse` over `rankings`, divided by its largest possible value
    len(rankings)/(rrf_k + 1): 1 = first in every list."""
    fused = rrf_fuse(rankings, rrf_k)
    top = len(rankings) / (rrf_k + 1.0)
    return [fused.get(m, 0.0) / top for m in ids]


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
    # the research runs took the gap to the candidates' best cosine (the library takes the depth list's)
    shared = feature_columns(query, ids, texts, cosines, dense, bm25, depth,
                             top_cosine=max((float(c) for c in cosines), default=0.0))
    return {
        "fused": [float(f) for f in fused],
        **{n: shared[n] for n in ("dense_rr", "bm25_rr", "dense_logrank", "bm25_logrank", "bm25_scaled")},
        "bm25_minmax": min_max_scores(ids, bm25[0], bm25[1]),
        **{n: shared[n] for n in ("cosine", "cosine_gap", "log_tokens")},
        "session_position": [p.session / (p.sessions - 1) if p.sessions > 1 else 1.0 for p in places],
        "turn_position": [p.position / (p.turns - 1) if p.turns > 1 else 0.0 for p in places],
        "speaker_major": [1.0 if p.speaker == majority_speaker else 0.0 for p in places],
        "speaker_share": speaker_share([p.speaker for p in places], speaker_top),
        "jaccard": shared["jaccard"], "query_coverage": shared["query_coverage"],
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
