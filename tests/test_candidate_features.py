"""Per-candidate features (issue 14): computed by the hybrid first stage, weighed by the reranker
beside Eq. 1 and the lexical weight, learned from what was sampled, kept in checkpoints (format 5)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_hybrid import TEXTS as CONCEPT_TEXTS
from test_hybrid import ConceptEncoder
from test_lexical_feature import lexical_problem

from rmm.errors import CheckpointError, DataError, FeatureMismatchError
from rmm.eval.benchmark_bank import fill
from rmm.memory.bank import MemoryBank
from rmm.memory.features import (
    CANDIDATE_FEATURES,
    candidate_feature_matrix,
    feature_columns,
)
from rmm.memory.hybrid import HybridRetriever
from rmm.policy.checkpoint import FORMAT_VERSION
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.optimizer import FEATURE_LR_SCALE, LEXICAL_LR_SCALE, param_groups
from rmm.policy.registry import LearnerRegistry
from rmm.policy.reranker import ResidualLinearReranker, candidate_subset, stack_features
from rmm.policy.sampling import plackett_luce_logp
from rmm.types import Candidates, Memory

D, K, F = 6, 5, len(CANDIDATE_FEATURES)
COVERAGE = CANDIDATE_FEATURES.index("query_coverage")


def featured(seed: int, k: int = K, names: tuple[str, ...] = CANDIDATE_FEATURES, lexical: bool = True) -> Candidates:
    g = torch.Generator().manual_seed(seed)
    return Candidates(f"q{seed}", [f"m{i}" for i in range(k)], torch.zeros(k), torch.randn(k, D, generator=g),
                      torch.randn(D, generator=g), lexical=torch.rand(k, generator=g) if lexical else None,
                      features=torch.rand(k, len(names), generator=g), feature_names=names)


def random_reranker(features: bool = True, seed: int = 0, v_scale: float = 1.0) -> ResidualLinearReranker:
    g = torch.Generator().manual_seed(seed)
    r = ResidualLinearReranker(D, lexical_feature=True, feature_names=CANDIDATE_FEATURES if features else ())
    with torch.no_grad():
        r.W_q.weight.copy_(0.3 * torch.randn(D, D, generator=g))
        r.W_m.weight.copy_(0.3 * torch.randn(D, D, generator=g))
        r.lexical_weight.fill_(0.4)
        if features:
            r.feature_weight.copy_(v_scale * torch.randn(F, generator=g))
    return r


# ---- the definitions ----------------------------------------------------------------------------------
def test_feature_values_on_a_hand_made_example_equal_the_definitions() -> None:
    ids = ["a", "b", "c"]
    texts = ["Pixel the cat sleeps", "the cat", "hiking in june with friends"]
    dense = (["b", "a", "x"], [0.9, 0.8, 0.1])  # c not returned by the dense half
    bm25 = (["a", "c"], [4.0, 1.0])  # b not returned by BM25
    x = candidate_feature_matrix("Where does Pixel the cat sleep?", ids, texts, [0.5, 0.7, 0.2], dense, bm25, depth=9,
                                 top_cosine=0.7)
    assert x.shape == (3, F) and x.dtype == torch.float32
    col = {n: x[:, i].tolist() for i, n in enumerate(CANDIDATE_FEATURES)}
    assert col["dense_rr"] == pytest.approx([1 / 2, 1, 1 / 10])  # rank 1, 0, absent = the depth 9
    assert col["bm25_rr"] == pytest.approx([1, 1 / 10, 1 / 2])
    assert col["dense_logrank"] == pytest.approx([math.log(2) / math.log(10), 0, 1])
    assert col["bm25_logrank"] == pytest.approx([0, 1, math.log(2) / math.log(10)])
    assert col["bm25_scaled"] == pytest.approx([1, 0, 0.25])
    assert col["cosine"] == pytest.approx([0.5, 0.7, 0.2])
    assert col["cosine_gap"] == pytest.approx([-0.2, 0, -0.5])
    assert col["log_tokens"] == pytest.approx([math.log(5), math.log(3), math.log(6)])
    # content words: query {pixel, cat, sleep}; a {pixel, cat, sleeps}; b {cat}; c {hiking, june, friends}
    assert col["jaccard"] == pytest.approx([2 / 4, 1 / 3, 0])
    assert col["query_coverage"] == pytest.approx([2 / 3, 1 / 3, 0])
    assert candidate_feature_matrix("q", [], [], [], ([], []), ([], []), 5, top_cosine=0.0).shape == (0, F)
    with pytest.raises(ValueError, match="one per candidate"):
        feature_columns("q", ["a"], [], [0.1], ([], []), ([], []), 5, top_cosine=0.1)


@pytest.fixture
def concept_bank(tmp_path: Path):
    with MemoryBank(tmp_path / "bank", ConceptEncoder(), device="cpu") as b:
        b.add("u", [Memory(id=k, user_id="u", kind="turn", text=v, source_text=f"src {v}")
                    for k, v in CONCEPT_TEXTS.items()])
        yield b


@pytest.mark.parametrize("fusion", ["rrf", "lexical", "convex"])
def test_hybrid_candidates_carry_the_features_in_candidate_order(concept_bank: MemoryBank, fusion: str) -> None:
    retriever = HybridRetriever(concept_bank, fusion=fusion, depth=4, candidate_features=True)
    query = "Which feline sleeps to piano music"
    (c,) = retriever.search([query], "u", 5)
    assert c.feature_names == CANDIDATE_FEATURES and c.features is not None
    assert c.features.shape == (len(c), F) and len(c) >= 3  # BM25 alone finds 3 of the 7
    dense = ([], []) if fusion == "lexical" else concept_bank.search([query], "u", 5)[0]
    (bm25,) = retriever.lexical.search([query], "u", 5)
    texts = [m.source_text for m in concept_bank.get("u", c.memory_ids)]  # the source text, not the embedded one
    expected = candidate_feature_matrix(
        query, c.memory_ids, texts, (c.embeddings @ c.query_embedding).tolist(),
        ([], []) if fusion == "lexical" else (dense.memory_ids, dense.retriever_scores.tolist()),
        (bm25.memory_ids, bm25.retriever_scores.tolist()), 4, top_cosine=depth_top_cosine(concept_bank, query, 4))
    assert torch.allclose(c.features, expected, atol=1e-6)
    if fusion == "lexical":  # no dense list: every dense rank is the depth
        assert c.features[:, CANDIDATE_FEATURES.index("dense_logrank")].tolist() == [1.0] * len(c)
    sub = candidate_subset(c, [2, 0])
    assert torch.equal(sub.features, c.features[[2, 0]]) and sub.feature_names == CANDIDATE_FEATURES
    # off (the default): nothing computed, the same candidates otherwise
    (plain,) = HybridRetriever(concept_bank, fusion=fusion, depth=4).search([query], "u", 5)
    assert plain.features is None and plain.feature_names == () and plain.memory_ids == c.memory_ids
    with pytest.raises(ValueError, match="candidate_features"):
        HybridRetriever(concept_bank, candidate_features="yes")  # type: ignore[arg-type]


def depth_top_cosine(bank: MemoryBank, query: str, depth: int) -> float:
    """The best cosine over the dense list's top `depth` (what `cosine_gap` is measured against)."""
    (d,) = bank.search([query], "u", depth)
    return float((d.embeddings @ d.query_embedding).max())


