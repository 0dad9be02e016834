#!/usr/bin/env python
"""Crash test for `rmm serve`: writes under load, `kill -9`, restart, every acknowledged write is there.

Starts the server in a subprocess on a fresh bank, runs writer threads that add memories (with
ids they choose, 1-3 per request) and reader threads that retrieve (leaving selections pending),
each recording what the server acknowledged (HTTP 201 / 200). At a random moment it sends
SIGKILL, restarts the server on the same bank and checks that

* every acknowledged memory is stored, with its text (listing each user's memories),
* a sample of them is retrievable: searching a memory's own text shows it first,
* every acknowledged selection still accepts feedback (pending selections are durable).

With `--events` the server builds CompassMem event graphs (`reflection_events: true`) and
`--event-writers` threads add to them under the same load: whole sessions (`POST
/v1/users/{user}/sessions`, acknowledged 202 with their `events` job queued) and event memories
(`kind: event` through `/v1/memories`, acknowledged 201). After the restart it also checks that

* every acknowledged event memory is stored as an event, with its text;
* every acknowledged session's `events` job finishes `done` after the restart, every event its
  result names is stored, and some stored event refers to a turn of that session;
* the bank's graph tables hold nothing dangling (read from its SQLite file once the server is
  stopped): no edge whose source or target is not a stored memory of the user, no participants
  row or topic membership of a missing memory — and at least one edge was written, so the check
  tested something.

Prints the counts; exits 1 if anything acknowledged was lost.

    python -m rmm.bench.crash                       # 6 writers, 2 readers, kill after 3-6 s
    python -m rmm.bench.crash --writers 16 --seconds 20 --rounds 3
    python -m rmm.bench.crash --events --rounds 2   # + 2 event writers: sessions into the event graph
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rmm.errors import RmmError
from rmm.memory.bank import STORE_FILE
from rmm.serve.process import start_server_process

KEY, TENANT = "crash-test-key-0123", "crash"
TOPICS = [["garden", "tomatoes", "compost", "seedlings"], ["marathon", "training", "running", "shoes"],
          ["violin", "concert", "rehearsal", "orchestra"], ["pottery", "clay", "kiln", "glaze"],
          ["sailing", "harbor", "wind", "boat"], ["telescope", "comet", "stars", "night"]]
WORDS = ["garden", "river", "violin", "pottery", "marathon", "chess", "lantern", "harbor", "orchard", "comet", "sailing", "bakery", "museum", "glacier", "falcon", "canyon", "meadow", "bicycle", "telescope", "library", "volcano", "compass", "ember", "quartz"]


def start(bank: Path, config: Path, log: Path) -> tuple[subprocess.Popen, str]:
    try:
        return start_server_process(bank, config, log)
    except RmmError as error:
        raise SystemExit(str(error)) from error


def sentence(rng: random.Random, n: int) -> str:
    return f"memory {n}: " + " ".join(rng.choice(WORDS) for _ in range(8))


@dataclass
class EventAcks:
    """What the server acknowledged of the event graph: event memories (201) and sessions (202, with
    their `events` job)."""

    events: dict[tuple[str, str], str] = field(default_factory=dict)  # (user, id) -> text
    sessions: dict[tuple[str, str], tuple[str, list[str]]] = field(default_factory=dict)  # -> (job id, turn ids)


def session_body(rng: random.Random, session_id: str) -> dict:
    """A session of 8-14 turns over 2-3 topics in turn, so the fallback segmenter makes several events."""
    topics = rng.sample(TOPICS, rng.randint(2, 3))
    turns = []
    for i in range(rng.randint(8, 14)):
        words = topics[min(len(topics) - 1, i * len(topics) // 12)]
        turns.append({"speaker": "Ana" if i % 2 == 0 else "Ben", "id": f"{session_id}:{i}",
                      "text": f"we talked about {' '.join(rng.choice(words) for _ in range(6))} today"})
    return {"session_id": session_id, "time": "2024-06-01", "turns": turns}


def run_round(bank: Path, config: Path, log: Path, args: argparse.Namespace, round_no: int,
              acked: dict[tuple[str, str], str], selections: list[str], event_acks: EventAcks | None = None
              ) -> dict[str, int]:
    proc, url = start(bank, config, log)
    stop = threading.Event()
    lock = threading.Lock()
    attempts = {"writes": 0, "write_errors": 0, "reads": 0, "event_writes": 0}
    users = [f"user-{u}" for u in range(args.users)]

    def writer(w: int) -> None:
        rng = random.Random(1000 * round_no + w)
        n = 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            while not stop.is_set():
                user = rng.choice(users)
                batch = []
                for _ in range(rng.randint(1, 3)):
                    batch.append({"id": f"r{round_no}-w{w}-{n}", "text": sentence(rng, n)})
                    n += 1
                with lock:
                    attempts["writes"] += 1
                try:
                    response = http.post(f"/v1/users/{user}/memories", json={"memories": batch})
                except httpx.HTTPError:
                    with lock:
                        attempts["write_errors"] += 1
                    return  # the server died mid-request: not acknowledged, may or may not be there
                if response.status_code == 201:
                    with lock:
                        for memory in batch:
                            acked[(user, memory["id"])] = memory["text"]
                elif not stop.is_set():
                    print(f"unexpected {response.status_code}: {response.text}", file=sys.stderr)

    def reader(r: int) -> None:
        rng = random.Random(7000 + 100 * round_no + r)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            while not stop.is_set():
                with lock:
                    known = list({u for (u, _) in acked})
                if not known:
                    time.sleep(0.05)
                    continue
                try:
                    response = http.post("/v1/retrieve", json={"queries": [
                        {"user": rng.choice(known), "query": " ".join(rng.choice(WORDS) for _ in range(3))}]})
                except httpx.HTTPError:
                    return
                with lock:
                    attempts["reads"] += 1
                if response.status_code == 200:
                    sid = response.json()["results"][0]["selection_id"]
                    if sid:
                        with lock:
                            selections.append(sid)

    def event_writer(w: int) -> None:
        """Alternates a whole session (into the event graph, by its job) and 1-2 event memories."""
        assert event_acks is not None
        rng = random.Random(5000 + 100 * round_no + w)
        n = 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            while not stop.is_set():
                user = rng.choice(users)
                n += 1
                try:
                    if n % 2:
                        body = session_body(rng, f"r{round_no}-s{w}-{n}")
                        response = http.post(f"/v1/users/{user}/sessions", json=body)
                    else:
                        events = [{"id": f"r{round_no}-e{w}-{n}-{i}", "kind": "event", "text": sentence(rng, n),
                                   "refs": [f"r{round_no}-e{w}-{n}:{i}"], "time": "2024-06-01",
                                   "participants": ["Ana"]} for i in range(rng.randint(1, 2))]
                        response = http.post(f"/v1/users/{user}/memories", json={"memories": events})
                except httpx.HTTPError:
                    return  # cut off by the kill: not acknowledged
                with lock:
                    attempts["event_writes"] += 1
                    if n % 2 and response.status_code == 202:
                        job = response.json()
                        event_acks.sessions[(user, body["session_id"])] = (
                            job["events_job_id"], [t["id"] for t in body["turns"]])
                    elif not n % 2 and response.status_code == 201:
                        for event in events:
                            event_acks.events[(user, event["id"])] = event["text"]
                    elif not stop.is_set():
                        print(f"unexpected {response.status_code}: {response.text}", file=sys.stderr)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(args.writers)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(args.readers)]
    if event_acks is not None:
        threads += [threading.Thread(target=event_writer, args=(w,)) for w in range(args.event_writers)]
    for t in threads:
        t.start()
    delay = random.Random(round_no).uniform(args.seconds / 2, args.seconds)
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stop.set()
    for t in threads:
        t.join(60)
    print(f"round {round_no}: SIGKILL after {delay:.1f} s under load; {len(acked)} memories acknowledged so far; "
          f"{attempts['writes']} write requests this round, {attempts['write_errors']} cut off by the kill; "
          f"{attempts['reads']} retrievals", flush=True)
    if event_acks is not None:
        print(f"  event graph: {len(event_acks.sessions)} sessions and {len(event_acks.events)} event memories "
              f"acknowledged so far; {attempts['event_writes']} event-writer requests answered this round", flush=True)
    return attempts


def verify(bank: Path, config: Path, log: Path, acked: dict[tuple[str, str], str], selections: list[str],
           sample: int, event_acks: EventAcks | None = None, job_timeout: float = 300.0) -> int:
    proc, url = start(bank, config, log)
    lost: list[tuple[str, str]] = []
    wrong: list[tuple[str, str]] = []
    graph_failed = False
    try:
        if event_acks is not None:
            graph_failed = verify_events(url, event_acks, job_timeout)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            stored: dict[tuple[str, str], str] = {}
            for user in sorted({u for (u, _) in acked}):
                response = http.get(f"/v1/users/{user}/memories")
                if response.status_code == 200:
                    stored.update({(user, m["id"]): m["text"] for m in response.json()["memories"]})
            for key, text in acked.items():
                if key not in stored:
                    lost.append(key)
                elif stored[key] != text:
                    wrong.append(key)
            probe = random.Random(0).sample(sorted(acked), min(sample, len(acked)))
            found = 0
            for user, memory_id in probe:
                response = http.post("/v1/retrieve", json={"queries": [
                    {"user": user, "query": acked[(user, memory_id)], "explore": False, "k": 5, "m": 5}]})
                if response.status_code == 200 and memory_id in [m["id"] for m in response.json()["results"][0]["memories"]]:
                    found += 1
            feedback_ok = 0
            for sid in selections:
                response = http.post("/v1/feedback", json={"selection_id": sid, "cited": [0]})
                feedback_ok += response.status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"after restart: {len(acked)} acknowledged memories, {len(acked) - len(lost)} present, {len(lost)} lost, "
          f"{len(wrong)} with wrong text; retrieval of own text finds {found}/{len(probe)}; "
          f"feedback accepted for {feedback_ok}/{len(selections)} acknowledged selections")
    if lost:
        print(f"LOST: {lost[:10]}", file=sys.stderr)
    if event_acks is not None:
        graph_failed = verify_graph_tables(bank) or graph_failed
    failed = bool(lost or wrong or found < len(probe) or feedback_ok < len(selections) or graph_failed)
    print("CRASH TEST FAILED" if failed else "CRASH TEST PASSED: nothing acknowledged was lost")
    return 1 if failed else 0


def verify_events(url: str, event_acks: EventAcks, job_timeout: float) -> bool:
    """After the restart: every acknowledged event memory is an event with its text; every acknowledged
    session's `events` job ends `done`, with its events stored and one of the session's turns in some
    event. Returns True when something failed."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        jobs: dict[tuple[str, str], dict] = {}
        deadline = time.monotonic() + job_timeout
        pending = dict(event_acks.sessions)
        while pending and time.monotonic() < deadline:
            for key, (job_id, _) in list(pending.items()):
                response = http.get(f"/v1/jobs/{job_id}")
                if response.status_code == 200 and response.json()["status"] in ("done", "failed", "cancelled"):
                    jobs[key] = response.json()
                    del pending[key]
            if pending:
                time.sleep(0.5)
        users = sorted({u for (u, _) in event_acks.events} | {u for (u, _) in event_acks.sessions})
        stored: dict[tuple[str, str], dict] = {}
        for user in users:
            response = http.get(f"/v1/users/{user}/memories")
            if response.status_code == 200:
                stored.update({(user, m["id"]): m for m in response.json()["memories"]})
    lost_events = [key for key in event_acks.events if key not in stored]
    wrong_events = [key for key, text in event_acks.events.items()
                    if key in stored and (stored[key]["kind"] != "event" or stored[key]["text"] != text)]
    not_done = {key: job.get("status") for key, job in jobs.items() if job["status"] != "done"}
    missing_built: list[tuple[str, str]] = []
    uncovered: list[tuple[str, str]] = []
    refs_by_user: dict[str, set[str]] = {}
    for (user, _), memory in stored.items():
        if memory["kind"] == "event":
            refs_by_user.setdefault(user, set()).update(memory["refs"])
    for (user, session), job in jobs.items():
        if job["status"] != "done":
            continue
        missing_built += [(user, e) for e in job["result"].get("events", []) if (user, e) not in stored]
        if refs_by_user.get(user, set()).isdisjoint(event_acks.sessions[(user, session)][1]):
            uncovered.append((user, session))
    events_built = sum(len(job["result"].get("events", [])) for job in jobs.values() if job["status"] == "done")
    print(f"event graph after restart: {len(event_acks.events)} acknowledged event memories, "
          f"{len(lost_events)} lost, {len(wrong_events)} not an event with its text; "
          f"{len(event_acks.sessions)} acknowledged sessions, {len(jobs) - len(not_done)} events jobs done "
          f"(their results name {events_built} new events), {len(not_done)} failed or "
          f"cancelled, {len(pending)} unfinished after {job_timeout:.0f} s; {len(missing_built)} built events missing; "
          f"{len(uncovered)} sessions with no event over their turns")
    for name, items in (("LOST EVENTS", lost_events), ("WRONG EVENTS", wrong_events),
                        ("JOBS NOT DONE", list(not_done.items())), ("JOBS UNFINISHED", list(pending)),
                        ("BUILT EVENTS MISSING", missing_built), ("SESSIONS WITHOUT EVENTS", uncovered)):
        if items:
            print(f"{name}: {items[:10]}", file=sys.stderr)
    return bool(lost_events or wrong_events or not_done or pending or missing_built or uncovered)


