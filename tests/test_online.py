"""The online training program: it learns what citations reward, resumes exactly, splits honestly."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from rmm.training.online import OnlineConfig, OnlineTrainer, split_questions
from rmm.training.online_plot import figure, plot, plot_series

from rmm.errors import CheckpointError
from rmm.eval.benchmark_bank import fill
from rmm.memory.bank import MemoryBank
from rmm.memory.hybrid import HybridRetriever
from rmm.policy.learner import recipe_for
from rmm.policy.registry import SHARED, LearnerRegistry
from rmm.policy.retrieve import RerankedRetriever
from rmm.types import Dataset, Question, Session, Turn

DIM = 16


class TableEncoder:
    """Looks vectors up by text: lets a test build a retrieval problem with a known structure."""

    def __init__(self, table: dict[str, torch.Tensor]) -> None:
        self.table, self.dim, self.name = table, DIM, "table"
        self.fingerprint = "table-encoder"

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        return torch.stack([self.table[t] for t in texts])

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        return self.encode_queries([t.split(": ", 1)[-1] for t in texts])  # memories read "speaker: text"


def hidden_feature_problem(n_users: int = 6, n_questions: int = 30, seed: int = 0):
    """Gold turns carry a feature (dim 15) the query never looks at, while three decoy turns per
    question match the query slightly better; every query has a constant component (dim 14)
    through which a learned W_m can reward the feature. Only citations reveal it.

    Question j's four turns are the conversation's session j+1, so a cut by dialogue time can hold
    out a user's later questions without their evidence ever being shown in training."""
    g = torch.Generator().manual_seed(seed)
    table: dict[str, torch.Tensor] = {}
    sessions, questions = {}, []
    for u in range(n_users):
        user = f"u{u}"
        sessions[user] = []
        for j in range(n_questions):
            topic = torch.randn(12, generator=g)
            table[f"{user} q{j}"] = torch.cat([topic, torch.tensor([0.0, 0.0, 1.0, 0.0])])
            turns = []
            for i, (scale, hidden) in enumerate([(0.6, 1.0), (0.7, 0.0), (0.7, 0.0), (0.7, 0.0)]):
                text = f"{user} turn {j}.{i}"
                noise = torch.randn(12, generator=g) * 0.05
                table[text] = torch.cat([topic * scale + noise, torch.tensor([0.0, 0.0, 0.0, hidden])])
                turns.append(Turn(id=f"{user}:D1:{4 * j + i}", session_id=f"{user}:S{j + 1}", speaker="A",
                                  text=text))
            questions.append(Question(id=f"{user}:q{j}", user_id=user, text=f"{user} q{j}", answer="",
                                      evidence_turns=[f"{user}:D1:{4 * j}"], evidence_sessions=[f"{user}:S{j + 1}"],
                                      category=1))
            sessions[user].append(Session(id=f"{user}:S{j + 1}", user_id=user, turns=turns))
    return Dataset("synthetic", sessions, questions, {1: "synthetic"}), TableEncoder(table)


@pytest.fixture
def problem(tmp_path):
    dataset, encoder = hidden_feature_problem()
    bank = MemoryBank(tmp_path / "bank", encoder)
    fill(bank, dataset, "turn", progress=False)
    yield dataset, bank
    bank.close()


def config(**kw) -> OnlineConfig:
    return OnlineConfig(**{"tau": 0.1, "baseline": "mean", "lr": 3e-2, "k": 10, "m": 3, "eval_k": 1, "heldout_fraction": 0.34,
                           "epochs": 2, **kw})


def test_reranker_learns_from_citations_and_generalises(problem):
    dataset, bank = problem
    report = OnlineTrainer(dataset, bank, config(), progress=False).run()
    before, after = report.retriever_heldout["recall@1"], report.reranker_heldout["recall@1"]
    assert after > before + 0.2, (before, after)
    assert report.reranker_prequential["recall@1"] > report.retriever["recall@1"]
    assert report.citer.startswith("simulated")
    assert len(report.cited_ratio) == config().epochs * len(OnlineTrainer(dataset, bank, config(), progress=False).split.train)


