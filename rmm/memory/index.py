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
import math
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
    "FaissIndex",
    "TorchIndex",
    "VectorIndex",
    "index_file_info",
    "load_index",
    "make_index",
]

log = logging.getLogger(__name__)

_FORMAT_VERSION = "1"
BACKENDS: tuple[str, ...] = ("torch", "faiss-flat", "faiss-ivf", "faiss-hnsw")
PRECISIONS: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
        target = _BACKEND_CLASSES[header["backend"]]
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
    """

    backend = "torch"

    def __init__(self, dim: int, device: str | torch.device = "auto", precision: str = "float32") -> None:
        super().__init__(dim)
        if precision not in PRECISIONS:
            raise ValueError(f"unknown index precision {precision!r}; use one of {list(PRECISIONS)}")
        self.device = resolve_device(device)
        self.precision = precision
        self._matrix = torch.empty((0, dim), dtype=torch.float32, device=self.device)
        self._scan: torch.Tensor | None = None if precision == "float32" else self._matrix.to(PRECISIONS[precision])
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
        self._matrix[n:need] = tensor
        if self._scan is not None:
            self._scan[n:need] = tensor.to(self._scan.dtype)
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
                self._ids[row] = moved
                self._rows[moved] = row
            self._ids.pop()

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, list[list[str]]]:
        q = _as_queries(queries, self.dim)
        n = len(self._ids)
        k = min(_check_k(k), n)
        if k == 0:
            return torch.zeros((q.shape[0], 0), dtype=torch.float32), [[] for _ in range(q.shape[0])]
        q = q.to(self.device)
        if self._scan is None:
            top = torch.topk(q @ self._matrix[:n].T, k, dim=1, sorted=True)
            values, rows = top.values, top.indices
        else:  # shortlist in half precision, then the exact float32 scores of the shortlist
            wide = min(n, 2 * k + 8)
            shortlist = torch.topk(q.to(self._scan.dtype) @ self._scan[:n].T, wide, dim=1, sorted=False).indices
            exact = torch.einsum("bd,bwd->bw", q, self._matrix[shortlist])
            top = torch.topk(exact, k, dim=1, sorted=True)
            values, rows = top.values, shortlist.gather(1, top.indices)
        return values.float().cpu(), [[self._ids[r] for r in row] for row in rows.cpu().tolist()]

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


# --------------------------------------------------------------------------- faiss


class FaissIndex(VectorIndex):
    """faiss on CPU (inner product), with our own string-id ↔ int64-label map.

    * ``flat``: `IndexIDMap2(IndexFlatIP)` — exact; removal is native.
    * ``ivf``: `IndexIVFFlat` over an `IndexFlatIP` quantizer with a hashtable direct map (so
      vectors can be read back and removed by label). IVF needs training: below
      `train_threshold` vectors it searches a flat index (exact; logged once), at the threshold it
      trains k-means on a random subsample (`train_per_list` × `nlist` vectors, nlist default
      √n) and moves everything over; it retrains when the index outgrows `retrain_factor` × its
      training size. `nprobe` lists are scanned per query.
    * ``hnsw``: `IDMap2(IndexHNSWFlat(M, METRIC_INNER_PRODUCT))`, `ef_construction` at build,
      `ef_search` per query (raised to k when smaller). HNSW cannot delete: removed labels are
      masked out of every search by an `IDSelector`, and once masked vectors exceed
      `rebuild_fraction` of the graph it is rebuilt from the live vectors.

    GPU: when `device` is CUDA and the faiss build has GPUs (`faiss.get_num_gpus() > 0`), a flat
    index gets a GPU replica (`faiss.index_cpu_to_gpu`) used for search; the CPU index stays the
    authority for writes, `vectors` and `save`, and the replica is re-made lazily after writes.
    With faiss-cpu (our machines) this path is inactive and cannot be tested here.
    """

    backend = "faiss"  # refined per kind in __init__ / BACKENDS
    KINDS: ClassVar[tuple[str, ...]] = ("flat", "ivf", "hnsw")

    def __init__(
        self,
        dim: int,
        kind: str = "flat",
        *,
        device: str | torch.device = "cpu",
        nlist: int | None = None,
        nprobe: int = 16,
        train_threshold: int = 10_000,
        train_per_list: int = 64,
        retrain_factor: float = 8.0,
        hnsw_m: int = 32,
        ef_construction: int = 40,
        ef_search: int = 64,
        rebuild_fraction: float = 0.25,
        seed: int = 1234,
    ) -> None:
        super().__init__(dim)
        import faiss

        if kind not in self.KINDS:
            raise ValueError(f"unknown faiss index kind {kind!r}; use one of {self.KINDS}")
        if nlist is not None and nlist < 1:
            raise ValueError(f"nlist must be >= 1, got {nlist}")
        if nprobe < 1 or hnsw_m < 2 or ef_search < 1 or ef_construction < 1:
            raise ValueError("nprobe, ef_search and ef_construction must be >= 1 and hnsw_m >= 2")
        self._faiss = faiss
        self.kind = kind
        self.backend = f"faiss-{kind}"  # type: ignore[misc]
        self.params: dict[str, Any] = {
            "nlist": nlist,
            "nprobe": nprobe,
            "train_threshold": max(train_threshold, nlist or 1),
            "train_per_list": train_per_list,
            "retrain_factor": retrain_factor,
            "hnsw_m": hnsw_m,
            "ef_construction": ef_construction,
            "ef_search": ef_search,
            "rebuild_fraction": rebuild_fraction,
            "seed": seed,
        }
        self._labels: dict[str, int] = {}
        self._ids_of: dict[int, str] = {}
        self._next_label = 0
        self._masked: set[int] = set()
        self._selector: Any = None  # cached IDSelector for the masked labels (HNSW)
        self._trained_size = 0  # IVF: number of vectors the centroids were trained on (0 = untrained)
        self._warned_untrained = False
        self._index = self._new_base_index()
        self._gpu_resources: Any = None
        self._gpu_index: Any = None
        self._gpu_dirty = True
        self.device = resolve_device(device)
        self._use_gpu = False
        if self.device.type == "cuda":
            if kind == "flat" and faiss.get_num_gpus() > 0:
                self._use_gpu = True
            else:
                log.debug("faiss-%s runs on CPU (faiss GPUs: %d; GPU replicas only for flat)", kind, faiss.get_num_gpus())

    # -------------------------------------------------------------- construction

    def _new_base_index(self) -> Any:
        faiss = self._faiss
        if self.kind == "hnsw":
            hnsw = faiss.IndexHNSWFlat(self.dim, self.params["hnsw_m"], faiss.METRIC_INNER_PRODUCT)
            hnsw.hnsw.efConstruction = self.params["ef_construction"]
            return faiss.IndexIDMap2(hnsw)
        return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))  # flat, and ivf before training

    def _train_ivf(self, labels: np.ndarray, data: np.ndarray) -> None:
        """Train IVF centroids on a subsample of `data` and make it the index (replaces any)."""
        faiss = self._faiss
        n = data.shape[0]
        nlist = self.params["nlist"] or max(1, int(round(math.sqrt(n))))
        nlist = min(nlist, n)
        sample = min(n, max(nlist, self.params["train_per_list"] * nlist))
        rng = np.random.default_rng(self.params["seed"])
        train = data if sample == n else data[np.sort(rng.choice(n, size=sample, replace=False))]
        quantizer = faiss.IndexFlatIP(self.dim)
        ivf = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.cp.seed = self.params["seed"]
        ivf.train(np.ascontiguousarray(train))
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        ivf.add_with_ids(np.ascontiguousarray(data), labels)
        self._index = ivf
        self._trained_size = n
        log.info("faiss-ivf trained: %d lists on %d of %d vectors", nlist, train.shape[0], n)

    def _all_live(self) -> tuple[np.ndarray, np.ndarray]:
        labels = np.fromiter(self._labels.values(), dtype=np.int64, count=len(self._labels))
        if labels.size == 0:
            return labels, np.zeros((0, self.dim), dtype=np.float32)
        return labels, self._reconstruct(labels)

    def _reconstruct(self, labels: np.ndarray) -> np.ndarray:
        return np.asarray(self._index.reconstruct_batch(labels), dtype=np.float32).reshape(len(labels), self.dim)

    # -------------------------------------------------------------- interface

    @property
    def ids(self) -> list[str]:
        return list(self._labels)

    def __len__(self) -> int:
        return len(self._labels)

    def __contains__(self, memory_id: object) -> bool:
        return memory_id in self._labels

    @property
    def nlist(self) -> int | None:
        """IVF only: number of inverted lists once trained, else None."""
        return int(self._index.nlist) if self.kind == "ivf" and self.is_trained_ivf else None

    @property
    def is_trained_ivf(self) -> bool:
        """IVF only: whether searches use trained inverted lists (else the exact flat fallback)."""
        return self._trained_size > 0

    def add(self, ids: list[str], vectors: torch.Tensor) -> None:
        ids = _check_new_ids(ids, self._labels)
        data = np.ascontiguousarray(_as_vectors(vectors, len(ids), self.dim).cpu().numpy())
        if not ids:
            return
        labels = np.arange(self._next_label, self._next_label + len(ids), dtype=np.int64)
        total = len(self._labels) + len(ids)
        if self.kind == "ivf" and (
            (not self.is_trained_ivf and total >= self.params["train_threshold"])
            or (self.is_trained_ivf and total > self.params["retrain_factor"] * self._trained_size)
        ):
            old_labels, old_data = self._all_live()
            self._train_ivf(np.concatenate([old_labels, labels]), np.concatenate([old_data, data]))
        else:
            if self.kind == "ivf" and not self.is_trained_ivf and not self._warned_untrained:
                log.info(
                    "faiss-ivf has %d vectors (< train_threshold %d): searching exactly with a flat index until then",
                    total, self.params["train_threshold"],
                )
                self._warned_untrained = True
            self._index.add_with_ids(data, labels)
        self._next_label += len(ids)
        for memory_id, label in zip(ids, labels.tolist()):
            self._labels[memory_id] = label
            self._ids_of[label] = memory_id
        self._gpu_dirty = True

    def remove(self, ids: list[str]) -> None:
        ids = _check_known_ids(ids, self._labels)
        if not ids:
            return
        labels = np.array([self._labels[i] for i in ids], dtype=np.int64)
        if self.kind == "hnsw":
            self._masked.update(labels.tolist())
            self._selector = None
        else:
            selector = self._faiss.IDSelectorArray(len(labels), self._faiss.swig_ptr(labels))
            removed = self._index.remove_ids(selector)
            if removed != len(labels):
                raise RuntimeError(f"faiss removed {removed} of {len(labels)} vectors; the index is inconsistent")
        for memory_id, label in zip(ids, labels.tolist()):
            del self._labels[memory_id]
            del self._ids_of[label]
        if self.kind == "hnsw" and len(self._masked) > self.params["rebuild_fraction"] * max(1, self._index.ntotal):
            self._rebuild_hnsw()
        self._gpu_dirty = True

    def _rebuild_hnsw(self) -> None:
        live_labels, data = self._all_live()
        log.info("faiss-hnsw: rebuilding the graph from %d live vectors (%d masked)", len(live_labels), len(self._masked))
        self._index = self._new_base_index()
        if len(live_labels):
            self._index.add_with_ids(data, live_labels)
        self._masked.clear()
        self._selector = None

    def _search_params(self, k: int) -> Any:
        faiss = self._faiss
        if self.kind == "hnsw":
            if self._masked and self._selector is None:
                masked = np.fromiter(self._masked, dtype=np.int64, count=len(self._masked))
                batch = faiss.IDSelectorBatch(masked)
                self._selector = (faiss.IDSelectorNot(batch), batch)  # keep `batch` alive with its wrapper
            sel = None if self._selector is None else self._selector[0]
            ef = max(self.params["ef_search"], k)
            return faiss.SearchParametersHNSW(sel=sel, efSearch=ef) if sel is not None else faiss.SearchParametersHNSW(efSearch=ef)
        if self.kind == "ivf" and self.is_trained_ivf:
            return faiss.SearchParametersIVF(nprobe=min(self.params["nprobe"], self._index.nlist))
        return None

    def _searcher(self) -> Any:
        if not self._use_gpu:
            return self._index
        if self._gpu_dirty or self._gpu_index is None:
            try:
                faiss = self._faiss
                if self._gpu_resources is None:
                    self._gpu_resources = faiss.StandardGpuResources()
                device_id = self.device.index or 0
                self._gpu_index = faiss.index_cpu_to_gpu(self._gpu_resources, device_id, self._index)
                self._gpu_dirty = False
            except Exception as exc:  # a faiss build without this GPU path: stay correct on CPU
                log.warning("faiss GPU replica failed (%s); searching on CPU", exc)
                self._use_gpu = False
                return self._index
        return self._gpu_index

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, list[list[str]]]:
        q = np.ascontiguousarray(_as_queries(queries, self.dim).cpu().numpy())
        k = min(_check_k(k), len(self._labels))
        if k == 0:
            return torch.zeros((q.shape[0], 0), dtype=torch.float32), [[] for _ in range(q.shape[0])]
        params = self._search_params(k)
        index = self._searcher()
        scores, labels = index.search(q, k, params=params) if params is not None else index.search(q, k)
        ids_of = self._ids_of
        out_ids = [[ids_of[int(label)] for label in row if label >= 0] for row in labels]
        scores = np.where(labels >= 0, scores, -np.inf).astype(np.float32)
        return torch.from_numpy(scores), out_ids

    def vectors(self, ids: list[str]) -> torch.Tensor:
        ids = list(ids)
        missing = [i for i in ids if i not in self._labels]
        if missing:
            raise UnknownMemoryError(f"{len(missing)} id(s) not in the index: {missing[:5]}")
        if not ids:
            return torch.zeros((0, self.dim), dtype=torch.float32)
        return torch.from_numpy(self._reconstruct(np.array([self._labels[i] for i in ids], dtype=np.int64)))

    # -------------------------------------------------------------- persistence

    def _payload(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        blob = self._faiss.serialize_index(self._index)
        tensors = {
            "faiss": np.asarray(blob, dtype=np.uint8),
            "labels": np.fromiter(self._labels.values(), dtype=np.int64, count=len(self._labels)),
            "masked": np.fromiter(self._masked, dtype=np.int64, count=len(self._masked)),
        }
        state = {
            "kind": self.kind,
            "options": self.params,
            "next_label": self._next_label,
            "trained_size": self._trained_size,
        }
        return tensors, state

    @classmethod
    def _from_payload(
        cls, dim: int, ids: list[str], tensors: dict[str, np.ndarray], params: dict[str, Any], device: str | torch.device
    ) -> FaissIndex:
        index = cls(dim, params["kind"], device=device, **params["options"])
        faiss_index = index._faiss.deserialize_index(np.ascontiguousarray(tensors["faiss"], dtype=np.uint8))
        labels = tensors["labels"].astype(np.int64).tolist()
        if len(labels) != len(ids) or faiss_index.d != dim:
            raise CorruptFileError("faiss index and id list disagree")
        masked = set(tensors["masked"].astype(np.int64).tolist())
        if faiss_index.ntotal != len(labels) + len(masked):
            raise CorruptFileError(f"faiss index holds {faiss_index.ntotal} vectors, the id list {len(labels)} (+{len(masked)} masked)")
        index._index = faiss_index
        index._labels = dict(zip(ids, labels))
        index._ids_of = dict(zip(labels, ids))
        index._masked = masked
        index._next_label = int(params["next_label"])
        index._trained_size = int(params["trained_size"])
        return index


# --------------------------------------------------------------------------- factory

_BACKEND_CLASSES: dict[str, type[VectorIndex]] = {
    "torch": TorchIndex,
    "faiss-flat": FaissIndex,
    "faiss-ivf": FaissIndex,
    "faiss-hnsw": FaissIndex,
}


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
        return FaissIndex(dim, backend.removeprefix("faiss-"), device=device, **options)
    raise ValueError(f"unknown index backend {backend!r}; use one of {BACKENDS}")


def load_index(path: str | Path, device: str | torch.device = "auto") -> VectorIndex:
    """Load any index file (`VectorIndex.load`)."""
    return VectorIndex.load(path, device=device)
