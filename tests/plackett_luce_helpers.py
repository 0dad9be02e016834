"""The Plackett–Luce log-probability written the plain way, one pick at a time: what the vectorised
forms (`rmm.kernels.reference.plackett_luce_picks_logp`, `rmm.policy.sampling.plackett_luce_logp`) are
tested against. Importable because conftest puts tests/ on sys.path."""

from __future__ import annotations

import torch
from torch import Tensor


def naive_pl_logp(scores: Tensor, chosen: Tensor, tau: float, mask: Tensor | None = None) -> Tensor:
    """`log π_j = s[c_j]/τ − logsumexp(s/τ over the candidates left)`, looping over rows and picks.

    Candidates left: those `mask` allows (all when None) that score above `-inf` and were not picked
    before. A -1 pick scores 0 (no gradient) and removes nothing. Differentiable w.r.t. `scores`; any
    leading batch dims, computed in the scores' dtype.
    """
    k, m = scores.shape[-1], chosen.shape[-1]
    flat_scores, flat_chosen = scores.reshape(-1, k), chosen.reshape(-1, m)
    flat_mask = None if mask is None else mask.reshape(-1, k)
    rows = []
    for b in range(flat_scores.shape[0]):
        logits = flat_scores[b] / tau
        left = [i for i in range(k) if logits[i] > float("-inf") and (flat_mask is None or flat_mask[b, i])]
        row = []
        for c in flat_chosen[b].tolist():
            if c < 0:
                row.append(torch.zeros((), dtype=scores.dtype))
                continue
            row.append(logits[c] - torch.logsumexp(logits[left], 0))
            left.remove(c)
        rows.append(torch.stack(row) if row else torch.zeros(0, dtype=scores.dtype))
    return torch.stack(rows).reshape(chosen.shape)
