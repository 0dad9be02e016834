"""REINFORCE learner: rewards, the update's direction, guards, and exact checkpoints."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
from plackett_luce_helpers import naive_pl_logp

import rmm.policy.learner as learner_module
from rmm.errors import CheckpointError, DimensionMismatchError, EncoderMismatchError
from rmm.policy.learner import Learner, LearnerConfig, rewards_from_citations
from rmm.policy.reranker import ResidualLinearReranker, candidate_subset
from rmm.policy.sampling import plackett_luce_logp
from rmm.types import Candidates, Selection

D, K, M = 8, 10, 3


# ---- a toy world: citations favour memories along a fixed direction `u` ----------------------
def world(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries share a mean direction `c` (as real embeddings do); `u` ⟂ `c` marks useful memories."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(D, generator=g)
    c = c / c.norm()
    u = torch.randn(D, generator=g)
    u = u - (u @ c) * c
    return c, u / u.norm()


def make_candidates(n: int, seed: int, c: torch.Tensor, k: int = K) -> list[Candidates]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        q = c + 0.3 * torch.randn(D, generator=g)
        m = torch.randn(k, D, generator=g)
        out.append(Candidates(f"q{i}", [f"{seed}-{i}-{j}" for j in range(k)], m @ q, m, q, user_id="u"))
    return out


def useful_rate(reranker: ResidualLinearReranker, cands: list[Candidates], u: torch.Tensor) -> float:
    sels = reranker.select(cands, M)
    hits = [float(s.candidates.embeddings[j] @ u > 0) for s in sels for j in s.chosen]
    return sum(hits) / len(hits)


def cited_of(sel: Selection, u: torch.Tensor) -> list[int]:
    return [j for j, idx in enumerate(sel.chosen) if sel.candidates.embeddings[idx] @ u > 0]


def run_toy(learner: Learner, n: int, seed: int = 1) -> None:
    c, u = world()
    gen = torch.Generator().manual_seed(seed)
    for cand in make_candidates(n, seed, c):
        sel = learner.reranker.select([cand], M, tau=learner.config.tau, explore=True, generator=gen)[0]
        learner.record(sel, rewards_from_citations(M, cited_of(sel, u)))


def selection(k: int = K, m: int = M, seed: int = 0, explore: bool = True, dim: int = D) -> Selection:
    g = torch.Generator().manual_seed(seed)
    q, mem = torch.randn(dim, generator=g), torch.randn(k, dim, generator=g)
    cand = Candidates("q", [str(i) for i in range(k)], mem @ q, mem, q)
    return ResidualLinearReranker(dim).select([cand], m, explore=explore, generator=g)[0]


# ---- rewards ---------------------------------------------------------------------------------
def test_rewards_from_citations() -> None:
    assert rewards_from_citations(4, [0, 2]).tolist() == [1, -1, 1, -1]
    assert rewards_from_citations(3, []).tolist() == [-1, -1, -1]
    assert rewards_from_citations(3, [], no_cite=True).tolist() == [-1, -1, -1]
    assert rewards_from_citations(3, None, no_cite=True).tolist() == [-1, -1, -1]
    assert rewards_from_citations(3, None) is None
    assert rewards_from_citations(2, [1, 5]).tolist() == [-1, 1]  # out of range ignored
    assert rewards_from_citations(0, []).shape == (0,)
    with pytest.raises(ValueError):
        rewards_from_citations(-1, [])


# ---- learning direction ----------------------------------------------------------------------
@pytest.mark.parametrize("estimator", ["plackett-luce", "paper"])
def test_learning_raises_the_cited_rate_and_a_flipped_sign_lowers_it(estimator: str) -> None:
    c, u = world()
    held_out = make_candidates(150, 99, c)
    config = LearnerConfig(lr=0.05, estimator=estimator)

    learner = Learner(ResidualLinearReranker(D), config)
    before = useful_rate(learner.reranker, held_out, u)
    run_toy(learner, 100)
    after = useful_rate(learner.reranker, held_out, u)
    assert learner.stats.step == 25 and learner.stats.records == 100

    flipped = Learner(ResidualLinearReranker(D), config)
    original_loss = flipped.loss
    flipped.loss = lambda batch: -original_loss(batch)  # type: ignore[method-assign]
    run_toy(flipped, 100)
    after_flipped = useful_rate(flipped.reranker, held_out, u)

    assert 0.35 < before < 0.65  # the retriever knows nothing about `u`
    assert after > before + 0.25
    assert after_flipped < before - 0.2


@pytest.mark.parametrize("importance", [True, False])
def test_loss_is_the_reinforce_objective(importance: bool) -> None:
    """The selections were sampled by zero weights, the learner's have moved since: each term is
    weighted by ρ = min(1, π/μ) (or 1 without the correction)."""
    learner = Learner(ResidualLinearReranker(D), LearnerConfig(batch_size=2, baseline=0.5, importance=importance))
    with torch.no_grad():
        learner.reranker.W_m.weight.copy_(0.2 * torch.randn(D, D, generator=torch.Generator().manual_seed(0)))
    sels = [selection(seed=1), selection(k=4, m=2, seed=2)]
    rewards = [torch.tensor([1.0, -1.0, -1.0]), torch.tensor([-1.0, 1.0])]
    expected, ratios = [], []
    for sel, r in zip(sels, rewards):
        c = sel.candidates
        scores = learner.reranker(c.query_embedding[None], c.embeddings[None])
        logp = plackett_luce_logp(scores, torch.tensor([sel.chosen]), 0.5)[0]
        rho = min(1.0, float((logp.sum() - sel.logp.sum()).detach().exp())) if importance else 1.0
        ratios.append(rho)
        expected.append(rho * ((r - 0.5) * logp).sum())
    assert importance is (min(ratios) < 0.99)  # the weights moved: the correction is not a no-op
    expected_loss = -torch.stack(expected).mean().item()
    assert learner.record(sels[0], rewards[0]) is None
    loss = learner.record(sels[1], rewards[1])
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert learner.stats.last_loss == loss and learner.pending == 0


def test_update_invalidates_folded_cache() -> None:
    learner = Learner(ResidualLinearReranker(D), LearnerConfig(batch_size=1, lr=0.1))
    sel = selection()
    q, m = sel.candidates.query_embedding[None], sel.candidates.embeddings[None]
    before = learner.reranker.fast_scores(q, m)
    learner.record(sel, torch.tensor([1.0, -1.0, -1.0]))
    after = learner.reranker.fast_scores(q, m)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, learner.reranker(q, m).detach(), rtol=1e-4, atol=1e-4)


# ---- guards and counters ---------------------------------------------------------------------
def test_skips_are_counted_and_flush_updates_partial_batches() -> None:
    learner = Learner(ResidualLinearReranker(D))
    assert learner.flush() is None
    assert learner.record(selection(seed=1), None) is None
    assert learner.stats.skipped_no_citation == 1 and learner.pending == 0
    for s in range(3):
        assert learner.record(selection(seed=s), torch.tensor([1.0, -1.0, -1.0])) is None
    assert learner.pending == 3 and learner.stats.step == 0
    weights = learner.reranker.W_q.weight.detach().clone()
    assert isinstance(learner.flush(), float)
    assert learner.pending == 0 and learner.stats.step == 1 and learner.stats.updates == 1
    assert not torch.equal(weights, learner.reranker.W_q.weight)
    assert learner.stats.records == 3


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_update_is_skipped_and_parameters_untouched(bad: float, caplog: pytest.LogCaptureFixture) -> None:
    learner = Learner(ResidualLinearReranker(D), LearnerConfig(batch_size=2))
    good = selection(seed=1)
    poisoned = selection(seed=2)
    poisoned.candidates.embeddings[0, 0] = bad
    before = [p.detach().clone() for p in learner.reranker.parameters()]
    learner.record(good, torch.tensor([1.0, -1.0, -1.0]))
    with caplog.at_level(logging.WARNING, logger="rmm.policy.learner"):
        assert learner.record(poisoned, torch.tensor([1.0, -1.0, 1.0])) is None
    assert "skipped" in caplog.text
    assert learner.stats.skipped_nonfinite == 1 and learner.stats.step == 0 and learner.stats.updates == 1
    assert all(torch.equal(a, b) for a, b in zip(before, learner.reranker.parameters()))
    assert all(p.grad is None for p in learner.reranker.parameters())
    # the learner keeps working afterwards
    learner.record(good, torch.tensor([1.0, -1.0, -1.0]))
    assert isinstance(learner.record(selection(seed=3), torch.tensor([-1.0, 1.0, -1.0])), float)
    assert learner.stats.step == 1


def test_a_ragged_batch_with_an_empty_selection_has_the_loss_of_its_records_one_by_one() -> None:
    """Rows of K 2, 0 and 20 with M 2, 0 and 5 padded into one batch: the update's loss is
    `−mean_b ρ_b Σ_j (r_bj − b)·log π_bj` written out per record (Eq. 1 scores, Plackett–Luce one pick
    at a time, ρ = min(1, π/μ) against the zero reranker that sampled them), the empty row a zero term."""
    reranker = ResidualLinearReranker(D)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():  # not the sampler's weights: ρ is not 1
        for p in reranker.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=g))
    config = LearnerConfig(batch_size=3)
    learner = Learner(reranker, config)
    records = [(selection(k=2, m=5), torch.tensor([1.0, -1.0])), (selection(k=0, m=5), torch.tensor([])),
               (selection(k=20, m=5, seed=4), torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0]))]
    terms = []
    with torch.no_grad():
        for sel, rewards in records:
            if not sel.chosen:
                terms.append(torch.tensor(0.0))
                continue
            scores = reranker(sel.candidates.query_embedding[None], sel.candidates.embeddings[None])[0]
            logp = naive_pl_logp(scores, torch.tensor(sel.chosen), config.tau)
            rho = torch.exp(logp.sum() - sel.logp.sum()).clamp(max=config.is_clip)
            terms.append(rho * ((rewards - config.baseline) * logp).sum())
    expected = float(-torch.stack(terms).mean())
    losses = [learner.record(sel, rewards) for sel, rewards in records]
    assert losses[:2] == [None, None] and learner.stats.step == 1 and learner.stats.skipped_nonfinite == 0
    assert losses[2] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert abs(expected) > 1e-3  # a loss that says something


def test_a_batch_without_a_pick_steps_nothing_and_is_counted() -> None:
    """Every record K = 0 or M = 0: the loss is a constant; an Adam step on its zero gradient would still
    move the weights by the momentum of earlier steps and advance the step count. Skipped and counted."""
    learner = Learner(ResidualLinearReranker(D), LearnerConfig(batch_size=2))
    learner.record(selection(seed=1), torch.tensor([1.0, -1.0, -1.0]))
    learner.record(selection(seed=2), torch.tensor([-1.0, 1.0, -1.0]))
    assert learner.stats.step == 1  # a real update first: Adam has momentum
    weights = [p.detach().clone() for p in learner.reranker.parameters()]
    adam_steps = [float(s["step"]) for s in learner.optimizer.state.values()]
    learner.record(selection(k=0, m=3), torch.tensor([]))
    loss = learner.record(selection(k=5, m=0, seed=3), torch.tensor([]))
    assert all(torch.equal(a, b) for a, b in zip(weights, learner.reranker.parameters()))
    assert [float(s["step"]) for s in learner.optimizer.state.values()] == adam_steps
    assert learner.stats.step == 1 and learner.version == learner.reranker.version == 1 and loss is None
    assert learner.stats.skipped_no_gradient == 1 and learner.stats.updates == 2
    assert learner.pending == 0 and all(p.grad is None for p in learner.reranker.parameters())
    learner.record(selection(seed=4), torch.tensor([1.0, -1.0, -1.0]))  # a batch with a pick steps again
    assert isinstance(learner.record(selection(k=0, m=3), torch.tensor([])), float)
    assert learner.stats.step == 2 and learner.stats.skipped_no_gradient == 1


def test_a_failing_optimizer_step_is_an_optimizer_step_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's Adam steps the reranker (fused on CPU); a step that raises may have stepped some parameter
    groups and not others, so it surfaces as `OptimizerStepError` (the learner, not the feedback row, is
    at fault: `rmm.serve.learner_lease` stops its round on it instead of setting the row aside)."""
    from rmm.policy.optimizer import OptimizerStepError

    learner = Learner(ResidualLinearReranker(D, lexical_feature=True), LearnerConfig(batch_size=1))
    assert type(learner.optimizer) is torch.optim.Adam and learner.optimizer.defaults["fused"]
    assert len(learner.optimizer.param_groups) == 2  # the matrices, and the lexical weight at its own lr

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("kernel refused")

    monkeypatch.setattr(learner.optimizer, "step", broken)
    with pytest.raises(OptimizerStepError, match="kernel refused"):
        learner.record(selection(), torch.tensor([1.0, -1.0, -1.0]))
    assert learner.stats.step == 0


