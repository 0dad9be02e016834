"""Vector indexes over one user's memory embeddings, inner-product metric (DESIGN.md §4).

Two families behind one interface (`VectorIndex`), keyed by string memory ids:

* `TorchIndex` — exact search as one `matmul` + `topk` on a dense matrix on CPU or CUDA. The
  default: per-user banks are small (hundreds to thousands of memories), where exact search is
  both fastest and simplest. `precision="bfloat16"`/`"float16"` keeps a half-precision copy to
  scan (half the bytes: ~3x faster on a CPU once the matrix outgrows the cache) and re-scores
  the best 2k+8 exactly from the float32 rows, so ids, order and scores match float32 unless a
  true top-k row ranks below 2k+8 in half precision.
* `FaissIndex` — faiss on CPU for large banks: `flat` (exact, `IndexFlatIP`), `ivf`
  (`IndexIVFFlat`, inner product; approximate once trained) and `hnsw` (`IndexHNSWFlat` with
  `METRIC_INNER_PRODUCT`).

An index is derived state: the store keeps every embedding, so a lost or stale index file is
rebuilt, never trusted. Files are one safetensors container (vectors or the serialised faiss
index, plus the id list and free-form string `metadata` such as the store generation the index
reflects), written atomically so a reader never sees half a file.

`search` returns `(scores [B, k'], ids)` with `k' = min(k, len(index))`. Exact indexes always fill
every row; approximate ones may return fewer than `k'` ids for a query (IVF when the probed lists
hold fewer vectors), in which case that row's `ids` list is shorter and the missing scores are
`-inf`.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from rmm.device import resolve_device
from rmm.errors import CorruptFileError, DimensionMismatchError, UnknownMemoryError

__all__ = [
    "BACKENDS",
    "PRECISIONS",
    "TorchIndex",
    "VectorIndex",
    "index_file_info",
    "load_index",
    "make_index",
]

log = logging.getLogger(__name__)

_FORMAT_VERSION = "1"
BACKENDS: tuple[str, ...] = ("torch", "faiss-flat", "faiss-ivf", "faiss-hnsw")
PRECISIONS: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                                      "int8": torch.int8, "int4": torch.uint8}
INT8_DIM_MULTIPLE = 16  # torch's int8 matrix-vector kernel (`_weight_int8pack_mm`) needs d % 16 == 0 (others crash)
INT4_GROUP = 32  # int4: dimensions sharing one (scale, zero) pair; d must be a multiple
INT4_BLOCK = 64  # int4: torch's CPU layout packs rows 64 at a time, each block alone (a write repacks its blocks)
CPU_PRECISIONS = {"int8": INT8_DIM_MULTIPLE, "int4": INT4_GROUP}  # scan kernels torch has only on the CPU: d multiple


# --------------------------------------------------------------------------- helpers


def _as_vectors(vectors: torch.Tensor | np.ndarray, n: int, dim: int) -> torch.Tensor:
    tensor = vectors if isinstance(vectors, torch.Tensor) else torch.as_tensor(np.asarray(vectors))
    if tensor.ndim != 2 or tensor.shape[0] != n:
        raise ValueError(f"expected vectors of shape [{n}, {dim}], got {tuple(tensor.shape)}")
    if tensor.shape[1] != dim:
        raise DimensionMismatchError(f"vectors have dimension {tensor.shape[1]}, the index has {dim}")
    tensor = tensor.detach().to(dtype=torch.float32)
    if not torch.isfinite(tensor).all():
        raise ValueError("vectors contain NaN or inf")
    return tensor


def _as_queries(queries: torch.Tensor | np.ndarray, dim: int) -> torch.Tensor:
    tensor = queries if isinstance(queries, torch.Tensor) else torch.as_tensor(np.asarray(queries))
    if tensor.ndim == 1:
        tensor = tensor.unsqueeze(0)
    if tensor.ndim != 2:
        raise ValueError(f"queries must be [B, {dim}], got shape {tuple(tensor.shape)}")
    if tensor.shape[1] != dim:
        raise DimensionMismatchError(f"queries have dimension {tensor.shape[1]}, the index has {dim}")
    return tensor.detach().to(dtype=torch.float32)


def _check_new_ids(ids: Sequence[str], existing: dict[str, Any]) -> list[str]:
    ids = list(ids)
    if len(set(ids)) != len(ids):
        raise ValueError("ids repeated within one add")
    clashes = [i for i in ids if i in existing]
    if clashes:
        raise ValueError(f"ids already in the index (remove them first): {clashes[:5]}")
    return ids


def _check_known_ids(ids: Sequence[str], existing: dict[str, Any]) -> list[str]:
    ids = list(dict.fromkeys(ids))
    missing = [i for i in ids if i not in existing]
    if missing:
        raise UnknownMemoryError(f"{len(missing)} id(s) not in the index: {missing[:5]}")
    return ids


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be a non-negative integer, got {k!r}")
    return int(k)


def _atomic_save(path: Path, tensors: dict[str, np.ndarray], header: dict[str, str]) -> None:
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=header)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_file(path: Path, with_tensors: bool) -> tuple[dict[str, str], dict[str, np.ndarray]]:
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
    if header.get("rmm_index_format") != _FORMAT_VERSION or header.get("backend") not in BACKENDS:
        raise CorruptFileError(f"{path} is not an rmm index file (format {header.get('rmm_index_format')!r})")
    return header, tensors


def index_file_info(path: str | Path) -> dict[str, Any]:
    """Backend, dim, size and user metadata of an index file without loading its vectors."""
    header, _ = _read_file(Path(path), with_tensors=False)
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
            "rmm_index_format": _FORMAT_VERSION,
            "backend": self.backend,
            "dim": str(self.dim),
            "size": str(len(self)),
            "ids": json.dumps(self.ids),
            "params": json.dumps(params),
            "metadata": json.dumps(self.metadata),
        }
        _atomic_save(Path(path), tensors, header)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "auto") -> VectorIndex:
        """Read an index file; `CorruptFileError` (naming the file) when it cannot be trusted."""
        path = Path(path)
        header, tensors = _read_file(path, with_tensors=True)
        target = _backend_class(header["backend"])
        if not issubclass(target, cls):
            raise CorruptFileError(f"{path} holds a {header['backend']!r} index, not a {cls.__name__}")
        try:
            dim = int(header["dim"])
            ids = json.loads(header["ids"])
            params = json.loads(header["params"])
            metadata = json.loads(header["metadata"])
            index = target._from_payload(dim, ids, tensors, params, device)
        except CorruptFileError:
            raise
        except Exception as exc:
            raise CorruptFileError(f"index file {path} is inconsistent: {exc}") from exc
        if len(index) != int(header["size"]):
            raise CorruptFileError(f"index file {path} claims {header['size']} vectors but holds {len(index)}")
        index.metadata = {str(k): str(v) for k, v in metadata.items()}
        return index


# --------------------------------------------------------------------------- torch


class TorchIndex(VectorIndex):
    """Exact search: a dense [n, d] matrix on the device, `matmul` + `topk`.

    Rows live in a buffer with spare capacity (amortised O(1) append); removal moves the last row
    into the hole, so the matrix stays dense and search never has to skip deleted rows. With a
    half `precision` a second buffer in that dtype mirrors the first and is what a search scans;
    the float32 rows stay the truth (`vectors`, files, the exact re-score of the shortlist).
    `int8` (CPU only) scans rows quantized with one scale each against a bfloat16 query: half of
    float16's bytes and a faster kernel (`scripts/recall_index_precision.py`). `int4` (CPU only)
    scans 4-bit codes with a scale and zero per 32 dimensions (torch's int4 matrix-vector kernel,
    the one LLM decoding uses): a search reads 0.6x int8's bytes; one query over 32 users'
    10k-row banks took 0.69 ms against int8's 1.09 (`scripts/bench_search.py --users 32`), one
    hot bank 1.1-1.4x less. It holds more memory than int8 (the codes one per byte, for
    writes, beside the packed copy the kernel reads), rebuilt lazily, 64 rows at a time, for the
    rows a write touched; the last partial block is scored in float32.
    """

    backend = "torch"

    def __init__(self, dim: int, device: str | torch.device = "auto", precision: str = "float32") -> None:
        super().__init__(dim)
        if precision not in PRECISIONS:
            raise ValueError(f"unknown index precision {precision!r}; use one of {list(PRECISIONS)}")
        self.device = resolve_device(device)
        multiple = CPU_PRECISIONS.get(precision)
        if multiple and (self.device.type != "cpu" or dim % multiple):
            raise ValueError(f"index precision {precision!r} needs the CPU and a dimension divisible by {multiple} "
                             f"(got {self.device.type}, {dim}); use float16")
        if precision == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            raise ValueError(f"index precision 'int4' needs torch's CPU int4 kernel (torch >= 2.5), not in "
                             f"{torch.__version__}")
        self.precision = precision
        self._matrix = torch.empty((0, dim), dtype=torch.float32, device=self.device)
        self._scan: torch.Tensor | None = None if precision == "float32" else self._matrix.to(PRECISIONS[precision])
        # int8: one bfloat16 scale per row; int4: a (scale, zero) pair per group of INT4_GROUP dimensions
        scale_shape = (0, dim // INT4_GROUP, 2) if precision == "int4" else (0,)
        self._scan_scale = torch.empty(scale_shape, dtype=torch.bfloat16, device=self.device)
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None  # int4: (packed codes, scales) of whole blocks
        self._stale_from = 0  # int4: the first row whose block changed since `_packed` was built
        self._ids: list[str] = []
        self._rows: dict[str, int] = {}

    @property
    def ids(self) -> list[str]:
        return list(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, memory_id: object) -> bool:
        return memory_id in self._rows

    def add(self, ids: list[str], vectors: torch.Tensor) -> None:
        ids = _check_new_ids(ids, self._rows)
        tensor = _as_vectors(vectors, len(ids), self.dim).to(self.device)
        n, need = len(self._ids), len(self._ids) + len(ids)
        if need > self._matrix.shape[0]:
            rows = max(need, 2 * self._matrix.shape[0], 64)
            grown = torch.empty((rows, self.dim), dtype=torch.float32, device=self.device)
            grown[:n] = self._matrix[:n]
            self._matrix = grown
            if self._scan is not None:
                scan = torch.empty((rows, self.dim), dtype=self._scan.dtype, device=self.device)
                scan[:n] = self._scan[:n]
                self._scan = scan
            if self.precision in CPU_PRECISIONS:
                scale = torch.empty((rows, *self._scan_scale.shape[1:]), dtype=torch.bfloat16, device=self.device)
                scale[:n] = self._scan_scale[:n]
                self._scan_scale = scale
        self._matrix[n:need] = tensor
        if self.precision == "int8":
            self._scan_scale[n:need], self._scan[n:need] = _int8_rows(tensor)
        elif self.precision == "int4":
            self._scan_scale[n:need], self._scan[n:need] = _int4_rows(tensor)
        elif self._scan is not None:
            self._scan[n:need] = tensor.to(self._scan.dtype)
        self._stale_from = min(self._stale_from, n)
        for offset, memory_id in enumerate(ids):
            self._rows[memory_id] = n + offset
        self._ids.extend(ids)

    def remove(self, ids: list[str]) -> None:
        for memory_id in _check_known_ids(ids, self._rows):
            row = self._rows.pop(memory_id)
            last = len(self._ids) - 1
            if row != last:
                moved = self._ids[last]
                self._matrix[row] = self._matrix[last]
                if self._scan is not None:
                    self._scan[row] = self._scan[last]
                if self.precision in CPU_PRECISIONS:
                    self._scan_scale[row] = self._scan_scale[last]
                self._ids[row] = moved
                self._rows[moved] = row
                self._stale_from = min(self._stale_from, row)
            self._ids.pop()

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, list[list[str]]]:
        q = _as_queries(queries, self.dim)
        n = len(self._ids)
        k = min(_check_k(k), n)
        if k == 0:
            return torch.zeros((q.shape[0], 0), dtype=torch.float32), [[] for _ in range(q.shape[0])]
        q = q.to(self.device)
        if self._scan is None:
            matrix = self._matrix[:n]
            # A few query rows on the CPU: [n, d] @ [d, B] streams the matrix once, while MKL's kernel
            # for [B, d] @ [d, n] took 2-5x longer for B = 2..8 on 10k x 384 rows (same ids, scores
            # within float rounding); one row is a matrix-vector product either way.
            scores = (matrix @ q.T).T if 1 < q.shape[0] and q.device.type == "cpu" else q @ matrix.T
            top = torch.topk(scores, k, dim=1, sorted=True)
            values, rows = top.values, top.indices
        else:  # shortlist in half precision or int8, then the exact float32 scores of the shortlist
            wide = min(n, 2 * k + 8)
            if self.precision == "int8":
                rough = torch._weight_int8pack_mm(q.to(torch.bfloat16), self._scan[:n], self._scan_scale[:n])
            elif self.precision == "int4":
                rough = self._int4_scores(q, n)
            else:
                rough = q.to(self._scan.dtype) @ self._scan[:n].T
            shortlist = torch.topk(rough, wide, dim=1, sorted=False).indices
            exact = torch.einsum("bd,bwd->bw", q, self._matrix[shortlist])
            top = torch.topk(exact, k, dim=1, sorted=True)
            values, rows = top.values, shortlist.gather(1, top.indices)
        return values.float().cpu(), [[self._ids[r] for r in row] for row in rows.cpu().tolist()]

    def _int4_scores(self, q: torch.Tensor, n: int) -> torch.Tensor:
        """Approximate scores of rows [0, n): whole 64-row blocks by the int4 kernel (their packed
        layout brought up to date first), the last partial block in float32."""
        whole = n // INT4_BLOCK * INT4_BLOCK
        parts = []
        if whole:
            codes, scales = self._int4_packed(n, whole)
            parts.append(torch.ops.aten._weight_int4pack_mm_for_cpu(q.to(torch.bfloat16), codes, INT4_GROUP, scales)
                         .float())
        if whole < n:
            parts.append(q @ self._matrix[whole:n].T)
        return torch.cat(parts, dim=1)

    def _int4_packed(self, n: int, whole: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's (packed codes, [groups, rows, 2] scales) of rows [0, whole), repacking only
        the 64-row blocks from the first one a write touched since the last search."""
        if self._packed is not None and self._packed[0].shape[0] == whole and self._stale_from >= whole:
            return self._packed
        codes = self._packed[0] if self._packed is not None else self._scan[:0]
        kept = min(self._stale_from, whole, codes.shape[0]) // INT4_BLOCK * INT4_BLOCK
        if kept < whole:
            fresh = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self._scan[kept:whole].to(torch.int32), 1)
            codes = torch.cat([codes[:kept], fresh]) if kept else fresh
        else:
            codes = codes[:whole]
        self._packed = codes, self._scan_scale[:whole].transpose(0, 1).contiguous()
        self._stale_from = n
        return self._packed

    def vectors(self, ids: list[str]) -> torch.Tensor:
        ids = list(ids)
        missing = [i for i in ids if i not in self._rows]
        if missing:
            raise UnknownMemoryError(f"{len(missing)} id(s) not in the index: {missing[:5]}")
        if not ids:
            return torch.zeros((0, self.dim), dtype=torch.float32)
        rows = torch.tensor([self._rows[i] for i in ids], dtype=torch.long, device=self.device)
        return self._matrix.index_select(0, rows).cpu()

    def _payload(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        params = {} if self.precision == "float32" else {"precision": self.precision}
        return {"vectors": self._matrix[: len(self._ids)].cpu().numpy()}, params

    @classmethod
    def _from_payload(
        cls, dim: int, ids: list[str], tensors: dict[str, np.ndarray], params: dict[str, Any], device: str | torch.device
    ) -> TorchIndex:
        index = cls(dim, device=device, precision=str(params.get("precision", "float32")))
        index.add(ids, torch.from_numpy(np.ascontiguousarray(tensors["vectors"], dtype=np.float32)))
        return index


def _int4_rows(vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bfloat16 [rows, groups, 2] scale and zero, uint8 codes 0-15 [rows, d]): each group of
    INT4_GROUP values spans its min to max in 15 steps; the kernel reads (code - 8) * scale + zero."""
    rows, dim = vectors.shape
    groups = vectors.reshape(rows, dim // INT4_GROUP, INT4_GROUP)
    low = groups.amin(dim=-1)
    scale = ((groups.amax(dim=-1) - low).clamp(min=1e-12) / 15.0).to(torch.bfloat16)
    zero = (low + 8 * scale.float()).to(torch.bfloat16)
    step = scale.float()[..., None]  # the rounded scale and zero the kernel reads, code 0 at zero - 8 * scale
    codes = torch.round((groups - (zero.float()[..., None] - 8 * step)) / step)
    return torch.stack([scale, zero], dim=-1), codes.clamp(0, 15).to(torch.uint8).reshape(rows, dim)


def _int8_rows(vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bfloat16 scale per row, int8 rows): each row over its largest magnitude, symmetric ±127,
    quantized with the bfloat16 scale the scan multiplies by."""
    scale = (vectors.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(torch.bfloat16)
    return scale, torch.round(vectors / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)


# --------------------------------------------------------------------------- factory

def _backend_class(backend: str) -> type[VectorIndex]:
    """The class that reads a file of `backend` (faiss is imported only when a faiss file is read)."""
    if backend == "torch":
        return TorchIndex
    from rmm.memory.faiss_index import FaissIndex

    return FaissIndex


def __getattr__(name: str) -> Any:
    """`FaissIndex` lives in `rmm.memory.faiss_index`; this name stays importable from here."""
    if name == "FaissIndex":
        from rmm.memory.faiss_index import FaissIndex

        return FaissIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_index(backend: str, dim: int, device: str | torch.device = "auto", **options: Any) -> VectorIndex:
    """A new empty index: `torch` (exact, CPU/CUDA) or `faiss-flat` / `faiss-ivf` / `faiss-hnsw`.

    `options` go to `FaissIndex` (nprobe, nlist, ef_search, hnsw_m, ...); torch takes `precision`.
    """
    if backend == "torch":
        unknown = sorted(set(options) - {"precision"})
        if unknown:
            raise ValueError(f"the torch index takes no options but 'precision', got {unknown}")
        return TorchIndex(dim, device=device, **options)
    if backend in ("faiss-flat", "faiss-ivf", "faiss-hnsw"):
        from rmm.memory.faiss_index import FaissIndex

        return FaissIndex(dim, backend.removeprefix("faiss-"), device=device, **options)
    raise ValueError(f"unknown index backend {backend!r}; use one of {BACKENDS}")


def load_index(path: str | Path, device: str | torch.device = "auto") -> VectorIndex:
    """Load any index file (`VectorIndex.load`)."""
    return VectorIndex.load(path, device=device)
