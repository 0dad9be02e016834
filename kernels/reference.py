"""The exact torch reference of the fused rerank step (what the Triton kernel must reproduce).

One step of serving / exploring (DESIGN.md §4): scores `s[b,k] = q[b]·E[ids[b,k]]`, Gumbel noise,
top-M of `s/τ + g` (of `s` when greedy), and the Plackett–Luce log-probability of each pick.

Noise comes from one of two sources, chosen by the caller:

- a **seed**: counter-based Philox-4x32-10, bit for bit the stream of Triton's `tl.rand(seed,
  offset)` with `offset = b·K + k`, re-implemented here in int64 torch arithmetic. The same seed
  gives the same uniforms on CPU and in the kernel, which is what lets tests compare the two
  exactly (the Gumbel transform on top may differ by an ulp: `log` is not correctly rounded);
- a **torch.Generator** (or the global RNG): `torch.rand` uniforms, identical to
  `rmm.policy.sampling.gumbel_noise`, so the reranker's CPU behaviour for a given generator is unchanged.

Conventions shared with the kernel: `ids == -1` marks padding; padded scores are `-inf`; a pick
that finds no valid candidate left is `-1` with log-probability 0; ties go to the lower index.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "RerankResult",
    "gather_scores",
    "gumbel_from_uniform",
    "philox_uniform",
    "picks_logp_of_logits",
    "plackett_luce_picks_logp",
    "rerank_reference",
    "rerank_rows",
    "seeded_gumbel",
    "select_top_m",
    "stream_gumbel",
]

_MASK32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_ROUNDS = 10
# Triton's uint_to_uniform_float scale: the largest value with (2**31 - 1) * scale < 1 in float32.
_UNIFORM_SCALE = 4.6566127342e-10


@dataclass
class RerankResult:
    """Output of one rerank call; rows are queries, K candidates, M picks (best / first drawn first)."""

    indices: Tensor  # [B, M] int64 positions into the K candidates, -1 = no pick (row ran out)
    scores: Tensor  # [B, K] float32 `q·E[id]`, -inf at padding
    logp: Tensor  # [B, M] float32 Plackett–Luce log-probability of each pick under s/τ, 0 where no pick
    noise: Tensor | None  # [B, K] float32 Gumbel noise when exploring, else None
    backend: str  # "torch" or "triton": which implementation produced it


# ---- counter-based noise (Philox-4x32-10, as triton.language.random) ---------------------------
def _umulhi_lo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """High and low 32 bits of `a * b` for a 32-bit constant `a` and uint32 values in int64 `b`.

    Splitting `b` into 16-bit halves keeps every intermediate below 2**49: no int64 overflow.
    """
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_hi, p_lo = a * b_hi, a * b_lo  # each < 2**48
    high = (p_hi + (p_lo >> 16)) >> 16
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return high & _MASK32, low


def philox_uniform(seed: int, offsets: Tensor) -> Tensor:
    """`tl.rand(seed, offsets)` for int64 `offsets`: float32 uniforms in [0, 1).

    Counter = (offset low word, offset high word, 0, 0), key = (seed low word, seed high word);
    the first output word becomes the float as in `uint_to_uniform_float`.
    """
    if not 0 <= int(seed) < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    seed = int(seed)
    offsets = offsets.to(torch.int64)
    c0 = offsets & _MASK32
    c1 = (offsets >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(_PHILOX_ROUNDS):
        hi_b, lo_b = _umulhi_lo(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _umulhi_lo(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    signed = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # bitcast to int32
    signed = torch.where(signed < 0, -signed - 1, signed).to(torch.int32)
    return signed.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=signed.device)


def gumbel_from_uniform(u: Tensor, *, inplace: bool = False) -> Tensor:
    """`-log(-log u)` with `u` kept inside (0, 1), so the noise is finite: the one Gumbel transform.

    `inplace=True` overwrites `u` (fresh draws nobody else holds): the same values, no temporaries.
    """
    finfo = torch.finfo(u.dtype)
    if inplace:
        return u.clamp_(min=finfo.tiny, max=1.0 - finfo.eps).log_().neg_().log_().neg_()
    u = u.clamp(min=finfo.tiny, max=1.0 - finfo.eps)
    return -torch.log(-torch.log(u))


def seeded_gumbel(seed: int, batch: int, k: int, device: torch.device | str | None = None) -> Tensor:
    """Gumbel noise `[batch, k]` from Philox counters `b·k + j`: the kernel's noise, bit for bit
    in the uniforms."""
    offsets = torch.arange(batch * k, dtype=torch.int64, device=device).view(batch, k)
    return gumbel_from_uniform(philox_uniform(seed, offsets), inplace=True)


def stream_gumbel(
    shape: torch.Size | tuple[int, ...],
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Gumbel noise of `shape` from torch's RNG (`generator`, else the global one): the noise of
    the torch backend and of `rmm.policy.sampling.gumbel_noise`, so the two draw the same values.

    The uniforms are drawn where the generator lives (a CPU generator may seed CUDA work) and moved.
    """
    draw_device = generator.device if generator is not None else device
    u = torch.rand(tuple(shape), generator=generator, device=draw_device, dtype=dtype)
    g = gumbel_from_uniform(u, inplace=True)
    if device is not None and g.device != torch.device(device):
        g = g.to(device)
    return g


