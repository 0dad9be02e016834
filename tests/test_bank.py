"""MemoryBank: store + per-user index + encoder — persistence, staleness, refusal of wrong encoders."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from rmm.errors import (
    CorruptFileError,
    DimensionMismatchError,
    EncoderMismatchError,
    UnknownMemoryError,
    UnknownUserError,
)
from rmm.memory.bank import BANK_FILE, INDEX_DIR, STORE_FILE, MemoryBank
from rmm.memory.store import DuplicateMemoryError, MemoryStore
from rmm.types import Candidates, Memory


class FakeEncoder:
    """Deterministic hashing bag-of-words: shared words → similar vectors. No model, no rmm.encoders."""

    def __init__(self, dim: int = 32, salt: str = "v1") -> None:
        self.dim = dim
        self.salt = salt
        self.name = f"fake-bow-{dim}"
        self.fingerprint = f"fake-bow:{dim}:{salt}"
        self.calls: list[tuple[str, int]] = []

    def _vector(self, text: str) -> torch.Tensor:
        vector = torch.zeros(self.dim)
        for token in re.findall(r"\w+", text.lower()):
            seed = int(hashlib.md5(f"{self.salt}:{token}".encode()).hexdigest()[:8], 16)
            vector += torch.randn(self.dim, generator=torch.Generator().manual_seed(seed))
        return torch.nn.functional.normalize(vector, dim=0) if vector.any() else torch.full((self.dim,), self.dim**-0.5)

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        self.calls.append(("queries", len(texts)))
        return torch.stack([self._vector(t) for t in texts]) if texts else torch.zeros(0, self.dim)

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        self.calls.append(("passages", len(texts)))
        return torch.stack([self._vector(t) for t in texts]) if texts else torch.zeros(0, self.dim)


TEXTS = {
    "hike": "alice loves hiking in the swiss mountains",
    "cat": "her cat is called pixel and sleeps all day",
    "job": "she works as a nurse at the city hospital",
    "food": "her favourite food is spicy thai curry",
    "trip": "next summer she plans a trip to japan",
}


def memories(user: str = "alice", texts: dict[str, str] = TEXTS) -> list[Memory]:
    return [Memory(id=k, user_id=user, kind="turn", text=v, refs=[f"{user}:D1:{i}"]) for i, (k, v) in enumerate(texts.items())]


@pytest.fixture
def encoder() -> FakeEncoder:
    return FakeEncoder()


@pytest.fixture(params=["folder", "postgresql"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a fresh bank lives: a folder (SQLite + in-process index) or a PostgreSQL schema (pgvector)."""
    return str(tmp_path / "bank") if request.param == "folder" else request.getfixturevalue("pg_url")


@pytest.fixture
def bank(location: str, encoder: FakeEncoder) -> MemoryBank:
    b = MemoryBank(location, encoder, device="cpu")
    b.add("alice", memories())
    yield b
    b.close()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("backend", ["torch", "faiss-flat", "faiss-hnsw", "postgresql"])
def test_search_finds_the_matching_memory(request: pytest.FixtureRequest, tmp_path: Path, encoder: FakeEncoder,
                                          backend: str) -> None:
    if backend == "postgresql":  # pgvector searches in the database
        where, backend = request.getfixturevalue("pg_url"), "torch"
    else:
        where = str(tmp_path / "b")
    with MemoryBank(where, encoder, index_backend=backend, device="cpu") as bank:
        assert bank.add("alice", memories()) == list(TEXTS)
        (c,) = bank.search(["what is her cat called"], "alice", k=3)
    assert isinstance(c, Candidates)
    assert c.memory_ids[0] == "cat" and len(c) == 3 and c.user_id == "alice"
    assert c.query == "what is her cat called"
    assert c.embeddings is not None and c.embeddings.shape == (3, encoder.dim)
    assert torch.allclose(c.embeddings, encoder.encode_passages([TEXTS[i] for i in c.memory_ids]))
    assert torch.allclose(c.query_embedding, encoder.encode_queries([c.query])[0])
    assert torch.allclose(c.retriever_scores, c.embeddings @ c.query_embedding, atol=1e-5)


def test_batched_search_equals_one_at_a_time_with_one_encoder_call(bank: MemoryBank, encoder: FakeEncoder) -> None:
    queries = ["hiking mountains", "thai curry", "trip to japan", "hospital nurse"]
    encoder.calls.clear()
    batched = bank.search(queries, "alice", k=4)
    assert encoder.calls == [("queries", 4)]
    for query, together in zip(queries, batched):
        (alone,) = bank.search([query], "alice", k=4)
        assert alone.memory_ids == together.memory_ids
        assert torch.allclose(alone.retriever_scores, together.retriever_scores)
        assert torch.allclose(alone.embeddings, together.embeddings)
    assert [c.memory_ids[0] for c in batched] == ["hike", "food", "trip", "job"]


