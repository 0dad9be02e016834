#!/usr/bin/env python
"""Benchmark vector search: exact torch vs faiss flat / IVF / HNSW (rmm.memory.index wrappers).

`torch-bfloat16` / `torch-float16` / `torch-int8` / `torch-int4` are the torch index scanning
in that precision (the `index_precision` setting) as asked, unmeasured; `torch-auto` scans what
`rmm.memory.scan_choice` measures fastest here (its note names it). `faiss-sq8` / `faiss-sq4`
are faiss's own scalar-quantised indexes (8 / 4 bits per dimension, each dimension's range
trained on the bank) re-ranking the best 2k+8 exactly (`IndexRefineFlat`): the public
counterparts of the torch index's int8 / int4 scans (`rmm.memory.scans` records the comparison).
Their note gives the single-query speed-up over `torch` (float32) in the same run.

`--users U` builds U indexes of each size (a server's users, each with its own bank) and sends
each query to a random one, so the scanned rows come from memory rather than the cache, as in a
server with many users (recall is checked on the first):

    python -m rmm.bench.search --sizes 10000 --users 32 --backends torch torch-int8 torch-int4 \
        faiss-sq8 faiss-sq4 torch-auto --threads 1 --queries 400

For each size: random unit-norm float32 vectors (default 384-d, the MiniLM size), build each
index, then time single-query search (p50 over `--queries` queries) and batch-64 search (time per
query), and measure recall@k of each index against exact torch search.

Random uniform-on-the-sphere data is the worst case for approximate indexes (no cluster
structure, neighbours barely closer than strangers); `--data clustered` gives a friendlier,
more embedding-like distribution.

    python -m rmm.bench.search --sizes 10000 100000 1000000 --queries 200
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from rmm.memory.faiss_index import FaissIndex
from rmm.memory.index import TorchIndex, VectorIndex


@dataclass
class Row:
    size: int
    backend: str
    build_s: float | None = None
    p50_ms: float | None = None
    batch_ms: float | None = None
    recall: float | None = None
    note: str = ""


def make_data(n: int, dim: int, kind: str, rng: np.random.Generator, centres: np.ndarray | None) -> np.ndarray:
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 100_000):  # chunked: bounded temporary memory at 1M
        stop = min(n, start + 100_000)
        block = rng.standard_normal((stop - start, dim), dtype=np.float32)
        if kind == "clustered" and centres is not None:
            block = block * 0.5 + centres[rng.integers(0, len(centres), stop - start)]
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        out[start:stop] = block
    return out


class FaissScalarQuantized:
    """faiss's own scalar-quantised index with re-ranking (`faiss-sq8`, `faiss-sq4`): an
    `IndexScalarQuantizer` (8 or 4 bits per dimension, each dimension's range trained on the bank)
    under an `IndexRefineFlat` that re-scores the best `2k+8` exactly, as the torch index's
    lower precisions do. Only `add` and `search`: what this benchmark calls."""

    def __init__(self, dim: int, bits: int) -> None:
        import faiss

        self._faiss, self.dim = faiss, dim
        qtype = {8: faiss.ScalarQuantizer.QT_8bit, 4: faiss.ScalarQuantizer.QT_4bit}[bits]
        self._base = faiss.IndexScalarQuantizer(dim, qtype, faiss.METRIC_INNER_PRODUCT)
        self._index = faiss.IndexRefineFlat(self._base)
        self._ids: list[str] = []

    def add(self, ids: list[str], vectors: torch.Tensor) -> None:
        data = np.ascontiguousarray(vectors.numpy(), dtype=np.float32)
        if not self._index.is_trained:
            self._index.train(data)
        self._index.add(data)
        self._ids.extend(ids)

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, list[list[str]]]:
        k = min(k, len(self._ids))
        params = self._faiss.IndexRefineSearchParameters(k_factor=(2 * k + 8) / k)
        scores, rows = self._index.search(np.ascontiguousarray(queries.numpy(), dtype=np.float32), k, params=params)
        return torch.from_numpy(scores), [[self._ids[r] for r in row if r >= 0] for row in rows.tolist()]


def new_index(backend: str, args: argparse.Namespace) -> VectorIndex | FaissScalarQuantized:
    """An empty index of `backend` (`torch[-PRECISION]`, `faiss-sq8`/`faiss-sq4` or `faiss-KIND`) with the
    command's options."""
    if backend in ("faiss-sq8", "faiss-sq4"):
        return FaissScalarQuantized(args.dim, int(backend.removeprefix("faiss-sq")))
    if backend.startswith("torch"):
        precision = backend.removeprefix("torch").removeprefix("-") or "float32"
        return TorchIndex(args.dim, device=args.device, precision=precision, measured=precision == "auto")
    return FaissIndex(args.dim, backend.removeprefix("faiss-"), nlist=args.nlist, nprobe=args.nprobe,
                      hnsw_m=args.hnsw_m, ef_construction=args.ef_construction, ef_search=args.ef_search,
                      seed=args.seed)


def time_queries(indexes: list[VectorIndex | FaissScalarQuantized], queries: torch.Tensor, k: int, seed: int) -> tuple[float, float]:
    """(median ms of one query, ms per query in batches of 64), each search on a random one of
    `indexes` (the same sequence for every backend)."""
    for index in indexes:
        index.search(queries[:2], k)  # warm-up (allocations, GPU replica, packed layouts)
    pick = random.Random(seed)
    single = []
    for i in range(queries.shape[0]):
        index = indexes[pick.randrange(len(indexes))]
        t0 = time.perf_counter()
        index.search(queries[i : i + 1], k)
        single.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for start in range(0, queries.shape[0], 64):
        indexes[pick.randrange(len(indexes))].search(queries[start : start + 64], k)
    batch = (time.perf_counter() - t0) / queries.shape[0]
    return statistics.median(single) * 1e3, batch * 1e3


def recall_at_k(truth: list[list[str]], found: list[list[str]]) -> float:
    return sum(len(set(t) & set(f)) for t, f in zip(truth, found)) / sum(len(t) for t in truth)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--queries", type=int, default=200, help="queries per size (single-query p50 and batch-64)")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--data", choices=["random", "clustered"], default="random")
    parser.add_argument("--backends", nargs="+", default=["torch", "faiss-flat", "faiss-ivf", "faiss-hnsw"])
    parser.add_argument("--device", default="cpu", help="device for the torch index (cpu, cuda, auto)")
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--nlist", type=int, default=None, help="IVF lists (default: sqrt(n))")
    parser.add_argument("--hnsw-m", type=int, default=32)
    parser.add_argument("--ef-construction", type=int, default=40)
    parser.add_argument("--ef-search", type=int, default=64)
    parser.add_argument(
        "--hnsw-budget-s", type=float, default=300.0,
        help="skip an HNSW build whose time, extrapolated (n log n) from the previous size, exceeds this",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch and faiss (OpenMP) threads; default: theirs")
    parser.add_argument("--users", type=int, default=1,
                        help="indexes per size, each query to a random one (their rows no longer fit the cache)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads is not None:
        import faiss

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)

    print(f"# torch {torch.__version__} ({torch.get_num_threads()} threads), data={args.data}, dim={args.dim}, "
          f"k={args.k}, queries={args.queries}, device={args.device}, users={args.users}", flush=True)
    print(f"# ivf: nlist={'sqrt(n)' if args.nlist is None else args.nlist}, nprobe={args.nprobe}; "
          f"hnsw: M={args.hnsw_m}, efConstruction={args.ef_construction}, efSearch={args.ef_search}", flush=True)
    rng = np.random.default_rng(args.seed)
    centres = rng.standard_normal((256, args.dim), dtype=np.float32) if args.data == "clustered" else None
    rows: list[Row] = []
    last_hnsw: tuple[int, float] | None = None
    for n in sorted(args.sizes):
        data = make_data(n, args.dim, args.data, rng, centres)
        queries = torch.from_numpy(make_data(args.queries, args.dim, args.data, rng, centres))
        ids = [str(i) for i in range(n)]
        vectors = torch.from_numpy(data)
        others = [torch.from_numpy(make_data(n, args.dim, args.data, rng, centres)) for _ in range(args.users - 1)]
        truth: list[list[str]] | None = None
        for backend in args.backends:
            row = Row(n, backend)
            rows.append(row)
            if backend == "faiss-hnsw" and last_hnsw is not None:
                prev_n, prev_s = last_hnsw
                predicted = prev_s * (n / prev_n) * (math.log(n) / math.log(prev_n))
                if predicted > args.hnsw_budget_s:
                    row.note = (f"skipped: build predicted ~{predicted:.0f}s from {prev_s:.0f}s at {prev_n:,} "
                                f"(> --hnsw-budget-s {args.hnsw_budget_s:.0f})")
                    print(f"  {n:>9,} {backend:<11} {row.note}", flush=True)
                    continue
            index = new_index(backend, args)
            t0 = time.perf_counter()
            index.add(ids, vectors)
            row.build_s = time.perf_counter() - t0
            indexes = [index]
            for other in others:  # the other users' banks (not timed: the build figure is the first's)
                indexes.append(new_index(backend, args))
                indexes[-1].add(ids, other)
            if backend == "faiss-hnsw":
                last_hnsw = (n, row.build_s)
            if backend == "faiss-ivf":
                row.note = (f"nlist={index.nlist}, trained on {min(n, 64 * (index.nlist or 0)):,}"
                            if index.is_trained_ivf else "below train_threshold: exact flat fallback")
            row.p50_ms, row.batch_ms = time_queries(indexes, queries, args.k, args.seed)
            float32 = next((r for r in rows if r.size == n and r.backend == "torch" and r.p50_ms), None)
            if backend.startswith(("torch-", "faiss-sq")) and float32 is not None and float32.p50_ms and float32.batch_ms:
                row.note = (f"{float32.p50_ms / row.p50_ms:.2f}x float32 (1 q), "
                            f"{float32.batch_ms / (row.batch_ms or 1):.2f}x (batch 64)")
            if backend == "torch-auto" and isinstance(index, TorchIndex):
                plan = ", ".join(f"{precision} at {batch} q" for batch, precision in index.scan_plan.items())
                row.note = f"scans {plan}; {row.note}".rstrip("; ")
            found = index.search(queries, args.k)[1]
            if truth is None and backend == "torch":
                truth = found
            row.recall = None if truth is None else recall_at_k(truth, found)
            print(f"  {n:>9,} {backend:<11} build {row.build_s:8.2f}s  p50 {row.p50_ms:8.3f} ms  "
                  f"batch64 {row.batch_ms:8.3f} ms/q  recall@{args.k} "
                  f"{'-' if row.recall is None else f'{row.recall:.3f}'}  {row.note}", flush=True)
            del index, indexes
            gc.collect()
        del data, vectors, ids, queries, others
        gc.collect()

    print()
    header = f"| {'size':>9} | {'index':<10} | {'build s':>8} | {'p50 ms (1 q)':>12} | {'ms/q (batch 64)':>15} | recall@{args.k} | note |"
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for r in rows:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"| {r.size:>9,} | {r.backend:<10} | {fmt(r.build_s, '8.2f'):>8} | {fmt(r.p50_ms, '12.3f'):>12} | "
              f"{fmt(r.batch_ms, '15.3f'):>15} | {fmt(r.recall, '9.3f'):>9} | {r.note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
