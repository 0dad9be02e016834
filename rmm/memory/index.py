"""Vector indexes over one user's memory embeddings, inner-product metric (DESIGN.md §4).

Two families behind one interface (`VectorIndex`, in `rmm.memory.vector_index`), keyed by string
memory ids:

* `TorchIndex` — exact search on a dense matrix on CPU or CUDA. The default: per-user banks are
  small (hundreds to thousands of memories), where exact search is both fastest and simplest.
  `precision` (`index_precision`) scans a smaller copy of the rows (`rmm.memory.scans`:
  bfloat16, float16, int8, int4) and re-scores the best 2k+8 exactly from the float32 rows, so
  ids, order and scores match float32 unless a true top-k row ranks below 2k+8 in the copy;
  which one runs is measured on the machine (`rmm.memory.scan_choice`; `auto` takes the fastest).
* `FaissIndex` (`rmm.memory.faiss_index`) — faiss on CPU for large banks: `flat` (exact,
  `IndexFlatIP`), `ivf` (`IndexIVFFlat`, inner product; approximate once trained) and `hnsw`
  (`IndexHNSWFlat` with `METRIC_INNER_PRODUCT`).

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

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rmm.device import resolve_device
from rmm.errors import UnknownMemoryError
from rmm.memory.scan_choice import AUTO, BATCH_SIZES, ScanChooser, default_chooser, measured_batch, probe_rows
from rmm.memory.scans import CPU_PRECISIONS, PRECISIONS, Scan, make_scan, unavailable
from rmm.memory.vector_index import (
    BACKENDS,
    VectorIndex,
    as_queries,
    as_vectors,
    check_k,
    check_known_ids,
    check_new_ids,
    index_file_info,
    read_index_file,
)

__all__ = [
    "BACKENDS",
    "CPU_PRECISIONS",
    "INDEX_PRECISIONS",
    "PRECISIONS",
    "TorchIndex",
    "VectorIndex",
    "index_file_info",
    "load_index",
    "make_index",
]

log = logging.getLogger(__name__)

INDEX_PRECISIONS: tuple[str, ...] = (*PRECISIONS, AUTO)  # what `index_precision` may say


# --------------------------------------------------------------------------- torch


class TorchIndex(VectorIndex):
    """Exact search: a dense [n, d] float32 matrix on the device, scanned by a `Scan` of `precision`.

    Rows live in a buffer with spare capacity (amortised O(1) append); removal moves the last row
    into the hole, so the matrix stays dense and search never has to skip deleted rows. The float32
    rows are the truth (`vectors`, files, the exact re-score of a smaller scan's shortlist).

    The scan is chosen at the first search, when the bank's size is known: with `measured` (the
    default) a precision other than float32 scans only where `rmm.memory.scan_choice` measured it
    no slower than float32 on this machine (`auto`: the fastest), else float32 — for one query and
    for a batch of queries apart (`scan_plan`); it is chosen again when the bank grows or shrinks
    into another probe size. `measured=False` scans `precision` as asked (a benchmark or a test of
    one kernel).
    """

    backend = "torch"

    def __init__(self, dim: int, device: str | torch.device = "auto", precision: str = "float32", *,
                 measured: bool = True, chooser: ScanChooser | None = None) -> None:
        super().__init__(dim)
        if precision not in INDEX_PRECISIONS:
            raise ValueError(f"unknown index precision {precision!r}; use one of {list(INDEX_PRECISIONS)}")
        if precision == AUTO and not measured:
            raise ValueError("index precision 'auto' is chosen by measurement (measured=True)")
        self.device = resolve_device(device)
        reason = None if precision == AUTO else unavailable(precision, dim, self.device)
        if reason is not None:
            raise ValueError(reason)
        self.precision = precision
        self._measured = measured and precision != "float32"
        self._chooser = chooser
        self._matrix = torch.empty((0, dim), dtype=torch.float32, device=self.device)
        # measured batch size -> the precision a search of about that many queries scans (chosen at the
        # first search when measured), and the scans built for them (at their first search)
        self._plan: dict[int, str] = {} if self._measured else dict.fromkeys(BATCH_SIZES, precision)
        self._plan_probe = 0  # the probe size `_plan` was measured for
        self._scans: dict[str, Scan] = {}
        self._ids: list[str] = []
        self._rows: dict[str, int] = {}

    @property
    def ids(self) -> list[str]:
        return list(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, memory_id: object) -> bool:
        return memory_id in self._rows

    @property
    def scan_plan(self) -> dict[int, str]:
        """The precision a search scans by the measured batch size it falls to (empty until the first
        search chose them)."""
        return dict(self._plan)

    @property
    def scan_precision(self) -> str | None:
        """The precision a one-query search scans (None until the first search chose it)."""
        return self._plan.get(1)

    def add(self, ids: list[str], vectors: torch.Tensor) -> None:
        ids = check_new_ids(ids, self._rows)
        tensor = as_vectors(vectors, len(ids), self.dim).to(self.device)
        n, need = len(self._ids), len(self._ids) + len(ids)
        if need > self._matrix.shape[0]:
            rows = max(need, 2 * self._matrix.shape[0], 64)
            grown = torch.empty((rows, self.dim), dtype=torch.float32, device=self.device)
            grown[:n] = self._matrix[:n]
            self._matrix = grown
        self._matrix[n:need] = tensor
        for scan in self._scans.values():
            scan.write(self._matrix, n, need)
        for offset, memory_id in enumerate(ids):
            self._rows[memory_id] = n + offset
        self._ids.extend(ids)

    def remove(self, ids: list[str]) -> None:
        for memory_id in check_known_ids(ids, self._rows):
            row = self._rows.pop(memory_id)
            last = len(self._ids) - 1
            if row != last:
                moved = self._ids[last]
                self._matrix[row] = self._matrix[last]
                self._ids[row] = moved
                self._rows[moved] = row
            for scan in self._scans.values():
                scan.remove(row, last)
            self._ids.pop()

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, list[list[str]]]:
        q = as_queries(queries, self.dim)
        n = len(self._ids)
        k = min(check_k(k), n)
        if k == 0:
            return torch.zeros((q.shape[0], 0), dtype=torch.float32), [[] for _ in range(q.shape[0])]
        values, rows = self._scan_for(n, q.shape[0]).search(q.to(self.device), self._matrix, n, k)
        return values.float().cpu(), [[self._ids[r] for r in row] for row in rows.cpu().tolist()]

    def _scan_for(self, n: int, queries: int) -> Scan:
        """The scan for `queries` queries over `n` rows: the plan kept while the bank stays in its probe
        size, else chosen again (measured); a scan built from the float32 rows at its first use."""
        if self._measured and probe_rows(n) != self._plan_probe:
            self._plan = (self._chooser or default_chooser()).resolve(self.precision, self.dim, n, self.device)
            self._plan_probe = probe_rows(n)
            self._scans = {p: scan for p, scan in self._scans.items() if p in self._plan.values()}
        precision = self._plan[measured_batch(queries)]
        scan = self._scans.get(precision)
        if scan is None:
            scan = self._scans[precision] = make_scan(precision, self.dim, self.device)
            scan.write(self._matrix, 0, n)
        return scan

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


# --------------------------------------------------------------------------- factory

def _backend_class(backend: str) -> type[VectorIndex]:
    """The class that reads a file of `backend` (faiss is imported only when a faiss file is read)."""
    if backend == "torch":
        return TorchIndex
    from rmm.memory.faiss_index import FaissIndex

    return FaissIndex


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
    """Load any index file: its header names the backend, whose class reads it (`VectorIndex.load`)."""
    header, _ = read_index_file(Path(path), with_tensors=False)
    return _backend_class(header["backend"]).load(path, device=device)
