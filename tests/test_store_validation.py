"""The SQLite and PostgreSQL stores refuse bad input alike, with the same messages
(`rmm.memory.validation` holds the checks; only where the store lives differs in a message)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rmm.memory.storage import MemoryStorage
from rmm.memory.store import MemoryStore
from rmm.types import Memory


def mem(memory_id: str, user: str = "alice") -> Memory:
    return Memory(id=memory_id, user_id=user, kind="topic", text=f"text of {memory_id}")


def refusals(store: MemoryStorage) -> list[str]:
    """The message of every refusal, with the store's location written as <store>."""
    store.add([mem("a"), mem("b")], torch.ones(2, 4))
    cases: list[Callable[[], Any]] = [
        lambda: store.get("alice", ["a", "x", "y"]),
        lambda: store.delete("alice", ["a", *[f"n{i}" for i in range(7)]]),
        lambda: store.add([mem("c")], torch.ones(1, 5)),
        lambda: store.add([mem("d"), mem("d")]),
        lambda: store.add([mem("a")]),
        lambda: store.set_meta("k", 3),  # type: ignore[arg-type]
        lambda: store.require_user(""),
        lambda: store.require_user("bob"),
        lambda: store.embeddings("alice", ["a", "zz"]),
        lambda: store.add([Memory(id="", user_id="alice", kind="topic", text="t")]),
    ]
    messages = []
    for case in cases:
        with pytest.raises(Exception) as refused:
            case()
        messages.append(f"{type(refused.value).__name__}: {refused.value}".replace(store.location, "<store>"))
    store.add([mem("e")])  # stored without an embedding
    with pytest.raises(Exception) as refused:
        store.embeddings("alice", ["e"])
    messages.append(f"{type(refused.value).__name__}: {refused.value}")
    return messages


def test_both_stores_refuse_alike_with_the_same_messages(tmp_path: Path, pg_url: str) -> None:
    from rmm.memory.pg_store import PostgresStore

    with MemoryStore(tmp_path / "m.sqlite") as sqlite, PostgresStore(pg_url) as postgres:
        expected, got = refusals(sqlite), refusals(postgres)
    assert got == expected
    assert "2 unknown memory id(s) for user 'alice': ['x', 'y']" in expected[0]
    assert "embedding dimension 5 does not match the store's 4 (<store>)" in expected[2]
    assert "known users: ['alice']" in expected[7]
