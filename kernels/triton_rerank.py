"""Fused rerank step as one Triton kernel: gather-dot scores, Philox Gumbel noise, top-M, log π.

One program per query row. The row's K candidates are scored `CHUNK_K` at a time: the chunk's ids
are loaded and the bank rows they name are streamed through a `[CHUNK_K, BLOCK_D]` register tile
and reduced against the query, so the `[B, K, d]` block the plain torch path gathers is never
written to memory — on a GPU the step is one pass over the K·d bank values it needs instead of
gather + write + read + matmul. Short chunks let `BLOCK_D` be long (up to 256 columns): each
gathered row is then read in long contiguous runs, which random-row DRAM reads need to get near
the copy bandwidth (issue 38). Each chunk's scores go to `scores_ptr`; after a barrier the whole
`[BLOCK_K]` row is read back and selection runs in registers: M rounds of (argmax, Plackett–Luce
normaliser over what is left, mask out), which is cheap for the sizes served (K ≤ 256, M ≤ 32;
DESIGN.md: K = 20, M = 5). `CHUNK_K == BLOCK_K` is the one-chunk kernel: scores stay in registers.

The fast (CHUNK_K, BLOCK_D, d unrolled or not, num_warps, num_stages) is chosen by measurement
on the GPU that runs it (`triton.autotune`, keyed on K, d and a coarse batch class, timed by the
GPU's clock from CUDA-graph replays so B 1 is not ranked by launch cost); `config_for` /
`chosen_configs` say what it chose (logged once per key at DEBUG). Configurations differ only in
how a row's float32 dot products are summed (rounding, ~1e-7 relative); ids, noise, masking and
the selection are the same code for all of them, and the tests run every candidate configuration
against the torch reference. The kernel writes only its outputs, so the autotuner's repeated
launches change nothing. Under `TRITON_INTERPRET=1` the autotuner cannot time anything (it
uses CUDA events), so one fixed configuration runs (`INTERPRET_CONFIG`).

Noise is `tl.rand(seed, b·K + k)` — counter-based, so `kernels.reference.philox_uniform`
reproduces the uniforms exactly on CPU.

This module imports triton; `rmm.kernels.dispatch` imports it only when the Triton backend is
chosen. Triton decides at import whether it interprets (`TRITON_INTERPRET=1` must be set before
the first `import triton`: its own `tl.*` helpers are decorated then).
"""

from __future__ import annotations

import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import interpreting
from .reference import RerankResult

__all__ = [
    "INTERPRET_CONFIG",
    "RerankConfig",
    "batch_class",
    "candidate_configs",
    "chosen_configs",
    "config_for",
    "rerank_triton",
]

log = logging.getLogger(__name__)

_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
_ONE_MINUS_EPS = 1.0 - float(torch.finfo(torch.float32).eps)
MAX_TILE = 16384  # CHUNK_K·BLOCK_D elements: beyond this the tile leaves registers for local memory
MAX_PER_THREAD = 64  # tile elements per thread (fp32 after conversion) that still fit in registers
MAX_UNROLLED_PER_THREAD = 128  # with d unrolled: a chunk's whole [CHUNK_K, d] block per thread


@dataclass(frozen=True)
class RerankConfig:
    """One launch configuration of the kernel; `chunk_k`/`block_d` are clamped to the problem."""

    chunk_k: int
    block_d: int
    num_warps: int
    num_stages: int
    unroll_d: bool = False  # d as a compile-time constant: a chunk's column blocks unrolled, loads issued together

    def __str__(self) -> str:
        return f"C{self.chunk_k}xD{self.block_d}{'u' if self.unroll_d else ''}/w{self.num_warps}s{self.num_stages}"


# Candidates the autotuner times (before clamping to BLOCK_K and d and pruning by tile size).
# Short chunks with long column blocks (long contiguous reads of each gathered row), a few warp
# and pipeline depths, d unrolled or not, and the pre-issue-38 shape (one chunk, narrow columns)
# as a floor. Measured on an H200 (triton 3.6, bf16, bank 100k rows), GPU time against the copy:
# at B 1024, K 200 the best were 16 × 256 unrolled / 8 warps (d 768) and 8 × 256 unrolled / 8 warps
# (d 1024), 1.3-1.5× the old shape; at B 64 the 16-warp 64 × 256 tile; at B 1024, K 20 4 × 256
# unrolled; no single one led everywhere, hence the tuner. Two that never led were dropped
# (4 × 256 / 2 warps, 64 × 256 unrolled / 16 warps).
_CANDIDATES: tuple[RerankConfig, ...] = (
    RerankConfig(8, 256, 4, 2),
    RerankConfig(8, 256, 4, 3),
    RerankConfig(16, 256, 4, 2),
    RerankConfig(16, 256, 8, 2),
    RerankConfig(32, 256, 8, 2),
    RerankConfig(32, 128, 4, 3),
    RerankConfig(64, 128, 8, 2),
    RerankConfig(64, 256, 16, 2),
    RerankConfig(4, 256, 4, 3, True),
    RerankConfig(8, 256, 4, 1, True),
    RerankConfig(8, 256, 4, 3, True),
    RerankConfig(8, 256, 8, 3, True),
    RerankConfig(16, 256, 4, 3, True),
    RerankConfig(16, 256, 8, 3, True),
)

