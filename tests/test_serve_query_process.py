"""The query encoder in a child process: the same vectors as in-process, a clear error when the
child dies (and a new child for the next call), refusals at start-up, and the server's wiring."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder, write_tiny_bert

from rmm.errors import ConfigError
from rmm.errors import EncoderUnavailableError
from rmm.serve.http_errors import error_response
from rmm.encoders.query.precision import build_engine
from rmm.encoders.query.process import ProcessQueryEncoder, QueryProcessSpec

QUERIES = ["Where does she hike?", "Who bakes bread on Sundays with her sister?", "Dog?"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("query_process")
    return (write_tiny_bert(root / "a", minilm_path, heads=4), write_tiny_bert(root / "b", minilm_path, seed=1, heads=4))


def local_encoder(folder: Path):
    from rmm.encoders import load_encoder

    return build_engine(load_encoder(str(folder), device="cpu"), "int8")


def kill_child(encoder: ProcessQueryEncoder) -> int:
    """SIGKILL the encoder's child and wait until it is gone; its pid."""
    child = encoder._child
    assert child is not None and child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.process.join(10)
    assert not child.process.is_alive()
    return child.pid


def test_child_vectors_are_the_in_process_ones_and_a_dead_child_is_replaced(folders) -> None:
    local = local_encoder(folders[0])
    encoder = ProcessQueryEncoder(local, QueryProcessSpec(str(folders[0]), "int8", 1))
    try:
        assert torch.equal(encoder.encode_queries(QUERIES), local.encode_queries(QUERIES))
        assert encoder.encode_queries([]).shape == (0, local.dim)
        assert torch.equal(encoder.encode_passages(QUERIES), local.encode_passages(QUERIES))  # in-process
        assert (encoder.name, encoder.dim, encoder.fingerprint) == (local.name, local.dim, local.fingerprint)
        child = encoder.child_pid
        assert child is not None and child != os.getpid()
        # died while idle: the next call starts a new child and succeeds
        kill_child(encoder)
        assert torch.equal(encoder.encode_queries(QUERIES), local.encode_queries(QUERIES))
        assert encoder.child_pid not in (None, child)
        # dies during a call: that call answers 503, the next one gets a new child
        outcome: list[BaseException] = []

        def long_call() -> None:
            try:
                encoder.encode_queries(["x"] * 200_000)  # seconds of work for the child
            except BaseException as err:  # noqa: BLE001 - the test inspects it
                outcome.append(err)

        caller = threading.Thread(target=long_call)
        caller.start()
        time.sleep(0.5)
        os.kill(encoder.child_pid, signal.SIGKILL)  # type: ignore[arg-type]  # the caller reaps it (one waiter only)
        caller.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], EncoderUnavailableError) and "died" in str(outcome[0])
        assert torch.equal(encoder.encode_queries(QUERIES), local.encode_queries(QUERIES))  # a new child
        encoder.spec = QueryProcessSpec(str(folders[0] / "missing"), "int8", 1)  # the restart cannot load
        kill_child(encoder)
        with pytest.raises(EncoderUnavailableError, match="could not be restarted"):  # 503, not a 422
            encoder.encode_queries(QUERIES)
    finally:
        encoder.close()
    assert encoder.child_pid is None
    with pytest.raises(EncoderUnavailableError, match="closed"):
        encoder.encode_queries(QUERIES)


def test_a_failing_call_raises_its_error_and_the_child_stays(folders) -> None:
    local = local_encoder(folders[0])
    encoder = ProcessQueryEncoder(local, QueryProcessSpec(str(folders[0]), "int8", 1))
    try:
        child = encoder.child_pid
        with pytest.raises((TypeError, ValueError, AttributeError)):
            encoder.encode_queries([None])  # type: ignore[list-item]  # the tokenizer refuses it
        assert encoder.child_pid == child
        assert torch.equal(encoder.encode_queries(QUERIES), local.encode_queries(QUERIES))
    finally:
        encoder.close()


def test_passages_are_not_held_up_by_a_query_call(folders) -> None:
    """The server's LockedEncoder must not hold its lock while the child works (or restarts)."""
    from rmm.encoders.query.locked import LockedEncoder

    local = local_encoder(folders[0])
    encoder = ProcessQueryEncoder(local, QueryProcessSpec(str(folders[0]), "int8", 1))
    locked = LockedEncoder(encoder)
    release = threading.Event()
    original = encoder.encode_queries

    def stuck(texts: list[str]) -> torch.Tensor:
        release.wait(10)
        return original(texts)

    encoder.encode_queries = stuck  # type: ignore[method-assign]  # a query call that takes its time
    try:
        query = threading.Thread(target=locked.encode_queries, args=(QUERIES,))
        query.start()
        time.sleep(0.1)
        started = time.monotonic()
        assert locked.encode_passages(QUERIES).shape == (3, local.dim)
        assert time.monotonic() - started < 5  # not after the query call
        release.set()
        query.join()
    finally:
        release.set()
        encoder.close()


