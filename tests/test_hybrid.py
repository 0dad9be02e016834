"""HybridRetriever: BM25 + dense fused; the fusion rules by hand, each half's finds kept, embeddings on every candidate."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rmm.errors import DimensionMismatchError, RmmError
from rmm.eval.benchmark_bank import RetrieverName, parse_retriever
from rmm.memory.bank import MemoryBank
from rmm.memory.hybrid import HybridRetriever, convex_fuse, rrf_fuse
from rmm.types import Candidates, Memory

# The "dense" encoder knows concepts, not words: synonyms share a dimension, and a word it does not
# know (a name such as Pixel) contributes nothing. So dense retrieval finds paraphrases BM25 cannot,
# and BM25 finds the name the encoder is blind to.
CONCEPTS = {"feline": 0, "cat": 0, "kitty": 0, "physician": 1, "doctor": 1, "medic": 1, "mountains": 2,
            "alps": 2, "curry": 3, "spicy": 3, "boat": 4, "sailing": 4, "piano": 5, "music": 5}
DIM = 8


class ConceptEncoder:
    name, dim, fingerprint = "concepts", DIM, "concepts-v1"

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        out = torch.zeros((len(texts), DIM))
        out[:, DIM - 1] = 0.1  # a shared bias dimension: unrelated texts tie at a small positive cosine
        for i, text in enumerate(texts):
            for word in re.findall(r"[a-z]+", text.lower()):
                if word in CONCEPTS:
                    out[i, CONCEPTS[word]] += 1.0
        return torch.nn.functional.normalize(out, dim=-1)

    encode_passages = encode_queries


TEXTS = {
    "kitty": "Her kitty sleeps on the sofa all day",              # dense-only for "feline"
    "pixel": "Pixel sleeps to piano music",                        # BM25-only for "Pixel": dense last
    "medic": "She trained as a medic in the army",
    "alps": "They went hiking in the Alps in June",
    "curry": "Spicy curry is her favourite dinner",
    "boat": "Sailing the boat on the lake every summer",
    "piano": "She plays piano music late at night",             # five words to BM25, one more than "pixel"
}


@pytest.fixture
def bank(tmp_path: Path) -> MemoryBank:
    with MemoryBank(tmp_path / "bank", ConceptEncoder(), device="cpu") as b:
        b.add("u", [Memory(id=k, user_id="u", kind="turn", text=v) for k, v in TEXTS.items()])
        yield b


def test_rrf_by_hand() -> None:
    fused = rrf_fuse([["a", "b", "c"], ["c", "d"]], rrf_k=1)
    assert fused == pytest.approx({"a": 1 / 2, "b": 1 / 3, "c": 1 / 4 + 1 / 2, "d": 1 / 3})
    with pytest.raises(ValueError):
        rrf_fuse([["a"]], rrf_k=-1)


def test_convex_by_hand() -> None:
    fused = convex_fuse((["a", "b", "c"], [0.9, 0.5, 0.1]), (["c", "d"], [8.0, 2.0]), alpha=0.25)
    # dense normalised: a 1, b 0.5, c 0; lexical: c 1, d 0.
    assert fused == pytest.approx({"a": 0.25, "b": 0.125, "c": 0.75, "d": 0.0})
    assert convex_fuse((["a"], [3.0]), ([], []), alpha=1.0) == {"a": 1.0}  # a one-item list is not worse than itself
    with pytest.raises(ValueError):
        convex_fuse((["a"], [1.0]), ([], []), alpha=1.5)


def test_hybrid_keeps_what_only_one_half_finds(bank: MemoryBank) -> None:
    hybrid = HybridRetriever(bank, depth=2)
    query = "Is Pixel a feline?"
    (dense,) = bank.search([query], "u", 2)
    (lexical,) = hybrid.lexical.search([query], "u", 2)
    assert dense.memory_ids[0] == "kitty" and "pixel" not in dense.memory_ids
    assert lexical.memory_ids == ["pixel"]  # "kitty" shares no word with the query
    (c,) = hybrid.search([query], "u", 2)
    assert set(c.memory_ids) == {"kitty", "pixel"}
    # Both are rank 1 in one list and absent from the other: a tie, broken towards the dense rank.
    assert c.memory_ids == ["kitty", "pixel"]
    assert c.retriever_scores.tolist() == pytest.approx([1 / 11, 1 / 11])  # default rrf_k 10


def test_every_candidate_carries_its_bank_embedding(bank: MemoryBank) -> None:
    hybrid = HybridRetriever(bank, depth=3)
    queries = ["Pixel the feline and the doctor", "sailing the boat", "zzz qqq"]
    for c in hybrid.search(queries, "u", 4):
        assert c.embeddings is not None and c.embeddings.shape == (len(c), DIM)
        assert torch.allclose(c.embeddings, bank.embeddings("u", c.memory_ids))
        assert torch.allclose(c.query_embedding, ConceptEncoder().encode_queries([c.query])[0])
        assert (c.retriever_scores[:-1] >= c.retriever_scores[1:]).all()


def test_convex_hybrid_orders_by_mixed_scores(bank: MemoryBank) -> None:
    query = "Pixel the feline"
    (dense,) = bank.search([query], "u", 7)
    lexical_only = HybridRetriever(bank, fusion="convex", alpha=0.0).search([query], "u", 1)[0]
    dense_only = HybridRetriever(bank, fusion="convex", alpha=1.0).search([query], "u", 1)[0]
    assert lexical_only.memory_ids == ["pixel"] and dense_only.memory_ids == [dense.memory_ids[0]] == ["kitty"]


def test_the_lexical_feature_is_bm25s_score_min_max_scaled_over_its_depth_list(bank: MemoryBank) -> None:
    """Not the fused score (the reranker adds the dense evidence itself, as q·m): the same number for
    every fusion and every K — K below or above the depth — 1 for BM25's best, 0 for its last at the
    depth, for what BM25 ranks below the depth and for a memory only the dense half found."""
    query = "Pixel the feline plays piano music on the boat in the Alps"
    (bm25,) = HybridRetriever(bank).lexical.search([query], "u", 7)
    assert bm25.memory_ids[:1] == ["pixel"] and len(bm25) == 4  # more BM25 matches than the depth (3)
    top = bm25.retriever_scores[:3]
    lo, hi = float(top.min()), float(top.max())
    expected = {m: (float(s) - lo) / (hi - lo) for m, s in zip(bm25.memory_ids[:3], top)}
    assert expected["pixel"] == 1.0 and expected[bm25.memory_ids[2]] == 0.0 and 0.0 < expected["piano"] < 1.0
    seen: dict[str, float] = {}
    for fusion in ("rrf", "convex", "lexical"):
        for k in (2, 5, 7):  # below and above the depth
            (c,) = HybridRetriever(bank, fusion=fusion, depth=3).search([query], "u", k)
            assert c.lexical is not None and c.lexical.dtype == torch.float32 and len(c.lexical) == len(c)
            for m, f in zip(c.memory_ids, c.lexical.tolist()):
                assert f == pytest.approx(expected.get(m, 0.0))
                assert seen.setdefault(m, f) == pytest.approx(f)  # whatever the fusion and K
    assert seen["kitty"] == 0.0  # dense-only ("feline" is no word of its text): no lexical evidence
    assert seen[bm25.memory_ids[3]] == 0.0  # BM25's fourth, below the depth: found only at K > 3
    # The fused score does count the dense half's find; the feature leaves that to q·m.
    (c,) = HybridRetriever(bank, depth=3).search([query], "u", 7)
    assert float(c.retriever_scores[c.memory_ids.index("kitty")]) > 0.0
    # A one-memory BM25 list is that memory's best: 1, not a division by zero.
    (one,) = HybridRetriever(bank, depth=1).search(["Pixel"], "u", 2)
    assert dict(zip(one.memory_ids, one.lexical.tolist()))["pixel"] == 1.0


def test_a_memorys_feature_does_not_move_with_k_or_its_batch_mates(bank: MemoryBank) -> None:
    """Serving searches a user's batch at the batch's largest k: one request's feature must not
    depend on another's k (nor `rmm eval --depth` beyond the reranker's training depth)."""
    query = "Pixel the feline plays piano music on the boat in the Alps"
    for fusion in ("rrf", "lexical"):
        hybrid = HybridRetriever(bank, fusion=fusion, depth=3)
        (shallow,) = hybrid.search([query], "u", 2)
        (deep,) = hybrid.search([query], "u", 6)
        (batched, _) = hybrid.search([query, "sailing the boat"], "u", 6)
        assert deep.memory_ids[:2] == shallow.memory_ids
        assert torch.equal(deep.lexical[:2], shallow.lexical) and torch.equal(batched.lexical, deep.lexical)
        assert 0.0 < float(shallow.lexical[1]) < 1.0  # piano: between BM25's best and its third


def test_lexical_fusion_checks_its_query_vectors(bank: MemoryBank) -> None:
    """`fusion="lexical"` never hands the vectors to the dense search, so it refuses them as that search does."""
    over = HybridRetriever(bank, fusion="lexical", depth=3)
    one = ConceptEncoder().encode_queries(["Pixel"])
    with pytest.raises(ValueError, match="2 query texts for 1 query embeddings"):
        over.search_embeddings(one, "u", 2, queries=["Pixel", "piano"])
    with pytest.raises(DimensionMismatchError):
        over.search_embeddings(torch.ones(1, 5), "u", 2, queries=["Pixel"])
    for fusion in ("rrf", "lexical"):  # the same refusals as the fused path's
        with pytest.raises(DimensionMismatchError):
            HybridRetriever(bank, fusion=fusion).search_embeddings(torch.ones(5), "u", 2, queries=["Pixel"])
    (c,) = over.search_embeddings(one[0], "u", 2, queries=["Pixel"])  # one 1-d vector for one query is fine
    assert c.memory_ids == ["pixel"]


def test_lexical_search_encodes_through_the_bank(bank: MemoryBank, monkeypatch) -> None:
    """A query encoder that returns the wrong shape is refused by the bank's own check, not carried."""
    monkeypatch.setattr(ConceptEncoder, "encode_queries", lambda self, texts: torch.ones(len(texts), 5))
    with pytest.raises(DimensionMismatchError, match="returned shape"):
        HybridRetriever(bank, fusion="lexical").search(["Pixel"], "u", 2)


