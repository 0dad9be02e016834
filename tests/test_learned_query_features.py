"""Whole-bank search (`scope: bank`): the reranker's learned query q·A chooses the candidates, but
every candidate's features are those of the query q — the numbers the reranker was trained on
over `scope: topk` candidates (issue 35, item 1). Checked with a non-identity A in the first stage
itself, in `rmm train`'s whole-bank row, over an agent's trained reranker and in `rmm serve`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_agent import ScriptedLLM, cite_mentions, facts_bank
from test_hybrid import TEXTS as CONCEPT_TEXTS
from test_hybrid import ConceptEncoder
from test_lexical_feature import lexical_problem
from test_serve_hybrid import capture_selections
from test_serve_service import FACTS, item, make_service

import rmm.training.online_report as online_report
from rmm.eval.benchmark_bank import fill
from rmm.frontends.agent import Agent
from rmm.memory.bank import MemoryBank
from rmm.memory.features import CANDIDATE_FEATURES
from rmm.memory.hybrid import HybridRetriever
from rmm.policy.learner import LearnerConfig
from rmm.policy.reranker import ResidualLinearReranker
from rmm.policy.retrieve import RerankedRetriever
from rmm.serve.records import NewMemory, RetrieveResult
from rmm.types import Candidates, Memory


def by_memory(c: Candidates) -> dict[str, tuple[torch.Tensor, float]]:
    """memory id → (its feature row, its lexical feature)."""
    assert c.features is not None and c.lexical is not None and c.feature_names == CANDIDATE_FEATURES
    return {m: (c.features[i], float(c.lexical[i])) for i, m in enumerate(c.memory_ids)}


def assert_features_of_the_query(found: Candidates, reference: Candidates) -> None:
    """Every candidate of `found` has the features (and lexical value) `reference` — the query's own
    search, deep enough to hold it — gives the same memory."""
    want = by_memory(reference)
    assert found.memory_ids and set(found.memory_ids) <= set(want)
    for m, (row, lexical) in by_memory(found).items():
        assert torch.allclose(row, want[m][0], atol=1e-6), (m, row, want[m][0])
        assert lexical == pytest.approx(want[m][1], abs=1e-7)


def a_learned_query(dim: int, seed: int = 0) -> ResidualLinearReranker:
    """A reranker with a far-from-identity A (what training moves it to), weighing every feature."""
    g = torch.Generator().manual_seed(seed)
    reranker = ResidualLinearReranker(dim, lexical_feature=True, feature_names=CANDIDATE_FEATURES)
    with torch.no_grad():
        reranker.W_q.weight.copy_(torch.randn(dim, dim, generator=g))
        reranker.feature_weight.copy_(torch.randn(len(CANDIDATE_FEATURES), generator=g))
    return reranker


@pytest.fixture
def concept_bank(tmp_path: Path):
    with MemoryBank(tmp_path / "bank", ConceptEncoder(), device="cpu") as b:
        b.add("u", [Memory(id=k, user_id="u", kind="turn", text=v) for k, v in CONCEPT_TEXTS.items()])
        yield b


@pytest.mark.parametrize("fusion", ["rrf", "convex", "lexical"])
def test_the_learned_query_chooses_the_candidates_and_the_query_gives_their_features(
        concept_bank: MemoryBank, fusion: str) -> None:
    retriever = HybridRetriever(concept_bank, fusion=fusion, depth=3, candidate_features=True)
    query = "Which feline sleeps to piano music"
    q = concept_bank.encoder.encode_queries([query])
    learned = a_learned_query(concept_bank.dim).transform_queries(q)
    (found,) = retriever.search_embeddings(q, "u", 3, queries=[query], search_with=learned)
    (alone,) = retriever.search([query], "u", 3)
    (everything,) = retriever.search([query], "u", len(CONCEPT_TEXTS))  # every memory's features for q
    assert torch.equal(found.query_embedding, q[0])
    assert_features_of_the_query(found, everything)
    if fusion == "lexical":  # BM25 chooses: the learned query changes nothing
        assert found.memory_ids == alone.memory_ids and torch.equal(found.features, alone.features)
    else:  # the dense half was searched with q·A: other candidates than q's own
        (chosen,) = retriever.search_embeddings(learned, "u", 3, queries=[query])
        assert found.memory_ids == chosen.memory_ids != alone.memory_ids
    (plain,) = HybridRetriever(concept_bank, fusion=fusion, depth=3).search_embeddings(
        q, "u", 3, queries=[query], search_with=learned)
    assert plain.features is None and plain.memory_ids == found.memory_ids


def test_a_dense_bank_searches_with_the_learned_query_and_carries_the_query(concept_bank: MemoryBank) -> None:
    q = concept_bank.encoder.encode_queries(["Which feline sleeps to piano music"])
    learned = a_learned_query(concept_bank.dim).transform_queries(q)
    (found,) = concept_bank.search_embeddings(q, "u", 3, search_with=learned)
    (chosen,) = concept_bank.search_embeddings(learned, "u", 3)
    assert found.memory_ids == chosen.memory_ids and torch.equal(found.retriever_scores, chosen.retriever_scores)
    assert torch.equal(found.query_embedding, q[0])
    with pytest.raises(ValueError, match="2 query texts for 1"):
        concept_bank.search_embeddings(torch.cat([q, q]), "u", 3, search_with=learned)


def test_rmm_trains_whole_bank_row_scores_the_features_of_the_query(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """K = a user's whole bank: both scopes hold every memory, so with features of q the trained
    reranker's whole-bank order is its top-K order, and the two held-out rows are equal."""
    from rmm.training.online import OnlineConfig, OnlineTrainer

    seen: list[tuple[RerankedRetriever, list[str]]] = []

    class Recording(RerankedRetriever):
        def select(self, queries, user, **kwargs):  # type: ignore[no-untyped-def]
            picked = super().select(queries, user, **kwargs)
            seen.append((self, picked))
            return picked

    monkeypatch.setattr(online_report, "RerankedRetriever", Recording)
    dataset, encoder = lexical_problem(n_users=3, n_questions=6)  # 18 turns a user
    with MemoryBank(tmp_path / "bank", encoder) as bank:
        fill(bank, dataset, "turn", progress=False)
        retriever = HybridRetriever(bank, candidate_features=True)
        cfg = OnlineConfig(tau=0.2, baseline="mean", lr=0.05, k=18, m=2, eval_k=1, heldout_fraction=0.34, epochs=2)
        trainer = OnlineTrainer(dataset, retriever, cfg, progress=False)
        report = trainer.run()
        (learner,) = [learner for _, learner in trainer.learners.items()]
        assert learner.reranker.W_q.weight.abs().sum() > 0.01  # a trained A, not the identity
        assert learner.reranker.feature_weight.abs().sum() > 0.01
        assert seen and all(r.scope == "bank" for r, _ in seen)
        for _, picked in seen:
            for selection in picked:
                qid = next(q.id for q in trainer.split.heldout if q.text == selection.candidates.query)
                assert_features_of_the_query(selection.candidates, trainer.cands[qid])
        assert report.reranker_heldout_whole_bank == report.reranker_heldout