@pytest.mark.parametrize("fusion", ["rrf", "lexical"])
def test_a_memorys_features_do_not_depend_on_k(concept_bank: MemoryBank, fusion: str) -> None:
    retriever = HybridRetriever(concept_bank, fusion=fusion, depth=4, candidate_features=True)
    query = "Which feline sleeps to piano music"
    (small,) = retriever.search([query], "u", 1)
    (large,) = retriever.search([query], "u", 7)
    common = [m for m in small.memory_ids if m in large.memory_ids]
    assert common
    for m in common:
        assert torch.equal(small.features[small.memory_ids.index(m)], large.features[large.memory_ids.index(m)])


def test_non_finite_features_are_refused_naming_the_feature() -> None:
    with pytest.raises(DataError, match="cosine"):
        candidate_feature_matrix("q", ["a"], ["x"], [float("nan")], ([], []), ([], []), 5, top_cosine=0.0)
    with pytest.raises(DataError, match="bm25_scaled"):
        candidate_feature_matrix("q", ["a"], ["x"], [0.1], ([], []), (["a"], [float("inf")]), 5, top_cosine=0.1)


# ---- scoring ----------------------------------------------------------------------------------------------
def test_zero_feature_weights_score_exactly_as_without_features() -> None:
    plain = random_reranker(features=False)
    with_features = random_reranker(features=True)
    with_features.load_state_dict({**plain.state_dict(), "feature_weight": torch.zeros(F)})
    assert ResidualLinearReranker(D, feature_names=CANDIDATE_FEATURES).feature_weight.tolist() == [0.0] * F
    q, m, f, x = torch.randn(3, D), torch.randn(3, K, D), torch.rand(3, K), torch.rand(3, K, F)
    assert torch.equal(with_features(q, m, f, x), plain(q, m, f))
    assert torch.equal(with_features.policy_scores(q, m, f, x), plain.policy_scores(q, m, f))
    assert torch.equal(with_features.fast_scores(q, m, f, x), plain.fast_scores(q, m, f))
    cands = [featured(1), featured(2), featured(3, k=3)]
    for a, b in zip(with_features.select(cands, 2), plain.select(cands, 2)):
        assert a.chosen == b.chosen and torch.allclose(a.scores, b.scores, atol=1e-6)


