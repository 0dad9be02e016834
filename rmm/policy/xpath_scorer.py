"""The learned reranker as a Semantic XPath scorer (`rmm.memory.xpath_exec.Scorer`).

The reranker scores a memory m for a query q as ``s = (q A)·m`` (Eq. 1 folded, `ResidualLinearReranker`).
Its scale is whatever training made it, so it is not a relevance in [0, 1] as it stands. Our
calibration divides out the transformed query's norm (and the passage's, unit already): the score
becomes the cosine between ``q A`` and ``m`` in the reranker's learned geometry, in [-1, 1] whatever
the weights' scale, then it is calibrated like the encoder's cosine (`rmm.memory.xpath_scorers.calibrate`).
For one query this changes no order between unit-norm memories (one positive factor for all of
them), and an untrained reranker (A = I) gives exactly `CosineScorer`'s relevances, so switching the
scorer on changes nothing before the reranker has learned. The lexical and candidate-feature terms
are not used: a tree node has no first-stage score.
"""

from __future__ import annotations

import numpy as np
import torch

from rmm.encoders.protocol import EncoderLike
from rmm.memory.xpath_scorers import Calibration, CosineScorer
from rmm.policy.reranker import ResidualLinearReranker

__all__ = ["RerankerScorer"]


class RerankerScorer(CosineScorer):
    """Calibrated reranker scores: clip(cos(q A, m)) by default. Reads the reranker's current weights
    at every call (a learner may step between queries); the encoder's query vectors are cached."""

    def __init__(self, reranker: ResidualLinearReranker, encoder: EncoderLike, calibration: Calibration = "clip",
                 cache_size: int = 4096) -> None:
        if reranker.dim != encoder.dim:
            raise ValueError(f"reranker of dimension {reranker.dim} for an encoder of dimension {encoder.dim}")
        super().__init__(encoder, calibration, cache_size)
        self.reranker = reranker
        self.name = f"reranker:{encoder.name}"

    def query_vector(self, query: str) -> np.ndarray:
        raw = torch.from_numpy(self.raw_query(query)).unsqueeze(0)
        weight = self.reranker.W_q.weight
        transformed = self.reranker.transform_queries(raw.to(weight.device, weight.dtype))[0]
        vector = transformed.detach().float().cpu().numpy()
        norm = float(np.linalg.norm(vector))
        return vector / norm if norm > 0 else vector