def test_bad_settings_and_names(bank: MemoryBank) -> None:
    with pytest.raises(ValueError):
        HybridRetriever(bank, fusion="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        HybridRetriever(bank, depth=0)
    with pytest.raises(ValueError):
        HybridRetriever(bank).search(["q"], "u", 0)
    assert parse_retriever("hybrid") == RetrieverName("minilm", "rrf")
    assert parse_retriever("hybrid:contriever") == RetrieverName("contriever", "rrf")
    assert parse_retriever("minilm").fusion is None and parse_retriever("bm25") == RetrieverName(None)
    for bad in ("hybrid:", "hybrid:bm25", "hybrid:hybrid"):
        with pytest.raises(RmmError):
            parse_retriever(bad)


def test_rmm_eval_and_open_retriever_take_hybrid(tiny_data_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """`--retriever hybrid` end to end on the tiny LoCoMo file (real MiniLM), and what `rmm train` reads."""
    import json

    from rmm.cli import main
    from rmm.data import load_dataset
    from rmm.eval.benchmark_bank import open_retriever

    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "eval.json"
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "hybrid", "bm25", "--k", "1", "5",
                 "--json", str(out)]) == 0
    reports = json.loads(out.read_text())
    assert reports["hybrid/turn"]["overall"]["recall@5"] >= reports["bm25/turn"]["overall"]["recall@5"] - 0.05
    opened = open_retriever("hybrid:minilm", load_dataset("locomo", data_dir=tiny_data_dir), "turn", progress=False)
    hybrid = opened.retriever
    assert isinstance(hybrid, HybridRetriever) and opened.encoder is not None and hybrid.dim == opened.encoder.dim
    user = hybrid.users()[0]
    (c,) = hybrid.search(["hello"], user, 5)
    assert c.embeddings is not None and c.embeddings.shape == (len(c), hybrid.dim)
    assert len(hybrid.memories(user)) >= len(c)


