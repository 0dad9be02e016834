#!/usr/bin/env python
"""Crash test for `rmm serve`: writes under load, `kill -9`, restart, every acknowledged write is there.

Starts the server in a subprocess on a fresh bank, runs writer threads that add memories (with
ids they choose, 1-3 per request) and reader threads that retrieve (leaving selections pending),
each recording what the server acknowledged (HTTP 201 / 200). At a random moment it sends
SIGKILL, restarts the server on the same bank and checks that

* every acknowledged memory is stored, with its text (listing each user's memories),
* a sample of them is retrievable: searching a memory's own text shows it first,
* every acknowledged selection still accepts feedback (pending selections are durable).

Prints the counts; exits 1 if anything acknowledged was lost.

    python -m rmm.bench.crash                       # 6 writers, 2 readers, kill after 3-6 s
    python -m rmm.bench.crash --writers 16 --seconds 20 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from rmm.errors import RmmError
from rmm.serve.process import start_server_process

KEY, TENANT = "crash-test-key-0123", "crash"
WORDS = ["garden", "river", "violin", "pottery", "marathon", "chess", "lantern", "harbor", "orchard", "comet", "sailing", "bakery", "museum", "glacier", "falcon", "canyon", "meadow", "bicycle", "telescope", "library", "volcano", "compass", "ember", "quartz"]


def start(bank: Path, config: Path, log: Path) -> tuple[subprocess.Popen, str]:
    try:
        return start_server_process(bank, config, log)
    except RmmError as error:
        raise SystemExit(str(error)) from error


def sentence(rng: random.Random, n: int) -> str:
    return f"memory {n}: " + " ".join(rng.choice(WORDS) for _ in range(8))


def run_round(bank: Path, config: Path, log: Path, args: argparse.Namespace, round_no: int,
              acked: dict[tuple[str, str], str], selections: list[str]) -> dict[str, int]:
    proc, url = start(bank, config, log)
    stop = threading.Event()
    lock = threading.Lock()
    attempts = {"writes": 0, "write_errors": 0, "reads": 0}
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

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(args.writers)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(args.readers)]
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
    return attempts


def verify(bank: Path, config: Path, log: Path, acked: dict[tuple[str, str], str], selections: list[str],
           sample: int) -> int:
    proc, url = start(bank, config, log)
    lost: list[tuple[str, str]] = []
    wrong: list[tuple[str, str]] = []
    try:
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
    failed = bool(lost or wrong or found < len(probe) or feedback_ok < len(selections))
    print("CRASH TEST FAILED" if failed else "CRASH TEST PASSED: nothing acknowledged was lost")
    return 1 if failed else 0


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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rmm-crash-") as tmp:
        bank = Path(args.bank) if args.bank else Path(tmp) / "bank"
        config = Path(tmp) / "serve.json"
        config.write_text(json.dumps({"auth": {"keys": {KEY: TENANT}}, "encoder": args.encoder, "device": "cpu",
                                      "log_level": "warning", "torch_threads": 1}))
        log = Path(tmp) / "server.log"
        acked: dict[tuple[str, str], str] = {}
        selections: list[str] = []
        for round_no in range(args.rounds):
            run_round(bank, config, log, args, round_no, acked, selections)
        if not acked:
            print("no write was acknowledged before the kill; raise --seconds", file=sys.stderr)
            return 1
        return verify(bank, config, log, acked, selections, args.sample)


if __name__ == "__main__":
    sys.exit(main())