def test_k_larger_than_bank_and_empty_query_list(bank: MemoryBank) -> None:
    (c,) = bank.search(["anything"], "alice", k=50)
    assert len(c) == len(TEXTS) and c.retriever_scores.shape == (len(TEXTS),)
    assert bank.search([], "alice", k=3) == []
    with pytest.raises(ValueError):
        bank.search(["x"], "alice", k=0)
    with pytest.raises(TypeError):
        bank.search("not a list", "alice", k=3)  # type: ignore[arg-type]


def test_search_embeddings_uses_the_given_vectors(bank: MemoryBank, encoder: FakeEncoder) -> None:
    target = bank.embeddings("alice", ["job"])  # query exactly at a memory's vector
    (c,) = bank.search_embeddings(target, "alice", k=2, queries=["custom"])
    assert c.memory_ids[0] == "job" and c.query == "custom"
    assert torch.equal(c.query_embedding, target[0])
    with pytest.raises(DimensionMismatchError):
        bank.search_embeddings(torch.zeros(1, encoder.dim + 1), "alice", k=2)
    with pytest.raises(ValueError):
        bank.search_embeddings(torch.zeros(2, encoder.dim), "alice", k=2, queries=["only one"])


def test_add_with_precomputed_embeddings_skips_the_encoder(bank: MemoryBank, encoder: FakeEncoder) -> None:
    vectors = encoder.encode_passages(["bob rows a red kayak"])
    calls = len(encoder.calls)
    with pytest.raises(DimensionMismatchError, match="needs"):
        bank.add("bob", [Memory(id="k", user_id="bob", kind="turn", text="x")], embeddings=torch.zeros(1, 3))
    assert not bank.store.has_user("bob")  # a refused write stores nothing
    bank.add("bob", [Memory(id="k", user_id="bob", kind="turn", text="bob rows a red kayak")], embeddings=vectors)
    assert len(encoder.calls) == calls
    assert torch.equal(bank.embeddings("bob", ["k"]), vectors)
    (c,) = bank.search(["red kayak"], "bob", k=1)
    assert c.memory_ids == ["k"]


def test_unknown_user_names_the_existing_ones(bank: MemoryBank) -> None:
    with pytest.raises(UnknownUserError, match="alice"):
        bank.search(["x"], "bob", k=3)
    for call in (lambda: bank.memories("bob"), lambda: bank.get("bob", ["cat"]), lambda: bank.delete_user("bob")):
        with pytest.raises(UnknownUserError):
            call()


def test_add_validation(bank: MemoryBank) -> None:
    with pytest.raises(ValueError, match="another user"):
        bank.add("alice", memories("bob"))
    with pytest.raises(DuplicateMemoryError):
        bank.add("alice", [Memory(id="cat", user_id="alice", kind="turn", text="dup")])
    assert bank.add("alice", []) == []
    assert len(bank.memories("alice")) == len(TEXTS)
    (c,) = bank.search(["pixel the cat"], "alice", k=10)
    assert sorted(c.memory_ids) == sorted(TEXTS)  # the refused add did not reach the index


def test_users_are_isolated(bank: MemoryBank) -> None:
    bank.add("bob", [Memory(id="cat", user_id="bob", kind="turn", text="bob has a dog named rex")])
    assert bank.users() == ["alice", "bob"]
    (c,) = bank.search(["dog named rex"], "alice", k=10)
    assert "cat" in c.memory_ids and len(c) == len(TEXTS)
    (c,) = bank.search(["cat"], "bob", k=10)
    assert c.memory_ids == ["cat"] and c.user_id == "bob"


def test_update_reembeds_changed_text(bank: MemoryBank, encoder: FakeEncoder) -> None:
    bank.search(["warm up the index"], "alice", k=1)
    (old,) = bank.get("alice", ["cat"])
    old_vector = bank.embeddings("alice", ["cat"])
    changed = Memory(**{**old.__dict__, "text": "her parrot is named kiwi", "refs": ["alice:D9:1"]})
    stored = bank.update("alice", changed)
    assert stored.updated_at > old.updated_at and stored.created_at == old.created_at
    (reloaded,) = bank.get("alice", ["cat"])
    assert reloaded.text == "her parrot is named kiwi" and reloaded.refs == ["alice:D9:1"]
    assert not torch.allclose(bank.embeddings("alice", ["cat"]), old_vector)
    (c,) = bank.search(["parrot kiwi"], "alice", k=1)
    assert c.memory_ids == ["cat"]
    assert torch.allclose(c.embeddings[0], encoder.encode_passages(["her parrot is named kiwi"])[0])
    encoder.calls.clear()
    bank.update("alice", Memory(**{**reloaded.__dict__, "refs": ["r"]}))  # same text: no re-encoding
    assert ("passages", 1) not in encoder.calls
    with pytest.raises(UnknownMemoryError):
        bank.update("alice", Memory(id="nope", user_id="alice", kind="turn", text="x"))