def test_the_feature_term_is_features_times_weights_on_every_path() -> None:
    r = random_reranker()
    q, m, f, x = torch.randn(2, D), torch.randn(2, K, D), torch.rand(2, K), torch.rand(2, K, F)
    base = r(q, m, f)
    for scores in (r(q, m, f, x), r.policy_scores(q, m, f, x), r.fast_scores(q, m, f, x)):
        assert torch.allclose(scores, base + x @ r.feature_weight.detach(), atol=1e-5)
    eq1 = random_reranker(features=False)
    assert torch.equal(eq1(q, m, f, x), eq1(q, m, f))  # a reranker without features ignores them
    with pytest.raises(ValueError, match="candidate features of shape"):
        r(q, m, f, x[..., :3])


def test_select_folds_the_features_into_the_kernel_like_the_reference_scores() -> None:
    r = random_reranker(v_scale=2.0)
    full = [featured(1), featured(2)]
    short = [featured(3), featured(4, k=3), featured(5, lexical=False)]
    short[2] = Candidates(short[2].query, short[2].memory_ids, short[2].retriever_scores, short[2].embeddings,
                          short[2].query_embedding)  # no features at all: zeros
    for cands, exclude in ((full, None), (short, None), (full, [{"m1"}, set()])):
        for explore in (False, True):
            g = torch.Generator().manual_seed(7)
            sels = r.select(cands, 2, tau=0.3, explore=explore, generator=g, exclude=exclude)
            for c, sel in zip(cands, sels):
                kept = sel.candidates
                lex = None if kept.lexical is None else kept.lexical[None]
                x = None if kept.features is None else kept.features[None]
                expected = r.fast_scores(kept.query_embedding[None], kept.embeddings[None], lex, x)[0]
                assert torch.allclose(sel.scores, expected, atol=1e-5)
                if not explore:
                    assert sel.chosen == torch.argsort(expected, descending=True)[:2].tolist()
                else:
                    pl = plackett_luce_logp(expected[None], torch.tensor([sel.chosen]), 0.3)[0]
                    assert torch.allclose(sel.logp, pl, atol=1e-4)
                assert kept.features is None or kept.feature_names == CANDIDATE_FEATURES


def test_candidates_with_other_feature_names_are_refused_naming_both() -> None:
    r = random_reranker()
    other = featured(1, names=tuple(reversed(CANDIDATE_FEATURES)))
    with pytest.raises(FeatureMismatchError, match="query_coverage.*dense_rr.*dense_rr.*query_coverage"):
        r.select([other], 2)
    learner = Learner(random_reranker(), LearnerConfig(tau=0.5, batch_size=8))
    (sel,) = learner.select([featured(2)], 2, generator=torch.Generator().manual_seed(0))
    sel.candidates.feature_names = ("jaccard",) * F
    with pytest.raises(FeatureMismatchError):
        learner.record(sel, torch.tensor([1.0, -1.0]))
    assert learner.pending == 0  # nothing kept


# ---- learning ------------------------------------------------------------------------------------------
def test_a_delayed_reward_learns_from_the_features_it_was_sampled_with() -> None:
    """Two selections sampled at version 0, one column of features each; the second is rewarded first.
    With SGD a weight moves only by its gradient: the late reward moves exactly its own sample's column."""
    learner = Learner(ResidualLinearReranker(D, feature_names=CANDIDATE_FEATURES),
                      LearnerConfig(tau=0.5, batch_size=1, baseline=0.0, optimizer="sgd", lr=0.1))

    def one_column(seed: int, column: int) -> Candidates:
        c = featured(seed, lexical=False)
        c.features = torch.zeros(K, F)
        c.features[0, column] = 1.0  # only candidate 0 has it
        return c

    g = torch.Generator().manual_seed(0)
    late, early = learner.select([one_column(1, COVERAGE), one_column(2, 0)], 1, generator=g)
    learner.record(early, torch.tensor([1.0 if early.chosen == [0] else -1.0]))
    after_early = learner.reranker.feature_weight.detach().clone()
    assert after_early[COVERAGE] == 0 and after_early[0] != 0 and learner.stats.step == 1
    learner.record(late, torch.tensor([1.0 if late.chosen == [0] else -1.0]))
    moved = learner.reranker.feature_weight.detach() - after_early
    assert learner.stats.step == 2 and moved[COVERAGE] > 0  # candidate 0 rewarded (or the others punished)
    assert learner.stats.staleness_sum == 1  # sampled one update before the one that learned from it
    assert torch.count_nonzero(moved) == 1  # no other column took part


