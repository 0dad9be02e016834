"""Gumbel top-M sampling and the log-probabilities REINFORCE needs (paper Eq. 2, DESIGN.md §4).

Why top-M of `s/τ + g` and not of `s + g`: the top-M of Gumbel-perturbed logits is an exact
sample *without replacement* from the Plackett–Luce distribution with logits `s/τ` (Gumbel-top-k
trick), so τ really sets how deterministic selection is. Adding `g` to `s` before dividing by τ
(the paper's literal wording) would make τ irrelevant to *which* items are picked.

All functions are pure tensor code: any leading batch dims, candidates (K) on the last dim,
picks (M) on the last dim of `chosen`, -1 where a row has fewer picks than M. `mask` (bool,
True = valid) marks real candidates when rows were padded to a common K.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rmm.kernels.reference import plackett_luce_picks_logp, stream_gumbel

__all__ = ["gumbel_noise", "gumbel_top_m", "paper_literal_logp", "plackett_luce_logp", "top_m"]


def gumbel_noise(
    shape: torch.Size | tuple[int, ...],
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Standard Gumbel noise `-log(-log u)`, with `u` kept away from 0 and 1 so it stays finite.

    The kernels' torch stream (`rmm.kernels.reference.stream_gumbel`), so the reranker draws the
    same noise through either path. The generator may live on another device than the output (a
    CPU generator seeding CUDA work): the uniforms are drawn where the generator is and moved.
    """
    return stream_gumbel(shape, generator, device, dtype)


def _check_tau(tau: float) -> None:
    if not tau > 0:
        raise ValueError(f"temperature tau must be > 0, got {tau}")


def _check_m(scores: Tensor, m: int, mask: Tensor | None) -> None:
    if m < 0:
        raise ValueError(f"m must be >= 0, got {m}")
    if mask is not None and mask.shape != scores.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != scores shape {tuple(scores.shape)}")
    if mask is None or mask.numel() == 0:
        valid = scores.shape[-1]  # no rows (or no candidates at all): nothing to violate
    else:
        valid = int(mask.sum(-1).min())
    if m > valid:
        raise ValueError(
            f"cannot pick m={m} from {valid} valid candidates; clip m to the number of candidates"
        )


def _masked(logits: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return logits
    return logits.masked_fill(~mask, float("-inf"))


def top_m(scores: Tensor, m: int, mask: Tensor | None = None) -> Tensor:
    """Deterministic top-M (serving without exploration), best first."""
    _check_m(scores, m, mask)
    return _masked(scores.detach(), mask).topk(m, dim=-1, sorted=True).indices


def gumbel_top_m(
    scores: Tensor,
    m: int,
    tau: float,
    generator: torch.Generator | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample M candidates without replacement from Plackett–Luce(`scores/τ`), in pick order.

    Returns `(chosen[..., M], noise[..., K])`; the noise is kept because the paper-literal
    estimator needs it. Raises ValueError when a row has fewer than `m` valid candidates.
    """
    _check_tau(tau)
    _check_m(scores, m, mask)
    with torch.no_grad():
        logits = scores.detach().float() / tau
        noise = gumbel_noise(logits.shape, generator=generator, device=logits.device)
        chosen = _masked(logits + noise, mask).topk(m, dim=-1, sorted=True).indices
    return chosen, noise


def plackett_luce_logp(
    scores: Tensor, chosen: Tensor, tau: float, mask: Tensor | None = None, *, complete: bool = False
) -> Tensor:
    """Log-probability of each pick in order: `logit[c_j] − logsumexp(logits not yet picked)`.

    Differentiable w.r.t. `scores`, in their dtype; `rmm.kernels.reference.plackett_luce_picks_logp`
    with the mask applied as `-inf` scores. Picks are distinct; -1 marks padding (rows with fewer picks,
    after their real ones) and scores 0 with zero gradient, so it never changes the real picks.
    The caller guarantees real picks are valid; `complete=True` promises there is no -1 pick and
    no masked or `-inf` one either (same values and gradients, fewer ops).
    """
    _check_tau(tau)
    if chosen.shape[:-1] != scores.shape[:-1]:
        raise ValueError(
            f"chosen batch shape {tuple(chosen.shape[:-1])} != scores batch shape {tuple(scores.shape[:-1])}"
        )
    return plackett_luce_picks_logp(_masked(scores, mask), chosen.long(), tau, complete=complete)


def paper_literal_logp(
    scores: Tensor, noise: Tensor, chosen: Tensor, tau: float, mask: Tensor | None = None
) -> Tensor:
    """The paper's estimator: `log softmax((s + g)/τ)` read at each chosen item.

    Kept as an option for replication; it is not the log-probability of the selection (the noise
    enters as a constant), so prefer `plackett_luce_logp`. A -1 pick (padding) scores 0.
    """
    _check_tau(tau)
    if noise.shape != scores.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != scores shape {tuple(scores.shape)}")
    chosen = chosen.long()
    logits = _masked((scores + noise.to(scores)) / tau, mask)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, chosen.clamp(min=0))
    return logp.masked_fill(chosen < 0, 0.0)
