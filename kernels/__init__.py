"""GPU kernels with a torch reference for each (installed as `rmm.kernels`).

Callers use `rerank` from `rmm.kernels.dispatch`: the Triton kernel on CUDA, the exact torch
reference everywhere else (DESIGN.md §2, §4).
"""

from .dispatch import BACKENDS, rerank, resolve_backend, triton_available
from .reference import RerankResult, philox_uniform, rerank_reference

__all__ = [
    "BACKENDS",
    "RerankResult",
    "philox_uniform",
    "rerank",
    "rerank_reference",
    "resolve_backend",
    "triton_available",
]