def test_a_tiny_online_run_learns_a_positive_weight_for_the_only_informative_feature() -> None:
    """Embeddings carry no signal; the gold candidate is the one whose query_coverage is 1."""
    learner = Learner(ResidualLinearReranker(D, lexical_feature=True, feature_names=CANDIDATE_FEATURES),
                      LearnerConfig(tau=0.2, batch_size=4, baseline="mean", lr=3e-3))
    g, draws = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    for step in range(300):
        c = featured(1000 + step, k=8, lexical=False)
        x = torch.rand(8, F, generator=g)
        gold = int(torch.randint(8, (1,), generator=g))
        x[:, COVERAGE] = 0.0
        x[gold, COVERAGE] = 1.0
        c.features = x
        (sel,) = learner.select([c], 2, generator=draws)
        learner.record(sel, torch.tensor([1.0 if i == gold else -1.0 for i in sel.chosen]))
    v = learner.reranker.feature_weight.detach()
    assert v[COVERAGE] > 0.3 and int(v.argmax()) == COVERAGE
    assert learner.optimizer.param_groups[1]["lr"] == pytest.approx(3e-3 * FEATURE_LR_SCALE)


def test_the_feature_and_lexical_weights_step_in_their_own_group_only_with_features() -> None:
    with_features = ResidualLinearReranker(D, lexical_feature=True, feature_names=CANDIDATE_FEATURES)
    groups = param_groups(with_features, 1e-3)
    assert len(groups) == 2 and groups[1]["lr"] == pytest.approx(1e-3 * FEATURE_LR_SCALE)
    assert groups[1]["params"] == [with_features.lexical_weight, with_features.feature_weight]
    lexical_only = ResidualLinearReranker(D, lexical_feature=True)
    assert [g.get("lr") for g in param_groups(lexical_only, 1e-3)] == [None, 1e-3 * LEXICAL_LR_SCALE]
    assert len(param_groups(ResidualLinearReranker(D), 1e-3)) == 1


def test_stacked_features_pad_with_zeros() -> None:
    a, b = torch.rand(3, 2), torch.rand(1, 2)
    out = stack_features([a, None, b], 4, 2)
    assert out.shape == (3, 4, 2) and torch.equal(out[0, :3], a) and out[1].abs().sum() == 0
    assert torch.equal(out[2, :1], b) and out[2, 1:].abs().sum() == 0 and out[0, 3].abs().sum() == 0
    assert stack_features([None, None], 4, 2) is None and stack_features([a], 3, 0) is None


# ---- checkpoints ---------------------------------------------------------------------------------------
def test_checkpoint_format_5_round_trip_format_4_load_and_a_name_mismatch(tmp_path: Path) -> None:
    learner = Learner(random_reranker(), LearnerConfig(tau=0.5, batch_size=8))
    (sel,) = learner.select([featured(4)], 2, generator=torch.Generator().manual_seed(0))
    learner.record(sel, torch.tensor([1.0, -1.0]))  # buffered with its features
    folder = learner.save(tmp_path / "ckpt")
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION == 5 and meta["feature_names"] == list(CANDIDATE_FEATURES)
    loaded = Learner.load(folder, feature_names=CANDIDATE_FEATURES)
    assert loaded.reranker.feature_names == CANDIDATE_FEATURES
    assert torch.equal(loaded.reranker.feature_weight, learner.reranker.feature_weight)
    assert torch.equal(loaded._buffer[0].features, sel.candidates.features)
    for asked in ((), CANDIDATE_FEATURES[:3]):
        with pytest.raises(CheckpointError, match="--no-candidate-features"):
            Learner.load(folder, feature_names=asked)
    # A format-4 checkpoint (no feature_names): as saved when the run asks for none, and gains the asked
    # ones at 0 otherwise (tests/test_checkpoint_growth.py covers the growth).
    old = Learner(random_reranker(features=False), LearnerConfig()).save(tmp_path / "old")
    old_meta = json.loads((old / "meta.json").read_text())
    del old_meta["feature_names"]
    (old / "meta.json").write_text(json.dumps({**old_meta, "format_version": 4}))
    legacy = Learner.load(old, feature_names=())
    assert legacy.reranker.feature_names == () and legacy.reranker.feature_weight is None
    assert legacy.reranker.lexical_feature
    grown = Learner.load(old, feature_names=CANDIDATE_FEATURES)
    assert grown.reranker.feature_names == CANDIDATE_FEATURES and not grown.reranker.feature_weight.any()


