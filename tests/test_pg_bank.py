"""MemoryBank on PostgreSQL: what only a database bank has (test_bank.py runs the shared behaviour on both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_bank import TEXTS, FakeEncoder, memories  # tests/ is on the path (conftest)

from rmm.errors import DimensionMismatchError, EncoderMismatchError, RmmError
from rmm.memory.bank import MemoryBank
from rmm.memory.pg_connect import DatabaseUnavailableError, parse_location, with_schema

pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")

import psycopg
from psycopg import sql


def contents(bank: MemoryBank) -> dict[str, object]:
    """Everything a bank holds, to compare before and after a refused open."""
    store = bank.store
    return {
        "meta": {key: store.get_meta(key) for key in ("encoder", "embedding_dim", "store_id")},
        "users": {user: (store.generation(user), [m.text for m in store.memories(user)],
                         store.embeddings(user)[1].tolist()) for user in store.users()},
    }


@pytest.mark.parametrize(
    ("other", "error", "message"),
    [
        (FakeEncoder(dim=16), DimensionMismatchError, r"32-d.*16-d"),
        (FakeEncoder(salt="v2"), EncoderMismatchError, r"fake-bow:32:v1.*fake-bow:32:v2"),
    ],
)
def test_wrong_encoder_is_refused_and_the_bank_is_untouched(
    pg_url: str, other: FakeEncoder, error: type[Exception], message: str
) -> None:
    encoder = FakeEncoder()
    with MemoryBank(pg_url, encoder, device="cpu") as bank:
        bank.add("alice", memories())
        before = contents(bank)
    with pytest.raises(error, match=message):
        MemoryBank(pg_url, other, device="cpu")
    with MemoryBank(pg_url, encoder, device="cpu") as bank:
        assert contents(bank) == before
        assert bank.search(["pixel"], "alice", k=1)[0].memory_ids == ["cat"]
        record = json.loads(bank.store.get_meta("encoder") or "{}")
    assert record["fingerprint"] == encoder.fingerprint and record["dim"] == encoder.dim


def test_database_bank_has_no_folder_and_refuses_folder_only_options(pg_url: str, tmp_path: Path) -> None:
    encoder = FakeEncoder()
    with MemoryBank(pg_url, encoder, device="cpu", index_options={"exact_limit": 0, "ef_search": 40}) as bank:
        assert bank.path is None and bank.location == bank.store.location
        assert bank.index_backend == "pgvector" and "pgvector" in repr(bank)
        bank.add("alice", memories())
        assert bank.search(["pixel the cat"], "alice", k=1)[0].memory_ids == ["cat"]  # through the HNSW index
    with pytest.raises(ValueError, match="folder banks"):
        MemoryBank(pg_url, encoder, index_backend="faiss-hnsw", device="cpu")
    with pytest.raises(ValueError, match=r"\['nprobe'\] do not apply"):
        MemoryBank(pg_url, encoder, device="cpu", index_options={"nprobe": 8})


def test_banks_of_different_encoders_share_one_database(pg_url: str) -> None:
    """One schema per bank: a 32-d and a 16-d bank side by side, each with its own users."""
    other_url = with_schema(pg_url, pg_url.rsplit("schema=", 1)[1] + "_b")
    small = FakeEncoder(dim=16, salt="small")
    with MemoryBank(pg_url, FakeEncoder(), device="cpu") as first, MemoryBank(other_url, small, device="cpu") as second:
        first.add("alice", memories())
        second.add("bob", memories("bob")[:2])
        assert first.users() == ["alice"] and second.users() == ["bob"]
        assert second.store.get_meta("embedding_dim") == "16" and first.store.get_meta("embedding_dim") == "32"
        assert second.search(["hiking"], "bob", k=5)[0].embeddings.shape == (2, 16)
        assert first.store.store_id != second.store.store_id
        second.delete_user("bob")
        assert first.users() == ["alice"] and len(first.memories("alice")) == len(TEXTS)
    with psycopg.connect(parse_location(pg_url).conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(parse_location(other_url).schema)))


def test_unreachable_database_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatabaseUnavailableError) as caught:
        MemoryBank(f"postgresql://rmm:secret@/rmm?host={tmp_path}&connect_timeout=2", FakeEncoder(), device="cpu")
    assert isinstance(caught.value, RmmError) and "secret" not in str(caught.value)
    assert not any(tmp_path.iterdir())  # nothing was created locally either


def test_search_scores_are_inner_products_of_the_returned_vectors(pg_url: str) -> None:
    encoder = FakeEncoder()
    with MemoryBank(pg_url, encoder, device="cpu") as bank:
        bank.add("alice", memories())
        (c,) = bank.search(["thai curry for dinner"], "alice", k=5)
        assert torch.allclose(c.retriever_scores, c.embeddings @ c.query_embedding, atol=1e-5)
        assert torch.allclose(c.embeddings, encoder.encode_passages([TEXTS[i] for i in c.memory_ids]))
        assert c.retriever_scores.tolist() == sorted(c.retriever_scores.tolist(), reverse=True)
