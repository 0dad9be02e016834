#!/usr/bin/env python
"""Benchmark `rmm serve`: N concurrent clients on loopback, micro-batching on vs off.

Two settings (`--setting`):

- `locomo` (default): a turn-level bank of LoCoMo with the MiniLM preset (built once, cached);
  each client sends one LoCoMo question for its own conversation.
- `goal`: the serving goal — 10,000 memories per user across 32 users, 32 concurrent clients,
  K 20, M 5, CPU. Encoding 320,000 texts would take hours on a small CPU box, so the memories
  are synthetic: random unit vectors (the 384 dimensions of MiniLM) with short texts, stored
  with precomputed embeddings in a bank that records the MiniLM encoder. Queries are real LoCoMo
  questions, encoded by the server's MiniLM query path, each for a random one of the 32 users, so
  every micro-batch searches many users' 10k-row matrices. Search results are meaningless; the
  cost of every step is not. The server scans 4-bit codes of each matrix (`index_precision: int4`,
  a shortlist re-scored exactly in float32: LoCoMo recall unchanged and no true top-20 member
  missed in a 5,882-row bank, research/recall_index_precision.py; 0.6x int8's bytes, 0.16x
  float32's); `--set index_precision='"int8"'` (or `"float16"`, `"float32"`) compares.

The bench's own bank starts every run without the selections earlier runs left pending (each
holds its candidates' embeddings; gigabytes after a few dozen runs). The server runs in a
subprocess for each batching mode (its torch thread count is printed); each
client sends retrieve requests back to back for `--duration` seconds after `--warmup`, on its own
keep-alive connection of a minimal HTTP client (the load generator shares the cores with the
server, so it must be cheap: its CPU time per request and share of a core are printed). Prints
throughput, p50/p99 latency, mean server-side batch size, the server's CPU time per request (a
figure other processes on the machine inflate far less than wall time), errors, the 1-minute
load average, then the batching on / off throughput ratio and both p99s. `--profile DIR` records
the server and its query-encoder process with py-spy during each timed run and prints their top
functions. Exits 1 if any request failed.

`--shadow` measures what shadow scoring (issue 32 item 4) costs the server: each configuration runs
twice in turn (`--shadow-rounds` pairs, alternating off-on / on-off so that a drift of the machine
cancels), once as above and once with a shadow reranker (`shadow.checkpoint`: an untrained one of
the live learner's kind for this bank's encoder, written by the bench; the bench tenant an admin).
The shadow's work is done when feedback is claimed, so with `--shadow` every client answers each
retrieve with feedback (a random subset of the shown memories cited) before its next one, in both
arms; server CPU per request then covers a retrieve and its feedback. Prints the on / off ratio of
server CPU per request, and the latency of one `GET /v1/ope` (the shadow's estimate on the rows
it kept) at the end of each shadow run. The bench's own bank starts a `--shadow` run without the
reranker checkpoints earlier feedback trained.

    python -m rmm.bench.serve                                # LoCoMo: 1, 8, 32 clients, 8 s each
    python -m rmm.bench.serve --setting goal --duration 30   # 32 users x 10k memories, 32 clients
    python -m rmm.bench.serve --setting goal --profile /tmp/prof  # and where the server's time goes
    python -m rmm.bench.serve --clients 1 16 64 --duration 20 --max-batch 128
    python -m rmm.bench.serve --setting goal --duration 20 --modes on --shadow   # shadow scoring's cost
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from rmm.errors import RmmError
from rmm.serve.process import start_server_process

TENANT, KEY = "bench", "bench-key-0123456789"


@dataclass
class Row:
    clients: int
    batching: str
    max_batch: int
    max_wait_ms: float
    requests: int
    req_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_batch: float
    errors: int
    load_avg: float  # 1-minute load average at the end of the run
    server_cpu_ms: float  # server CPU time per request (all its threads and child processes)
    client_cpu_ms: float  # the load generator's CPU time per request (this process)
    client_cpu_share: float  # the load generator's CPU seconds per second: the cores it took from the server
    prepare_busy: float  # share of the run the first stage (query encoding) was working
    finish_busy: float  # share of the run the second stage (search, rerank, store) was working
    shadow: str = "none"  # "none": no --shadow; "off" / "on": a --shadow pair's arms (clients send feedback)


def build_bank(bank: Path, data_dir: str | None, conversations: int | None) -> list[tuple[str, str]]:
    """The LoCoMo turn bank under tenant `bench` (built once); returns (user, question) pairs."""
    from rmm.data import load_dataset
    from rmm.encoders import load_encoder
    from rmm.eval.benchmark_bank import documents
    from rmm.memory.bank import MemoryBank
    from rmm.serve.service import scoped

    dataset = load_dataset("locomo", data_dir=data_dir)
    users = dataset.users[:conversations] if conversations else dataset.users
    questions = [(q.user_id, q.text) for q in dataset.questions if q.user_id in users]
    with MemoryBank(bank, load_encoder("minilm", device="cpu"), device="cpu") as b:
        for user in users:
            docs = documents(dataset, user, "turn")
            uid = scoped(TENANT, user)
            if b.store.has_user(uid) and b.store.count(uid) == len(docs):
                continue
            if b.store.has_user(uid):
                b.delete_user(uid)
            t0 = time.perf_counter()
            for d in docs:
                d.user_id = uid
            b.add(uid, docs)
            print(f"  encoded {len(docs)} turns of {user} in {time.perf_counter() - t0:.1f} s", flush=True)
    return questions


def build_synthetic_bank(bank: Path, data_dir: str | None, users: int, per_user: int,
                         seed: int) -> list[tuple[str, str]]:
    """`users` x `per_user` random unit vectors under tenant `bench` (built once); returns
    (user, LoCoMo question) pairs, questions spread over the users round-robin."""
    import torch

    from rmm.data import load_dataset
    from rmm.encoders import load_encoder
    from rmm.memory.bank import MemoryBank
    from rmm.serve.tenants import scoped
    from rmm.types import Memory

    names = [f"user{u:02d}" for u in range(users)]
    with MemoryBank(bank, load_encoder("minilm", device="cpu"), device="cpu") as b:
        for u, user in enumerate(names):
            uid = scoped(TENANT, user)
            if b.store.has_user(uid) and b.store.count(uid) == per_user:
                continue
            if b.store.has_user(uid):
                b.delete_user(uid)
            t0 = time.perf_counter()
            generator = torch.Generator().manual_seed(seed * 10_007 + u)
            vectors = torch.nn.functional.normalize(torch.randn(per_user, b.dim, generator=generator), dim=1)
            memories = [Memory(id=f"m{j}", user_id=uid, kind="turn", text=f"{user} said thing number {j} of "
                               f"{per_user} about a synthetic topic") for j in range(per_user)]
            b.add(uid, memories, embeddings=vectors)
            print(f"  stored {per_user} synthetic memories of {user} in {time.perf_counter() - t0:.1f} s", flush=True)
    questions = [q.text for q in load_dataset("locomo", data_dir=data_dir).questions]
    return [(names[i % users], question) for i, question in enumerate(questions)]


def start_server(bank: Path, workdir: Path, batching: bool, max_batch: int, max_wait_ms: float,
                 device: str, threads: int | None, extra: dict[str, object],
                 tag: str = "") -> tuple[subprocess.Popen, str, Path]:
    name = f"{'on' if batching else 'off'}{tag}"
    config = workdir / f"serve-{name}.json"  # JSON is valid YAML
    config.write_text(json.dumps({
        "auth": {"keys": {KEY: TENANT}}, "device": device, "log_level": "warning", "torch_threads": threads,
        "batching": {"enabled": batching, "max_batch": max_batch, "max_wait_ms": max_wait_ms}, **extra,
    }))
    log = workdir / f"server-{name}.log"
    try:
        proc, url = start_server_process(bank, config, log)
    except RmmError as error:
        raise SystemExit(str(error)) from error
    return proc, url, log


def server_health(url: str) -> dict:
    """The server's health answer (torch threads, the query engine it measured and chose)."""
    return httpx.get(f"{url}/health", timeout=10).json()