def test_the_registry_builds_and_loads_rerankers_with_the_configured_features(tmp_path: Path) -> None:
    on = LearnerRegistry(D, LearnerConfig(), root=tmp_path)
    assert on.get("a").reranker.feature_names == CANDIDATE_FEATURES
    on.save("a", only_changed=False)
    off = LearnerRegistry(D, LearnerConfig(candidate_features=False), root=tmp_path)
    assert off.get("b").reranker.feature_weight is None  # today's reranker
    with pytest.raises(CheckpointError, match="candidate features"):
        off.get("a")
    with pytest.raises(ValueError, match="candidate_features"):
        LearnerConfig(candidate_features=1)  # type: ignore[arg-type]


# ---- rmm train ---------------------------------------------------------------------------------------
def test_no_candidate_features_flag_or_config_key_gives_todays_reranker() -> None:
    from rmm.cli.arguments import CheckedParser
    from rmm.cli.train import _online_config, add_train_command_options

    parser = CheckedParser(prog="rmm train")
    add_train_command_options(parser)
    for argv, expected in (([], True), (["--no-candidate-features"], False), (["candidate_features=false"], False)):
        cfg = _online_config(parser.parse_args(argv), normalized_encoder=True)
        assert cfg.candidate_features is expected and cfg.learner_config().candidate_features is expected


def test_rmm_train_over_hybrid_candidates_learns_from_their_features(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from rmm.training.online import OnlineConfig, OnlineTrainer

    dataset, encoder = lexical_problem(n_users=2, n_questions=12)
    with MemoryBank(tmp_path / "bank", encoder) as bank:
        fill(bank, dataset, "turn", progress=False)
        retriever = HybridRetriever(bank, candidate_features=True)
        cfg = OnlineConfig(tau=0.2, baseline="mean", lr=0.01, k=6, m=2, eval_k=1, heldout_fraction=0.5, epochs=1)
        trainer = OnlineTrainer(dataset, retriever, cfg, progress=False)
        report = trainer.run()
        (learner,) = [learner for _, learner in trainer.learners.items()]
        assert report.config["candidate_features"] and learner.stats.step > 0
        assert learner.reranker.feature_names == CANDIDATE_FEATURES
        assert bool(learner.reranker.feature_weight.detach().abs().sum() > 0)  # the features were learned from
        with caplog.at_level("WARNING", logger="rmm.training.online"):  # weights without features: said so
            OnlineTrainer(dataset, HybridRetriever(bank), cfg, progress=False)
        assert "computes none" in caplog.text


def test_rmm_eval_reranker_computes_the_features_its_checkpoint_weighs(tiny_data_dir: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """q' = −q reverses the embedding order; a large weight on BM25's reciprocal rank restores BM25's,
    which only a first stage that computes the features can show."""
    from test_bm25_over_dense import NormalizedBagOfWords, question_decoys

    import rmm.eval.benchmark_bank
    from rmm.cli import main

    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(rmm.eval.benchmark_bank, "load_encoder", lambda name, **kw: NormalizedBagOfWords())
    question_decoys(tiny_data_dir / "locomo" / "locomo10.json")  # BM25's first is a decoy (its recall@1 is 0)
    encoder = NormalizedBagOfWords()
    recall_at_1 = {}
    for name, features in (("plain", ()), ("featured", CANDIDATE_FEATURES)):
        reranker = ResidualLinearReranker(encoder.dim, lexical_feature=True, lexical_init=0.0, feature_names=features)
        with torch.no_grad():
            reranker.W_q.weight.copy_(-2 * torch.eye(encoder.dim))
            if features:
                reranker.feature_weight[CANDIDATE_FEATURES.index("bm25_rr")] = 100.0
        folder = Learner(reranker, LearnerConfig(), encoder_name=encoder.fingerprint).save(tmp_path / name)
        out = tmp_path / f"{name}.json"
        assert main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "bm25:minilm", "--k", "1",
                     "--depth", "8", "--reranker", str(folder), "--json", str(out)]) == 0
        recall_at_1[name] = json.loads(out.read_text())["bm25:minilm/turn+reranker"]["overall"]["recall@1"]
    assert recall_at_1["plain"] > 0.5 and recall_at_1["featured"] == 0.0  # BM25's order again: the decoy first