def test_sgd_with_clipping() -> None:
    config = LearnerConfig(batch_size=2, optimizer="sgd", max_grad_norm=0.01, lr=1.0, estimator="paper")
    learner = Learner(ResidualLinearReranker(D), config)
    assert isinstance(learner.optimizer, torch.optim.SGD)
    learner.record(selection(), torch.tensor([1.0, -1.0, -1.0]))
    learner.record(selection(seed=5), torch.tensor([-1.0, -1.0, 1.0]))
    moved = torch.cat([p.detach().flatten() for p in learner.reranker.parameters()]).norm().item()
    assert 0 < moved <= 0.01 + 1e-6  # one SGD step of lr 1 on a gradient clipped to norm 0.01


def test_greedy_selections_are_refused_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Greedy picks were not sampled (no μ): learning from them would be biased, so they are counted
    and dropped — without an exception for a caller that passes one by mistake."""
    learner = Learner(ResidualLinearReranker(D), LearnerConfig(batch_size=1))
    before = [p.detach().clone() for p in learner.reranker.parameters()]
    with caplog.at_level(logging.WARNING, logger="rmm.policy.learner"):
        assert learner.record(selection(explore=False), torch.tensor([1.0, -1.0, -1.0])) is None
        assert learner.record(selection(seed=2, explore=False), None) is None
    assert "greedy" in caplog.text
    assert learner.stats.skipped_greedy == 1 and learner.stats.records == 0 and learner.pending == 0
    assert learner.stats.skipped_no_citation == 1 and learner.stats.step == 0  # no reward: nothing to refuse
    assert all(torch.equal(a, b) for a, b in zip(before, learner.reranker.parameters()))
    assert isinstance(learner.record(selection(), torch.tensor([1.0, -1.0, -1.0])), float)


def test_record_refuses_bad_input() -> None:
    learner = Learner(ResidualLinearReranker(D))
    with pytest.raises(ValueError, match="rewards"):
        learner.record(selection(), torch.tensor([1.0, -1.0]))
    with pytest.raises(DimensionMismatchError):
        learner.record(selection(dim=D + 2), torch.tensor([1.0, -1.0, -1.0]))
    bm25 = Selection(Candidates("q", ["a"], torch.tensor([1.0])), [0], torch.tensor([1.0]), explore=True)
    with pytest.raises(ValueError, match="embeddings"):
        learner.record(bm25, torch.tensor([1.0]))
    bad = selection()
    bad.chosen = [0, 0, 1]
    with pytest.raises(ValueError, match="distinct"):
        learner.record(bad, torch.tensor([1.0, -1.0, -1.0]))
    assert learner.stats.records == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": 0}, {"batch_size": 0}, {"tau": 0}, {"estimator": "x"}, {"optimizer": "rmsprop"},
     {"max_grad_norm": -1.0}, {"baseline": float("nan")}],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LearnerConfig(**kwargs)


# ---- checkpoints -----------------------------------------------------------------------------
def trained(n: int, config: LearnerConfig | None = None) -> Learner:
    learner = Learner(ResidualLinearReranker(D), config or LearnerConfig(lr=0.05), encoder_name="toy-enc")
    run_toy(learner, n)
    return learner


def test_save_load_resume_is_exact(tmp_path: Path) -> None:
    c, u = world()
    stream = make_candidates(30, 7, c)

    def continue_on(learner: Learner) -> None:
        gen = torch.Generator().manual_seed(3)
        for cand in stream:
            sel = learner.reranker.select([cand], M, explore=True, generator=gen)[0]
            learner.record(sel, rewards_from_citations(M, cited_of(sel, u)))

    uninterrupted = trained(18)  # 4 updates + 2 records pending
    continue_on(uninterrupted)

    interrupted = trained(18)
    assert interrupted.pending == 2
    interrupted.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["meta.json", "optimizer.pt", "reranker.safetensors"]
    resumed = Learner.load(tmp_path / "ckpt", encoder_name="toy-enc", dim=D)
    assert resumed.pending == 2 and resumed.stats == interrupted.stats
    assert resumed.config == interrupted.config and resumed.encoder_name == "toy-enc"
    continue_on(resumed)

    for a, b in zip(uninterrupted.reranker.parameters(), resumed.reranker.parameters()):
        assert torch.equal(a, b)
    assert resumed.stats == uninterrupted.stats
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["dim"] == D and meta["encoder_name"] == "toy-enc" and meta["step"] == 4
    assert meta["format_version"] == learner_module.FORMAT_VERSION


def test_failed_save_leaves_the_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    learner = trained(8)
    learner.save(tmp_path / "ckpt")
    saved = [p.detach().clone() for p in learner.reranker.parameters()]
    run_toy(learner, 8, seed=2)

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(learner_module.torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        learner.save(tmp_path / "ckpt")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp folder left behind
    reloaded = Learner.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(saved, reloaded.reranker.parameters()))
    assert reloaded.stats.step == 2

    learner.save(tmp_path / "ckpt")  # a later save replaces it
    assert Learner.load(tmp_path / "ckpt").stats.step == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_crash_between_renames_falls_back_to_previous(tmp_path: Path) -> None:
    learner = trained(4)
    learner.save(tmp_path / "ckpt")
    (tmp_path / "ckpt").rename(tmp_path / ".ckpt.old")  # the state a crash mid-swap leaves
    assert Learner.load(tmp_path / "ckpt").stats.step == 1
    learner.save(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_load_refuses_mismatch_missing_and_corrupt(tmp_path: Path) -> None:
    learner = trained(4)
    folder = learner.save(tmp_path / "ckpt")
    with pytest.raises(DimensionMismatchError):
        Learner.load(folder, dim=D + 1)
    with pytest.raises(EncoderMismatchError):
        Learner.load(folder, encoder_name="other-enc")
    with pytest.raises(CheckpointError):
        Learner.load(tmp_path / "nowhere")

    weights = folder / "reranker.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:50] + b"garbage" + original[57:])
    with pytest.raises(CheckpointError, match="corrupt"):
        Learner.load(folder)
    weights.write_bytes(original)

    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text("{not json")
    with pytest.raises(CheckpointError):
        Learner.load(folder)
    meta_path.write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(CheckpointError, match="format version"):
        Learner.load(folder)
    meta_path.write_text(json.dumps({**meta, "sha256": {}}))  # checksums gone: parsing still guards
    (folder / "optimizer.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError):
        Learner.load(folder)
    (folder / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError):
        Learner.load(folder)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError):
        learner.save(tmp_path / "file")


def test_checkpoint_without_encoder_name_adopts_the_given_one(tmp_path: Path) -> None:
    folder = Learner(ResidualLinearReranker(D)).save(tmp_path / "anon")
    assert Learner.load(folder, encoder_name="minilm").encoder_name == "minilm"
    assert Learner.load(folder).encoder_name == ""


def test_save_keeps_what_else_the_folder_holds(tmp_path: Path) -> None:
    """A registry nests other keys' checkpoints in the shared one's folder; a save must keep them."""
    learner = trained(4)
    folder = learner.save(tmp_path / "ckpt")
    (folder / "users" / "x").mkdir(parents=True)
    (folder / "users" / "x" / "weights").write_text("kept")
    run_toy(learner, 4, seed=2)
    learner.save(folder)
    assert (folder / "users" / "x" / "weights").read_text() == "kept"
    assert Learner.load(folder).stats.step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_recipes_and_format_stay_importable_from_the_learner() -> None:
    from rmm.policy import checkpoint, recipes

    assert learner_module.LearnerConfig is recipes.LearnerConfig and learner_module.RECIPES is recipes.RECIPES
    assert learner_module.recipe_config("paper", True) == LearnerConfig()
    assert learner_module.FORMAT_VERSION == checkpoint.FORMAT_VERSION


# ---- what a selection records, and learning from it later ---------------------------------------
def test_selections_record_tau_version_and_mu_and_the_learner_samples_at_its_own_tau() -> None:
    learner = Learner(ResidualLinearReranker(D), LearnerConfig(batch_size=1, tau=0.3, lr=0.05))
    c, _ = world()
    cand = make_candidates(1, 5, c)[0]
    first = learner.select([cand], M, generator=torch.Generator().manual_seed(0))[0]
    assert first.explore and first.tau == pytest.approx(0.3) and first.version == 0
    scores = learner.reranker(cand.query_embedding[None], cand.embeddings[None]).detach()
    expected_mu = plackett_luce_logp(scores, torch.tensor([first.chosen]), 0.3)[0]
    torch.testing.assert_close(first.logp, expected_mu, rtol=1e-5, atol=1e-5)
    assert first.behaviour_logp == pytest.approx(float(expected_mu.sum()), abs=1e-5)
    learner.record(first, torch.tensor([1.0, -1.0, -1.0]))
    second = learner.select([cand], M, generator=torch.Generator().manual_seed(1))[0]
    assert learner.version == learner.stats.step == 1 and second.version == 1
    greedy = learner.select([cand], M, explore=False)[0]
    assert not greedy.explore and greedy.logp is None and greedy.version == 1


def test_log_pi_uses_the_tau_the_selection_was_sampled_at(caplog: pytest.LogCaptureFixture) -> None:
    """A learner configured for τ 0.5 given a selection sampled at τ 0.2 learns it at 0.2 (μ and π
    on one τ), says so once, and matches the REINFORCE objective written out at 0.2."""
    learner = Learner(ResidualLinearReranker(D), LearnerConfig(batch_size=2, baseline=0.5, tau=0.5))
    cand = make_candidates(1, 3, world()[0])[0]
    gen = torch.Generator().manual_seed(0)
    sels = [learner.reranker.select([cand], M, tau=0.2, explore=True, generator=gen)[0] for _ in range(2)]
    rewards = torch.tensor([1.0, -1.0, -1.0])
    scores = learner.reranker(cand.query_embedding[None], cand.embeddings[None])
    expected = -sum(((rewards - 0.5) * plackett_luce_logp(scores, torch.tensor([s.chosen]), 0.2)[0]).sum()
                    for s in sels).item() / 2
    with caplog.at_level(logging.WARNING, logger="rmm.policy.learner"):
        learner.record(sels[0], rewards)
        assert learner.record(sels[1], rewards) == pytest.approx(expected, rel=1e-5)
    assert caplog.text.count("tau=0.2") == 1
    assert learner.last_log_ratio is not None and learner.last_log_ratio.tolist() == [0.0, 0.0]


def test_a_mask_is_the_same_as_leaving_the_masked_candidates_out() -> None:
    """The reranker drops excluded candidates; a hand-built Selection may mask them instead."""
    full = selection(k=6, m=2, seed=3)
    keep = [i for i in range(6) if i not in (1, 4) or i in full.chosen][:4]
    keep = sorted(set(keep) | set(full.chosen))
    mask = torch.tensor([i in keep for i in range(6)])
    masked = Selection(full.candidates, full.chosen, full.scores, explore=True, tau=0.5, mask=mask)
    position = {old: new for new, old in enumerate(keep)}
    sub = candidate_subset(full.candidates, keep)
    dropped = Selection(sub, [position[i] for i in full.chosen], full.scores[keep], explore=True, tau=0.5)
    losses = []
    for sel in (masked, dropped):
        learner = Learner(ResidualLinearReranker(D), LearnerConfig(batch_size=1))
        with torch.no_grad():
            learner.reranker.W_q.weight.copy_(torch.eye(D) * 0.3)
        losses.append(learner.record(sel, torch.tensor([1.0, -1.0])))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    unmasked = Learner(ResidualLinearReranker(D), LearnerConfig(batch_size=1))
    with torch.no_grad():
        unmasked.reranker.W_q.weight.copy_(torch.eye(D) * 0.3)
    assert unmasked.record(Selection(full.candidates, full.chosen, full.scores, explore=True, tau=0.5),
                           torch.tensor([1.0, -1.0])) != pytest.approx(losses[0], rel=1e-3)
    with pytest.raises(ValueError, match="masked-out"):
        bad = mask.clone()
        bad[full.chosen[0]] = False
        Learner(ResidualLinearReranker(D)).record(
            Selection(full.candidates, full.chosen, full.scores, explore=True, mask=bad), torch.tensor([1.0, -1.0]))


def test_record_refuses_malformed_off_policy_fields() -> None:
    learner = Learner(ResidualLinearReranker(D))
    sel = selection()
    sel.logp = torch.tensor([-1.0])
    with pytest.raises(ValueError, match="logp"):
        learner.record(sel, torch.tensor([1.0, -1.0, -1.0]))
    sel = selection()
    sel.tau = 0.0
    with pytest.raises(ValueError, match="tau"):
        learner.record(sel, torch.tensor([1.0, -1.0, -1.0]))
    assert learner.stats.records == 0 and learner.pending == 0


@pytest.mark.parametrize("kwargs", [{"credit": "per-memory"}, {"is_clip": 0.0}, {"is_clip": -1.0},
                                    {"importance": "yes"}, {"is_clip": True},
                                    {"is_normalize": 1}])
def test_off_policy_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LearnerConfig(**kwargs)


def test_checkpoint_keeps_the_off_policy_fields_of_buffered_selections(tmp_path: Path) -> None:
    """A buffered selection sampled at another τ, with a mask, by older weights: the resumed learner's
    update is the saved learner's update exactly."""
    config = LearnerConfig(batch_size=3, lr=0.05, credit="reward-to-go", is_clip=2.0, tau=0.5)
    learner = trained(3, config)  # one update: step 1
    stale = learner.reranker.select([make_candidates(1, 11, world()[0])[0]], M, tau=0.4, explore=True,
                                    generator=torch.Generator().manual_seed(4))[0]
    run_toy(learner, 6, seed=2)  # three updates: step 3, nothing buffered
    assert stale.version == 1 and learner.pending == 0
    stale.mask = torch.ones(K, dtype=torch.bool)
    stale.mask[next(i for i in range(K) if i not in stale.chosen)] = False
    learner.record(stale, torch.tensor([1.0, -1.0, 1.0]))
    assert learner.pending == 1
    learner.save(tmp_path / "ckpt")
    resumed = Learner.load(tmp_path / "ckpt")
    assert resumed.config == config and resumed.stats == learner.stats and resumed.reranker.version == 3
    last = selection(seed=9)
    last.tau = 0.5
    for each in (learner, resumed):
        each.record(last, torch.tensor([-1.0, 1.0, -1.0]))
        each.record(last, torch.tensor([-1.0, -1.0, 1.0]))
    assert resumed.stats == learner.stats and resumed.stats.staleness_sum == learner.stats.staleness_sum
    assert torch.equal(resumed.last_log_ratio, learner.last_log_ratio)
    assert resumed.last_log_ratio[0] != 0  # the stale one was corrected
    assert all(torch.equal(a, b) for a, b in zip(learner.reranker.parameters(), resumed.reranker.parameters()))