def test_a_memory_below_the_depth_tying_an_all_equal_depth_list_gets_1_not_0(bank: MemoryBank) -> None:
    """BM25's top-depth scores all equal (span 0 → each 1): a deeper memory with that same score is no
    worse and gets 1 too; a deeper one with a lower score gets 0; above-depth scaling is unchanged."""
    hybrid = HybridRetriever(bank, depth=2)
    tied = Candidates("q", ["a", "b", "c", "d"], torch.tensor([2.0, 2.0, 2.0, 1.0]))
    assert hybrid.scaled_bm25(tied) == {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0}
    spread = Candidates("q", ["a", "b", "c"], torch.tensor([3.0, 1.0, 0.5]))
    assert hybrid.scaled_bm25(spread) == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert hybrid.scaled_bm25(Candidates("q", ["a", "b"], torch.tensor([3.0, 1.0]))) == {"a": 1.0, "b": 0.0}


@pytest.mark.parametrize("features", [True, False])
def test_an_ablation_feature_variant_keeps_its_first_stage_candidate_features(bank: MemoryBank, features: bool) -> None:
    """`rmm.bench.ablations` sets candidate features on the first stage before wrapping it in a
    lexical-feature variant; the variant must carry them, or its rows rerank zeros for them."""
    from rmm.bench.lexical_spread import FeatureVariant

    variant = FeatureVariant(HybridRetriever(bank, candidate_features=features), "fused")
    assert variant.candidate_features is features
    found = variant.search(["hiking"], "u", 2)[0]
    assert (found.features is not None) is features