# ---- scoring, selection, log-probabilities -----------------------------------------------------
def gather_scores(queries: Tensor, bank: Tensor, ids: Tensor) -> Tensor:
    """`s[b,k] = q[b]·E[ids[b,k]]` in float32, `-inf` where `ids == -1`.

    The reference may materialise the gathered `[B, K, d]` block; only the kernel must not.
    """
    return _gather_scores(queries, bank, ids, ids < 0)


def _gather_scores(queries: Tensor, bank: Tensor, ids: Tensor, padding: Tensor) -> Tensor:
    gathered = _float32(bank[ids.clamp(min=0)])  # [B, K, d]
    scores = (gathered @ _float32(queries).unsqueeze(-1)).squeeze(-1)
    return scores.masked_fill_(padding, float("-inf"))


def select_top_m(keys: Tensor, m: int) -> Tensor:
    """Top-`m` positions of `keys` per row, best first, ties to the lower index; `-inf` → -1.

    A stable descending sort makes ties deterministic (the kernel's argmax loop does the same).
    """
    batch, k = keys.shape
    take = min(m, k)
    picks = _top_m_of_sort(torch.sort(keys, dim=-1, descending=True, stable=True), take)
    if take < m:
        picks = torch.cat([picks, picks.new_full((batch, m - take), -1)], dim=-1)
    return picks


def _top_m_of_sort(order: torch.return_types.sort, m: int) -> Tensor:
    """The first `m` positions of a descending sort, -1 where the key is `-inf` (no valid candidate left)."""
    return order.indices[..., :m].masked_fill(order.values[..., :m] == float("-inf"), -1)


def _over_tau(scores: Tensor, tau: float) -> Tensor:
    """`scores / tau`, skipping the op at τ = 1 (x / 1 is x bit for bit, and so is its gradient)."""
    return scores / tau if tau != 1.0 else scores


def _float32(t: Tensor) -> Tensor:
    """`t.float()`, skipping the call when it would return `t` (a turn's ops are mostly overhead)."""
    return t if t.dtype == torch.float32 else t.float()


