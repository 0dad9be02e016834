"""The query encoder in a child process: the same vectors as in-process, a clear error when the
child dies (and a new child for the next call), refusals at start-up, and the server's wiring."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder, write_tiny_bert

from rmm.errors import ConfigError
from rmm.serve.errors import EncoderUnavailableError
from rmm.serve.http_errors import error_response
from rmm.serve.query_encoder import query_encoder
from rmm.serve.query_process import ProcessQueryEncoder, QueryProcessSpec

QUERIES = ["Where does she hike?", "Who bakes bread on Sundays with her sister?", "Dog?"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("query_process")
    return (write_tiny_bert(root / "a", minilm_path, heads=4), write_tiny_bert(root / "b", minilm_path, seed=1, heads=4))


def local_encoder(folder: Path):
    from rmm.encoders import load_encoder

    return query_encoder(load_encoder(str(folder), device="cpu"), "int8")


def test_child_vectors_are_the_in_process_ones_and_a_dead_child_is_replaced(folders) -> None:
    local = local_encoder(folders[0])
    encoder = ProcessQueryEncoder(local, QueryProcessSpec(str(folders[0]), "int8", 1))
    try:
        assert torch.equal(encoder.encode_queries(QUERIES), local.encode_queries(QUERIES))
        assert encoder.encode_queries([]).shape == (0, local.dim)
        assert torch.equal(encoder.encode_passages(QUERIES), local.encode_passages(QUERIES))  # in-process
        assert (encoder.name, encoder.dim, encoder.fingerprint) == (local.name, local.dim, local.fingerprint)
        child = encoder._pool.submit(os.getpid).result()  # type: ignore[union-attr]
        assert child != os.getpid()
        os.kill(child, signal.SIGKILL)
        with pytest.raises(EncoderUnavailableError, match="died"):
            encoder.encode_queries(QUERIES)
        assert torch.equal(encoder.encode_queries(QUERIES), local.encode_queries(QUERIES))  # a new child
        os.kill(encoder._pool.submit(os.getpid).result(), signal.SIGKILL)  # type: ignore[union-attr]
        with pytest.raises(EncoderUnavailableError, match="died"):
            encoder.encode_queries(QUERIES)
        encoder.spec = QueryProcessSpec(str(folders[0] / "missing"), "int8", 1)  # the restart cannot load
        with pytest.raises(EncoderUnavailableError, match="could not be restarted"):  # 503, not a 422
            encoder.encode_queries(QUERIES)
    finally:
        encoder.close()
    assert encoder._pool is None


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
    service = RetrievalService(config(query_process="off"))
    assert service.query_process is None
    service.add_memories("alpha", "ana", [NewMemory(text=t) for t in QUERIES])
    (expected,) = service.retrieve_batch([RetrieveItem("alpha", "ana", "bread", k=3, m=2, explore=False)])
    service.close()

    service = RetrievalService(config())  # auto: the server loads the encoder onto the CPU
    try:
        assert service.query_process is not None
        (got,) = service.retrieve_batch([RetrieveItem("alpha", "ana", "bread", k=3, m=2, explore=False)])
        assert [m.id for m in got.memories] == [m.id for m in expected.memories]
        assert [m.score for m in got.memories] == [m.score for m in expected.memories]
    finally:
        service.close()
    assert service.query_process._pool is None  # closed with the service

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
        "from rmm.serve.query_encoder import query_encoder\n"
        "from rmm.serve.query_process import ProcessQueryEncoder, QueryProcessSpec\n"
        "if __name__ == '__main__':\n"
        f"    local = query_encoder(load_encoder({str(folders[0])!r}, device='cpu'), 'int8')\n"
        f"    encoder = ProcessQueryEncoder(local, QueryProcessSpec({str(folders[0])!r}, 'int8', 1))\n"
        "    print(encoder._pool.submit(os.getpid).result(), flush=True)\n"
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
