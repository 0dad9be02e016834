"""The one entry point the reranker calls: `rerank(...)` picks the Triton kernel or the torch reference.

`backend="auto"` takes Triton when the tensors are on CUDA, triton imports and the sizes fit the
kernel (K ≤ 256, M ≤ 32); everything else — CPU, no triton, bigger sizes — gets the torch
reference, so every caller has a path that runs anywhere. `RMM_KERNEL_BACKEND=torch|triton`
overrides "auto" (an operator's escape hatch when a kernel misbehaves on some GPU).

Masking: `mask [B, K]` (True = may be picked) removes candidates before the Gumbel top-M. A masked
slot is turned into padding (id -1), which both backends already score −∞ and never read from the
bank: it is never picked and is in no Plackett–Luce normaliser, so `logp` is the log-likelihood of
a valid sample over the unmasked candidates. The Triton kernel needs no change for it.

Randomness: with `seed` both backends draw the same counter-based Philox uniforms. Without it,
the torch backend uses `generator` (or the global RNG) exactly like `rmm.policy.sampling`, and the
Triton backend draws its seed from that generator — repeatable for a seeded generator, though
not the same picks as on CPU.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch import Tensor

from rmm.errors import DimensionMismatchError

from .reference import RerankResult, rerank_reference

__all__ = ["BACKENDS", "MAX_K", "MAX_M", "interpreting", "rerank", "resolve_backend", "triton_available"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")
MAX_K = 256  # the kernel keeps a row's K scores and a [K, BLOCK_D] tile in registers
MAX_M = 32
_SEED_RANGE = 2**62


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`, read by triton at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def _triton_import_error() -> str | None:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_available() -> bool:
    """Whether `import triton` works here (a CUDA device is a separate question)."""
    return _triton_import_error() is None


def resolve_backend(backend: str, device: torch.device, k: int, m: int) -> str:
    """The backend that will run: "torch" or "triton"; raises when "triton" cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; use one of {BACKENDS}")
    if backend == "auto":
        override = os.environ.get("RMM_KERNEL_BACKEND", "").strip().lower()
        if override in ("torch", "triton"):
            backend = override
        elif override not in ("", "auto"):
            raise ValueError(f"RMM_KERNEL_BACKEND={override!r}; use torch, triton or auto")
    if backend == "torch":
        return "torch"
    fits = k <= MAX_K and m <= MAX_M
    runnable = device.type == "cuda" or interpreting()
    if backend == "auto":
        if device.type == "cuda" and fits and triton_available():
            return "triton"
        if device.type == "cuda":
            log.debug("rerank on torch: triton=%s, K=%d (max %d), M=%d (max %d)",
                      _triton_import_error() or "ok", k, MAX_K, m, MAX_M)
        return "torch"
    # backend == "triton": asked for explicitly, so say why it cannot run instead of falling back
    if not triton_available():
        raise RuntimeError(f"backend='triton' but triton does not import ({_triton_import_error()}); "
                           "pip install triton, or use backend='torch'")
    if not runnable:
        raise RuntimeError(f"backend='triton' needs CUDA tensors (got {device}) or TRITON_INTERPRET=1")
    if not fits:
        raise ValueError(f"the Triton kernel handles K <= {MAX_K} and M <= {MAX_M}, got K={k}, M={m}; "
                         "use backend='torch' or 'auto'")
    return "triton"


def _check_mask(mask: Tensor, ids: Tensor) -> None:
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool (True = may be picked), got {mask.dtype}")
    if mask.shape != ids.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != ids shape {tuple(ids.shape)}")
    if mask.device != ids.device:
        raise ValueError(f"mask is on {mask.device}, ids on {ids.device}")


def _check(queries: Tensor, bank: Tensor, ids: Tensor, m: int, tau: float) -> None:
    if queries.ndim != 2 or bank.ndim != 2 or ids.ndim != 2:
        raise ValueError(f"expected queries [B, d], bank [N, d], ids [B, K]; got shapes "
                         f"{tuple(queries.shape)}, {tuple(bank.shape)}, {tuple(ids.shape)}")
    if queries.shape[1] != bank.shape[1]:
        raise DimensionMismatchError(f"queries have dimension {queries.shape[1]}, the bank {bank.shape[1]}")
    if ids.shape[0] != queries.shape[0]:
        raise ValueError(f"{ids.shape[0]} rows of ids for {queries.shape[0]} queries")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must be int64 (or int32), got {ids.dtype}")
    if not queries.is_floating_point() or not bank.is_floating_point():
        raise TypeError(f"queries and bank must be floating point, got {queries.dtype} and {bank.dtype}")
    if len({queries.device, bank.device, ids.device}) != 1:
        raise ValueError(f"queries, bank and ids must share a device, got "
                         f"{queries.device}, {bank.device}, {ids.device}")
    if m < 0:
        raise ValueError(f"m must be >= 0, got {m}")
    if not tau > 0:
        raise ValueError(f"temperature tau must be > 0, got {tau}")
    if ids.numel():
        low, high = (int(v) for v in torch.aminmax(ids))  # one reduction, one device sync
        if low < -1 or high >= bank.shape[0]:
            raise IndexError(f"candidate ids must be in [-1, {bank.shape[0]}) (-1 = padding); "
                             f"got min {low}, max {high}")


def rerank(
    queries: Tensor,
    bank: Tensor,
    ids: Tensor,
    m: int,
    tau: float = 0.5,
    seed: int | None = None,
    explore: bool = False,
    backend: str = "auto",
    generator: torch.Generator | None = None,
    mask: Tensor | None = None,
) -> RerankResult:
    """Score candidates, pick top-M (Gumbel-sampled when `explore`), return picks with log π.

    `queries [B, d]` are already transformed by the reranker (`q @ A`); `bank [N, d]` holds the
    embeddings `ids [B, K]` point into (-1 = padding). Picks are positions into each row's K
    candidates, `[B, m]`, -1 once a row runs out; `logp` is the Plackett–Luce log-probability
    of each pick under logits `s/τ` (also reported for greedy picks, where it is informative
    only). Greedy mode ranks by `s` itself. `mask [B, K]` (bool, True = may be picked) excludes
    candidates: they score −∞ like padding, so `logp` is Plackett–Luce over what is left.
    """
    _check(queries, bank, ids, m, tau)
    ids = ids.to(torch.int64)
    if mask is not None:
        _check_mask(mask, ids)
        ids = ids.masked_fill(~mask, -1)
    k = ids.shape[1]
    chosen = resolve_backend(backend, queries.device, k, m)
    if chosen == "torch":
        return rerank_reference(queries, bank, ids, m, tau, explore=explore, seed=seed, generator=generator)
    from .triton_rerank import rerank_triton

    if explore and seed is None:
        draw_device = generator.device if generator is not None else "cpu"
        seed = int(torch.randint(0, _SEED_RANGE, (), generator=generator, device=draw_device))
    return rerank_triton(_rows_contiguous(queries), _rows_contiguous(bank), ids.contiguous(), m, tau,
                         explore=explore, seed=0 if seed is None else seed)


def _rows_contiguous(t: Tensor) -> Tensor:
    """The kernel needs unit stride along d only; a big bank with another row stride is not copied."""
    return t if t.stride(1) == 1 else t.contiguous()
