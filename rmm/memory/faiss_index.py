"""faiss indexes on CPU for large banks, behind `rmm.memory.vector_index.VectorIndex`: `flat` (exact),
`ivf` (approximate once trained) and `hnsw`, with a string-id ↔ int64-label map of our own.

Kept apart from the exact torch index so the default path never imports faiss.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import numpy as np
import torch

from rmm.device import resolve_device
from rmm.errors import CorruptFileError, UnknownMemoryError
from rmm.memory.vector_index import VectorIndex, as_queries, as_vectors, check_k, check_known_ids, check_new_ids

__all__ = ["FaissIndex"]

log = logging.getLogger(__name__)

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

    @classmethod
    def reads(cls, backend: str) -> bool:
        return backend in tuple(f"faiss-{kind}" for kind in cls.KINDS)

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
        ids = check_new_ids(ids, self._labels)
        data = np.ascontiguousarray(as_vectors(vectors, len(ids), self.dim).cpu().numpy())
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
        ids = check_known_ids(ids, self._labels)
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
        q = np.ascontiguousarray(as_queries(queries, self.dim).cpu().numpy())
        k = min(check_k(k), len(self._labels))
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