def test_untrained_reranker_scores_like_the_retriever(problem):
    dataset, bank = problem
    trainer = OnlineTrainer(dataset, bank, config(lr=1e-12, epochs=1), progress=False)
    report = trainer.run()
    assert report.reranker_heldout["recall@1"] == pytest.approx(report.retriever_heldout["recall@1"])


def test_runs_are_repeatable(problem):
    dataset, bank = problem
    a = OnlineTrainer(dataset, bank, config(epochs=1), progress=False).run()
    b = OnlineTrainer(dataset, bank, config(epochs=1), progress=False).run()
    assert a.to_json() == b.to_json()


def crash_then_resume(dataset, bank, cfg: OnlineConfig, out, monkeypatch, after: int) -> OnlineTrainer:
    """Run with checkpoints into `out`, interrupt it after `after` questions, resume it to the end."""
    interrupted = OnlineTrainer(dataset, bank, cfg, output_dir=out, progress=False)
    real_step, calls = interrupted.step, {"n": 0}

    def crash_after(*args):
        calls["n"] += 1
        if calls["n"] > after:
            raise KeyboardInterrupt
        real_step(*args)

    monkeypatch.setattr(interrupted, "step", crash_after)
    with pytest.raises(KeyboardInterrupt):
        interrupted.run()
    return OnlineTrainer(dataset, bank, cfg, output_dir=out, progress=False)


def test_interrupted_run_resumes_to_the_same_result(problem, tmp_path, monkeypatch):
    dataset, bank = problem
    cfg = config(epochs=1, checkpoint_every=7)
    straight = OnlineTrainer(dataset, bank, cfg, progress=False).run()

    resumed = crash_then_resume(dataset, bank, cfg, tmp_path / "run", monkeypatch, after=30)
    assert resumed.run().to_json() == straight.to_json()


def test_interrupted_per_user_run_resumes_from_the_registry_layout(problem, tmp_path, monkeypatch):
    """Per-user learners live where the agent and `rmm serve` keep them: `rerankers/users/<key>`."""
    dataset, bank = problem
    cfg = config(epochs=1, per_user=True, checkpoint_every=5)
    straight = OnlineTrainer(dataset, bank, cfg, progress=False).run()
    out = tmp_path / "run"
    resumed = crash_then_resume(dataset, bank, cfg, out, monkeypatch, after=47)  # 2 users done, 7 of the 3rd
    assert resumed.run().to_json() == straight.to_json()
    registry = LearnerRegistry(bank.dim, cfg.learner_config(), encoder_name=bank.encoder.fingerprint,
                               root=out / "rerankers", subdir="users")
    assert not (out / "rerankers" / "meta.json").exists()  # no shared learner in per-user mode
    for user in dataset.users:
        assert (registry.path(user) / "meta.json").exists()
        assert registry.get(user).stats == resumed.learners.get(user).stats


def test_resume_refuses_what_it_cannot_continue_exactly(problem, tmp_path):
    dataset, bank = problem
    out = tmp_path / "run"
    OnlineTrainer(dataset, bank, config(epochs=1), output_dir=out, progress=False).run()
    assert (out / "rerankers" / "meta.json").exists()  # the shared learner at the registry's root
    state_file = out / "state.json"
    state = json.loads(state_file.read_text())
    assert set(state["learners"]) == {SHARED}

    state_file.write_text(json.dumps({**state, "learners": {SHARED: [0, 0, 0, 0]}}))
    with pytest.raises(CheckpointError, match="does not match"):  # learners saved, state not: crashed between
        OnlineTrainer(dataset, bank, config(epochs=1), output_dir=out, progress=False).run()
    old = {k: v for k, v in state.items() if k not in ("version", "learners")}
    state_file.write_text(json.dumps({**old, "users": ["*"]}))  # what rmm wrote before the registry
    with pytest.raises(CheckpointError, match="older rmm"):
        OnlineTrainer(dataset, bank, config(epochs=1), output_dir=out, progress=False).run()
    state_file.unlink()
    with pytest.raises(CheckpointError, match="no state.json"):
        OnlineTrainer(dataset, bank, config(epochs=1), output_dir=out, progress=False).run()


