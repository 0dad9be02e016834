"""The value of a target reranker π from selections logged under μ (assumptions: `rmm.ope`).

Every estimate is a ratio Σ_n num_n / Σ_n den_n over logged selections n, so one bootstrap over
selections serves them all: resample the selections with replacement `bootstrap` times, recompute
each ratio, take the percentile interval. Two figures per estimator: the expected reward per shown
memory (den = M_n) and the expected number of cited memories per retrieval (the rewards mapped
+1 → 1, −1 → 0; den = 1). With w_i = P_π(i ∈ top M) / P_μ(i ∈ top M) for a shown memory i:

- `ips`: num = Σ_{i shown} w_i r_i;
- `ips-clipped`: the same with w_i ∧ `clip` (biased low where weights exceed it: reported with the
  fraction clipped);
- `snips`: num as `ips`, den = Σ_{i shown} w_i (whose expectation is M_n): self-normalised;
- `dr`: num = Σ_{i ∈ K} P_π(i) r̂_i + Σ_{i shown} w_i (r_i − r̂_i), r̂ cross-fitted (`rmm.ope.reward_model`);
- `slate`: num = (π(S)/μ(S)) Σ_{i shown} r_i, S the ordered picks: the slate-level ratio;
- `logged`: μ's own on-policy mean, Σ r_i (weights 1), the figure a target must beat.

Effective sample size (ESS) is (Σw)²/Σw² over the weights an estimator uses (shown memories for
the item-level ones, selections for `slate`): how many on-policy observations the estimate is
worth. The mean weight (per shown memory; `slate`: per selection) has expectation 1; far below 1,
the logs missed the rare draws that carry the target's mass, and the ESS alone would not say so.
Overlap is checked before any number is given: the target's inclusion mass on candidates μ
could not show (probability 0, or below float64's range) must stay under `max_unsupported`, and
the item-level ESS must reach `min_ess`; otherwise `OverlapError` says why, with the figures.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from rmm.errors import RmmError
from rmm.ope.inclusion import EXACT_LIMIT, exact_cost, greedy_inclusion, inclusion
from rmm.ope.logs import LoggedSelection, TargetPolicy
from rmm.ope.reward_model import cross_fit
from rmm.policy.sampling import plackett_luce_logp

__all__ = ["ASSUMPTIONS", "Estimate", "OpeReport", "OverlapError", "RowWeights", "evaluate", "row_weights"]

log = logging.getLogger(__name__)

ASSUMPTIONS = {
    "ips": "a shown memory's reward depends on the query and that memory only (not its slate-mates or "
           "position); μ could show every memory π would (overlap)",
    "ips-clipped": "as ips; biased towards 0 where a weight exceeds the clip",
    "snips": "as ips; consistent (small bias, less variance) rather than unbiased",
    "dr": "as ips, with cross-fitted r̂; unbiased if either the propensities or r̂ are right",
    "slate": "overlap of ordered slates only: rewards may depend on the whole slate and its order",
    "logged": "none: the logging policy's own mean",
}
_UNSUPPORTED = 1e-300  # an inclusion probability below this counts as 0 (μ could not show the memory)


class OverlapError(RmmError, ValueError):
    """The target puts its weight where the logging policy could not (or almost never did) show."""


@dataclass
class Estimate:
    """One estimator's figures: reward per shown memory and cited memories per retrieval, each with
    its bootstrap interval; the ESS of the weights it used and how many there were."""

    name: str
    value: float
    low: float
    high: float
    cited: float
    cited_low: float
    cited_high: float
    ess: float
    weights: int
    max_weight: float
    mean_weight: float  # per shown memory (slate: per selection); ≈ 1 when the logs cover the target
    clipped: float = 0.0  # fraction of weights clipped (ips-clipped only)
    assumption: str = ""


@dataclass
class OpeReport:
    """What `evaluate` found, JSON-ready (`to_json`)."""

    target: str
    selections: int
    shown: int
    estimates: list[Estimate]
    inclusion: str  # "exact", "monte-carlo", "exact+monte-carlo" (rows differ), or "greedy"
    samples: int  # Monte Carlo races per row (0: all exact)
    max_stderr: float  # largest Monte Carlo standard error of a shown memory's inclusion probability
    unsupported: float  # π's inclusion mass outside μ's support, per shown memory
    clip: float
    bootstrap: int
    level: float
    folds: int
    notes: list[str] = field(default_factory=list)

    def get(self, name: str) -> Estimate:
        return next(e for e in self.estimates if e.name == name)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RowWeights:
    """Per selection: both policies' inclusion probabilities `[K]` and the slate log-ratio."""

    pi: list[np.ndarray]
    mu: list[np.ndarray]
    slate_log_ratio: np.ndarray  # [n]
    method: str
    samples: int
    max_stderr: float