def test_delete_and_delete_user(bank: MemoryBank) -> None:
    bank.search(["warm"], "alice", k=1)
    bank.delete("alice", ["cat", "job"])
    (c,) = bank.search(["cat called pixel"], "alice", k=10)
    assert sorted(c.memory_ids) == ["food", "hike", "trip"]
    with pytest.raises(UnknownMemoryError):
        bank.get("alice", ["cat"])
    with pytest.raises(UnknownMemoryError):
        bank.delete("alice", ["cat"])
    bank.flush()
    index_files = list((bank.path / INDEX_DIR).iterdir()) if bank.path is not None else []
    assert len(index_files) == (1 if bank.path is not None else 0)  # a database bank keeps no index files
    bank.delete_user("alice")
    assert bank.users() == [] and not any(file.exists() for file in index_files)
    with pytest.raises(UnknownUserError):
        bank.search(["x"], "alice", k=1)


def test_reopen_loads_the_saved_index_without_rebuilding(tmp_path: Path, encoder: FakeEncoder) -> None:
    path = tmp_path / "bank"
    with MemoryBank(path, encoder, device="cpu") as bank:
        bank.add("alice", memories())
        before = bank.search(["japan trip"], "alice", k=3)[0]
    assert {p.name for p in path.iterdir()} >= {BANK_FILE, STORE_FILE, INDEX_DIR}
    with MemoryBank(path, encoder, device="cpu") as again:
        def no_rebuild(*args: object, **kwargs: object) -> None:
            raise AssertionError("index was rebuilt although its file was current")

        again.store.embeddings = no_rebuild  # type: ignore[method-assign]
        after = again.search(["japan trip"], "alice", k=3)[0]
        assert after.memory_ids == before.memory_ids
        assert torch.allclose(after.retriever_scores, before.retriever_scores)
        assert [m.id for m in again.memories("alice")] == list(TEXTS)


