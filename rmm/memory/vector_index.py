"""What every vector index shares: the `VectorIndex` interface, argument checks, and the file format.

Below both `rmm.memory.index` (the torch index, the factory) and `rmm.memory.faiss_index`, so
neither imports the other for these. An index file is one safetensors container (vectors or the
serialised faiss index, plus the id list and free-form string `metadata`), written atomically so a
reader never sees half a file; `rmm.memory.index.load_index` reads any backend's file.
"""

from __future__ import annotations

import inspect
import json
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from rmm.errors import CorruptFileError, DimensionMismatchError, UnknownMemoryError

__all__ = ["BACKENDS", "VectorIndex", "as_queries", "as_vectors", "check_k", "check_known_ids", "check_new_ids",
           "index_file_info", "read_index_file"]

FORMAT_VERSION = "1"
BACKENDS: tuple[str, ...] = ("torch", "faiss-flat", "faiss-ivf", "faiss-hnsw")


# --------------------------------------------------------------------------- helpers


def as_vectors(vectors: torch.Tensor | np.ndarray, n: int, dim: int) -> torch.Tensor:
    tensor = vectors if isinstance(vectors, torch.Tensor) else torch.as_tensor(np.asarray(vectors))
    if tensor.ndim != 2 or tensor.shape[0] != n:
        raise ValueError(f"expected vectors of shape [{n}, {dim}], got {tuple(tensor.shape)}")
    if tensor.shape[1] != dim:
        raise DimensionMismatchError(f"vectors have dimension {tensor.shape[1]}, the index has {dim}")
    tensor = tensor.detach().to(dtype=torch.float32)
    if not torch.isfinite(tensor).all():
        raise ValueError("vectors contain NaN or inf")
    return tensor


def as_queries(queries: torch.Tensor | np.ndarray, dim: int) -> torch.Tensor:
    tensor = queries if isinstance(queries, torch.Tensor) else torch.as_tensor(np.asarray(queries))
    if tensor.ndim == 1:
        tensor = tensor.unsqueeze(0)
    if tensor.ndim != 2:
        raise ValueError(f"queries must be [B, {dim}], got shape {tuple(tensor.shape)}")
    if tensor.shape[1] != dim:
        raise DimensionMismatchError(f"queries have dimension {tensor.shape[1]}, the index has {dim}")
    return tensor.detach().to(dtype=torch.float32)


def check_new_ids(ids: Sequence[str], existing: dict[str, Any]) -> list[str]:
    ids = list(ids)
    if len(set(ids)) != len(ids):
        raise ValueError("ids repeated within one add")
    clashes = [i for i in ids if i in existing]
    if clashes:
        raise ValueError(f"ids already in the index (remove them first): {clashes[:5]}")
    return ids


def check_known_ids(ids: Sequence[str], existing: dict[str, Any]) -> list[str]:
    ids = list(dict.fromkeys(ids))
    missing = [i for i in ids if i not in existing]
    if missing:
        raise UnknownMemoryError(f"{len(missing)} id(s) not in the index: {missing[:5]}")
    return ids


def check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be a non-negative integer, got {k!r}")
    return int(k)


def atomic_save(path: Path, tensors: dict[str, np.ndarray], header: dict[str, str]) -> None:
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=header)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_index_file(path: Path, with_tensors: bool) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"index file {path} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as fh:
            header = dict(fh.metadata() or {})
            tensors = {name: fh.get_tensor(name) for name in fh.keys()} if with_tensors else {}
    except Exception as exc:  # safetensors raises its own error types (and OSError for short files)
        raise CorruptFileError(f"index file {path} cannot be read: {exc}") from exc
    if header.get("rmm_index_format") != FORMAT_VERSION or header.get("backend") not in BACKENDS:
        raise CorruptFileError(f"{path} is not an rmm index file (format {header.get('rmm_index_format')!r})")
    return header, tensors


def index_file_info(path: str | Path) -> dict[str, Any]:
    """Backend, dim, size and user metadata of an index file without loading its vectors."""
    header, _ = read_index_file(Path(path), with_tensors=False)
    try:
        return {
            "backend": header["backend"],
            "dim": int(header["dim"]),
            "size": int(header["size"]),
            "params": json.loads(header["params"]),
            "metadata": json.loads(header["metadata"]),
        }
    except (KeyError, ValueError) as exc:
        raise CorruptFileError(f"index file {path} has a malformed header: {exc}") from exc


# --------------------------------------------------------------------------- interface


class VectorIndex(ABC):
    """Inner-product top-k over vectors keyed by string id.

    `metadata` (str → str) travels with `save`/`load`; the bank stamps it with the store
    generation the index reflects.
    """

    backend: ClassVar[str]

    def __init__(self, dim: int) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be a positive integer, got {dim!r}")
        self.dim = dim
        self.metadata: dict[str, str] = {}

    @property
    @abstractmethod
    def ids(self) -> list[str]:
        """Ids currently in the index."""

    @abstractmethod
    def add(self, ids: list[str], vectors: torch.Tensor) -> None: ...

    @abstractmethod
    def remove(self, ids: list[str]) -> None: ...

    @abstractmethod
    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, list[list[str]]]: ...

    @abstractmethod
    def vectors(self, ids: list[str]) -> torch.Tensor:
        """float32 CPU [len(ids), dim], in the order of `ids`."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, memory_id: object) -> bool: ...

    @abstractmethod
    def _payload(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Tensors and JSON-able params to save."""

    @classmethod
    @abstractmethod
    def _from_payload(
        cls, dim: int, ids: list[str], tensors: dict[str, np.ndarray], params: dict[str, Any], device: str | torch.device
    ) -> VectorIndex: ...

    def save(self, path: str | Path) -> None:
        """Write the index atomically (temp file + rename)."""
        tensors, params = self._payload()
        header = {
            "rmm_index_format": FORMAT_VERSION,
            "backend": self.backend,
            "dim": str(self.dim),
            "size": str(len(self)),
            "ids": json.dumps(self.ids),
            "params": json.dumps(params),
            "metadata": json.dumps(self.metadata),
        }
        atomic_save(Path(path), tensors, header)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "auto") -> VectorIndex:
        """Read a file of this class's backend; `CorruptFileError` (naming the file) when it cannot be
        trusted or holds another backend's index (`rmm.memory.index.load_index` reads any)."""
        if inspect.isabstract(cls):
            raise TypeError(f"{cls.__name__} is abstract: read a file with rmm.memory.index.load_index")
        path = Path(path)
        header, tensors = read_index_file(path, with_tensors=True)
        if not cls.reads(header["backend"]):
            raise CorruptFileError(f"{path} holds a {header['backend']!r} index, not a {cls.__name__}")
        try:
            dim = int(header["dim"])
            ids = json.loads(header["ids"])
            params = json.loads(header["params"])
            metadata = json.loads(header["metadata"])
            index = cls._from_payload(dim, ids, tensors, params, device)
        except CorruptFileError:
            raise
        except Exception as exc:
            raise CorruptFileError(f"index file {path} is inconsistent: {exc}") from exc
        if len(index) != int(header["size"]):
            raise CorruptFileError(f"index file {path} claims {header['size']} vectors but holds {len(index)}")
        index.metadata = {str(k): str(v) for k, v in metadata.items()}
        return index

    @classmethod
    def reads(cls, backend: str) -> bool:
        """Whether a file of `backend` is this class's (one class may serve several backend names)."""
        return backend == cls.backend