def _group(rows: Sequence[LoggedSelection]) -> dict[tuple[int, int], list[int]]:
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[(r.k, r.m)].append(i)
    return groups


def row_weights(rows: Sequence[LoggedSelection], target: TargetPolicy, *, samples: int = 1000,
                exact_limit: int = EXACT_LIMIT, seed: int = 0) -> RowWeights:
    """Inclusion probabilities of π and μ for every candidate of every row, and log π(S)/μ(S).

    Rows are batched by (K, M); Monte Carlo groups use the same races for π and μ (one seed).
    """
    target_logits = target.logits(rows)
    pi: list[np.ndarray] = [np.zeros(0)] * len(rows)
    mu: list[np.ndarray] = [np.zeros(0)] * len(rows)
    methods: set[str] = set()
    max_stderr = 0.0
    for g, ((k, m), idx) in enumerate(sorted(_group(rows).items())):
        mask = torch.stack([torch.ones(k, dtype=torch.bool) if rows[i].mask is None else rows[i].mask.bool()
                            for i in idx])
        mu_logits = torch.stack([rows[i].scores.double() / rows[i].tau for i in idx])
        pi_logits = torch.stack([target_logits[i] for i in idx])
        mu_inc = inclusion(mu_logits, m, mask, samples=samples, exact_limit=exact_limit, seed=seed + g)
        if target.greedy:
            pi_probs, pi_err = greedy_inclusion(pi_logits, m, mask), None
        else:
            pi_inc = inclusion(pi_logits, m, mask, samples=samples, exact_limit=exact_limit, seed=seed + g)
            pi_probs, pi_err = pi_inc.probs, pi_inc.stderr
        methods.add(mu_inc.method)
        for j, i in enumerate(idx):
            pi[i], mu[i] = pi_probs[j], mu_inc.probs[j]
            shown = rows[i].chosen.numpy()
            for err in (mu_inc.stderr, pi_err):
                if err is not None and shown.size:
                    max_stderr = max(max_stderr, float(err[j, shown].max()))
    slate = np.zeros(len(rows))
    for i, r in enumerate(rows):
        if target.greedy:
            order = torch.topk(target_logits[i].masked_fill(~r.mask.bool(), float("-inf")) if r.mask is not None
                               else target_logits[i], r.m).indices
            log_pi = 0.0 if torch.equal(order, r.chosen) else float("-inf")
        else:
            log_pi = float(plackett_luce_logp(target_logits[i][None], r.chosen[None], 1.0,
                                              None if r.mask is None else r.mask.bool()[None]).sum())
        slate[i] = log_pi - float(r.behaviour_logp.double().sum())
    exact_groups = all(exact_cost(k, m) <= exact_limit for k, m in _group(rows))
    method = "+".join(sorted(methods)) if len(methods) > 1 else next(iter(methods), "exact")
    return RowWeights(pi, mu, slate, method, 0 if exact_groups else samples, max_stderr)


def _ess(w: np.ndarray) -> float:
    total = float((w ** 2).sum())
    return float(w.sum() ** 2 / total) if total > 0 else 0.0