def test_plot_draws_the_questions_the_table_reports(problem, tmp_path):
    """The curves end at the table's prequential figures (LoCoMo's category 5 left out of both), and
    the second panel shows the held-out comparison."""
    dataset, bank = problem
    locomo = dataclasses.replace(
        dataset, name="locomo", categories={1: "multi-hop", 2: "temporal", 5: "adversarial"},
        questions=[dataclasses.replace(q, category=(5 if i % 4 == 0 else 1 + i % 2))
                   for i, q in enumerate(dataset.questions)])
    trainer = OnlineTrainer(locomo, bank, config(epochs=1), progress=False)
    report = trainer.run()
    series = plot_series(report)
    headline_train = [q for q in trainer.split.train if q.category != 5]
    assert report.reranker_prequential["n"] == len(headline_train) < len(trainer.split.train)
    for label, figure_key in (("retriever alone", "retriever"), ("retriever + reranker", "reranker_prequential")):
        curve = series.prequential[label]
        assert len(curve) == len(headline_train)
        assert curve[-1] == pytest.approx(100 * getattr(report, figure_key)["recall@1"], abs=1e-9)  # the table's %
    assert list(series.heldout.values()) == pytest.approx([100 * report.retriever_heldout["recall@1"],
                                                           100 * report.reranker_heldout["recall@1"],
                                                           100 * report.reranker_heldout_whole_bank["recall@1"]])
    assert report.headline_questions == "locomo categories 1, 2; 5 adversarial reported apart"
    assert report.headline_questions in series.prequential_title
    assert f"{len(headline_train)} training questions" in series.prequential_title
    assert len(figure(report).axes) == 2
    png = plot(report, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_refuses_a_different_configuration(problem, tmp_path):
    dataset, bank = problem
    out = tmp_path / "run"
    OnlineTrainer(dataset, bank, config(epochs=1), output_dir=out, progress=False).run()
    with pytest.raises(ValueError, match="different configuration"):
        OnlineTrainer(dataset, bank, config(epochs=1, lr=1e-2), output_dir=out, progress=False).run()


def test_shared_split_holds_out_whole_users(problem):
    dataset, _ = problem
    shared = split_questions(dataset, dataset.questions, config())
    assert not set(shared.train_users) & set(shared.heldout_users)
    assert {q.user_id for q in shared.heldout} == set(shared.heldout_users)
    assert not shared.dropped and not shared.visible_sessions


def test_per_user_split_holds_out_by_dialogue_time_and_drops_questions_spanning_the_cut(problem):
    """A held-out question's evidence lies entirely in sessions no training question could retrieve
    from; a question whose evidence spans both parts is dropped, and the description counts it."""
    dataset, _ = problem
    # Questions 0 and 25 of u0 cite a turn of the first and of the last session too: they span any cut.
    first, last = dataset.sessions["u0"][0].turns[1].id, dataset.sessions["u0"][-1].turns[1].id
    spanning = {"u0:q0": last, "u0:q25": first}
    questions = [dataclasses.replace(q, evidence_turns=[*q.evidence_turns, spanning[q.id]])
                 if q.id in spanning else q for q in dataset.questions]
    dataset = dataclasses.replace(dataset, questions=questions)
    split = split_questions(dataset, dataset.questions, config(per_user=True))
    assert {q.id for q in split.dropped} == set(spanning)
    assert "2 dropped because their evidence spans both parts" in split.description
    session_of = {t.id: s.id for ss in dataset.sessions.values() for s in ss for t in s.turns}
    for user in dataset.users:
        visible = split.visible_sessions[user]
        train = [q for q in split.train if q.user_id == user]
        held = [q for q in split.heldout if q.user_id == user]
        assert train and held
        assert all(session_of[t] in visible for q in train for t in q.evidence_turns)
        assert not any(session_of[t] in visible for q in held for t in q.evidence_turns)
        assert len(held) / (len(held) + len(train)) == pytest.approx(0.34, abs=0.05)
    assert len(split.train) + len(split.heldout) + len(split.dropped) == len(dataset.questions)


def test_per_user_training_never_shows_held_out_evidence(problem):
    """Training questions retrieve from their user's earlier sessions only, so no held-out question's
    gold turn can be shown — and rewarded — while training."""
    dataset, bank = problem
    trainer = OnlineTrainer(dataset, bank, config(per_user=True, epochs=1), progress=False)
    cands = trainer.candidates(trainer.split.train, trainer.split.visible_sessions)
    shown = {ref for q in trainer.split.train for mid in cands[q.id].memory_ids for ref in trainer.refs[mid]}
    held_gold = {t for q in trainer.split.heldout for t in q.evidence_turns}
    assert shown and not shown & held_gold
    assert all(len(cands[q.id]) == 10 for q in trainer.split.train)  # K still filled from the visible sessions


def test_per_user_mode_trains_one_reranker_per_user(problem):
    dataset, bank = problem
    trainer = OnlineTrainer(dataset, bank, config(per_user=True, epochs=1), progress=False)
    trainer.run()
    assert set(trainer.learners) == set(dataset.users)


def test_whole_bank_search_ranks_a_trained_rerankers_candidates_on_the_querys_features(problem):
    """With K = the user's whole bank both scopes hold every memory: the learned query q·A only
    chooses candidates, so a trained reranker (A far from the identity, feature weights learned)
    ranks them exactly as over its top-K — on the features of q it was trained on (issue 35)."""
    dataset, bank = problem
    hybrid = HybridRetriever(bank, candidate_features=True)
    trainer = OnlineTrainer(dataset, hybrid, config(epochs=1), progress=False)
    trainer.run()
    reranker = trainer.learner_for("u0").reranker
    assert reranker.W_q.weight.abs().sum() > 0.01 and reranker.feature_weight.abs().sum() > 0.01
    qs = [q.text for q in dataset.questions_of("u0")[:5]]
    n = len(bank.memories("u0"))
    topk = RerankedRetriever(hybrid, reranker, k=n, m=n, scope="topk").select(qs, "u0")
    whole = RerankedRetriever(hybrid, reranker, k=n, m=n, scope="bank").select(qs, "u0")
    for t, w in zip(topk, whole, strict=True):
        assert w.memory_ids == t.memory_ids
        score = dict(zip(t.candidates.memory_ids, t.scores.tolist()))
        assert [score[m] for m in w.candidates.memory_ids] == pytest.approx(w.scores.tolist(), abs=1e-5)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="citer"):
        OnlineConfig(citer="gpt")
    with pytest.raises(ValueError, match="heldout"):
        OnlineConfig(heldout_fraction=1.0)
    with pytest.raises(ValueError, match="M=30"):
        OnlineConfig(m=30, k=20)
    with pytest.raises(ValueError, match="recipe"):
        recipe_for("fast", True)
    assert recipe_for("auto", True)["recipe"] == "normalized"
    assert recipe_for("auto", False) == {"recipe": "paper"}
    assert dataclasses.asdict(OnlineConfig())["tau"] == 0.5  # the paper's defaults stay the defaults


def test_table_titles_name_the_datasets_own_categories(problem):
    from rmm.cli.train import train_figures
    from rmm.training.online import headline_questions

    dataset, bank = problem
    msc = dataclasses.replace(dataset, name="msc", categories={1: "persona", 2: "followup"})
    assert headline_questions(msc) == "msc categories 1, 2 (persona, followup)"
    report = OnlineTrainer(msc, bank, config(epochs=1), progress=False).run()
    title = train_figures(report, "minilm").title
    assert "msc categories 1, 2 (persona, followup)" in title and "1–4" not in title
