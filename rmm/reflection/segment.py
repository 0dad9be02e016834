"""The non-LLM fallback of prospective reflection: embedding-based topic segmentation.

With no LLM configured (or when its output is unusable) a session is still split into topics, the
TextTiling way (Hearst 1997) but over sentence embeddings instead of word counts: the similarity
between the window of turns before and after each gap, a *depth* score per gap (how far the
similarity dips below the nearest peaks on either side), and boundaries at the deepest gaps. The
"summary" of a segment is extractive — its turns joined — and labelled as such wherever it is
stored (`EXTRACTIVE_LABEL` in `source_text`), so nobody mistakes it for an LLM summary.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from rmm.types import Session, Turn

__all__ = ["EXTRACTIVE_LABEL", "SegmenterConfig", "TopicSegmenter", "turn_line"]

log = logging.getLogger(__name__)

EXTRACTIVE_LABEL = "[extractive topic: non-LLM fallback segmentation]"


class PassageEncoder(Protocol):
    def encode_passages(self, texts: list[str]) -> torch.Tensor: ...


def turn_line(turn: Turn) -> str:
    """How a turn reads inside a topic memory (the same `speaker: text` as turn memories)."""
    return f"{turn.speaker}: {turn.text}"


@dataclass(frozen=True)
class SegmenterConfig:
    """`depth_threshold=None` takes TextTiling's cutoff, mean − σ/2 of the session's depth scores."""

    window: int = 2
    min_size: int = 2
    max_size: int = 8
    depth_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.min_size < 1 or self.max_size < self.min_size:
            raise ValueError(f"need 1 <= min_size <= max_size, got {self.min_size}, {self.max_size}")

    def key(self) -> str:
        return f"w{self.window}-min{self.min_size}-max{self.max_size}-d{self.depth_threshold}"


class TopicSegmenter:
    def __init__(self, encoder: PassageEncoder, config: SegmenterConfig | None = None) -> None:
        self.encoder = encoder
        self.config = config or SegmenterConfig()

    def segments(self, session: Session) -> list[list[Turn]]:
        """Consecutive runs of the session's turns, one per topic, covering every turn once."""
        return self.segments_many([session])[0]

    def segments_many(self, sessions: Sequence[Session]) -> list[list[list[Turn]]]:
        """`segments` of each session, every turn that needs a vector encoded in one call.

        Encoding is nearly all the fallback's time, and one long call is the cheapest way to do
        it: the encoder sorts a call's texts by length into batches, so little goes on padding,
        and on shared cores every extra call costs far more than its matrix products.
        """
        kept = [[t for t in s.turns if t.text.strip()] for s in sessions]
        out = [[turns] if turns else [] for turns in kept]
        cut = [i for i, turns in enumerate(kept) if self._may_cut(len(turns))]
        texts = [turn_line(t) for i in cut for t in kept[i]]
        if not texts:
            return out
        vectors = F.normalize(torch.as_tensor(self.encoder.encode_passages(texts)).float(), dim=-1)
        offset = 0
        for i in cut:
            n = len(kept[i])
            edges = [0, *boundaries(vectors[offset:offset + n], self.config), n]
            out[i] = [kept[i][a:b] for a, b in itertools.pairwise(edges)]
            offset += n
        return out

    def _may_cut(self, n: int) -> bool:
        """Whether `n` turns could become more than one segment (else they need no vectors)."""
        return n >= 2 * self.config.min_size or n > self.config.max_size


def gap_similarities(vectors: torch.Tensor, window: int) -> torch.Tensor:
    """Cosine between the mean of the `window` turns before gap g and the `window` after ([n−1])."""
    n = vectors.shape[0]
    sims = []
    for g in range(1, n):
        left = vectors[max(0, g - window):g].mean(0)
        right = vectors[g:g + window].mean(0)
        sims.append(F.cosine_similarity(left, right, dim=0))
    return torch.stack(sims) if sims else torch.zeros(0)


def depth_scores(sims: torch.Tensor) -> torch.Tensor:
    """TextTiling depth: (highest peak reached climbing left − s) + (same to the right − s)."""
    values = sims.tolist()
    depths = []
    for i, s in enumerate(values):
        left = s
        for v in reversed(values[:i]):
            if v < left:
                break
            left = v
        right = s
        for v in values[i + 1:]:
            if v < right:
                break
            right = v
        depths.append((left - s) + (right - s))
    return torch.tensor(depths)


def boundaries(vectors: torch.Tensor, config: SegmenterConfig) -> list[int]:
    """Cut positions (index of a segment's first turn) honouring the size limits."""
    n = vectors.shape[0]
    sims = gap_similarities(vectors, config.window)
    depth = depth_scores(sims)
    if config.depth_threshold is not None:
        cutoff = config.depth_threshold
    else:
        cutoff = float(depth.mean() - depth.std(unbiased=False) / 2) if len(depth) > 1 else float("inf")
    cuts: list[int] = []
    # Deepest gaps first; a cut is kept only if every segment it creates stays >= min_size.
    for g in sorted(range(len(depth)), key=lambda i: -float(depth[i])):
        if float(depth[g]) <= 0 or float(depth[g]) < cutoff:
            break
        pos = g + 1
        edges = sorted([0, *cuts, pos, n])
        if all(b - a >= config.min_size for a, b in itertools.pairwise(edges)):
            cuts.append(pos)
    cuts.sort()
    return _split_long([0, *cuts, n], sims, config)[1:-1]


def _split_long(edges: list[int], sims: torch.Tensor, config: SegmenterConfig) -> list[int]:
    """Split segments longer than max_size at their least similar inner gap (recursively)."""
    out = [edges[0]]
    for a, b in itertools.pairwise(edges):
        out.extend(_split_one(a, b, sims, config))
    return out


def _split_one(a: int, b: int, sims: torch.Tensor, config: SegmenterConfig) -> list[int]:
    if b - a <= config.max_size:
        return [b]
    lo, hi = a + config.min_size, b - config.min_size  # allowed cut positions
    if hi < lo:
        lo = hi = a + (b - a) // 2
    pos = min(range(lo, hi + 1), key=lambda p: float(sims[p - 1]))
    return _split_one(a, pos, sims, config) + _split_one(pos, b, sims, config)