def engine_line(health: dict) -> str:
    """The server's query engine, what was asked for, and its start-up probe (ms/query by batch)."""
    engine = health.get("query_engine")
    if not engine:
        return "query engine not reported"
    probe = "; ".join(f"{name} " + "/".join(f"{ms:.2f}" for ms in by_size.values())
                      for name, by_size in engine["ms_per_query"].items())
    sizes = "/".join(str(s) for s in engine["batch_sizes"])
    return (f"query engine {engine['engine']} (asked {engine['requested']}, "
            f"{'cached' if engine['cached'] else 'measured'} ms/query at batch {sizes}: {probe or engine['note']})")


def batch_totals(url: str) -> tuple[float, float, float, float]:
    """(queries batched, batches, prepare-stage seconds, finish-stage seconds) so far."""
    text = httpx.get(f"{url}/metrics", timeout=10).text

    def value(pattern: str) -> float:
        found = re.search(rf"^{pattern} ([0-9.e+]+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    return (value("rmm_batch_size_sum"), value("rmm_batch_size_count"),
            value(r'rmm_batch_stage_seconds_sum\{stage="prepare"\}'),
            value(r'rmm_batch_stage_seconds_sum\{stage="finish"\}'))


class Connection:
    """One keep-alive HTTP/1.1 connection speaking just what the bench needs (POST, a
    Content-Length body back): a load generator sharing the cores with the server must cost as
    little as possible per request, and a general client (httpx) costs several times more."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {KEY}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        if length is None:
            raise ConnectionError("response without Content-Length")
        return status, await self.reader.readexactly(int(length.group(1)))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def load(url: str, questions: list[tuple[str, str]], clients: int, duration: float, k: int, m: int,
               seed: int, feedback: bool = False) -> tuple[list[float], int, int, float]:
    """N clients, each on its own keep-alive connection, sending requests back to back until the
    time is up; with `feedback`, each answers every retrieve with feedback (each shown memory cited
    with probability 0.3, else `no_cite`) before its next (the latency is the retrieve's)."""
    latencies: list[float] = []
    errors = 0
    sent = 0
    host, _, port = url.removeprefix("http://").partition(":")

    async def client(n: int) -> None:
        nonlocal errors, sent
        rng = random.Random(seed * 1000 + n)
        connection = Connection(host, int(port))
        try:
            while time.perf_counter() < stop:
                user, question = rng.choice(questions)
                body = json.dumps({"queries": [{"user": user, "query": question, "k": k, "m": m}]}).encode()
                t0 = time.perf_counter()
                try:
                    status, answer = await connection.post("/v1/retrieve", body)
                    result = json.loads(answer)["results"][0] if status == 200 else {}
                    ok = len(result.get("memories", ())) == m
                    elapsed_one = time.perf_counter() - t0
                    if ok and feedback:
                        cited = [i for i in range(m) if rng.random() < 0.3]
                        said = {"cited": cited} if cited else {"no_cite": True}
                        status, _ = await connection.post(
                            "/v1/feedback", json.dumps({"selection_id": result["selection_id"], **said}).encode())
                        ok = status == 200
                except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, KeyError):
                    connection.close()
                    ok = False
                sent += 1
                if ok:
                    latencies.append(elapsed_one)
                else:
                    errors += 1
        finally:
            connection.close()

    started = time.perf_counter()
    stop = started + duration
    await asyncio.gather(*(client(n) for n in range(clients)))
    elapsed = time.perf_counter() - started
    return latencies, errors, sent, elapsed


