"""`--store postgresql://…` end to end: the server's memories and benchmark banks live in PostgreSQL."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from fakes import BagOfWordsEncoder

from rmm.cli.arguments import store_url
from rmm.errors import ConfigError
from rmm.memory.pg_store import PostgresStore
from rmm.serve.config import load_config
from rmm.serve.records import NewMemory, RetrieveItem, RetrieveResult
from rmm.serve.service import RetrievalService

pytest.importorskip("psycopg", reason="PostgreSQL banks need psycopg (postgres extra)")

import psycopg
from psycopg import sql

from rmm.memory.pg_connect import parse_location

FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread on Sundays",
         "Ana plays cello in a community orchestra", "Ana booked a summer trip to Lisbon"]


def test_serve_keeps_memories_and_search_in_the_database(tmp_path: Path, pg_url: str) -> None:
    config = load_config(None, {"bank": str(tmp_path / "bank"), "store": pg_url, "auth.keys": {"key-alpha-123": "alpha"},
                                "device": "cpu"}, environ={})
    service = RetrievalService(config, encoder=BagOfWordsEncoder())
    service.start()
    try:
        ids = service.add_memories("alpha", "ana", [NewMemory(text=t) for t in FACTS])
        (result,) = service.retrieve_batch([RetrieveItem(tenant="alpha", user="ana", query="who plays the cello?",
                                                         k=4, m=2, explore=False)])
        assert isinstance(result, RetrieveResult) and result.selection_id
        assert "cello" in result.memories[0].text  # ranked by the database's search, then the reranker
        service.feedback("alpha", result.selection_id, cited=[0])
    finally:
        service.close()
    assert not (tmp_path / "bank" / "memories.sqlite").exists()  # the folder keeps only the server's own state
    with PostgresStore(pg_url) as store:  # another process's view of the same bank
        (user,) = store.users()
        assert user.endswith("ana") and sorted(m.id for m in store.memories(user)) == sorted(ids)
        assert store.embeddings(user)[1].shape == (len(FACTS), BagOfWordsEncoder().dim)


def test_a_store_that_is_not_a_database_url_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="postgresql://"):
        load_config(None, {"bank": str(tmp_path), "store": str(tmp_path / "other")}, environ={})
    with pytest.raises(argparse.ArgumentTypeError, match="postgresql://"):
        store_url("/var/lib/rmm")
    with pytest.raises(argparse.ArgumentTypeError, match="unsupported store URL scheme"):
        store_url("mysql://u@h/db")
    assert store_url("postgresql://rmm@db:5432/rmm?schema=prod") == "postgresql://rmm@db:5432/rmm?schema=prod"


def test_benchmark_banks_go_to_one_schema_each(tiny_data_dir: Path, tmp_path: Path, pg_url: str) -> None:
    from rmm.data import load_dataset
    from rmm.eval.benchmark_bank import open_retriever
    from rmm.memory.bm25 import BM25Retriever

    dataset = load_dataset("locomo", data_dir=tiny_data_dir, download=False)
    opened = open_retriever("bm25", dataset, "turn", cache=tmp_path / "cache", store=pg_url, progress=False)
    assert isinstance(opened.retriever, BM25Retriever) and opened.path is None
    assert isinstance(opened.retriever.store, PostgresStore)
    assert opened.retriever.store.schema.startswith("locomo_turn_")
    assert opened.retriever.store.users() == sorted(dataset.users)
    user = dataset.users[0]
    (c,) = opened.retriever.search(["Where did they go hiking?"], user, k=3)
    assert "hiking" in opened.retriever.store.get(user, [c.memory_ids[0]])[0].text.lower()
    again = open_retriever("bm25", dataset, "turn", cache=tmp_path / "cache", store=pg_url, progress=False)
    assert again.retriever.store.generation(user) == opened.retriever.store.generation(user)  # reused, not refilled
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.sqlite"))
    opened.retriever.store.close()
    again.retriever.store.close()
    with psycopg.connect(parse_location(pg_url).conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(opened.retriever.store.schema)))