def plackett_luce_picks_logp(scores: Tensor, picks: Tensor, tau: float, *, complete: bool = False) -> Tensor:
    """`log π_j = s[c_j]/τ − logsumexp(s/τ over valid candidates not yet picked)`; 0 where c_j = -1.

    The one Plackett–Luce log-probability: the reference's (so the sampler's μ) and, with
    gradients, the learner's log π (through `rmm.policy.sampling.plackett_luce_logp`). Any
    leading batch dims; candidates on the last dim of `scores`, picks on the last dim of `picks`.
    Padding is whatever scores `-inf`; picks are distinct, and -1 marks no pick (a row that ran
    out, or padding to a common M): it removes nothing and scores 0, with zero gradient. Computed in
    the scores' dtype (float32 from the reference's scoring; a float64 caller keeps float64).
    `complete=True` is the caller's promise that every pick is a real one (no -1, none scoring
    `-inf`): the same values and gradients, without the ops that handle -1 picks.

    One masked `[M, K]` row per pick, not a reverse logcumsumexp over the picks (which saves ~30 µs
    on a CPU turn): that sums in another order, and REINFORCE under Adam carries a rounding change
    into other learned weights (the quickstart's whole-bank recall@5 moved 39.9 → 40.1).
    """
    k = scores.shape[-1]
    if k == 0:  # nothing to pick from: every pick is -1
        return torch.zeros(picks.shape, dtype=scores.dtype, device=scores.device)
    # the learner divides by each row's τ first and passes τ = 1: one op fewer
    return picks_logp_of_logits(_over_tau(scores, tau), picks, complete=complete)


@functools.lru_cache(maxsize=64)
def _pick_steps(m: int, device: torch.device) -> Tensor:
    """`arange(m)`, kept: every sampled turn and every update asks for the same one (never written to)."""
    return torch.arange(m, device=device)


def picks_logp_of_logits(logits: Tensor, picks: Tensor, *, complete: bool = False) -> Tensor:
    """`plackett_luce_picks_logp` on logits already divided by τ (K ≥ 1).

    Row j of the `[M, K]` block keeps the candidates not picked before j: those whose rank (the
    position of their pick, M when never picked) is ≥ j. One scatter of the pick positions builds
    the ranks; the block, and so every value and gradient, is the one-hot form's
    (`picked.cumsum(-2) == picked`) exactly, in fewer ops.
    """
    m, k = picks.shape[-1], logits.shape[-1]
    steps = _pick_steps(m, logits.device)
    if complete:
        rank = torch.full(logits.shape, m, dtype=torch.long, device=logits.device)
        rank.scatter_(-1, picks, steps.expand(picks.shape))
    else:  # a -1 pick scatters into an extra column, sliced away
        rank = torch.full((*logits.shape[:-1], k + 1), m, dtype=torch.long, device=logits.device)
        rank = rank.scatter_(-1, picks.masked_fill(picks < 0, k), steps.expand(picks.shape))[..., :k]
    return _logp_from_rank(logits, rank, picks, complete=complete)


def _logp_from_rank(logits: Tensor, rank: Tensor, picks: Tensor, *, complete: bool, finite: bool = False) -> Tensor:
    """The picks' log π from each candidate's rank (the position of its pick; anything ≥ M when not
    picked): row j of the `[M, K]` block keeps the candidates of rank ≥ j. `complete`: every pick is
    real (no -1, none `-inf`), so no row is empty; `finite`: no logit is `-inf`, so none needs masking."""
    m = picks.shape[-1]
    available = rank.unsqueeze(-2) >= _pick_steps(m, logits.device).view(m, 1)
    if not finite:
        available = available & (logits > float("-inf")).unsqueeze(-2)
    rows = torch.where(available, logits.unsqueeze(-2), float("-inf"))
    if complete:  # every row holds its own pick: never empty
        return logits.gather(-1, picks) - torch.logsumexp(rows, dim=-1)
    empty = ~available.any(-1, keepdim=True)  # nothing left (only after a row ran out): a finite placeholder
    normaliser = torch.logsumexp(torch.where(empty, 0.0, rows), dim=-1)  # [..., M]
    return torch.where(picks >= 0, logits.gather(-1, picks.clamp(min=0)) - normaliser, 0.0)


