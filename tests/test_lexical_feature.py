"""The lexical feature (our extension of Eq. 1): `s_i = q'·m'_i + w·f_i` with one learned scalar `w`
and `f` the hybrid first stage's lexical feature in [0, 1] (BM25's score scaled over its top list).
Scored the same on every path, recorded with the selection, learned from citations, kept in
checkpoints with the feature's definition, off with a flag."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rmm.training.online import OnlineConfig, OnlineTrainer

from rmm.errors import CheckpointError
from rmm.eval.benchmark_bank import fill
from rmm.memory.bank import MemoryBank
from rmm.memory.hybrid import LEXICAL_DEFINITION, HybridRetriever
from rmm.policy.checkpoint import FORMAT_VERSION, LEGACY_LEXICAL_DEFINITION
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.registry import LearnerRegistry
from rmm.policy.reranker import LEXICAL_INIT, ResidualLinearReranker, candidate_subset
from rmm.policy.retrieve import RerankedRetriever
from rmm.policy.sampling import plackett_luce_logp
from rmm.types import Candidates, Dataset, Question, Session, Turn

D, K = 6, 5


def random_reranker(lexical: bool, w: float = 0.7, seed: int = 0) -> ResidualLinearReranker:
    g = torch.Generator().manual_seed(seed)
    r = ResidualLinearReranker(D, lexical_feature=lexical)
    with torch.no_grad():
        r.W_q.weight.copy_(0.3 * torch.randn(D, D, generator=g))
        r.W_m.weight.copy_(0.3 * torch.randn(D, D, generator=g))
        if lexical:
            r.lexical_weight.fill_(w)
    return r


def candidates(seed: int, lexical: bool = True, k: int = K) -> Candidates:
    g = torch.Generator().manual_seed(seed)
    return Candidates(f"q{seed}", [f"m{i}" for i in range(k)], torch.zeros(k), torch.randn(k, D, generator=g),
                      torch.randn(D, generator=g), lexical=torch.rand(k, generator=g) if lexical else None)


def test_the_lexical_term_is_one_learned_scalar_times_the_feature() -> None:
    plain, lexical = random_reranker(False), random_reranker(True, w=0.7)
    q, m, f = torch.randn(2, D), torch.randn(2, K, D), torch.rand(2, K)
    base = plain(q, m)
    for scores in (lexical(q, m, f), lexical.policy_scores(q, m, f), lexical.fast_scores(q, m, f)):
        assert torch.allclose(scores, base + 0.7 * f, atol=1e-5)
    assert torch.allclose(lexical(q, m), base, atol=1e-6)  # no feature given: Eq. 1
    assert torch.allclose(plain(q, m, f), base)  # a reranker without the feature ignores it
    assert "lexical_weight" not in plain.state_dict() and "lexical_weight" in lexical.state_dict()
    lexical.policy_scores(q, m, f)[0, 0].backward()
    assert lexical.lexical_weight.grad == pytest.approx(float(f[0, 0]))


def test_sampling_uses_the_same_scores_and_records_the_feature() -> None:
    reranker = random_reranker(True, w=1.5)
    cands = [candidates(1), candidates(2, lexical=False), candidates(3, k=3)]
    greedy = reranker.select(cands, 2)
    for c, sel in zip(cands, greedy):
        f = None if c.lexical is None else c.lexical[None]
        expected = reranker.fast_scores(c.query_embedding[None], c.embeddings[None], f)[0]
        assert torch.allclose(sel.scores, expected, atol=1e-5)
        assert sel.chosen == torch.argsort(expected, descending=True)[:2].tolist()
        assert sel.candidates.lexical is c.lexical  # recorded as scored, for an update any time later
    sampled = reranker.select(cands, 2, tau=0.3, explore=True, generator=torch.Generator().manual_seed(0))
    for sel in sampled:
        expected = plackett_luce_logp(sel.scores[None], torch.tensor([sel.chosen]), 0.3)[0]
        assert torch.allclose(sel.logp, expected, atol=1e-4)
    # Exclusion keeps each remaining candidate's feature with it.
    (kept,) = reranker.select([cands[0]], 2, exclude=[{"m1"}])
    assert kept.candidates.memory_ids == ["m0", "m2", "m3", "m4"]
    assert torch.equal(kept.candidates.lexical, cands[0].lexical[[0, 2, 3, 4]])


def test_an_untrained_reranker_starts_from_cosine_plus_the_chosen_share_of_the_fused_score() -> None:
    plain, lexical = ResidualLinearReranker(D), ResidualLinearReranker(D, lexical_feature=True)
    assert float(lexical.lexical_weight.detach()) == pytest.approx(LEXICAL_INIT) and LEXICAL_INIT > 0
    cands = [candidates(s) for s in range(4)]
    (sel,) = lexical.select(cands[:1], K)
    assert torch.allclose(sel.scores, cands[0].embeddings @ cands[0].query_embedding + LEXICAL_INIT * cands[0].lexical)
    at_zero = ResidualLinearReranker(D, lexical_feature=True, lexical_init=0.0)  # w = 0: exactly Eq. 1
    a = plain.select(cands, 3, tau=0.2, explore=True, generator=torch.Generator().manual_seed(5))
    b = at_zero.select(cands, 3, tau=0.2, explore=True, generator=torch.Generator().manual_seed(5))
    assert [s.chosen for s in a] == [s.chosen for s in b]


def test_the_learner_learns_w_from_citations_of_lexically_marked_memories() -> None:
    """Embeddings say nothing (all candidates alike to the query); only f marks the useful one."""
    learner = Learner(ResidualLinearReranker(D, lexical_feature=True),
                      LearnerConfig(lr=0.05, tau=0.5, baseline="mean", lexical_feature=True))
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        q = torch.randn(D, generator=g)
        f = torch.rand(K, generator=g) * 0.5
        useful = int(torch.randint(K, (1,), generator=g))
        f[useful] = 1.0
        cand = Candidates("q", [f"m{i}" for i in range(K)], torch.zeros(K), q.repeat(K, 1) * 0.1, q, lexical=f)
        (sel,) = learner.select([cand], 1, generator=g)
        learner.record(sel, torch.tensor([1.0 if sel.chosen[0] == useful else -1.0]))
    assert float(learner.reranker.lexical_weight.detach()) > 2.0


def test_a_checkpoint_states_whether_its_reranker_has_the_feature(tmp_path: Path) -> None:
    assert LearnerConfig().lexical_feature  # on by default: a registry builds rerankers with it
    learner = Learner(ResidualLinearReranker(D, lexical_feature=True), LearnerConfig(tau=0.5))
    sel = learner.select([candidates(7)], 2, generator=torch.Generator().manual_seed(1))[0]
    learner.record(sel, torch.tensor([1.0, -1.0]))  # buffered, with its feature
    with torch.no_grad():
        learner.reranker.lexical_weight.fill_(0.25)
    folder = learner.save(tmp_path / "ckpt")
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["lexical_feature"] is True and meta["format_version"] == FORMAT_VERSION
    assert meta["lexical_definition"] == LEXICAL_DEFINITION  # which feature w was learned on
    resumed = Learner.load(folder, lexical_feature=True)
    assert float(resumed.reranker.lexical_weight.detach()) == 0.25 and resumed.config == learner.config
    assert torch.equal(resumed._buffer[0].lexical, sel.candidates.lexical.float())
    with pytest.raises(CheckpointError, match="trained with the lexical feature"):
        Learner.load(folder, lexical_feature=False)

    # A learner learns what its reranker has; the checkpoint says so, whatever the config's default.
    plain = Learner(ResidualLinearReranker(D), LearnerConfig()).save(tmp_path / "plain")
    assert json.loads((plain / "meta.json").read_text())["lexical_feature"] is False
    assert not Learner.load(plain, lexical_feature=False).reranker.lexical_feature
    # Asked for the feature, a checkpoint without it gains w = 0 (not LEXICAL_INIT: its ranking stays).
    assert float(Learner.load(plain, lexical_feature=True).reranker.lexical_weight.detach()) == 0.0
    # A checkpoint from before the feature (format 2, no lexical_feature) loads as plain Eq. 1 unless asked.
    meta = json.loads((plain / "meta.json").read_text())
    del meta["lexical_feature"], meta["config"]["lexical_feature"]
    (plain / "meta.json").write_text(json.dumps({**meta, "format_version": 2}))
    loaded = Learner.load(plain)
    assert not loaded.reranker.lexical_feature and loaded.config == LearnerConfig()
    assert float(Learner.load(plain, lexical_feature=True).reranker.lexical_weight.detach()) == 0.0
    # A registry builds new learners with the feature; a checkpoint without it gains it at 0.
    registry = LearnerRegistry(D, LearnerConfig(), root=tmp_path / "reg")
    assert registry.get("a").reranker.lexical_feature
    Learner(ResidualLinearReranker(D), LearnerConfig()).save(registry.path("b"))
    assert float(registry.get("b").reranker.lexical_weight.detach()) == 0.0
    assert not LearnerRegistry(D, LearnerConfig(lexical_feature=False)).get("c").reranker.lexical_feature


def test_a_format_3_reranker_trained_on_the_fused_score_loads_warns_and_is_saved_as_todays(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Format 3 names no definition: its w was learned on the fused score. It loads as it is (weights
    and pending features kept), says so, a save with no update since loading keeps the old label (the
    warning repeats), and the first save after an update records today's definition; a definition
    this rmm does not know is refused, and so is a format-4 lexical checkpoint that names none."""
    learner = Learner(ResidualLinearReranker(D, lexical_feature=True), LearnerConfig(tau=0.5))
    sel = learner.select([candidates(3)], 2, generator=torch.Generator().manual_seed(2))[0]
    learner.record(sel, torch.tensor([1.0, 0.0]))
    with torch.no_grad():
        learner.reranker.lexical_weight.fill_(0.8)
    folder = learner.save(tmp_path / "old")
    meta = json.loads((folder / "meta.json").read_text())
    del meta["lexical_definition"]
    (folder / "meta.json").write_text(json.dumps({**meta, "format_version": 3}))
    with caplog.at_level("WARNING", logger="rmm.policy.checkpoint"):
        old = Learner.load(folder, lexical_feature=True)
    assert LEGACY_LEXICAL_DEFINITION in caplog.text and LEXICAL_DEFINITION in caplog.text
    assert float(old.reranker.lexical_weight.detach()) == pytest.approx(0.8)
    assert torch.equal(old._buffer[0].lexical, sel.candidates.lexical.float())  # as sampled
    # Saved with no update since loading (rmm chat --no-learn closing): still the old feature's weights.
    kept = json.loads((old.save(folder) / "meta.json").read_text())
    assert kept["format_version"] == FORMAT_VERSION and kept["lexical_definition"] == LEGACY_LEXICAL_DEFINITION
    caplog.clear()
    with caplog.at_level("WARNING", logger="rmm.policy.checkpoint"):
        old = Learner.load(folder, lexical_feature=True)
    assert LEGACY_LEXICAL_DEFINITION in caplog.text  # says so again
    step, seed = old.stats.step, 10
    while old.stats.step == step:  # one update on today's feature
        (more,) = old.select([candidates(seed)], 2, generator=torch.Generator().manual_seed(seed))
        old.record(more, torch.tensor([1.0, -1.0]))
        seed += 1
    saved = json.loads((old.save(folder) / "meta.json").read_text())
    assert saved["format_version"] == FORMAT_VERSION and saved["lexical_definition"] == LEXICAL_DEFINITION
    caplog.clear()
    with caplog.at_level("WARNING", logger="rmm.policy.checkpoint"):
        Learner.load(folder, lexical_feature=True)
    assert "lexical feature" not in caplog.text  # today's definition: nothing to say
    for stated, version in (("rrf-v9", 4), (None, 4)):
        bad = {**saved, "format_version": version}
        if stated is None:
            del bad["lexical_definition"]
        else:
            bad["lexical_definition"] = stated
        (folder / "meta.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="lexical feature"):
            Learner.load(folder, lexical_feature=True)
    # A plain Eq. 1 checkpoint has no definition to state.
    plain = json.loads((Learner(ResidualLinearReranker(D), LearnerConfig()).save(tmp_path / "p") / "meta.json").read_text())
    assert "lexical_definition" not in plain


def test_a_format_3_checkpoint_without_the_lexical_weight_loads_with_no_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Only a lexical weight was trained on some definition: a plain format-3 reranker has nothing to warn about."""
    folder = Learner(ResidualLinearReranker(D), LearnerConfig()).save(tmp_path / "plain3")
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["lexical_feature"] is False and "lexical_definition" not in meta
    (folder / "meta.json").write_text(json.dumps({**meta, "format_version": 3}))
    with caplog.at_level("WARNING"):
        loaded = Learner.load(folder, lexical_feature=False)
    assert not loaded.reranker.lexical_feature and caplog.records == []
    saved = json.loads((loaded.save(folder) / "meta.json").read_text())
    assert saved["format_version"] == FORMAT_VERSION and "lexical_definition" not in saved


# ---- through the hybrid first stage and rmm train's trainer -----------------------------------------
class TableEncoder:
    """Vectors by text, so a test fixes what the dense half can and cannot see."""

    name, fingerprint = "table", "table-v1"

    def __init__(self, table: dict[str, torch.Tensor]) -> None:
        self.table, self.dim = table, next(iter(table.values())).numel()

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        return torch.stack([self.table[t] for t in texts])

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        return self.encode_queries([t.split(": ", 1)[-1] for t in texts])


Made = tuple[str, torch.Tensor, list[tuple[str, torch.Tensor]]]


def three_turn_dataset(n_users: int, n_questions: int, make: Callable[[int, int, torch.Generator], Made]
                       ) -> tuple[Dataset, TableEncoder]:
    """One session per question holding three turns, the first the gold: `make(u, j, generator)`
    gives the question, its vector and each turn's (text, vector), which the encoder answers from."""
    g = torch.Generator().manual_seed(0)
    table, sessions, questions = {}, {}, []
    for u in range(n_users):
        user = f"u{u}"
        sessions[user] = []
        for j in range(n_questions):
            query, query_vector, made = make(u, j, g)
            table[query] = query_vector
            turns = []
            for i, (text, vector) in enumerate(made):
                table[text] = vector
                turns.append(Turn(id=f"{user}:D{j}:{i}", session_id=f"{user}:S{j + 1}", speaker="A", text=text))
            questions.append(Question(id=f"{user}:q{j}", user_id=user, text=query, answer="",
                                      evidence_turns=[f"{user}:D{j}:0"], evidence_sessions=[f"{user}:S{j + 1}"],
                                      category=1))
            sessions[user].append(Session(id=f"{user}:S{j + 1}", user_id=user, turns=turns))
    return Dataset("synthetic", sessions, questions, {1: "synthetic"}), TableEncoder(table)


def lexical_problem(n_users: int = 4, n_questions: int = 24) -> tuple[Dataset, TableEncoder]:
    """Each question names a rare keyword that only its gold turn contains; two decoys match the
    query's embedding better and the gold turn's embedding is no different in kind, so Eq. 1 alone
    cannot find it — BM25 can, and so can a reranker that learns to trust the lexical feature."""
    def make(u: int, j: int, g: torch.Generator) -> Made:
        topic = torch.nn.functional.normalize(torch.randn(12, generator=g), dim=0)
        texts = [f"note zq{u}x{j} here", f"decoy {u} {j} 1", f"decoy {u} {j} 2"]
        return f"what about zq{u}x{j}", topic, [(text, topic * scale + 0.005 * torch.randn(12, generator=g))
                                                for text, scale in zip(texts, (0.6, 0.7, 0.7))]
    return three_turn_dataset(n_users, n_questions, make)


@pytest.fixture
def hybrid(tmp_path: Path):
    dataset, encoder = lexical_problem()
    bank = MemoryBank(tmp_path / "bank", encoder)
    fill(bank, dataset, "turn", progress=False)
    yield dataset, HybridRetriever(bank)
    bank.close()


def test_hybrid_candidates_carry_bm25s_score_scaled_over_its_depth_list(hybrid) -> None:
    dataset, retriever = hybrid
    q = dataset.questions[0]
    (c,) = retriever.search([q.text], q.user_id, 6)
    assert c.lexical is not None and c.lexical.shape == (6,)
    (bm25,) = retriever.lexical.search([q.text], q.user_id, retriever.depth)
    scaled = dict(zip(bm25.memory_ids, retriever.lexical_feature(bm25, bm25.memory_ids).tolist()))
    assert c.lexical.tolist() == [scaled.get(m, 0.0) for m in c.memory_ids]
    assert float(c.lexical.max()) <= 1.0 and c.memory_ids[0] == "u0:D0:0"  # found by BM25, fused first
    assert float(c.lexical[0]) == 1.0  # BM25's best: only the gold turn holds the keyword
    sub = candidate_subset(c, [2, 0])
    assert torch.equal(sub.lexical, c.lexical[[2, 0]])
    # The whole-bank search (the reranker's learned query) is fused with BM25 the same way.
    (again,) = retriever.search_embeddings(c.query_embedding[None], q.user_id, 6, queries=[q.text])
    assert again.memory_ids == c.memory_ids and torch.allclose(again.lexical, c.lexical)
    (dense_only,) = retriever.search_embeddings(c.query_embedding[None], q.user_id, 6)
    assert dense_only.lexical is None and dense_only.memory_ids[0] != "u0:D0:0"
    # RerankedRetriever (agent, goal front end) samples through the hybrid with the feature.
    reranker = ResidualLinearReranker(retriever.dim, lexical_feature=True)
    with torch.no_grad():
        reranker.lexical_weight.fill_(100.0)
    (sel,) = RerankedRetriever(retriever, reranker, k=6, m=2).select([q.text], q.user_id)
    assert sel.memory_ids[0] == "u0:D0:0" and sel.candidates.lexical is not None


def _train(dataset: Dataset, retriever: HybridRetriever, lexical: bool):
    cfg = OnlineConfig(tau=0.2, baseline="mean", lr=0.05, k=6, m=2, eval_k=1, heldout_fraction=0.25, epochs=2,
                       lexical_feature=lexical)
    return OnlineTrainer(dataset, retriever, cfg, progress=False).run()


def test_rmm_train_learns_the_lexical_weight_over_hybrid_candidates(hybrid) -> None:
    dataset, retriever = hybrid
    on, off = _train(dataset, retriever, True), _train(dataset, retriever, False)
    assert off.retriever_heldout["recall@1"] == 1.0  # the fused order has the gold first
    assert off.reranker_heldout["recall@1"] <= 0.3  # Eq. 1 reorders by embeddings, and they mislead
    assert on.reranker_heldout["recall@1"] >= 0.9  # w learned: the fused evidence is back
    assert on.learner["step"] > 0 and on.config["lexical_feature"] and not off.config["lexical_feature"]
    # The report carries the ceiling and the share of headroom captured.
    assert on.headroom["k"] == 6 and on.headroom["m"] == 1
    held = on.headroom["heldout"]
    assert held["retriever_recall@6"] == 1.0 and held["reranker_recall@1"] == on.reranker_heldout["recall@1"]
    assert held["captured"] is None  # the retriever already had it all at M: no headroom
    assert 0.0 <= on.reranker_heldout_whole_bank["recall@1"] <= 1.0  # the whole-bank search runs on a hybrid


def test_rmm_train_turns_the_feature_off_by_flag_or_config_key() -> None:
    from rmm.cli.arguments import CheckedParser
    from rmm.cli.train import _online_config, add_train_command_options

    parser = CheckedParser(prog="rmm train")
    add_train_command_options(parser)
    for argv, expected in (([], True), (["--no-lexical-feature"], False), (["lexical_feature=false"], False)):
        args = parser.parse_args(argv)
        cfg = _online_config(args, normalized_encoder=True)
        assert cfg.lexical_feature is expected and cfg.learner_config().lexical_feature is expected