def _interval(num: np.ndarray, den: np.ndarray, resamples: np.ndarray, level: float) -> tuple[float, float, float]:
    """Σnum/Σden and its percentile bootstrap interval over the resampled selections."""
    value = float(num.sum() / den.sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        boot = num[resamples].sum(1) / den[resamples].sum(1)
    boot = boot[np.isfinite(boot)]
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(boot, [tail, 100 - tail]) if boot.size else (float("nan"), float("nan"))
    return value, float(low), float(high)


def evaluate(rows: Sequence[LoggedSelection], target: TargetPolicy, *, clip: float = 10.0,
             bootstrap: int = 1000, level: float = 0.95, folds: int = 5, ridge: float = 1.0,
             samples: int = 1000, exact_limit: int = EXACT_LIMIT, seed: int = 0, min_ess: float = 10.0,
             max_unsupported: float = 0.01) -> OpeReport:
    """Every estimator of π's value on `rows` (module docstring); `OverlapError` instead of a number
    when π's inclusion mass leaves μ's support or the weights' ESS is below `min_ess`."""
    rows = [r for r in rows if r.m]
    if len(rows) < 2:
        raise ValueError(f"off-policy evaluation needs at least 2 logged selections with picks, got {len(rows)}")
    if not clip > 0 or not 0 < level < 1 or bootstrap < 1:
        raise ValueError(f"clip must be > 0, level in (0, 1) and bootstrap >= 1; got {clip}, {level}, {bootstrap}")
    rw = row_weights(rows, target, samples=samples, exact_limit=exact_limit, seed=seed)
    n = len(rows)
    m_n = np.array([r.m for r in rows], dtype=np.float64)
    shown_total = float(m_n.sum())
    unsupported = 0.0
    weights: list[np.ndarray] = []
    for r, p, q in zip(rows, rw.pi, rw.mu):
        valid = np.ones(r.k, bool) if r.mask is None else r.mask.numpy().astype(bool)
        outside = valid & (q < _UNSUPPORTED)
        unsupported += float(p[outside].sum())
        shown = r.chosen.numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            weights.append(np.where(q[shown] >= _UNSUPPORTED, p[shown] / np.maximum(q[shown], _UNSUPPORTED), 0.0))
    unsupported /= shown_total
    flat = np.concatenate(weights)
    item_ess = _ess(flat)
    if unsupported > max_unsupported:
        raise OverlapError(f"{target.name} puts {unsupported:.1%} of its inclusion mass on memories the logging "
                           f"policy could not show (allowed: {max_unsupported:.1%}); these logs cannot evaluate it — "
                           "log with more exploration (a higher τ) or evaluate a closer policy")
    if item_ess < min_ess:
        raise OverlapError(f"{target.name}'s importance weights have an effective sample size of {item_ess:.1f} "
                           f"shown memories (of {flat.size}; at least {min_ess:g} needed): too little overlap with "
                           "the logging policy for an estimate")
    rewards = [r.rewards.double().numpy() for r in rows]
    cited = [(x + 1.0) / 2.0 for x in rewards]
    hat = cross_fit(rows, folds=folds, ridge=ridge, seed=seed)
    clipped_w = [np.minimum(w, clip) for w in weights]
    slate_w = np.exp(np.clip(rw.slate_log_ratio, -700, 700))

    def sums(per_row: list[np.ndarray]) -> np.ndarray:
        return np.array([float(x.sum()) for x in per_row])

    def dr(values: list[np.ndarray], model: list[np.ndarray]) -> np.ndarray:
        return np.array([float(p @ h + w @ (v - h[r.chosen.numpy()]))
                         for r, p, w, v, h in zip(rows, rw.pi, weights, values, model)])

    hat_cited = [(h + 1.0) / 2.0 for h in hat]
    w_sum = sums(weights)
    ones = np.ones(n)
    # name -> (num for reward, num for cited, den per shown, den per retrieval, weights for ESS, clipped fraction);
    # the mean weight is the weights' sum over the shown memories (slate: selections) they stand for
    table: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]] = {
        "ips": (sums([w * x for w, x in zip(weights, rewards)]), sums([w * c for w, c in zip(weights, cited)]),
                m_n, ones, flat, 0.0),
        "ips-clipped": (sums([w * x for w, x in zip(clipped_w, rewards)]),
                        sums([w * c for w, c in zip(clipped_w, cited)]), m_n, ones, np.concatenate(clipped_w),
                        float((flat > clip).mean())),
        "snips": (sums([w * x for w, x in zip(weights, rewards)]), sums([w * c for w, c in zip(weights, cited)]),
                  w_sum, w_sum / m_n, flat, 0.0),
        "dr": (dr(rewards, hat), dr(cited, hat_cited), m_n, ones, flat, 0.0),
        "slate": (slate_w * sums(rewards), slate_w * sums(cited), m_n, ones, slate_w, 0.0),
        "logged": (sums(rewards), sums(cited), m_n, ones, np.ones(int(shown_total)), 0.0),
    }
    resamples = np.random.default_rng(seed).integers(0, n, size=(bootstrap, n))
    estimates = []
    for name, (num_r, num_c, den_shown, den_ret, w, clipped) in table.items():
        value, low, high = _interval(num_r, den_shown, resamples, level)
        c_value, c_low, c_high = _interval(num_c, den_ret, resamples, level)
        mean_w = float(w.sum() / (n if name == "slate" else shown_total))
        estimates.append(Estimate(name, value, low, high, c_value, c_low, c_high, _ess(w), int(w.size),
                                  float(w.max()) if w.size else 0.0, mean_w, clipped, ASSUMPTIONS[name]))
    notes = []
    if rw.samples:
        notes.append(f"inclusion probabilities by Monte Carlo ({rw.samples} races per selection, largest "
                     f"standard error {rw.max_stderr:.2g}); bootstrap intervals do not include it")
    notes.append("dr's interval holds its reward model fixed (fitted once, cross-fitted over "
                 f"{max(2, min(folds, n))} folds)")
    return OpeReport(target.name, n, int(shown_total), estimates, rw.method, rw.samples, rw.max_stderr,
                     unsupported, float(clip), int(bootstrap), float(level), max(2, min(folds, n)), notes)