def rerank_reference(
    queries: Tensor,
    bank: Tensor,
    ids: Tensor,
    m: int,
    tau: float,
    *,
    explore: bool,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> RerankResult:
    """The whole step in plain torch; inputs are assumed validated (see `rmm.kernels.dispatch`).

    Noise when exploring: `noise` if given, else Philox from `seed`, else the torch stream of
    `generator` (the global RNG when None).
    """
    batch, k = ids.shape
    padding = ids < 0
    scores = _gather_scores(queries, bank, ids, padding)
    if explore:
        if noise is None:
            noise = (seeded_gumbel(seed, batch, k, device=scores.device) if seed is not None
                     else stream_gumbel((batch, k), generator, device=scores.device))
        if noise.device != scores.device or noise.dtype != torch.float32:
            noise = noise.to(scores.device, torch.float32)
        keys = (scores / tau).add_(noise).masked_fill_(padding, float("-inf"))
    else:
        noise = None
        keys = scores
    picks = select_top_m(keys, m)
    logp = plackett_luce_picks_logp(scores, picks, tau)
    return RerankResult(indices=picks, scores=scores, logp=logp, noise=noise, backend="torch")


def rerank_rows(
    queries: Tensor,
    memories: Tensor,
    m: int,
    tau: float,
    *,
    explore: bool,
    generator: torch.Generator | None = None,
) -> RerankResult:
    """`rerank_reference` over candidate rows already gathered, every one real: the CPU turn's step.

    `memories [B, K, d]` float32 (row b holds query b's K candidates, so ids are `arange`), `queries
    [B, d]` float32, 1 ≤ m ≤ K (checked: a ValueError otherwise). Bit for bit `rerank_reference(queries, memories.reshape(-1, d),
    arange(B·K).view(B, K), ...)` with the torch stream's noise — the same ops on the same values,
    minus those that only act on padding: no gather of the rows, no padding fill, s/τ divided once
    for the keys and log π, and log π from the sort's ranking unless a score is not finite.
    """
    _check_rows(queries, memories, m)
    # the bmm `gathered @ q.unsqueeze(-1)` reaches through matmul's expands and views, called directly
    scores = torch.bmm(memories, queries.unsqueeze(-1)).squeeze(-1)
    batch, k = scores.shape
    logits = _over_tau(scores, tau)
    if explore:
        noise: Tensor | None = stream_gumbel((batch, k), generator, device=scores.device)
        keys = logits + noise
    else:
        noise, keys = None, scores
    order = torch.sort(keys, dim=-1, descending=True, stable=True)
    if math.isfinite(float(logits.sum())):  # every score finite (one sum: the usual case), so every key is
        # each candidate's rank is its position in the sort (a permutation per row): one scatter, and no
        # -inf mask — `picks_logp_of_logits(logits, picks, complete=True)`'s values, bit for bit
        ranking = order.indices
        picks = ranking[:, :m]
        rank = torch.empty_like(ranking).scatter_(-1, ranking, _pick_steps(k, logits.device).expand(ranking.shape))
        logp = _logp_from_rank(logits, rank, picks, complete=True, finite=True)
    else:  # a score overflowed or is NaN: picks past the finite keys are -1, as the reference marks them
        picks = _top_m_of_sort(order, m)
        logp = picks_logp_of_logits(logits, picks)
    return RerankResult(indices=picks, scores=scores, logp=logp, noise=noise, backend="torch")


def _check_rows(queries: Tensor, memories: Tensor, m: int) -> None:
    """`rerank_rows`' inputs as it states them, so a misuse is a clear error and not a wrong sample."""
    if memories.ndim != 3 or queries.ndim != 2 or queries.shape != (memories.shape[0], memories.shape[2]):
        raise ValueError(f"rerank_rows needs queries [B, d] and memories [B, K, d], got {tuple(queries.shape)} "
                         f"and {tuple(memories.shape)}")
    if memories.dtype != torch.float32 or queries.dtype != torch.float32:
        raise ValueError(f"rerank_rows needs float32 queries and memories, got {queries.dtype} and {memories.dtype}")
    if not 1 <= m <= memories.shape[1]:
        raise ValueError(f"rerank_rows needs 1 <= m <= K, got m={m} for K={memories.shape[1]}")