def test_an_agents_trained_reranker_searches_the_whole_bank_on_the_features_of_the_query(tmp_path: Path) -> None:
    with facts_bank(tmp_path / "bank") as bank:
        llm = ScriptedLLM(cite_mentions("cello"))
        agent = Agent(bank, llm, first_stage=HybridRetriever(bank, candidate_features=True), k=5, m=3,
                      learner_config=LearnerConfig(batch_size=1, lr=0.5, lexical_feature=True, candidate_features=True))
        for _ in range(3):
            agent.respond("ana", "Does Ana play the cello?", remember=False)
        reranker = agent.learner("ana").reranker
        assert reranker.W_q.weight.abs().sum() > 0.01 and reranker.feature_weight.abs().sum() > 0.01  # trained
        n = len(bank.memories("ana"))
        queries = ["Does Ana play the cello?", "What does Ana bake?"]
        whole = RerankedRetriever(agent.first_stage, reranker, k=3, m=2, scope="bank").candidates(queries, "ana")
        everything = agent.first_stage.search(queries, "ana", n)
        for found, reference in zip(whole, everything, strict=True):
            assert_features_of_the_query(found, reference)
        # K = the whole bank: the same candidates either way, so the same order
        top = agent.retriever("ana", k=n, m=n).select(queries, "ana")
        bank_scope = RerankedRetriever(agent.first_stage, reranker, k=n, m=n, scope="bank").select(queries, "ana")
        assert [s.memory_ids for s in bank_scope] == [s.memory_ids for s in top]


def test_rmm_serve_whole_bank_search_logs_the_features_of_the_query(tmp_path: Path) -> None:
    service = make_service(tmp_path, scope="bank", retriever="hybrid", learner={"batch_size": 1, "lr": 0.5})
    try:
        service.add_memories("alpha", "ana", [NewMemory(text=t, id=f"f{i}") for i, t in enumerate(FACTS)])
        for _ in range(3):  # feedback trains A (and the feature weights) away from the identity
            (r,) = service.retrieve_batch([item("ana", "cello orchestra", k=4, m=2, explore=True)])
            assert isinstance(r, RetrieveResult)
            service.feedback("alpha", r.selection_id, cited=[0])
        reranker = service.learner("alpha").reranker
        assert reranker.W_q.weight.abs().sum() > 0.01 and reranker.feature_weight.abs().sum() > 0.01
        sampled = capture_selections(service)
        queries = ["cello orchestra", "sourdough bread on Sundays"]
        results = service.retrieve_batch([item("ana", text, k=3, m=2) for text in queries])
        assert all(isinstance(r, RetrieveResult) for r in results), results
        everything = service.retriever.first_stage.search(queries, "alpha:ana", len(FACTS))
        for selection, reference in zip(sampled, everything, strict=True):
            assert_features_of_the_query(selection.candidates, reference)
            assert torch.equal(selection.candidates.query_embedding, reference.query_embedding)
    finally:
        service.close()
