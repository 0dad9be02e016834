"""Starting a server and waiting for readiness, against a stand-in for vLLM's OpenAI server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from rmm.errors import LLMError
from rmm.llm.vllm_server import (
    served_model_name,
    server_command,
    start_vllm_server,
    stop_server,
)

FAKE_SERVER = """
import argparse, json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--model"); parser.add_argument("--host"); parser.add_argument("--port", type=int)
parser.add_argument("--mode", default="ok"); parser.add_argument("--served-model-name")
args = parser.parse_args()
print("fake vllm starting", args.model, flush=True)
if args.mode == "crash":
    print("CUDA out of memory (pretend)", flush=True)
    sys.exit(3)
time.sleep(0.3)  # not ready at once: the caller must poll

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        name = args.served_model_name or args.model
        body = json.dumps({"data": [{"id": name}]} if args.mode == "ok" else {"data": []}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a):
        pass

HTTPServer((args.host, args.port), Handler).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    """An importable `vllm.entrypoints.openai.api_server` that serves /v1/models on loopback."""
    package = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(textwrap.dedent(FAKE_SERVER))
    return {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}


def test_command_is_vllms_openai_server() -> None:
    command = server_command("/m", "127.0.0.1", 8001, ["--dtype", "bfloat16"], python="/venv/bin/python")
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[3:] == ["--model", "/m", "--host", "127.0.0.1", "--port", "8001", "--dtype", "bfloat16"]


def test_waits_until_models_answers_then_stops(fake_vllm: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    proc = start_vllm_server("tiny-model", port=port, python=sys.executable, env=fake_vllm, timeout_s=20,
                             poll_s=0.1, log_path=tmp_path / "server.log")
    try:
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == "tiny-model"
        assert proc.base_url == f"http://127.0.0.1:{port}/v1"  # type: ignore[attr-defined]
    finally:
        stop_server(proc)
    assert proc.poll() is not None


def test_exit_before_ready_raises_with_log_tail(fake_vllm: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(LLMError, match=r"(?s)exited with code 3.*CUDA out of memory"):
        start_vllm_server("m", port=free_port(), extra_args=["--mode", "crash"], python=sys.executable,
                          env=fake_vllm, timeout_s=20, poll_s=0.1, log_path=tmp_path / "server.log")


def test_timeout_raises_and_stops_the_process(fake_vllm: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(LLMError, match=r"(?s)not ready after.*fake vllm starting"):
        start_vllm_server("m", port=free_port(), extra_args=["--mode", "empty"], python=sys.executable,
                          env=fake_vllm, timeout_s=1.5, poll_s=0.1, log_path=tmp_path / "server.log")


def test_served_model_name_is_what_clients_send() -> None:
    assert served_model_name("/models/smollm2-hf") == "/models/smollm2-hf"
    assert served_model_name("/m", ["--dtype", "float32", "--served-model-name", "smollm2"]) == "smollm2"
    assert served_model_name("/m", ["--served-model-name=smol"]) == "smol"


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_rmm_llm_serve_stops_the_server_on_sigterm(fake_vllm: dict[str, str], tmp_path: Path) -> None:
    """`kill PID` of `rmm llm serve` must not leave the server (its own process group) running."""
    port = free_port()
    command = [sys.executable, "-m", "rmm", "llm", "serve", "/models/smollm2-hf", "--port", str(port),
               "--python", sys.executable, "--timeout", "20", "--log", str(tmp_path / "server.log"),
               "--", "--served-model-name", "smollm2"]
    proc = subprocess.Popen(command, env=fake_vllm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks until `rmm llm serve` says the server is ready (or exits)
            lines.append(line)
            if line.startswith("ready"):
                break
        assert proc.poll() is None, "".join(lines)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"] == "smollm2"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines) + output
    assert proc.returncode == 0
    assert f"openai:http://127.0.0.1:{port}/v1@smollm2" in " ".join(output.split())
    assert _port_closed(port)