def touch_every_user(url: str, questions: list[tuple[str, str]], k: int, m: int) -> None:
    """One query per user before timing: each user's index is loaded on its first search, a
    one-off cost that would otherwise land in the timed run."""
    first = {user: question for user, question in reversed(questions)}
    queries = [{"user": user, "query": question, "k": k, "m": m} for user, question in first.items()]
    for start in range(0, len(queries), 64):
        response = httpx.post(f"{url}/v1/retrieve", json={"queries": queries[start:start + 64]},
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
        response.raise_for_status()


def write_shadow_checkpoint(bank: Path, folder: Path, extra: dict[str, object]) -> None:
    """An untrained reranker checkpoint of the kind the server's live learner is (this bank's encoder
    and dimension, the learner settings `extra` gives): the shadow of a `--shadow` run."""
    from rmm.encoders import load_encoder
    from rmm.policy.learner import is_normalized_encoder
    from rmm.policy.registry import SHARED, LearnerRegistry
    from rmm.serve.config import load_config

    config = load_config(None, {"bank": str(bank), **extra}, environ={})
    encoder = load_encoder(config.encoder, device="cpu")
    registry = LearnerRegistry(encoder.dim, config.learner_config(is_normalized_encoder(encoder)),
                               encoder_name=encoder.fingerprint)
    registry.get(SHARED).save(folder)


def shadow_settings(checkpoint: Path) -> dict[str, object]:
    """The server settings of a `--shadow` run's shadow arm: the bench tenant's learner judged, the
    bench tenant an admin (so the bench may read `GET /v1/ope`)."""
    return {"shadow": {"checkpoint": str(checkpoint), "key": TENANT, "admin_tenants": [TENANT]}}


def time_ope(url: str) -> tuple[float, dict]:
    """Seconds one `GET /v1/ope` took, and its answer."""
    t0 = time.perf_counter()
    response = httpx.get(f"{url}/v1/ope", headers={"Authorization": f"Bearer {KEY}"}, timeout=600)
    elapsed = time.perf_counter() - t0
    response.raise_for_status()
    return elapsed, response.json()


def shadow_arms(rounds: int) -> list[str]:
    """The shadow arms in the order they run: off-on, on-off, off-on, ..."""
    return [arm for r in range(rounds) for arm in (("off", "on") if r % 2 == 0 else ("on", "off"))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its live descendants (the query encoder's process)
    (Linux /proc; NaN elsewhere): what a request costs the server whatever else the machine is doing."""
    def stat(p: int | str) -> list[str]:
        return Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()

    try:
        parents = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    parents[int(entry.name)] = int(stat(entry.name)[1])
                except (OSError, ValueError, IndexError):
                    continue  # exited meanwhile
        family, frontier = {pid}, [pid]
        while frontier:
            parent = frontier.pop()
            children = [p for p, pp in parents.items() if pp == parent and p not in family]
            family.update(children)
            frontier.extend(children)
        total = 0.0
        for member in family:
            try:
                fields = stat(member)
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total
    except (OSError, ValueError, IndexError):
        return float("nan")


def start_profile(pid: int, duration: float, out: Path) -> subprocess.Popen | None:
    """`py-spy record` of the server and its child processes (the query encoder's) for the timed
    window (raw collapsed stacks), or None without py-spy. Non-blocking sampling at 50 Hz: the
    profiler shares the cores with the server."""
    import shutil

    exe = shutil.which("py-spy")
    if exe is None:
        print("  (py-spy not found: pip install py-spy; no profile)", flush=True)
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, round(duration))),
                             "--rate", "50", "--nonblocking", "--threads", "--subprocesses", "--format", "raw",
                             "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def profile_summary(path: Path, top: int = 18) -> list[str]:
    """The functions in most samples (inclusive %, own %), from py-spy's collapsed stacks: one line
    per stack, frames `name (file:line)` separated by `;`, then the sample count."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    threads: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[frames[0]] = threads.get(frames[0], 0) + n
        names = [re.sub(r":\d+\)$", ")", f) for f in frames[1:]]
        for name in set(names):
            inclusive[name] = inclusive.get(name, 0) + n
        if names:
            own[names[-1]] = own.get(names[-1], 0) + n
    if not total:
        return ["  (no samples)"]
    lines = [f"  {total} samples (all threads, idle excluded); by thread: "
             + ", ".join(f"{t} {100 * n / total:.1f}%" for t, n in sorted(threads.items(), key=lambda x: -x[1])[:4])]
    lines.append(f"  {'incl %':>7} {'own %':>6}  function")
    for name, n in sorted(inclusive.items(), key=lambda x: -x[1])[:top]:
        lines.append(f"  {100 * n / total:7.1f} {100 * own.get(name, 0) / total:6.1f}  {name[:110]}")
    lines.append("  top own time:")
    for name, n in sorted(own.items(), key=lambda x: -x[1])[:top // 2]:
        lines.append(f"  {100 * inclusive[name] / total:7.1f} {100 * n / total:6.1f}  {name[:110]}")
    return lines


def stage_busy(row: Row) -> str:
    """How busy the two pipelined stages were; none without micro-batching, where each request runs
    both on its own, many at a time (their summed stage time is a concurrency, not a share)."""
    if row.batching != "on":
        return "–"
    return f"{100 * row.prepare_busy:.0f}% / {100 * row.finish_busy:.0f}%"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=("locomo", "goal"), default="locomo",
                        help="goal: 32 users x 10k synthetic memories, 32 clients (see the module docstring)")
    parser.add_argument("--users", type=int, default=32, help="goal setting: users")
    parser.add_argument("--per-user", type=int, default=10_000, help="goal setting: memories per user")
    parser.add_argument("--clients", type=int, nargs="+", help="default: 1 8 32 (locomo), 32 (goal)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of load per configuration")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds of unmeasured load before each")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--m", type=int, default=5)
    parser.add_argument("--conversations", type=int, help="use only the first N LoCoMo conversations")
    parser.add_argument("--bank", help="bank folder (default: <cache>/bench-serve/locomo-turn-minilm)")
    parser.add_argument("--data-dir", help="benchmark data (default: $RMM_DATA_DIR / the shared data folder)")
    parser.add_argument("--device", default="cpu", help="server device (auto | cpu | cuda)")
    parser.add_argument("--threads", type=int, default=1,
                        help="server torch threads (default 1: the clients need the other core of a 2-core box; "
                             "0 = torch's default)")
    parser.add_argument("--modes", nargs="+", choices=("on", "off"), default=["on", "off"])
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=JSON",
                        help="extra server setting, e.g. --set query_precision='\"int8\"' (repeatable)")
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--profile", metavar="DIR", help="record the server with py-spy during each timed run "
                        "(DIR/serve-MODE-CLIENTS.txt, collapsed stacks) and print its top functions")
    parser.add_argument("--shadow", action="store_true",
                        help="server CPU per request with and without a shadow reranker, clients sending feedback "
                             "(see the module docstring)")
    parser.add_argument("--shadow-rounds", type=int, default=1,
                        help="--shadow: off/on pairs per configuration, alternating their order (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from rmm.paths import cache_dir

    goal = args.setting == "goal"
    args.clients = args.clients or ([32] if goal else [1, 8, 32])
    extra = {key: json.loads(value) for key, _, value in (s.partition("=") for s in args.settings)}
    if goal:  # 10k rows per user outgrow the cache: a 4-bit scan (re-scored in float32) reads a sixth of the bytes
        extra.setdefault("index_precision", "int4")
    if goal:
        default_bank = cache_dir() / "bench-serve" / f"synthetic-{args.users}x{args.per_user}-minilm"
        what = f"{args.users} users x {args.per_user} synthetic memories (random unit vectors), LoCoMo questions"
    else:
        default_bank = cache_dir() / "bench-serve" / "locomo-turn-minilm"
        what = "LoCoMo turns, MiniLM"
    bank = Path(args.bank) if args.bank else default_bank
    if not args.bank:  # the bench's own bank: the selections earlier runs left pending (tens of KB each) go
        for leftover in bank.glob("selections.sqlite*"):
            leftover.unlink()
        if args.shadow and (bank / "reranker").is_dir():  # what earlier runs' feedback trained
            import shutil

            shutil.rmtree(bank / "reranker")
    print(f"bank {bank} ({what}); K {args.k}, M {args.m}; server device {args.device}, torch threads "
          f"{args.threads or 'default'}; {os.cpu_count()} CPUs; settings {extra or 'default'}", flush=True)
    t0 = time.perf_counter()
    if goal:
        pairs = build_synthetic_bank(bank, args.data_dir, args.users, args.per_user, args.seed)
    else:
        pairs = build_bank(bank, args.data_dir, args.conversations)
    print(f"  ready in {time.perf_counter() - t0:.1f} s; {len(pairs)} questions", flush=True)
    rows: list[Row] = []
    ope_calls: list[tuple[str, int, float, dict]] = []  # (batching, clients, seconds, answer) of GET /v1/ope
    with tempfile.TemporaryDirectory(prefix="rmm-bench-serve-") as tmp:
        shadow_checkpoint = Path(tmp) / "shadow"
        if args.shadow:
            write_shadow_checkpoint(bank, shadow_checkpoint, extra)
        for mode, arm in [(mode, arm) for mode in args.modes
                          for arm in (shadow_arms(args.shadow_rounds) if args.shadow else ["none"])]:
            batching = mode == "on"
            settings = {**extra, **(shadow_settings(shadow_checkpoint) if arm == "on" else {})}
            proc, url, _log = start_server(bank, Path(tmp), batching, args.max_batch, args.max_wait_ms, args.device,
                                          args.threads or None, settings, tag=f"-shadow-{arm}")
            health = server_health(url)
            print(f"  server ({mode}{'' if arm == 'none' else f', shadow {arm}'}): torch threads "
                  f"{health['torch_threads']}; {engine_line(health)}", flush=True)
            feedback = arm != "none"
            try:
                touch_every_user(url, pairs, args.k, args.m)
                for clients in args.clients:
                    asyncio.run(load(url, pairs, clients, args.warmup, args.k, args.m, args.seed + 99, feedback))
                    profile = Path(args.profile) / f"serve-{mode}-{clients}.txt" if args.profile else None
                    spy = None
                    if profile is not None:
                        profile.parent.mkdir(parents=True, exist_ok=True)
                        spy = start_profile(proc.pid, args.duration, profile)
                    before, cpu_before = batch_totals(url), cpu_seconds(proc.pid)
                    client_before = time.process_time()
                    latencies, errors, sent, elapsed = asyncio.run(
                        load(url, pairs, clients, args.duration, args.k, args.m, args.seed, feedback))
                    client_cpu = time.process_time() - client_before
                    after, cpu_after = batch_totals(url), cpu_seconds(proc.pid)
                    if spy is not None and profile is not None:
                        spy.wait(60)
                        if profile.exists():
                            print(f"  py-spy profile of the server ({mode}, {clients} clients): {profile}")
                            print("\n".join(profile_summary(profile)), flush=True)
                    batches = after[1] - before[1]
                    row = Row(clients=clients, batching=mode, max_batch=args.max_batch if batching else 1,
                              max_wait_ms=args.max_wait_ms if batching else 0.0, requests=sent,
                              req_per_s=len(latencies) / elapsed, p50_ms=1000 * percentile(latencies, 0.5),
                              p90_ms=1000 * percentile(latencies, 0.9), p99_ms=1000 * percentile(latencies, 0.99),
                              max_ms=1000 * max(latencies, default=float("nan")),
                              mean_batch=(after[0] - before[0]) / batches if batches else float("nan"),
                              errors=errors, load_avg=os.getloadavg()[0],
                              server_cpu_ms=1000 * (cpu_after - cpu_before) / max(1, sent),
                              client_cpu_ms=1000 * client_cpu / max(1, sent), client_cpu_share=client_cpu / elapsed,
                              prepare_busy=(after[2] - before[2]) / elapsed, finish_busy=(after[3] - before[3]) / elapsed,
                              shadow=arm)
                    rows.append(row)
                    print(f"  batching {mode:3s} clients {clients:3d}: {row.req_per_s:7.1f} req/s  "
                          f"p50 {row.p50_ms:7.1f} ms  p90 {row.p90_ms:7.1f} ms  p99 {row.p99_ms:7.1f} ms  max {row.max_ms:7.1f} ms  batch {row.mean_batch:5.1f}  "
                          f"server CPU {row.server_cpu_ms:5.1f} ms/req  client CPU {row.client_cpu_ms:4.2f} ms/req "
                          f"({100 * row.client_cpu_share:.0f}% of a core)  stages busy (encode / search+rerank+store) {stage_busy(row)}  errors {errors}  "
                          f"load {row.load_avg:.1f}{'' if arm == 'none' else f'  shadow {arm}'}",
                          flush=True)
                    if arm == "on":
                        seconds, answer = time_ope(url)
                        ope_calls.append((mode, clients, seconds, answer))
                        print(f"  GET /v1/ope: {1000 * seconds:.0f} ms over {answer['selections']} rewarded "
                              f"selections: {answer['status']} ({answer['reason']})", flush=True)
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()

    print()
    print("| clients | batching | shadow | max_batch | max_wait_ms | req/s | p50 ms | p90 ms | p99 ms | max ms "
          "| mean batch | server CPU ms/req | client CPU ms/req | busy: encode / search+rerank+store | errors | load |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.clients} | {r.batching} | {r.shadow} | {r.max_batch} | {r.max_wait_ms:g} | {r.req_per_s:.1f} | "
              f"{r.p50_ms:.1f} | {r.p90_ms:.1f} | {r.p99_ms:.1f} | {r.max_ms:.1f} | {r.mean_batch:.1f} | {r.server_cpu_ms:.1f} | {r.client_cpu_ms:.2f} | "
              f"{stage_busy(r)} | {r.errors} | "
              f"{r.load_avg:.1f} |")
    on = {r.clients: r for r in rows if r.batching == "on" and r.shadow != "on"}
    off = {r.clients: r for r in rows if r.batching == "off" and r.shadow != "on"}
    common = [c for c in args.clients if c in on and c in off]
    if common:
        print()
        for c in common:
            print(f"clients {c:3d}: batching on / off throughput = {on[c].req_per_s / off[c].req_per_s:.2f}x, "
                  f"p99 on / off = {on[c].p99_ms:.1f} / {off[c].p99_ms:.1f} ms = "
                  f"{on[c].p99_ms / off[c].p99_ms:.2f}x, server CPU per request off / on = "
                  f"{off[c].server_cpu_ms / on[c].server_cpu_ms:.2f}x")
    if args.shadow:
        print()
        for line in shadow_summary(rows, ope_calls):
            print(line)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
        print(f"wrote {args.json}")
    failed = sum(r.errors for r in rows)
    if failed:
        print(f"FAILED: {failed} request(s) failed", file=sys.stderr)
    slower = batching_slower(rows)
    for line in slower:
        print(f"FAILED: {line}", file=sys.stderr)
    if failed or slower:
        return 1
    print("all requests succeeded; batching on is not slower than off")
    return 0


def shadow_summary(rows: list[Row], ope_calls: list[tuple[str, int, float, dict]]) -> list[str]:
    """Per batching mode and client count: server CPU per request with the shadow over without (the
    mean of each arm's runs), and the `GET /v1/ope` latencies."""
    lines = []
    for mode, clients in sorted({(r.batching, r.clients) for r in rows if r.shadow == "on"}):
        arms = {arm: [r for r in rows if (r.batching, r.clients, r.shadow) == (mode, clients, arm)]
                for arm in ("on", "off")}
        if not arms["off"]:
            continue
        cpu = {arm: sum(r.server_cpu_ms for r in runs) / len(runs) for arm, runs in arms.items()}
        rate = {arm: sum(r.req_per_s for r in runs) / len(runs) for arm, runs in arms.items()}
        calls = [f"{1000 * s:.0f} ms ({a['selections']} rows, {a['status']})"
                 for m, c, s, a in ope_calls if (m, c) == (mode, clients)]
        lines.append(f"batching {mode} clients {clients}: server CPU per request (retrieve + feedback) shadow on / off "
                     f"= {cpu['on']:.2f} / {cpu['off']:.2f} ms = {cpu['on'] / cpu['off']:.3f}x "
                     f"({100 * (cpu['on'] / cpu['off'] - 1):+.1f}%); req/s {rate['on']:.1f} / {rate['off']:.1f}; "
                     f"GET /v1/ope {', '.join(calls)}")
    return lines


def batching_slower(rows: list[Row]) -> list[str]:
    """The client counts at which batching on answered fewer requests a second than off: micro-
    batching exists to be faster, so a slower 'on' is a fast path gone wrong on this machine
    (issue 34: 0.3 vs 125 req/s with oneDNN's int8 kernel on an AMD EPYC)."""
    on = {r.clients: r for r in rows if r.batching == "on" and r.shadow != "on"}
    off = {r.clients: r for r in rows if r.batching == "off" and r.shadow != "on"}
    return [f"batching on is slower than off at {c} clients: {on[c].req_per_s:.1f} vs {off[c].req_per_s:.1f} req/s"
            for c in sorted(set(on) & set(off)) if on[c].req_per_s < off[c].req_per_s]


if __name__ == "__main__":
    sys.exit(main())
