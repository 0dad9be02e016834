"""`start_server_process`: a server that cannot start is reported with its log, not waited on."""

from __future__ import annotations

from pathlib import Path

import pytest

import rmm.serve.process as process_module
from rmm.errors import RmmError
from rmm.serve.process import free_port, start_server_process


def test_a_server_that_exits_at_start_raises_with_the_end_of_its_log(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("k: -3\n")
    log = tmp_path / "server.log"
    with pytest.raises(RmmError, match=r"(?s)exited with 2.*\bk\b"):
        start_server_process(tmp_path / "bank", config, log, timeout_s=120)
    assert log.exists() and log.read_text()


def test_free_port_takes_a_kernel_chosen_loopback_port_and_leaves_nothing_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`free_port` binds port 0 on loopback (the kernel picks one nobody holds), reads it and closes its
    socket before returning, so the server it is for can bind it. Checked on the socket it used, not by
    binding the port afterwards: that was true of almost any port, and another process may take the
    port meanwhile."""
    import socket

    made: list[socket.socket] = []
    bound: list[tuple] = []

    class Recording(socket.socket):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

        def bind(self, address: tuple) -> None:  # type: ignore[override]
            bound.append(address)
            super().bind(address)

    monkeypatch.setattr(process_module.socket, "socket", Recording)
    port = free_port()
    monkeypatch.undo()
    (sock,) = made
    assert bound == [("127.0.0.1", 0)]  # loopback, the kernel's choice
    assert (sock.family, sock.type) == (socket.AF_INET, socket.SOCK_STREAM)
    assert sock.fileno() == -1  # closed before returning: nothing of ours holds the port
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if ranges.exists():  # Linux: a port bound to 0 comes from the ephemeral range
        low, high = map(int, ranges.read_text().split())
        assert low <= port <= high
    else:
        assert 0 < port < 65536
