"""Micro-batching changes the cost of retrieval, never its answer: the same queries in one batch or
one at a time (same seed, same order) show the same memories, with the same scores up to float
rounding (a matmul of several query rows may sum in another order than one of a single row)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch

from rmm.serve.config import load_config
from rmm.serve.records import NewMemory, RetrieveItem, RetrieveResult
from rmm.serve.service import RetrievalService

KEYS = {"key-alpha-123": "alpha", "key-beta-4567": "beta"}
TOPICS = ["hikes mountain trails", "bakes sourdough bread", "plays cello in an orchestra", "adopted a puppy",
          "works night shifts at the hospital", "booked a trip to Lisbon", "repairs old radios", "grows tomatoes",
          "reads crime novels", "runs a marathon in spring", "learns Portuguese", "paints watercolours"]
QUERIES = [("alpha", "ana", "mountain trails"), ("alpha", "bob", "repairs old radios"), ("beta", "ana", "a puppy"),
           ("alpha", "ana", "bread on Sundays"), ("alpha", "cy", "a trip to Lisbon"), ("beta", "ana", "Portuguese"),
           ("alpha", "bob", "crime novels"), ("alpha", "ana", "cello orchestra"), ("alpha", "cy", "marathon")]


class WordVectorEncoder:
    """Each word a fixed random direction, each text a little of its own: similar texts score
    alike and no two memories tie (a tie may break either way in any float order)."""

    name, dim, fingerprint = "word-vectors", 64, "word-vectors-v1"

    @staticmethod
    def _direction(token: str) -> torch.Tensor:
        seed = int(hashlib.md5(token.encode()).hexdigest()[:12], 16)
        return torch.randn(64, generator=torch.Generator().manual_seed(seed))

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        rows = [sum((self._direction(w) for w in re.findall(r"[a-z]+", t.lower()) if len(w) > 3),
                    torch.zeros(64)) + 0.3 * self._direction("text:" + t) for t in texts]
        return torch.nn.functional.normalize(torch.stack(rows), dim=-1)

    encode_passages = encode_queries


def make_service(root: Path) -> RetrievalService:
    config = load_config(None, {"bank": str(root / "bank"), "auth.keys": KEYS, "device": "cpu", "seed": 7},
                         environ={})
    service = RetrievalService(config, encoder=WordVectorEncoder())
    service.start()
    for n, (tenant, user) in enumerate((("alpha", "ana"), ("alpha", "bob"), ("alpha", "cy"), ("beta", "ana"))):
        service.add_memories(tenant, user, [NewMemory(text=f"{user.title()} {t} ({n}{i})", id=f"{user}{i}")
                                            for i, t in enumerate(TOPICS)])
    return service


def picks(result: RetrieveResult | Exception) -> list[tuple[str, float, float]]:
    assert isinstance(result, RetrieveResult), result
    return [(m.id, m.score, m.retriever_score) for m in result.memories]


@pytest.mark.parametrize("explore", [False, True])
def test_batched_and_one_at_a_time_show_the_same_memories(tmp_path: Path, explore: bool) -> None:
    """Two tenants' queries interleaved: each tenant's reranker draws its own noise, in arrival order."""
    items = [RetrieveItem(tenant=t, user=u, query=q, k=8, m=3, explore=explore) for t, u, q in QUERIES]
    batched_service, single_service = make_service(tmp_path / "a"), make_service(tmp_path / "b")
    try:
        batched = batched_service.retrieve_batch(items)
        single = [r for it in items for r in single_service.retrieve_batch([it])]
        assert batched_service.encoder.query_calls == 1 and single_service.encoder.query_calls == len(items)
        for together, alone in zip(batched, single):
            assert [m[0] for m in picks(together)] == [m[0] for m in picks(alone)]
            assert [x for m in picks(together) for x in m[1:]] == pytest.approx(
                [x for m in picks(alone) for x in m[1:]], rel=1e-5, abs=1e-6)
        if explore:  # the picks were sampled, not simply the top-M in score order
            scores = [[score for _, score, _ in picks(r)] for r in batched]
            assert any(row != sorted(row, reverse=True) for row in scores)
    finally:
        batched_service.close()
        single_service.close()
