"""The on-disk query-embedding cache: same vectors as the encoder, each text encoded once, kept across processes."""

from __future__ import annotations

from pathlib import Path

import torch

from rmm.eval.query_cache import QueryEmbeddingCache, cache_queries, encoder_key


class CountingEncoder:
    """A deterministic stand-in encoder that counts what it was asked to encode."""

    def __init__(self, fingerprint: str = "fake:1") -> None:
        self.fingerprint, self.dim, self.calls = fingerprint, 4, []

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        self.calls.append(list(texts))
        return torch.tensor([[len(t), t.count("a"), t.count("b"), 1.0] for t in texts])


def test_cached_vectors_equal_the_encoders_and_each_text_is_encoded_once(tmp_path: Path) -> None:
    enc = CountingEncoder()
    direct = enc.encode_queries(["ab", "a", "bbb"])
    enc.calls.clear()
    cache = cache_queries(enc, tmp_path)
    first = enc.encode_queries(["ab", "a", "ab"])
    second = enc.encode_queries(["bbb", "a"])
    assert torch.equal(first, direct[[0, 1, 0]]) and torch.equal(second, direct[[2, 1]])
    assert enc.calls == [["ab", "a"], ["bbb"]]
    assert (cache.hits, cache.misses) == (2, 3)


def test_a_new_process_reads_the_flushed_file_and_encodes_nothing(tmp_path: Path) -> None:
    enc = CountingEncoder()
    cache = cache_queries(enc, tmp_path)
    enc.encode_queries(["x", "y"])
    cache.flush()
    again = CountingEncoder()
    cache_queries(again, tmp_path)
    assert torch.equal(again.encode_queries(["y", "x"]), CountingEncoder().encode_queries(["y", "x"]))
    assert again.calls == []


def test_another_encoder_never_reads_the_file(tmp_path: Path) -> None:
    enc = CountingEncoder("fake:1")
    cache = cache_queries(enc, tmp_path)
    enc.encode_queries(["x"])
    cache.flush()
    other = CountingEncoder("fake:2")
    assert encoder_key(other) != encoder_key(enc)
    cache_queries(other, tmp_path)
    other.encode_queries(["x"])
    assert other.calls == [["x"]]


def test_two_writers_merge_instead_of_overwriting(tmp_path: Path) -> None:
    path = tmp_path / "q.pt"
    a, b = QueryEmbeddingCache(path, "k"), QueryEmbeddingCache(path, "k")
    enc = CountingEncoder()
    a.encode(["one"], enc.encode_queries)
    b.encode(["two"], enc.encode_queries)
    a.flush()
    b.flush()
    assert set(QueryEmbeddingCache(path, "k").vectors) == {"one", "two"}