def test_stale_index_file_is_rebuilt(tmp_path: Path, encoder: FakeEncoder, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "bank"
    with MemoryBank(path, encoder, device="cpu") as bank:
        bank.add("alice", memories())
        bank.search(["x"], "alice", k=1)
    # A write that bypasses the bank (as a crashed or foreign writer would leave it).
    with MemoryStore(path / STORE_FILE) as store:
        extra = Memory(id="bike", user_id="alice", kind="turn", text="she bought a red bicycle")
        store.add([extra], encoder.encode_passages([extra.text]))
    with MemoryBank(path, encoder, device="cpu") as bank, caplog.at_level(logging.INFO, logger="rmm.memory.index_cache"):
        (c,) = bank.search(["red bicycle"], "alice", k=1)
    assert c.memory_ids == ["bike"] and "stale" in caplog.text


def test_corrupt_index_file_is_rebuilt_transparently(tmp_path: Path, encoder: FakeEncoder, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "bank"
    with MemoryBank(path, encoder, device="cpu") as bank:
        bank.add("alice", memories())
        expected = bank.search(["curry"], "alice", k=2)[0].memory_ids
    (index_file,) = (path / INDEX_DIR).iterdir()
    index_file.write_bytes(b"\x13\x00\x00\x00not an index at all")
    with MemoryBank(path, encoder, device="cpu") as bank, caplog.at_level(logging.WARNING, logger="rmm.memory.index_cache"):
        assert bank.search(["curry"], "alice", k=2)[0].memory_ids == expected
    assert "unreadable" in caplog.text
    assert index_file.read_bytes()[:8] != b"\x13\x00\x00\x00not " and index_file.stat().st_size > 100  # rewritten


def test_corrupt_store_is_refused_and_not_modified(tmp_path: Path, encoder: FakeEncoder) -> None:
    path = tmp_path / "bank"
    MemoryBank(path, encoder, device="cpu").close()
    for suffix in ("-wal", "-shm"):
        Path(str(path / STORE_FILE) + suffix).unlink(missing_ok=True)
    garbage = os.urandom(8192)
    (path / STORE_FILE).write_bytes(garbage)
    with pytest.raises(CorruptFileError, match=STORE_FILE):
        MemoryBank(path, encoder, device="cpu")
    assert (path / STORE_FILE).read_bytes() == garbage


@pytest.mark.parametrize(
    ("other", "error", "message"),
    [
        (FakeEncoder(dim=16), DimensionMismatchError, r"32-d.*16-d"),
        (FakeEncoder(salt="v2"), EncoderMismatchError, r"fake-bow:32:v1.*fake-bow:32:v2"),
    ],
)
def test_wrong_encoder_is_refused_and_the_bank_is_untouched(
    tmp_path: Path, encoder: FakeEncoder, other: FakeEncoder, error: type[Exception], message: str
) -> None:
    path = tmp_path / "bank"
    with MemoryBank(path, encoder, device="cpu") as bank:
        bank.add("alice", memories())
    before = snapshot(path)
    with pytest.raises(error, match=message):
        MemoryBank(path, other, device="cpu")
    assert snapshot(path) == before
    # The store keeps its own copy of the encoder record: losing bank.json does not open the door.
    (path / BANK_FILE).unlink()
    with pytest.raises(error):
        MemoryBank(path, other, device="cpu")
    with MemoryBank(path, encoder, device="cpu") as bank:  # the right encoder still works, and restores bank.json
        assert bank.search(["pixel"], "alice", k=1)[0].memory_ids == ["cat"]
    assert (path / BANK_FILE).exists()


def test_two_banks_on_one_path_see_each_others_writes(location: str, encoder: FakeEncoder) -> None:
    path = location
    first = MemoryBank(path, encoder, device="cpu")
    second = MemoryBank(path, encoder, device="cpu")
    first.add("alice", memories())
    assert second.search(["pixel"], "alice", k=1)[0].memory_ids == ["cat"]  # second builds its index
    first.add("alice", [Memory(id="bike", user_id="alice", kind="turn", text="red bicycle")])
    assert second.search(["red bicycle"], "alice", k=1)[0].memory_ids == ["bike"]  # stale cache noticed
    second.delete("alice", ["bike"])
    assert "bike" not in first.search(["red bicycle"], "alice", k=10)[0].memory_ids
    first.close()
    second.close()


def test_writes_in_another_process_survive_without_close(location: str, encoder: FakeEncoder) -> None:
    path = location
    reader = MemoryBank(path, encoder, device="cpu")
    reader.add("alice", memories())
    assert reader.search(["bicycle"], "alice", k=10)[0].memory_ids  # index cached in this process
    writer = f"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("bank_test_module", {str(Path(__file__))!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
from rmm.memory.bank import MemoryBank
from rmm.types import Memory
bank = MemoryBank(sys.argv[1], module.FakeEncoder(), device="cpu")
bank.add("alice", [Memory(id="bike", user_id="alice", kind="turn", text="she bought a red bicycle")])
bank.add("bob", [Memory(id="b1", user_id="bob", kind="turn", text="bob plays chess")])
os._exit(0)  # no close(): acknowledged writes must already be durable
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    subprocess.run([sys.executable, "-c", writer, str(path)], check=True, env=env, timeout=120)
    assert reader.search(["red bicycle"], "alice", k=1)[0].memory_ids == ["bike"]
    reader.close()
    with MemoryBank(path, encoder, device="cpu") as fresh:
        assert fresh.users() == ["alice", "bob"]
        assert fresh.search(["chess"], "bob", k=1)[0].memory_ids == ["b1"]


def test_concurrent_threads(location: str, encoder: FakeEncoder) -> None:
    errors: list[BaseException] = []
    with MemoryBank(location, encoder, device="cpu") as bank:
        def worker(t: int) -> None:
            try:
                user = f"user{t}"
                for i in range(15):
                    bank.add(user, [Memory(id=f"m{i}", user_id=user, kind="turn", text=f"fact {i} about topic{t}x{i}")])
                    (c,) = bank.search([f"topic{t}x{i}"], user, k=3)
                    assert c.memory_ids[0] == f"m{i}"
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert all(len(bank.memories(f"user{t}")) == 15 for t in range(4))


def test_bank_path_that_is_a_file_and_bad_backend(tmp_path: Path, encoder: FakeEncoder) -> None:
    file = tmp_path / "not_a_dir"
    file.write_text("x")
    with pytest.raises(CorruptFileError):
        MemoryBank(file, encoder)
    with pytest.raises(ValueError, match="backend"):
        MemoryBank(tmp_path / "b", encoder, index_backend="annoy")
    assert not (tmp_path / "b").exists()
    with pytest.raises(TypeError, match="lacks"):
        MemoryBank(tmp_path / "c", object())  # type: ignore[arg-type]


def test_switching_backend_rebuilds_the_index(tmp_path: Path, encoder: FakeEncoder) -> None:
    path = tmp_path / "bank"
    with MemoryBank(path, encoder, device="cpu") as bank:
        bank.add("alice", memories())
        expected = bank.search(["thai curry"], "alice", k=3)[0].memory_ids
    with MemoryBank(path, encoder, index_backend="faiss-flat", device="cpu") as bank:
        assert bank.search(["thai curry"], "alice", k=3)[0].memory_ids == expected
