"""`rmm ope --server URL [--promote]` (issue 32 item 5): the command asks a running `rmm serve` for its
shadow's estimate and for guarded promotion through the official client; a refusal is one line with
both figures and a non-zero exit, errors (403, no shadow, server down) one clear line. The server runs
in this process (uvicorn on loopback, as tests/test_serve_client.py), its traffic logged through its
service as tests/test_serve_shadow.py does."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import uvicorn
from fakes import BagOfWordsEncoder, loopback_server
from test_serve_shadow import GOOD, Q0, config, log_traffic, write_shadow

from rmm.cli import main
from rmm.policy.registry import SHARED
from rmm.serve.app import create_app
from rmm.serve.service import RetrievalService

ADMIN, ALPHA = "key-admin-123", "key-alpha-123"
URL = "http://127.0.0.1:1"  # for parse-time checks only


@contextmanager
def serving(bank: Path, traffic: int = 0, **shadow: object) -> Iterator[tuple[str, RetrievalService]]:
    """A real server on loopback (uvicorn in a thread, lifespan on) with `traffic` rewarded live
    selections logged through its service; yields its URL and the service."""
    cfg = config(bank, **shadow) if shadow else config(bank)
    cfg.shadow.admin_tenants = ["admin"]
    app = create_app(cfg, encoder=BagOfWordsEncoder())
    with loopback_server(app) as url:
        service = app.state.service
        if traffic:
            log_traffic(service, traffic)
        yield url, service


@pytest.fixture(scope="module")
def shadows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shadows")
    out = {"better": root / "better", "worse": root / "worse"}
    write_shadow(root / "bank", out["better"], 2.0)
    write_shadow(root / "bank", out["worse"], -2.0)
    return out


def test_estimate_then_promotion(tmp_path: Path, shadows, capsys) -> None:
    with serving(tmp_path / "bank", 400, checkpoint=str(shadows["better"])) as (url, service):
        before = service.learner(SHARED).reranker.W_q.weight.clone()
        assert main(["ope", "--server", url, "--api-key", ADMIN]) == 0  # the running estimate only
        printed = capsys.readouterr().out
        assert "promote: dr lower bound" in printed and "live value" in printed and "dr *" in printed
        assert torch.equal(service.learner(SHARED).reranker.W_q.weight, before)  # asking changes nothing

        out = tmp_path / "promoted.json"
        assert main(["ope", "--server", url, "--api-key", ADMIN, "--promote", "--json", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "promoted:" in printed and "previous live weights are kept at" in printed
        assert torch.allclose(service.learner(SHARED).reranker.W_q.weight, 2.0 * torch.outer(GOOD, Q0))
        figures = json.loads(out.read_text())
        assert figures["promoted"] and figures["low"] > figures["live_value"] and figures["server"] == url


def test_a_refusal_is_one_line_with_both_figures(tmp_path: Path, shadows, capsys) -> None:
    with serving(tmp_path / "bank", 400, checkpoint=str(shadows["worse"])) as (url, service):
        before = service.learner(SHARED).reranker.W_q.weight.clone()
        assert main(["ope", "--server", url, "--api-key", ADMIN, "--promote"]) == 1
        (line,) = capsys.readouterr().out.strip().splitlines()
        assert line.startswith("promotion refused: dr lower bound") and "does not clear the live value" in line
        assert torch.equal(service.learner(SHARED).reranker.W_q.weight, before)


def test_too_little_evidence_is_a_refusal_too(tmp_path: Path, shadows, capsys) -> None:
    with serving(tmp_path / "bank", checkpoint=str(shadows["better"])) as (url, _):
        assert main(["ope", "--server", url, "--api-key", ADMIN, "--promote"]) == 1
        assert "promotion refused: 0 rewarded sampled selections" in capsys.readouterr().out


def test_a_tenant_that_is_not_admin_is_one_clear_error(tmp_path: Path, shadows, capsys) -> None:
    with serving(tmp_path / "bank", checkpoint=str(shadows["better"])) as (url, _):
        assert main(["ope", "--server", url, "--api-key", ALPHA, "--promote"]) == 2
        printed = " ".join(capsys.readouterr().out.split())  # rmm's error line, as the terminal width wraps it
        assert "HTTP 403" in printed and "not an admin" in printed and "Traceback" not in printed


def test_no_shadow_is_one_clear_error(tmp_path: Path, capsys) -> None:
    with serving(tmp_path / "bank") as (url, _):
        assert main(["ope", "--server", url, "--api-key", ADMIN]) == 2
        printed = " ".join(capsys.readouterr().out.split())
        assert "HTTP 404 no_shadow" in printed and "shadow.checkpoint" in printed


def test_a_server_that_is_down_is_one_clear_error(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["ope", "--server", f"http://127.0.0.1:{port}", "--api-key", ADMIN, "--timeout", "2"]) == 2
    printed = " ".join(capsys.readouterr().out.split())
    assert printed.startswith("error: cannot reach the rmm server") and "Traceback" not in printed


@pytest.mark.parametrize("argv, why", [
    (["ope", "logs", "target", "--promote"], "--promote needs --server"),
    (["ope", "logs", "--server", URL, "--api-key", ADMIN], "give no LOGS or TARGET"),
    (["ope", "--server", URL], "needs --api-key"),
    (["ope", "logs"], "give LOGS and TARGET, or --server"),
])
def test_mode_flags_are_checked_at_parse_time(argv: list[str], why: str, monkeypatch: pytest.MonkeyPatch,
                                              capsys) -> None:
    monkeypatch.delenv("RMM_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and why in capsys.readouterr().err
