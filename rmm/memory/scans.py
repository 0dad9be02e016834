"""How the torch index scans its rows (`index_precision`): float32 exactly, or a smaller copy of the
rows whose shortlist of the best `2k+8` is re-scored from the float32 rows, so ids, order and
scores match float32 unless a true top-k row ranks below `2k+8` in the smaller copy.

* `float32` — one `matmul` + `topk` (`ExactScan`).
* `bfloat16` / `float16` — a half-precision copy, any device (`HalfScan`).
* `int8` (CPU) — faiss's `IndexScalarQuantizer` (`QT_8bit_uniform`), one range for the whole
  index (`Int8Scan`): a public kernel.
* `int4` (CPU) — 4-bit codes with a scale and zero per 32 dimensions through torch's private
  LLM-decoding kernel `_weight_int4pack_mm_for_cpu` (`Int4Scan`).

Private kernels against public ones (issue 37): a private kernel stays only where it is at least
1.3x faster than faiss's scalar-quantised index of the same bits with re-ranking (the best 2k+8
re-scored, `IndexRefineFlat`), one query at a time over 32 users' 10k-row banks, one thread:

    python -m rmm.bench.search --sizes 10000 --users 32 --backends torch torch-int8 torch-int4 \\
        faiss-sq8 faiss-sq4 --threads 1 --queries 400

On an Intel Xeon with AMX (2 shared cores, load 3.3-3.8, three runs, p50 ms per query; torch
2.13, faiss 1.15.1): float32 1.30-1.34; torch `_weight_int8pack_mm` 0.63 / 0.75 / 0.73 against
faiss-sq8 0.79 / 0.83 / 0.81 — 1.10-1.26x, under 1.3x: the private int8 kernel went, `int8`
scans through faiss; torch int4 0.46 / 0.53 / 0.50 against faiss-sq4 0.94 / 1.08 / 1.00 (whose
recall@10 was 0.991: its 4-bit re-ranked shortlist missed true neighbours) — 2.0-2.1x: torch's
int4 kernel stays. After the change, same command plus `torch-auto` (four runs, load 8.4-12.4):
float32 1.30-1.46, `int8` (faiss `QT_8bit_uniform` in the torch index) 0.76-0.79, int4
0.46-0.48, faiss-sq8 0.76-0.83, faiss-sq4 1.07-1.11 (recall 0.991), `auto` 0.47-0.49 (int4 for one
query). A batch of 64 queries is another matter: there faiss's scans took 0.8-1.5 ms a query
against float32's 0.35-0.55, which is why the measurement times batches apart.

None of these runs unmeasured: `rmm.memory.scan_choice` times every precision on the machine
and scans float32 where a smaller one is slower or fails (`TorchIndex(measured=False)` is for
benchmarks and tests of one kernel).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch

__all__ = ["CPU_PRECISIONS", "PRECISIONS", "Scan", "make_scan", "unavailable"]

PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "float16", "int8", "int4")
INT4_GROUP = 32  # int4: dimensions sharing one (scale, zero) pair; d must be a multiple
INT4_BLOCK = 64  # int4: torch's CPU layout packs rows 64 at a time, each block alone (a write repacks its blocks)
CPU_PRECISIONS: dict[str, int] = {"int8": 1, "int4": INT4_GROUP}  # scans only on the CPU: the d multiple each needs
INT8_HEADROOM = 1.25  # int8: the code step leaves this much room above the largest value, so growth rarely re-encodes
_HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def unavailable(precision: str, dim: int, device: torch.device) -> str | None:
    """Why `precision` cannot scan `dim`-d rows on `device` here, or None when it can."""
    if precision not in PRECISIONS:
        return f"unknown index precision {precision!r}; use one of {list(PRECISIONS)}"
    multiple = CPU_PRECISIONS.get(precision)
    if multiple and (device.type != "cpu" or dim % multiple):
        return (f"index precision {precision!r} needs the CPU and a dimension divisible by {multiple} "
                f"(got {device.type}, {dim}); use float16")
    if precision == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"index precision 'int4' needs torch's CPU int4 kernel (torch >= 2.5), not in {torch.__version__}"
    if precision == "int8":
        try:
            import faiss  # noqa: F401
        except ImportError as exc:
            return f"index precision 'int8' scans through faiss, which does not import: {exc}"
    return None


def make_scan(precision: str, dim: int, device: torch.device) -> Scan:
    """An empty scan of `precision` (`unavailable` says whether it can run)."""
    if precision == "float32":
        return ExactScan(dim, device)
    if precision in _HALF:
        return HalfScan(dim, device, _HALF[precision])
    if precision == "int8":
        return Int8Scan(dim, device)
    if precision == "int4":
        return Int4Scan(dim, device)
    raise ValueError(f"unknown index precision {precision!r}; use one of {list(PRECISIONS)}")


class Scan(ABC):
    """The index's rows in the form a search reads, kept in step with the float32 rows (the truth):
    row i of the scan is row i of the index's matrix."""

    precision: ClassVar[str]

    def __init__(self, dim: int, device: torch.device) -> None:
        self.dim, self.device = dim, device

    @abstractmethod
    def write(self, matrix: torch.Tensor, start: int, stop: int) -> None:
        """Rows [start, stop) of `matrix` were appended (rows before `start` are unchanged)."""

    @abstractmethod
    def remove(self, row: int, last: int) -> None:
        """Row `last` moved into `row` (when they differ) and the index now holds `last` rows."""

    @abstractmethod
    def shortlist(self, q: torch.Tensor, matrix: torch.Tensor, n: int, wide: int) -> torch.Tensor:
        """[B, wide] row numbers of the best approximate scores among rows [0, n)."""

    def search(self, q: torch.Tensor, matrix: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, rows) [B, k] of the top k of rows [0, n), best first: the shortlist of 2k+8
        re-scored exactly from the float32 `matrix`."""
        shortlist = self.shortlist(q, matrix, n, min(n, 2 * k + 8))
        exact = torch.einsum("bd,bwd->bw", q, matrix[shortlist])
        top = torch.topk(exact, k, dim=1, sorted=True)
        return top.values, shortlist.gather(1, top.indices)


class ExactScan(Scan):
    """float32: the matrix itself, no copy."""

    precision = "float32"

    def write(self, matrix: torch.Tensor, start: int, stop: int) -> None:
        pass

    def remove(self, row: int, last: int) -> None:
        pass

    def shortlist(self, q: torch.Tensor, matrix: torch.Tensor, n: int, wide: int) -> torch.Tensor:
        return self.search(q, matrix, n, wide)[1]

    def search(self, q: torch.Tensor, matrix: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = matrix[:n]
        # A few query rows on the CPU: [n, d] @ [d, B] streams the matrix once, while MKL's kernel
        # for [B, d] @ [d, n] took 2-5x longer for B = 2..8 on 10k x 384 rows (same ids, scores
        # within float rounding); one row is a matrix-vector product either way.
        scores = (rows @ q.T).T if 1 < q.shape[0] and q.device.type == "cpu" else q @ rows.T
        top = torch.topk(scores, k, dim=1, sorted=True)
        return top.values, top.indices


def _grown(buffer: torch.Tensor, rows: int, keep: int) -> torch.Tensor:
    """`buffer` with room for `rows` rows, its first `keep` kept."""
    if buffer.shape[0] >= rows:
        return buffer
    grown = torch.empty((rows, *buffer.shape[1:]), dtype=buffer.dtype, device=buffer.device)
    grown[:keep] = buffer[:keep]
    return grown


class HalfScan(Scan):
    """A bfloat16 or float16 copy (half the bytes: ~3x faster on a CPU once the matrix outgrows the
    cache, on CPUs with native half arithmetic)."""

    def __init__(self, dim: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(dim, device)
        self.precision = str(dtype).removeprefix("torch.")  # type: ignore[misc]
        self._rows = torch.empty((0, dim), dtype=dtype, device=device)

    def write(self, matrix: torch.Tensor, start: int, stop: int) -> None:
        self._rows = _grown(self._rows, matrix.shape[0], start)
        self._rows[start:stop] = matrix[start:stop].to(self._rows.dtype)

    def remove(self, row: int, last: int) -> None:
        self._rows[row] = self._rows[last]

    def shortlist(self, q: torch.Tensor, matrix: torch.Tensor, n: int, wide: int) -> torch.Tensor:
        rough = q.to(self._rows.dtype) @ self._rows[:n].T
        return torch.topk(rough, wide, dim=1, sorted=False).indices


class Int8Scan(Scan):
    """8-bit codes through faiss's `IndexScalarQuantizer` (`QT_8bit_uniform`: one range for every
    dimension), the range [-bound, bound] set from the rows rather than trained on a sample. One
    range, not one per row, keeps the codes' inner products proportional to the rows' (a rough
    score's error is alike for every row, which is what a ranking needs). The bound leaves
    `INT8_HEADROOM` above the largest magnitude written; a write beyond it re-encodes every row
    with a wider one. (faiss 1.15.1's `QT_8bit_direct*` codecs, which would skip the range, scan
    d >= 32 with the query rounded to integers: wrong rankings for unit vectors.)"""

    precision = "int8"

    def __init__(self, dim: int, device: torch.device) -> None:
        super().__init__(dim, device)
        import faiss

        self._faiss = faiss
        self._index = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_8bit_uniform,
                                                 faiss.METRIC_INNER_PRODUCT)
        self._index.sq.rangestat = faiss.ScalarQuantizer.RS_minmax
        self.bound = 0.0  # 0 until a non-zero value is written

    def write(self, matrix: torch.Tensor, start: int, stop: int) -> None:
        largest = float(matrix[start:stop].abs().max()) if stop > start else 0.0
        if largest > self.bound:  # (re)set the range over every row, then encode them all
            self.bound = INT8_HEADROOM * max(largest, float(matrix[:start].abs().max()) if start else 0.0)
            self._index.reset()
            self._index.train(np.array([[-self.bound] * self.dim, [self.bound] * self.dim], dtype=np.float32))
            start = 0
        if self.bound and stop > start:  # (all-zero rows before any other are left out: see `shortlist`)
            self._index.add(np.ascontiguousarray(matrix[start:stop].numpy(), dtype=np.float32))

    def remove(self, row: int, last: int) -> None:
        if self._index.ntotal <= last:  # nothing was encoded (all rows zero so far)
            return
        if row != last:
            size = self._index.code_size
            codes: Any = self._faiss.rev_swig_ptr(self._index.codes.data(), self._index.ntotal * size)
            codes[row * size:(row + 1) * size] = codes[last * size:(last + 1) * size]
        self._index.remove_ids(self._faiss.IDSelectorRange(last, last + 1))  # the last row: a truncation

    def shortlist(self, q: torch.Tensor, matrix: torch.Tensor, n: int, wide: int) -> torch.Tensor:
        if self._index.ntotal < n:  # every row is zero so far: any order is exact
            return torch.arange(wide).expand(q.shape[0], wide)
        _, rows = self._index.search(np.ascontiguousarray(q.numpy(), dtype=np.float32), wide)
        return torch.from_numpy(rows)


class Int4Scan(Scan):
    """4-bit codes with a scale and zero per `INT4_GROUP` dimensions through torch's int4
    matrix-vector kernel (the one LLM decoding uses): a search reads 0.6x int8's bytes. It holds the
    codes one per byte (for writes) beside the packed copy the kernel reads, rebuilt lazily, 64 rows
    at a time, for the rows a write touched; the last partial block is scored in float32."""

    precision = "int4"

    def __init__(self, dim: int, device: torch.device) -> None:
        super().__init__(dim, device)
        self._codes = torch.empty((0, dim), dtype=torch.uint8)
        self._scales = torch.empty((0, dim // INT4_GROUP, 2), dtype=torch.bfloat16)  # (scale, zero) per group
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (packed codes, scales) of whole blocks
        self._stale_from = 0  # the first row whose block changed since `_packed` was built

    def write(self, matrix: torch.Tensor, start: int, stop: int) -> None:
        self._codes = _grown(self._codes, matrix.shape[0], start)
        self._scales = _grown(self._scales, matrix.shape[0], start)
        self._scales[start:stop], self._codes[start:stop] = int4_rows(matrix[start:stop])
        self._stale_from = min(self._stale_from, start)

    def remove(self, row: int, last: int) -> None:
        if row != last:
            self._codes[row], self._scales[row] = self._codes[last], self._scales[last]
            self._stale_from = min(self._stale_from, row)

    def shortlist(self, q: torch.Tensor, matrix: torch.Tensor, n: int, wide: int) -> torch.Tensor:
        """Approximate scores of rows [0, n): whole 64-row blocks by the int4 kernel (their packed
        layout brought up to date first), the last partial block in float32."""
        whole = n // INT4_BLOCK * INT4_BLOCK
        parts = []
        if whole:
            codes, scales = self._packed_rows(n, whole)
            parts.append(torch.ops.aten._weight_int4pack_mm_for_cpu(q.to(torch.bfloat16), codes, INT4_GROUP, scales)
                         .float())
        if whole < n:
            parts.append(q @ matrix[whole:n].T)
        return torch.topk(torch.cat(parts, dim=1), wide, dim=1, sorted=False).indices

    def _packed_rows(self, n: int, whole: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's (packed codes, [groups, rows, 2] scales) of rows [0, whole), repacking only
        the 64-row blocks from the first one a write touched since the last search."""
        if self._packed is not None and self._packed[0].shape[0] == whole and self._stale_from >= whole:
            return self._packed
        codes = self._packed[0] if self._packed is not None else self._codes[:0]
        kept = min(self._stale_from, whole, codes.shape[0]) // INT4_BLOCK * INT4_BLOCK
        if kept < whole:
            fresh = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self._codes[kept:whole].to(torch.int32), 1)
            codes = torch.cat([codes[:kept], fresh]) if kept else fresh
        else:
            codes = codes[:whole]
        self._packed = codes, self._scales[:whole].transpose(0, 1).contiguous()
        self._stale_from = n
        return self._packed


def int4_rows(vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
