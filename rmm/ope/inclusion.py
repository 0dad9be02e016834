"""P(memory i is among the M picks) under Plackett–Luce(logits), exactly or by Monte Carlo.

Item-level off-policy estimates weight each shown memory by P_π(i ∈ top M) / P_μ(i ∈ top M). The
sampler (`rmm.policy.sampling.gumbel_top_m`) draws M without replacement from Plackett–Luce with
logits `s/τ`; the inclusion probability of one item has no closed form, so:

- **Exact** (`exact_inclusion`): a dynamic programme over the *unordered* sets of the first m picks,
  F(S) = Σ_{j∈S} F(S∖j) · p_j / (Z − p(S∖j)), p = exp(logits), Z = Σp; P(i ∈ top M) = Σ_{|S|=M, i∈S} F(S).
  It visits Σ_{m≤M} C(K, m)·m (set, last pick) pairs — about 10⁵ at K = 20, M = 5 (rmm serve's
  defaults) — so it is used while that count is at most `EXACT_LIMIT`; tests check it against brute
  enumeration of every ordered pick sequence.
- **Monte Carlo** (`monte_carlo_inclusion`), beyond that: Rao–Blackwellised over the Gumbel trick's
  exponential race. Item j "arrives" at T_j ~ Exp(p_j); the top M are the first M arrivals. Given the
  other items' times, i is picked iff T_i < t*, t* the M-th earliest of the *others* (the (M+1)-th
  overall when i is itself among the first M, else the M-th), which has probability 1 − exp(−p_i t*).
  Averaging that conditional probability over `samples` races is unbiased, never returns 0 for a
  valid item (so a shown memory never gets an infinite weight), and has a far smaller variance than
  counting picks. The standard error returned is the sample standard deviation / √samples, per item.

Both work in float64 with logits shifted to a maximum of 0. A valid item whose probability is below
float64's range (logit gap > ~700) comes out 0: the estimators treat that as "outside the logging
policy's support" (`rmm.ope.estimators`). Masked candidates (False in `mask`) have probability 0.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

__all__ = ["EXACT_LIMIT", "Inclusion", "exact_cost", "exact_inclusion", "greedy_inclusion", "inclusion",
           "monte_carlo_inclusion"]

# (set, last pick) pairs the exact programme may visit per row: K = 20, M = 5 needs ~1.0e5 (~1 ms a row)
EXACT_LIMIT = 200_000
# rows per exact batch: bounds the [rows, C(K, M)] float64 table (64 × 15,504 × 8 B ≈ 8 MB at K = 20, M = 5)
_EXACT_ROWS = 64
_MC_ROWS = 32  # rows per Monte Carlo block: [samples, rows, K] float64 (1000 × 32 × 50 × 8 B = 13 MB)


@dataclass
class Inclusion:
    """Inclusion probabilities `[B, K]` and how they were computed."""

    probs: np.ndarray  # [B, K] float64
    method: str  # "exact", "monte-carlo" or "greedy"
    samples: int = 0  # Monte Carlo races per row (0 when exact)
    stderr: np.ndarray | None = None  # [B, K] Monte Carlo standard error (None when exact)


def exact_cost(k: int, m: int) -> int:
    """(set, last pick) pairs the exact programme visits for K candidates and M picks."""
    return sum(math.comb(k, j) * j for j in range(1, min(m, k) + 1))


@lru_cache(maxsize=32)
def _levels(k: int, m: int) -> list[tuple[np.ndarray, list[np.ndarray]]]:
    """Per size j = 1..m: the j-subsets of range(k) in colex rank order `[C, j]`, and for each
    position t the colex rank of the subset without its t-th element (into level j−1)."""
    table = np.zeros((k + 1, m + 2), dtype=np.int64)
    for n in range(k + 1):
        for r in range(m + 2):
            table[n, r] = math.comb(n, r)
    levels = []
    for j in range(1, m + 1):
        combos = np.array(list(itertools.combinations(range(k), j)), dtype=np.int64).reshape(-1, j)
        ranks = sum(table[combos[:, t], t + 1] for t in range(j))
        ordered = np.empty_like(combos)
        ordered[ranks] = combos
        parents = []
        for t in range(j):
            rest = np.delete(ordered, t, axis=1)
            parents.append(sum((table[rest[:, u], u + 1] for u in range(j - 1)), np.zeros(len(ordered), np.int64)))
        levels.append((ordered, parents))
    return levels


def _weights(logits: Tensor, mask: Tensor | None) -> np.ndarray:
    """exp(logits − max) in float64, 0 where masked."""
    x = logits.detach().double().cpu()
    if mask is not None:
        x = x.masked_fill(~mask.cpu().bool(), float("-inf"))
    x = x - x.max(-1, keepdim=True).values
    return torch.exp(x).numpy()


def exact_inclusion(logits: Tensor, m: int, mask: Tensor | None = None) -> np.ndarray:
    """Exact P(i ∈ top m) `[B, K]` for logits `[B, K]` (module docstring); every row needs m valid items."""
    p_all = _weights(logits, mask)
    b, k = p_all.shape
    m = min(m, k)
    out = np.zeros((b, k))
    if m == 0 or b == 0:
        return out
    levels = _levels(k, m)
    for start in range(0, b, _EXACT_ROWS):
        p = np.ascontiguousarray(p_all[start:start + _EXACT_ROWS].T)  # [K, rows]: gathers copy whole rows
        z = p.sum(0, keepdims=True)
        f = np.ones((1, p.shape[1]))  # F(∅) = 1, one column per logged row
        mass = np.zeros((1, p.shape[1]))  # p(∅) = 0
        for combos, parents in levels:
            left = z - mass  # what is left to pick from after each parent set
            # F(parent) / left; 0 where nothing is left (then every remaining p_j is 0 as well)
            g = np.divide(f, left, out=np.zeros_like(f), where=left > 0)
            f = np.zeros((len(combos), p.shape[1]))
            for t, parent in enumerate(parents):
                f += g[parent] * p[combos[:, t]]
            mass = p[combos].sum(1)
        member = np.zeros((k, len(levels[-1][0])))
        for t in range(m):
            member[levels[-1][0][:, t], np.arange(len(levels[-1][0]))] = 1.0
        out[start:start + _EXACT_ROWS] = (member @ f).T
    return np.clip(out, 0.0, 1.0)


def monte_carlo_inclusion(logits: Tensor, m: int, mask: Tensor | None = None, samples: int = 1000,
                          seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rao–Blackwellised Monte Carlo P(i ∈ top m) and its standard error, each `[B, K]`.

    The races are drawn from `seed` (per block of rows), so two policies estimated with the same
    seed share them (common random numbers: the error of their ratio shrinks, and equal policies
    get equal estimates).
    """
    if samples < 2:
        raise ValueError(f"Monte Carlo inclusion needs at least 2 samples (for its standard error), got {samples}")
    x = logits.detach().double().cpu()
    if mask is not None:
        x = x.masked_fill(~mask.cpu().bool(), float("-inf"))
    x = x - x.max(-1, keepdim=True).values
    b, k = x.shape
    m = min(m, k)
    mean, stderr = np.zeros((b, k)), np.zeros((b, k))
    if m == 0:
        return mean, stderr
    for block, start in enumerate(range(0, b, _MC_ROWS)):
        xs = x[start:start + _MC_ROWS]
        generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + block)
        races = torch.empty(samples, *xs.shape, dtype=torch.float64).exponential_(generator=generator)
        log_t = torch.log(races) - xs  # arrival times, in log; masked items never arrive (+inf)
        first = torch.topk(log_t, min(m + 1, k), dim=-1, largest=False).values
        t_m = first[..., m - 1:m]
        t_next = first[..., m:m + 1] if k > m else torch.full_like(t_m, float("inf"))
        threshold = torch.where(log_t <= t_m, t_next, t_m)  # the M-th earliest arrival among the others
        cond = torch.nan_to_num(-torch.expm1(-torch.exp(xs + threshold)), nan=0.0)  # P(T_i < t*) | others
        mean[start:start + _MC_ROWS] = cond.mean(0).numpy()
        stderr[start:start + _MC_ROWS] = (cond.std(0) / math.sqrt(samples)).numpy()
    return mean, stderr


def greedy_inclusion(logits: Tensor, m: int, mask: Tensor | None = None) -> np.ndarray:
    """A deterministic top-m policy: 1 for the m best (ties to the lower index), 0 elsewhere."""
    x = logits.detach().double().cpu()
    if mask is not None:
        x = x.masked_fill(~mask.cpu().bool(), float("-inf"))
    out = np.zeros(tuple(x.shape))
    top = torch.topk(x, min(m, x.shape[-1]), dim=-1).indices.numpy()
    np.put_along_axis(out, top, 1.0, axis=-1)
    return out


def inclusion(logits: Tensor, m: int, mask: Tensor | None = None, *, samples: int = 1000,
              exact_limit: int = EXACT_LIMIT, seed: int = 0) -> Inclusion:
    """Exact when `exact_cost(K, m) <= exact_limit`, Monte Carlo with `samples` races otherwise."""
    k = logits.shape[-1]
    if exact_cost(k, m) <= exact_limit:
        return Inclusion(exact_inclusion(logits, m, mask), "exact")
    probs, stderr = monte_carlo_inclusion(logits, m, mask, samples, seed)
    return Inclusion(probs, "monte-carlo", samples, stderr)