# The interpreter's fixed configuration: several chunks and column blocks even at test sizes,
# so the chunked path (store, barrier, read back) is what the CPU tests exercise.
INTERPRET_CONFIG = RerankConfig(8, 32, 4, 1)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_k(k: int) -> int:
    return max(16, _next_pow2(k))


def batch_class(batch: int) -> int:
    """Coarse batch size for the tuning key: single queries, small batches, large batches."""
    return 0 if batch < 64 else 1 if batch < 512 else 2


def _legacy(block_k: int, dim: int) -> RerankConfig:
    """The configuration the kernel used before autotuning (one chunk, tile near 8K floats)."""
    block_d = max(16, min(128, _next_pow2(dim), 8192 // block_k))
    return RerankConfig(block_k, block_d, 4 if block_k <= 64 else 8, 3)


def _clamp(config: RerankConfig, block_k: int, dim: int) -> RerankConfig:
    return RerankConfig(min(config.chunk_k, block_k), max(16, min(config.block_d, _next_pow2(dim))),
                        config.num_warps, config.num_stages, config.unroll_d)


def _fits(c: RerankConfig, dim: int) -> bool:
    """Whether the configuration's registers hold: the tile, and with d unrolled the chunk's block."""
    tile, threads = c.chunk_k * c.block_d, 32 * c.num_warps
    if tile > MAX_TILE or tile > MAX_PER_THREAD * threads:
        return False
    blocks = -(-dim // c.block_d)
    return not c.unroll_d or tile * blocks <= MAX_UNROLLED_PER_THREAD * threads


def candidate_configs(k: int, dim: int) -> list[RerankConfig]:
    """Every configuration the autotuner may choose for K candidates of dimension `dim`."""
    block_k = _block_k(k)
    seen: dict[RerankConfig, None] = {}
    for config in (*_CANDIDATES, _legacy(block_k, dim)):
        c = _clamp(config, block_k, dim)
        if _fits(c, dim):
            seen.setdefault(c, None)
    if not seen:  # cannot happen with the list above; keep the autotuner's "at least one" promise
        seen[_clamp(_legacy(block_k, dim), block_k, dim)] = None
    return list(seen)


def _as_triton(config: RerankConfig, dim: int) -> triton.Config:
    return triton.Config({"CHUNK_K": config.chunk_k, "BLOCK_D": config.block_d,
                          "D_STATIC": dim if config.unroll_d else 0},
                         num_warps=config.num_warps, num_stages=config.num_stages)


def _from_triton(config: Any) -> RerankConfig:
    return RerankConfig(int(config.kwargs["CHUNK_K"]), int(config.kwargs["BLOCK_D"]),
                        int(config.num_warps), int(config.num_stages), bool(config.kwargs["D_STATIC"]))


@triton.jit
def _block_dot(q_ptr, bank_ptr, row, d0, D, safe, valid, stride_q, stride_bank, BLOCK_D: tl.constexpr):
    """Dot products of the chunk's rows with the query over columns d0 .. d0+BLOCK_D."""
    ds = d0 + tl.arange(0, BLOCK_D)
    in_d = ds < D
    q = tl.load(q_ptr + row * stride_q + ds, mask=in_d, other=0.0).to(tl.float32)
    e = tl.load(bank_ptr + safe[:, None] * stride_bank + ds[None, :],
                mask=valid[:, None] & in_d[None, :], other=0.0).to(tl.float32)
    return tl.sum(e * q[None, :], axis=1)


@triton.jit
def _chunk_scores(q_ptr, bank_ptr, ids_ptr, row, c0, K, D, stride_q, stride_bank, stride_ids,
                  CHUNK_K: tl.constexpr, BLOCK_D: tl.constexpr, D_STATIC: tl.constexpr):
    """Scores of candidates c0 .. c0+CHUNK_K of one row (padding and out-of-row slots: invalid).

    D_STATIC > 0 (== D): the column loop is unrolled at compile time, so a chunk's loads can all
    be in flight at once; 0: a run-time loop, one compiled kernel for every d."""
    ks = c0 + tl.arange(0, CHUNK_K)
    in_row = ks < K
    ids = tl.load(ids_ptr + row * stride_ids + ks, mask=in_row, other=-1)
    valid = ids >= 0
    safe = tl.where(valid, ids, 0)
    acc = tl.zeros([CHUNK_K], dtype=tl.float32)
    if D_STATIC > 0:
        for d0 in tl.static_range(0, D_STATIC, BLOCK_D):
            acc += _block_dot(q_ptr, bank_ptr, row, d0, D_STATIC, safe, valid, stride_q, stride_bank, BLOCK_D)
    else:
        for d0 in range(0, D, BLOCK_D):
            acc += _block_dot(q_ptr, bank_ptr, row, d0, D, safe, valid, stride_q, stride_bank, BLOCK_D)
    return ks, in_row, valid, acc


@triton.jit(do_not_specialize=["seed", "n_picks", "batch_class"])
def _rerank_kernel(
    q_ptr, bank_ptr, ids_ptr,  # inputs: [B, D], [N, D], [B, K] int64
    scores_ptr, noise_ptr, picks_ptr, logp_ptr,  # outputs: [B, K], [B, K], [B, M] int64, [B, M]
    K, D, n_picks, seed, tau,
    stride_q, stride_bank, stride_ids,
    batch_class,  # unused by the kernel: part of the autotuning key only
    EXPLORE: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    D_STATIC: tl.constexpr, TINY: tl.constexpr, ONE_MINUS_EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    in_row = ks < K
    neg_inf = float("-inf")

    if CHUNK_K == BLOCK_K:
        # one chunk: the row's scores stay in registers
        _, _, valid, acc = _chunk_scores(q_ptr, bank_ptr, ids_ptr, row, 0, K, D, stride_q, stride_bank,
                                         stride_ids, CHUNK_K, BLOCK_D, D_STATIC)
        scores = tl.where(valid, acc, neg_inf)
        tl.store(scores_ptr + row * K + ks, scores, mask=in_row)
    else:
        # chunks: write each chunk's scores, then read the row back for the selection
        for c0 in range(0, K, CHUNK_K):
            ks_c, in_c, valid_c, acc_c = _chunk_scores(q_ptr, bank_ptr, ids_ptr, row, c0, K, D, stride_q,
                                                       stride_bank, stride_ids, CHUNK_K, BLOCK_D, D_STATIC)
            tl.store(scores_ptr + row * K + ks_c, tl.where(valid_c, acc_c, neg_inf), mask=in_c)
        tl.debug_barrier()  # other threads of this program wrote parts of the row
        ids = tl.load(ids_ptr + row * stride_ids + ks, mask=in_row, other=-1)
        valid = ids >= 0
        # .cg: read through L2, where the stores above are visible, not a stale L1 line
        scores = tl.load(scores_ptr + row * K + ks, mask=in_row, other=neg_inf, cache_modifier=".cg")
        scores = tl.where(valid, scores, neg_inf)
        acc = tl.where(valid, scores, 0.0)
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


def _prune(configs: list, named_args: dict, **kwargs: Any) -> list:
    """Keep (clamped) configurations whose tile fits registers for this K and d."""
    k, dim = int(named_args["K"]), int(named_args["D"])
    return [_as_triton(c, dim) for c in candidate_configs(k, dim)]


def _gpu_time(kernel_call, quantiles):
    """Time a configuration by the GPU's clock: launches replayed from a CUDA graph, so a small
    kernel is not ranked by the host's launch cost (`do_bench` would time that at B 1); where
    graph capture fails, triton's `do_bench` with a short warm-up and repetition."""
    import triton.testing

    kernel_call()  # compiles; OutOfResources and the like reach the autotuner, which skips the config
    try:
        return triton.testing.do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)
    except RuntimeError as exc:
        log.debug("rerank autotune: CUDA graph timing failed (%s); timing launches instead", exc)
        return triton.testing.do_bench(kernel_call, warmup=10, rep=40, quantiles=quantiles)


def _tuned_kernel():
    options: dict[str, Any] = {"prune_configs_by": {"early_config_prune": _prune}}
    if "do_bench" in inspect.signature(triton.autotune).parameters:
        options["do_bench"] = _gpu_time
    # the list handed over is replaced per key by _prune; it only needs to be non-empty
    return triton.autotune(configs=[_as_triton(c, 0) for c in _CANDIDATES], key=["K", "D", "batch_class"],
                           **options)(_rerank_kernel)


_TUNED = None if interpreting() else _tuned_kernel()
_CHOSEN: dict[tuple[int, int, int, str], RerankConfig] = {}
_CHOSEN_LOCK = threading.Lock()
# triton's Autotuner keeps per-call state on itself (nargs while tuning, best_config after): one
# launch through it at a time, so serving threads neither break a tuning run nor read another's pick
_TUNED_LOCK = threading.Lock()


def _record(key: tuple[int, int, int, str], config: RerankConfig, how: str) -> None:
    with _CHOSEN_LOCK:
        if _CHOSEN.get(key) == config:
            return
        _CHOSEN[key] = config
    log.debug("rerank kernel config for batch class %d, K=%d, d=%d, %s: %s (%s)", *key, config, how)


def chosen_configs() -> dict[tuple[int, int, int, str], RerankConfig]:
    """Configurations launched so far, by (batch class, K, d, bank dtype): what the tuner chose."""
    with _CHOSEN_LOCK:
        return dict(_CHOSEN)


def config_for(batch: int, k: int, dim: int, dtype: torch.dtype) -> RerankConfig | None:
    """The configuration the latest autotuned (or interpreted) launch of this shape used, if any;
    launches with a forced `config` are not recorded."""
    with _CHOSEN_LOCK:
        return _CHOSEN.get((batch_class(batch), k, dim, str(dtype).removeprefix("torch.")))


def _launch(batch: int, args: tuple, consts: dict[str, Any], config: RerankConfig, dim: int) -> None:
    _rerank_kernel[(batch,)](*args, **consts, CHUNK_K=config.chunk_k, BLOCK_D=config.block_d,
                             D_STATIC=dim if config.unroll_d else 0,
                             num_warps=config.num_warps, num_stages=config.num_stages)


def rerank_triton(
    queries: Tensor, bank: Tensor, ids: Tensor, m: int, tau: float, *, explore: bool, seed: int,
    config: RerankConfig | None = None,
) -> RerankResult:
    """Launch the kernel; inputs validated by `rmm.kernels.dispatch` (contiguous rows, ids < N).

    `config` forces one configuration (tests, benchmarks of a single shape); without it the
    autotuner picks on a GPU and `INTERPRET_CONFIG` runs under the interpreter.
    """
    batch, k = ids.shape
    dim = queries.shape[1]
    device = queries.device
    scores = torch.empty((batch, k), dtype=torch.float32, device=device)
    noise = torch.empty((batch, k), dtype=torch.float32, device=device) if explore else scores
    picks = torch.empty((batch, m), dtype=torch.int64, device=device)
    logp = torch.empty((batch, m), dtype=torch.float32, device=device)
    if batch and (m or k):
        block_k = _block_k(k)
        args = (queries, bank, ids, scores, noise, picks, logp,
                k, dim, m, int(seed), float(tau),
                queries.stride(0), bank.stride(0), ids.stride(0), batch_class(batch))
        consts = {"EXPLORE": explore, "BLOCK_K": block_k, "TINY": _FLOAT32_TINY, "ONE_MINUS_EPS": _ONE_MINUS_EPS}
        key = (batch_class(batch), k, dim, str(bank.dtype).removeprefix("torch."))
        if config is None and _TUNED is not None:
            chosen = _CHOSEN.get(key)
            if chosen is None:  # this shape's first launch: the autotuner times the candidates once
                with _TUNED_LOCK:
                    _TUNED[(batch,)](*args, **consts)
                    chosen = _from_triton(_TUNED.best_config)
                _record(key, chosen, "autotuned")
            else:  # tuned before: its choice launched directly, without the autotuner's per-call Python
                _launch(batch, args, consts, chosen, dim)
        else:
            fixed = _clamp(config or INTERPRET_CONFIG, block_k, dim)
            if fixed.chunk_k & (fixed.chunk_k - 1) or fixed.block_d & (fixed.block_d - 1):
                raise ValueError(f"chunk_k and block_d must be powers of two, got {fixed}")
            _launch(batch, args, consts, fixed, dim)
            if config is None:  # a forced configuration is the caller's, not the kernel's choice
                _record(key, fixed, "interpreter")
    return RerankResult(indices=picks, scores=scores, logp=logp, noise=noise if explore else None,
                        backend="triton")
