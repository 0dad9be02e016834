"""The doubly robust estimate's reward model r̂(query, memory), fitted by cross-fitting.

A ridge regression of a shown memory's reward on what the reranker itself sees of it: the
elementwise product q⊙m (a diagonal bilinear form), the memory's embedding m (what makes a memory
useful whatever the query), q·m, the lexical feature and the candidate features, plus an intercept
(unpenalised). Ridge, not a deeper model: the
doubly robust estimate stays unbiased whatever r̂ is (given correct propensities); a better r̂ only
lowers its variance, and a closed-form fit keeps `rmm ope` at seconds.

Cross-fitting: the rows (selections, not items: a selection's picks share a query) are split into
`folds` at random; each fold's r̂ comes from a model fitted on the other folds, so no row's own
reward enters the prediction its correction term is measured against (which would bias the
estimate towards the model, the over-fitting bias cross-fitting exists to remove). Predictions are
clamped to the rewards' observed range. The ridge strength is fixed (`ridge`), never tuned on the
rows being evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from rmm.ope.logs import LoggedSelection

__all__ = ["cross_fit", "item_features"]


def item_features(row: LoggedSelection, width: int) -> Tensor:
    """`[K, 2d + 3 + F]` design rows of one selection's candidates (`width`: F of the widest row)."""
    q, mems = row.query.double(), row.memories.double()
    k = row.k
    lexical = torch.zeros(k, 1, dtype=torch.float64) if row.lexical is None else row.lexical.double().reshape(k, 1)
    feats = torch.zeros(k, width, dtype=torch.float64)
    if row.features is not None and width:
        feats[:, : row.features.shape[1]] = row.features.double()
    ones = torch.ones(k, 1, dtype=torch.float64)
    return torch.cat([mems * q, mems, (mems @ q).reshape(k, 1), lexical, feats, ones], 1)


def _fit(x: Tensor, y: Tensor, ridge: float) -> Tensor:
    """Ridge coefficients, the last column (intercept) unpenalised."""
    penalty = torch.full((x.shape[1],), float(ridge), dtype=torch.float64)
    penalty[-1] = 0.0
    gram = x.T @ x + torch.diag(penalty)
    return torch.linalg.lstsq(gram, x.T @ y).solution


def cross_fit(rows: Sequence[LoggedSelection], folds: int = 5, ridge: float = 1.0,
              seed: int = 0) -> list[np.ndarray]:
    """Per row, r̂ of each of its K candidates `[K]`, from a model fitted on the other folds."""
    n = len(rows)
    if n < 2:
        raise ValueError(f"cross-fitting needs at least 2 logged selections, got {n}")
    folds = max(2, min(int(folds), n))
    width = max((0 if r.features is None else r.features.shape[1]) for r in rows)
    designs = [item_features(r, width) for r in rows]
    fold_of = np.random.default_rng(seed).permutation(n) % folds
    lo = min(float(r.rewards.min()) for r in rows if r.m)
    hi = max(float(r.rewards.max()) for r in rows if r.m)
    out: list[np.ndarray] = [np.zeros(r.k) for r in rows]
    for fold in range(folds):
        train = [i for i in range(n) if fold_of[i] != fold]
        x = torch.cat([designs[i][rows[i].chosen] for i in train])
        y = torch.cat([rows[i].rewards.double() for i in train])
        coef = _fit(x, y, ridge)
        for i in np.flatnonzero(fold_of == fold):
            out[i] = (designs[i] @ coef).clamp(lo, hi).numpy()
    return out
