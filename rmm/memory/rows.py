"""Checks both stores apply before a write, so SQLite and PostgreSQL refuse the same bad input alike."""

from __future__ import annotations

import numpy as np
import torch

from rmm.errors import RmmError
from rmm.types import Memory

__all__ = ["DuplicateMemoryError", "as_matrix", "check_memory", "duplicate_keys"]


class DuplicateMemoryError(RmmError, ValueError):
    """A memory id that already exists for that user (the store never silently overwrites)."""


def check_memory(memory: Memory) -> Memory:
    """A `Memory` with a non-empty id and user id, else `TypeError` / `ValueError`."""
    if not isinstance(memory, Memory):
        raise TypeError(f"expected a Memory, got {type(memory).__name__}")
    if not memory.id or not memory.user_id:
        raise ValueError(f"memory needs a non-empty id and user_id, got id={memory.id!r} user_id={memory.user_id!r}")
    return memory


def duplicate_keys(memories: list[Memory]) -> None:
    """Refuse one add that names the same (user, id) twice."""
    keys = [(m.user_id, m.id) for m in memories]
    if len(set(keys)) != len(keys):
        dupes = sorted({f"{u}/{i}" for (u, i) in keys if keys.count((u, i)) > 1})
        raise DuplicateMemoryError(f"memory ids repeated within one add: {dupes[:5]}")


def as_matrix(embeddings: torch.Tensor | np.ndarray, n: int) -> np.ndarray:
    """float32 C-contiguous [n, d], finite, else `ValueError`."""
    array = embeddings.detach().cpu().float().numpy() if isinstance(embeddings, torch.Tensor) else np.asarray(embeddings, dtype=np.float32)
    if array.ndim != 2 or array.shape[0] != n:
        raise ValueError(f"expected embeddings of shape [{n}, d], got {tuple(array.shape)}")
    if not np.isfinite(array).all():
        raise ValueError("embeddings contain NaN or inf")
    return np.ascontiguousarray(array, dtype=np.float32)