def test_a_child_with_another_encoder_or_none_is_refused(folders) -> None:
    local = local_encoder(folders[0])
    with pytest.raises(ConfigError, match="not the server's"):
        ProcessQueryEncoder(local, QueryProcessSpec(str(folders[1]), "int8", 1))  # other weights
    with pytest.raises(ConfigError, match="did not start"):
        ProcessQueryEncoder(local, QueryProcessSpec(str(folders[0] / "missing"), "int8", 1))


def test_a_dead_encoder_answers_503() -> None:
    response = error_response(EncoderUnavailableError("the query encoder process died; retry the request"))
    assert response.status_code == 503 and b'"code":"encoder_unavailable"' in response.body


def test_the_server_encodes_queries_in_a_child_when_it_loads_its_encoder(tmp_path: Path, folders) -> None:
    from rmm.serve.config import load_config
    from rmm.serve.records import NewMemory, RetrieveItem
    from rmm.serve.service import RetrievalService

    def config(**overrides):
        return load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": {"k" * 20: "alpha"}, "device": "cpu",
                                  "encoder": str(folders[0]), **overrides}, environ={})

    with pytest.raises(ConfigError, match="query_process must be"):
        config(query_process="maybe")
    # one engine on both sides (auto could time two engines apart differently in two processes)
    service = RetrievalService(config(query_process="off", query_precision="int8"))
    assert service.query_process is None
    service.add_memories("alpha", "ana", [NewMemory(text=t) for t in QUERIES])
    (expected,) = service.retrieve_batch([RetrieveItem("alpha", "ana", "bread", k=3, m=2, explore=False)])
    service.close()

    service = RetrievalService(config(query_precision="int8"))  # query_process auto: the server loads the encoder onto the CPU
    try:
        assert service.query_process is not None
        (got,) = service.retrieve_batch([RetrieveItem("alpha", "ana", "bread", k=3, m=2, explore=False)])
        assert [m.id for m in got.memories] == [m.id for m in expected.memories]
        assert [m.score for m in got.memories] == [m.score for m in expected.memories]
    finally:
        service.close()
    assert service.query_process.child_pid is None  # closed with the service

    injected = RetrievalService(config(bank=str(tmp_path / "bank3")), encoder=BagOfWordsEncoder())  # in-process
    assert injected.query_process is None
    injected.close()
    with pytest.raises(ConfigError, match="needs the server to load its encoder"):
        RetrievalService(config(bank=str(tmp_path / "bank2"), query_process="on"), encoder=BagOfWordsEncoder())


def test_the_child_leaves_when_the_server_is_killed(tmp_path: Path, folders) -> None:
    """`kill -9` of the server: its encoder process must not live on as an orphan."""
    import subprocess
    import sys
    import time

    script = tmp_path / "server.py"
    script.write_text(
        "import os, sys, time\n"
        "from rmm.encoders import load_encoder\n"
        "from rmm.encoders.query.precision import build_engine\n"
        "from rmm.encoders.query.process import ProcessQueryEncoder, QueryProcessSpec\n"
        "if __name__ == '__main__':\n"
        f"    local = build_engine(load_encoder({str(folders[0])!r}, device='cpu'), 'int8')\n"
        f"    encoder = ProcessQueryEncoder(local, QueryProcessSpec({str(folders[0])!r}, 'int8', 1))\n"
        "    print(encoder.child_pid, flush=True)\n"
        "    time.sleep(600)\n")
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        child = int(server.stdout.readline())  # type: ignore[union-attr]
        os.kill(child, 0)  # alive
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the encoder process outlived its killed server")


def test_settings_that_cannot_work_are_refused_before_anything_starts(tmp_path: Path, monkeypatch) -> None:
    from rmm.serve.config import load_config
    from rmm.serve.service import RetrievalService

    def config(**overrides):
        return load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": {"k" * 20: "alpha"}, **overrides},
                           environ={})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU box: the device resolves
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="query_process: on encodes queries in a CPU process"):
        config(device="cuda", query_process="on")
    for precision in ("int8", "int4"):
        with pytest.raises(ConfigError, match=f"index_precision '{precision}' scans on the CPU"):
            config(device="cuda", index_precision=precision)
    monkeypatch.undo()

    class OddSize(BagOfWordsEncoder):
        name, dim, fingerprint = "odd", 20, "odd-v1"

    with pytest.raises(ConfigError, match="'int4' needs an embedding size divisible by 32; odd has 20"):
        RetrievalService(config(device="cpu", index_precision="int4"), encoder=OddSize())
    assert not (tmp_path / "bank").exists()  # refused before the bank was opened


def test_a_service_that_fails_to_build_leaves_no_child_behind(tmp_path: Path, folders, monkeypatch) -> None:
    import rmm.serve.service as service_module
    from rmm.serve.config import load_config

    started: list[ProcessQueryEncoder] = []
    original_init = ProcessQueryEncoder.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        started.append(self)

    def broken_bank(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ProcessQueryEncoder, "__init__", recording_init)
    monkeypatch.setattr(service_module, "MemoryBank", broken_bank)
    config = load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": {"k" * 20: "alpha"}, "device": "cpu",
                                "encoder": str(folders[0])}, environ={})
    with pytest.raises(OSError, match="disk full"):
        service_module.RetrievalService(config)
    (encoder,) = started
    assert encoder.child_pid is None  # stopped with the failure, not left running
