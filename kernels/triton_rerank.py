"""Fused rerank step as one Triton kernel: gather-dot scores, Philox Gumbel noise, top-M, log π.

One program per query row. The row's K candidate ids are loaded once; the bank rows they name
are streamed through registers `BLOCK_D` columns at a time and reduced against the query, so the
`[B, K, d]` block the plain torch path gathers is never written to memory — on a GPU the step is
one pass over the K·d bank values it needs instead of gather + write + read + matmul. Selection
then runs in registers: M rounds of (argmax, Plackett–Luce normaliser over what is left, mask
out), which is cheap for the sizes served (K ≤ 256, M ≤ 32; DESIGN.md: K = 20, M = 5).

Noise is `tl.rand(seed, b·K + k)` — counter-based, so `kernels.reference.philox_uniform`
reproduces the uniforms exactly on CPU.

This module imports triton; `rmm.kernels.dispatch` imports it only when the Triton backend is
chosen. Triton decides at import whether it interprets (`TRITON_INTERPRET=1` must be set before
the first `import triton`: its own `tl.*` helpers are decorated then).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import RerankResult

__all__ = ["rerank_triton"]

_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
_ONE_MINUS_EPS = 1.0 - float(torch.finfo(torch.float32).eps)


@triton.jit(do_not_specialize=["seed", "n_picks"])
def _rerank_kernel(
    q_ptr, bank_ptr, ids_ptr,  # inputs: [B, D], [N, D], [B, K] int64
    scores_ptr, noise_ptr, picks_ptr, logp_ptr,  # outputs: [B, K], [B, K], [B, M] int64, [B, M]
    K, D, n_picks, seed, tau,
    stride_q, stride_bank, stride_ids,
    EXPLORE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    TINY: tl.constexpr, ONE_MINUS_EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    in_row = ks < K
    ids = tl.load(ids_ptr + row * stride_ids + ks, mask=in_row, other=-1)
    valid = ids >= 0
    safe = tl.where(valid, ids, 0)

    # scores: stream the candidates' bank rows through registers, BLOCK_D columns at a time
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        in_d = ds < D
        q = tl.load(q_ptr + row * stride_q + ds, mask=in_d, other=0.0).to(tl.float32)
        e = tl.load(bank_ptr + safe[:, None] * stride_bank + ds[None, :],
                    mask=valid[:, None] & in_d[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(e * q[None, :], axis=1)
    neg_inf = float("-inf")
    scores = tl.where(valid, acc, neg_inf)
    tl.store(scores_ptr + row * K + ks, scores, mask=in_row)
    logits = tl.where(valid, tl.math.div_rn(acc, tau), neg_inf)

    if EXPLORE:
        u = tl.rand(seed, row * K + ks)
        u = tl.minimum(tl.maximum(u, TINY), ONE_MINUS_EPS)
        g = -tl.log(-tl.log(u))
        tl.store(noise_ptr + row * K + ks, g, mask=in_row)
        keys = tl.where(valid, logits + g, neg_inf)
    else:
        keys = scores

    # top-M in registers; log π_j over the candidates still available before pick j
    available = valid
    for j in range(n_picks):
        best = tl.max(keys, axis=0)
        pick = tl.min(tl.where(keys == best, ks, BLOCK_K), axis=0)  # ties → lower index
        found = best > neg_inf
        top = tl.max(tl.where(available, logits, neg_inf), axis=0)
        top = tl.where(top > neg_inf, top, 0.0)
        total = tl.sum(tl.where(available, tl.exp(logits - top), 0.0), axis=0)
        total = tl.where(total > 0.0, total, 1.0)  # nothing left: log π is masked out below
        chosen_logit = tl.sum(tl.where(ks == pick, logits, 0.0), axis=0)
        log_pi = chosen_logit - (top + tl.log(total))
        tl.store(picks_ptr + row * n_picks + j, tl.where(found, pick.to(tl.int64), -1))
        tl.store(logp_ptr + row * n_picks + j, tl.where(found, log_pi, 0.0))
        taken = ks == tl.where(found, pick, -1)
        available = available & (ks != tl.where(found, pick, -1))
        keys = tl.where(taken, neg_inf, keys)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rerank_triton(
    queries: Tensor, bank: Tensor, ids: Tensor, m: int, tau: float, *, explore: bool, seed: int
) -> RerankResult:
    """Launch the kernel; inputs validated by `rmm.kernels.dispatch` (contiguous rows, ids < N)."""
    batch, k = ids.shape
    dim = queries.shape[1]
    device = queries.device
    scores = torch.empty((batch, k), dtype=torch.float32, device=device)
    noise = torch.empty((batch, k), dtype=torch.float32, device=device) if explore else scores
    picks = torch.empty((batch, m), dtype=torch.int64, device=device)
    logp = torch.empty((batch, m), dtype=torch.float32, device=device)
    if batch and m or batch and k:
        block_k = max(16, _next_pow2(k))
        # keep the gathered tile near 8K floats: registers, not local memory
        block_d = max(16, min(128, _next_pow2(dim), 8192 // block_k))
        _rerank_kernel[(batch,)](
            queries, bank, ids, scores, noise, picks, logp,
            k, dim, m, int(seed), float(tau),
            queries.stride(0), bank.stride(0), ids.stride(0),
            EXPLORE=explore, BLOCK_K=block_k, BLOCK_D=block_d,
            TINY=_FLOAT32_TINY, ONE_MINUS_EPS=_ONE_MINUS_EPS,
            num_warps=4 if block_k <= 64 else 8,
        )
    return RerankResult(indices=picks, scores=scores, logp=logp, noise=noise if explore else None,
                        backend="triton")
