"""`start_server_process`: a server that cannot start is reported with its log, not waited on."""

from __future__ import annotations

from pathlib import Path

import pytest

from rmm.errors import RmmError
from rmm.serve.process import free_port, start_server_process


def test_a_server_that_exits_at_start_raises_with_the_end_of_its_log(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("k: -3\n")
    log = tmp_path / "server.log"
    with pytest.raises(RmmError, match=r"(?s)exited with 2.*\bk\b"):
        start_server_process(tmp_path / "bank", config, log, timeout_s=120)
    assert log.exists() and log.read_text()


def test_free_port_is_bindable() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