def test_a_format_1_checkpoint_is_upgraded_on_load(tmp_path: Path) -> None:
    """Version 1 kept no τ or μ with buffered records and no credit/importance in the config: they
    load with the defaults, the old records as sampled by the loaded weights (ρ = 1)."""
    learner = trained(6)  # one update, two records buffered
    folder = learner.save(tmp_path / "ckpt")
    training = torch.load(folder / "optimizer.pt", weights_only=True)
    training["pending"] = [{k: s[k] for k in ("query", "memories", "chosen", "rewards", "noise") if k in s}
                           for s in training["pending"]]
    torch.save(training, folder / "optimizer.pt")
    meta = json.loads((folder / "meta.json").read_text())
    for key in ("credit", "importance", "is_clip", "is_normalize"):
        del meta["config"][key]
    for key in ("skipped_greedy", "importance_sum", "importance_count", "importance_clipped", "staleness_sum",
                "staleness_count"):
        del meta["stats"][key]
    meta["format_version"] = 1
    meta["sha256"]["optimizer.pt"] = hashlib.sha256((folder / "optimizer.pt").read_bytes()).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))

    old = Learner.load(folder)
    assert old.pending == 2 and old.stats.step == 1 and old.reranker.version == 1
    assert old.config == LearnerConfig(lr=0.05)
    old.record(selection(seed=4), torch.tensor([1.0, -1.0, -1.0]))
    old.record(selection(seed=5), torch.tensor([1.0, -1.0, -1.0]))
    assert old.stats.step == 2 and old.last_log_ratio is not None
    assert old.last_log_ratio[:2].tolist() == [0.0, 0.0]  # the upgraded records count as on-policy
    old.save(folder)
    assert json.loads((folder / "meta.json").read_text())["format_version"] == learner_module.FORMAT_VERSION