GRAPH_CHECKS = {
    "edges from a missing memory": "SELECT COUNT(*) FROM graph_edges e WHERE NOT EXISTS "
                                   "(SELECT 1 FROM memories m WHERE m.user_id = e.user_id AND m.id = e.source)",
    "edges to a missing memory": "SELECT COUNT(*) FROM graph_edges e WHERE NOT EXISTS "
                                 "(SELECT 1 FROM memories m WHERE m.user_id = e.user_id AND m.id = e.target)",
    "participants of a missing memory": "SELECT COUNT(*) FROM graph_events g WHERE NOT EXISTS "
                                        "(SELECT 1 FROM memories m WHERE m.user_id = g.user_id AND m.id = g.memory_id)",
    "topic members missing": "SELECT COUNT(*) FROM graph_members g WHERE NOT EXISTS "
                             "(SELECT 1 FROM memories m WHERE m.user_id = g.user_id AND m.id = g.memory_id)",
}


def verify_graph_tables(bank: Path) -> bool:
    """The stopped server's SQLite file: nothing in the graph tables refers to a missing memory, and
    some edge was written (else the check proved nothing). Returns True when something failed."""
    with sqlite3.connect(f"file:{bank / STORE_FILE}?mode=ro", uri=True) as db:
        dangling = {name: db.execute(sql).fetchone()[0] for name, sql in GRAPH_CHECKS.items()}
        edges = db.execute("SELECT COUNT(*) FROM graph_edges").fetchone()[0]
        labels = dict(db.execute("SELECT label, COUNT(*) FROM graph_edges GROUP BY label").fetchall())
        events = db.execute("SELECT COUNT(*) FROM memories WHERE kind = 'event'").fetchone()[0]
    print(f"graph tables: {events} events, {edges} edges {labels}; dangling: "
          + ", ".join(f"{n} {name}" for name, n in dangling.items()))
    if not edges:
        print("no edge was written before the kills: the graph check tested nothing (raise --seconds)",
              file=sys.stderr)
    return bool(any(dangling.values()) or not edges)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=6)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0, help="kill at a random time in [s/2, s]")
    parser.add_argument("--rounds", type=int, default=1, help="load + kill -9 rounds before verifying")
    parser.add_argument("--sample", type=int, default=40, help="memories checked by retrieval")
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--bank", help="bank folder (default: a fresh temporary one)")
    parser.add_argument("--events", action="store_true",
                        help="also build event graphs under the load (reflection_events) and check them")
    parser.add_argument("--event-writers", type=int, default=2, help="--events: threads adding sessions and events")
    parser.add_argument("--job-timeout", type=float, default=300.0,
                        help="--events: seconds the restarted server gets to finish the acknowledged events jobs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rmm-crash-") as tmp:
        bank = Path(args.bank) if args.bank else Path(tmp) / "bank"
        config = Path(tmp) / "serve.json"
        config.write_text(json.dumps({"auth": {"keys": {KEY: TENANT}}, "encoder": args.encoder, "device": "cpu",
                                      "log_level": "warning", "torch_threads": 1,
                                      "reflection_events": args.events}))
        log = Path(tmp) / "server.log"
        acked: dict[tuple[str, str], str] = {}
        selections: list[str] = []
        event_acks = EventAcks() if args.events else None
        for round_no in range(args.rounds):
            run_round(bank, config, log, args, round_no, acked, selections, event_acks)
        if not acked or (event_acks is not None and not event_acks.sessions):
            print("no write (or, with --events, no session) was acknowledged before the kill; raise --seconds",
                  file=sys.stderr)
            return 1
        return verify(bank, config, log, acked, selections, args.sample, event_acks, args.job_timeout)


if __name__ == "__main__":
    sys.exit(main())
