"""BM25Retriever: lexical baseline over the store, kept in step with the store's generation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rmm.errors import UnknownUserError
from rmm.memory.bm25 import BM25Retriever
from rmm.memory.store import MemoryStore
from rmm.memory.tokens import content_words, tokenize
from rmm.types import Candidates, Memory

TEXTS = {
    "hike": "Alice loves hiking in the Swiss mountains",
    "cat": "Her cat is called Pixel and sleeps all day",
    "job": "She works as a nurse at the city hospital",
    "food": "Her favourite food is spicy Thai curry",
    "trip": "Next summer she plans a trip to Japan and the mountains",
}


@pytest.fixture
def store(tmp_path: Path) -> MemoryStore:
    s = MemoryStore(tmp_path / "m.sqlite")
    s.add([Memory(id=k, user_id="alice", kind="turn", text=v) for k, v in TEXTS.items()])
    yield s
    s.close()


def test_lexical_match_ranks_first(store: MemoryStore) -> None:
    retriever = BM25Retriever(store)
    (c,) = retriever.search(["What is the name of her CAT?"], "alice", k=3)
    assert isinstance(c, Candidates)
    assert c.memory_ids[0] == "cat" and c.embeddings is None and c.query_embedding is None and c.user_id == "alice"
    assert c.retriever_scores.dtype == torch.float32 and c.retriever_scores[0] > 0
    (c,) = retriever.search(["mountains hiking"], "alice", k=5)
    assert c.memory_ids[:2] == ["hike", "trip"]  # both mention mountains; only one also hiking
    assert (c.retriever_scores[:-1] >= c.retriever_scores[1:]).all()


def test_batched_equals_one_at_a_time(store: MemoryStore) -> None:
    retriever = BM25Retriever(store)
    queries = ["thai curry", "hospital nurse", "zzz unknown words", "japan summer trip"]
    batched = retriever.search(queries, "alice", k=3)
    for query, together in zip(queries, batched):
        (alone,) = retriever.search([query], "alice", k=3)
        assert alone.memory_ids == together.memory_ids and alone.query == query == together.query
        assert torch.allclose(alone.retriever_scores, together.retriever_scores)
    assert [c.memory_ids[:1] for c in batched] == [["food"], ["job"], [], ["trip"]]


def test_no_shared_terms_gives_no_candidates(store: MemoryStore) -> None:
    retriever = BM25Retriever(store)
    for query in ("xylophone", "the and of", ""):
        (c,) = retriever.search([query], "alice", k=3)
        assert c.memory_ids == [] and c.retriever_scores.shape == (0,)


def test_k_clips_to_matching_memories(store: MemoryStore) -> None:
    retriever = BM25Retriever(store)
    (c,) = retriever.search(["she", "mountains"], "alice", k=10)[1:]  # a batch where k > matches
    assert sorted(c.memory_ids) == ["hike", "trip"]
    (c,) = retriever.search(["curry cat hospital japan"], "alice", k=2)
    assert len(c.memory_ids) == 2 and c.retriever_scores.shape == (2,)


def test_rebuilt_when_the_store_changes(store: MemoryStore) -> None:
    retriever = BM25Retriever(store)
    assert retriever.search(["bicycle"], "alice", k=3)[0].memory_ids == []
    store.add([Memory(id="bike", user_id="alice", kind="turn", text="She bought a red bicycle")])
    assert retriever.search(["bicycle"], "alice", k=3)[0].memory_ids == ["bike"]
    store.delete("alice", ["cat"])
    assert retriever.search(["pixel cat"], "alice", k=3)[0].memory_ids == []
    store.update(Memory(id="job", user_id="alice", kind="turn", text="She now works as a chef"))
    assert retriever.search(["chef"], "alice", k=3)[0].memory_ids == ["job"]
    assert retriever.search(["hospital"], "alice", k=3)[0].memory_ids == []


def test_empty_and_unknown_users(store: MemoryStore) -> None:
    retriever = BM25Retriever(store)
    store.add([Memory(id="x", user_id="bob", kind="turn", text="chess")])
    store.delete("bob", ["x"])  # bob exists with no memories
    (c,) = retriever.search(["chess"], "bob", k=5)
    assert c.memory_ids == [] and c.user_id == "bob"
    assert retriever.search([], "alice", k=5) == []
    with pytest.raises(UnknownUserError, match="alice"):
        retriever.search(["x"], "carol", k=5)
    with pytest.raises(ValueError):
        retriever.search(["x"], "alice", k=0)
    with pytest.raises(TypeError):
        retriever.search("cat", "alice", k=1)  # type: ignore[arg-type]


def test_users_are_isolated(store: MemoryStore) -> None:
    store.add([Memory(id="cat", user_id="bob", kind="turn", text="Bob's cat is called Rex")])
    retriever = BM25Retriever(store)
    assert retriever.search(["rex"], "alice", k=3)[0].memory_ids == []
    assert retriever.search(["rex"], "bob", k=3)[0].memory_ids == ["cat"]


def test_bm25_reads_the_words_the_candidate_features_compare(store: MemoryStore) -> None:
    """One tokenisation (`rmm.memory.tokens`): question scaffolding the features drop ("what", "know",
    "her") matches no memory in BM25 either, and a non-ASCII word is one word to both."""
    retriever = BM25Retriever(store)
    (c,) = retriever.search(["what do you know about her"], "alice", k=3)
    assert c.memory_ids == [] and content_words("what do you know about her") == set()
    store.add([Memory(id="cafe", user_id="alice", kind="turn", text="Ana's café in São Paulo")])
    (c,) = retriever.search(["a café in são paulo?"], "alice", k=3)
    assert c.memory_ids == ["cafe"]
    assert content_words("Ana's café in São Paulo") == {"ana", "café", "são", "paulo"}


def test_tokenize_keeps_order_and_repeats_for_bm25() -> None:
    assert tokenize("The cat and THE cat_toy, 2 cats in 2024!") == ["cat", "cat", "toy", "cats", "2024"]
    assert tokenize("") == [] and tokenize("I a an") == []
