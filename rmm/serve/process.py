"""Running `rmm serve` as a child process: what benchmarks, crash tests and notebooks need.

The server gets its own process (as in production) so that `kill -9` is a real crash and client
load does not share the server's interpreter; `start_server_process` returns once `/health`
answers, or raises with the end of the server's log.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rmm.errors import RmmError

__all__ = ["free_port", "start_server_process"]


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_process(bank: str | Path, config: str | Path, log_path: str | Path, *, port: int | None = None,
                         timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    """Start `rmm serve --bank BANK --config CONFIG` on loopback; (process, base URL) once healthy.

    The log is appended to, so a restarted server's output follows the crashed one's.
    """
    port = port or free_port()
    log_path = Path(log_path)
    with log_path.open("a") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rmm", "serve", "--bank", str(bank), "--config", str(config),
             "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RmmError(f"rmm serve exited with {proc.returncode}; end of {log_path}:\n"
                           f"{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RmmError(f"rmm serve did not become healthy in {timeout_s:.0f} s; see {log_path}")
        time.sleep(0.2)
