"""The per-turn fast paths equal the plain formulations they replace.

- The learner's loss (scored query-side through `policy_scores`, log π of the picks vectorised) has
  the gradients of the REINFORCE objective written out from Eq. 1 and one pick at a time.
- `plackett_luce_picks_logp`, the one Plackett–Luce log-probability (the kernels' reference and the
  learner), computes the M normalisers from one masked `[M, K]` block; the plain formulation is a
  loop over the picks.
- The learner pads rows with fewer picks with -1 (scored 0) where it padded with repeats of pick 0
  and zeroed them afterwards: the same weights, update after update.
- The `[M, K]` block of available candidates is built from the picks' ranks (one scatter), not
  one-hot rows and a cumsum: the same values and gradients bit for bit, `complete=True` too.
- `select` scores full candidate rows in place (`rerank_rows`) instead of gathering them through
  the dispatched reference: the same picks, scores, log μ and noise bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from plackett_luce_helpers import naive_pl_logp
from rmm.kernels.reference import (
    picks_logp_of_logits,
    rerank_reference,
    rerank_rows,
)
from torch import Tensor

import rmm.policy.learner as learner_module
import rmm.policy.reranker as reranker_module
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.reranker import ResidualLinearReranker
from rmm.types import Candidates, Selection

D = 24


def _candidates(rng: torch.Generator, k: int, lexical: bool) -> Candidates:
    q = torch.randn(D, generator=rng)
    mem = torch.randn(k, D, generator=rng)
    lex = torch.rand(k, generator=rng) if lexical else None
    return Candidates("q", [str(i) for i in range(k)], mem @ q, mem, q, lexical=lex)


def test_public_loss_has_the_gradients_of_the_reinforce_objective_written_out() -> None:
    """`loss` (what callers differentiate with autograd.grad, and the update's backward) against
    `−mean_b ρ_b Σ_j (r_bj − b)·log π_bj` written from Eq. 1's `forward` + w·f and Plackett–Luce one pick
    at a time: the same value and the same gradient of every parameter, over rows of K 6 and 8 (padded),
    with and without the lexical feature, ρ < 1 for selections the moved weights now find less likely."""
    config = LearnerConfig(batch_size=10, tau=0.5, baseline=0.5)
    learner = Learner(_reranker_with_weights(D, True, seed=6), config)
    sampler = ResidualLinearReranker(D, lexical_feature=True)  # μ: the weights before they moved
    rng = torch.Generator().manual_seed(0)
    records = []
    for k, lexical in ((6, False), (8, True), (8, True)):
        sel = sampler.select([_candidates(rng, k, lexical)], 3, tau=config.tau, explore=True, generator=rng)[0]
        records.append((sel, torch.where(torch.rand(3, generator=rng) < 0.4, 1.0, -1.0)))
        learner.record(*records[-1])
    params = list(learner.reranker.parameters())
    loss = learner.loss(list(learner._buffer))
    grads = torch.autograd.grad(loss, params)
    r = learner.reranker
    terms, rhos = [], []
    for sel, rewards in records:
        c = sel.candidates
        lexical = torch.zeros(1, len(c)) if c.lexical is None else c.lexical[None]
        scores = r(c.query_embedding[None], c.embeddings[None], lexical)[0]
        logp = naive_pl_logp(scores, torch.tensor(sel.chosen), config.tau)
        rho = torch.exp(logp.detach().sum() - sel.logp.sum()).clamp(max=config.is_clip)
        rhos.append(float(rho))
        terms.append(rho * ((rewards - config.baseline) * logp).sum())
    expected = -torch.stack(terms).mean()
    expected_grads = torch.autograd.grad(expected, params)
    assert min(rhos) < 0.9 and max(rhos) == pytest.approx(1.0)  # the correction acts on some rows
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        assert want.abs().max() > 1e-4
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- padded picks: -1 now, repeats of pick 0 before ----------------------------------------------
def old_plackett_luce_logp(scores: Tensor, chosen: Tensor, tau: float, mask: Tensor | None = None, *,
                           complete: bool = False) -> Tensor:
    """The learner's log π before the kernels' function served it, written out: rows with fewer picks
    were padded with pick 0 (one one-hot row per pick, so a repeat never changes the real picks),
    and the learner zeroed the padding picks afterwards. It had one path for every batch, so the
    learner's `complete` (its promise of no padding picks) changes nothing here."""
    valid = chosen >= 0
    chosen = chosen.clamp(min=0)
    logits = scores / tau
    picked = torch.nn.functional.one_hot(chosen, num_classes=scores.shape[-1])
    available = (picked.cumsum(-2) - picked) == 0
    if mask is not None:
        available = available & mask.unsqueeze(-2)
    empty = ~available.any(-1, keepdim=True)
    rows = torch.where(empty, 0.0, torch.where(available, logits.unsqueeze(-2), float("-inf")))
    masked = logits if mask is None else logits.masked_fill(~mask, float("-inf"))
    logp = masked.gather(-1, chosen) - torch.logsumexp(rows, dim=-1)
    return torch.where(valid, logp, torch.zeros_like(logp))


def old_paper_literal_logp(scores: Tensor, noise: Tensor, chosen: Tensor, tau: float,
                           mask: Tensor | None = None) -> Tensor:
    """The paper estimator as the learner used it: read at pick 0 for padding, zeroed afterwards."""
    logits = (scores + noise) / tau
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1).gather(-1, chosen.clamp(min=0))
    return torch.where(chosen >= 0, logp, torch.zeros_like(logp))


def _train_with_short_rows(config: LearnerConfig) -> Learner:
    """20 updates of 3 selections that differ in K and M, so every batch pads picks (and one row of
    each takes all its candidates, leaving its padding picks nothing to pick from)."""
    learner = Learner(ResidualLinearReranker(D, lexical_feature=True), config)
    rng = torch.Generator().manual_seed(11)
    for turn in range(60):
        k, m = ((8, 3), (6, 1), (4, 4))[turn % 3]
        sel = learner.select([_candidates(rng, k, lexical=turn % 2 == 0)], m, generator=rng)[0]
        learner.record(sel, torch.where(torch.rand(m, generator=rng) < 0.4, 1.0, -1.0))
    return learner


@pytest.mark.parametrize(("estimator", "credit"), [("plackett-luce", "per-pick"), ("plackett-luce", "sequence"),
                                                   ("paper", "reward-to-go")])
def test_padding_picks_with_minus_one_learns_what_repeats_did(monkeypatch: pytest.MonkeyPatch, estimator: str,
                                                              credit: str) -> None:
    config = LearnerConfig(batch_size=3, lr=0.05, tau=0.3, estimator=estimator, credit=credit)
    now = _train_with_short_rows(config)
    monkeypatch.setattr(learner_module, "plackett_luce_logp", old_plackett_luce_logp)
    monkeypatch.setattr(learner_module, "paper_literal_logp", old_paper_literal_logp)
    before = _train_with_short_rows(config)
    assert now.stats.step == before.stats.step == 20 and now.stats.skipped_nonfinite == 0
    initial = ResidualLinearReranker(D, lexical_feature=True).state_dict()
    for name, got in now.reranker.state_dict().items():
        expected = before.reranker.state_dict()[name]
        assert not torch.allclose(got, initial[name], atol=1e-3), name  # it learned
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        # bit for bit: Adam carries a rounding difference in log π into other weights over a longer run
        # (another summation order moved the quickstart's whole-bank recall@5 from 39.9 to 40.1)
        assert torch.equal(got, expected), name
    assert now.stats.last_loss == before.stats.last_loss


# ---- Plackett–Luce log-probabilities of the picks --------------------------------------------
@pytest.mark.parametrize("tau", [0.05, 0.5, 2.0])
def test_picks_logp_equals_the_loop(tau: float) -> None:
    rng = torch.Generator().manual_seed(7)
    for trial in range(30):
        batch, k = 4, 12
        m = [1, 3, 5, 12][trial % 4]
        scores = torch.randn(batch, k, generator=rng) * (1 + trial % 3) * 3
        scores[1, k - 4 :] = float("-inf")  # a short row: padding, picks run out
        if trial % 2:
            scores[2] = float("-inf")  # an empty row: every pick is -1
        ids = torch.where(torch.isfinite(scores), torch.arange(k).expand(batch, k), torch.tensor(-1))
        noise = -torch.log(-torch.log(torch.rand(batch, k, generator=rng).clamp(1e-6, 1 - 1e-6)))
        bank = torch.eye(k)
        queries = torch.where(torch.isfinite(scores), scores, torch.zeros(()))
        result = rerank_reference(queries, bank, ids, m, tau, explore=True, noise=noise)
        expected = naive_pl_logp(result.scores, result.indices, tau)  # one pick at a time
        torch.testing.assert_close(result.logp, expected, rtol=0, atol=1e-5)
        assert (result.indices[1, 8:] == -1).all()


# ---- the select step on full rows (rerank_rows) and the rank form of the picks' log π -------------
def one_hot_picks_logp(logits: Tensor, picks: Tensor) -> Tensor:
    """`plackett_luce_picks_logp` as it built the `[M, K]` block before: one-hot rows and a cumsum."""
    k = logits.shape[-1]
    has = picks >= 0
    picked = torch.nn.functional.one_hot(picks.masked_fill(~has, k), num_classes=k + 1)[..., :k]
    available = (picked.cumsum(-2) == picked) & (logits > float("-inf")).unsqueeze(-2)
    empty = ~available.any(-1, keepdim=True)
    rows = torch.where(available, logits.unsqueeze(-2), float("-inf"))
    normaliser = torch.logsumexp(torch.where(empty, 0.0, rows), dim=-1)
    return torch.where(has, logits.gather(-1, picks.clamp(min=0)) - normaliser, 0.0)


def _logp_and_grad(fn, logits: Tensor, picks: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    leaf = logits.clone().requires_grad_()
    logp = fn(leaf, picks)
    (grad,) = torch.autograd.grad((logp * weights).sum(), leaf)
    return logp.detach(), grad


@pytest.mark.parametrize("m", [0, 1, 4, 9])
def test_rank_form_of_picks_logp_is_the_one_hot_form_bit_for_bit(m: int) -> None:
    """Values and gradients equal exactly, with -1 picks, `-inf` padding, rows that run out and
    leading batch dims; `complete=True` equals both wherever every pick is real."""
    rng = torch.Generator().manual_seed(m)
    for _ in range(20):
        logits = torch.randn(2, 3, 9, generator=rng) * 4
        logits[0, 1, 5:] = float("-inf")  # padding: this row runs out after 5 picks
        keys = logits + torch.rand(2, 3, 9, generator=rng)
        order = torch.sort(keys, dim=-1, descending=True, stable=True)
        picks = order.indices[..., :m].masked_fill(order.values[..., :m] == float("-inf"), -1)
        weights = torch.randn(picks.shape, generator=rng)
        expected = _logp_and_grad(one_hot_picks_logp, logits, picks, weights)
        got = _logp_and_grad(picks_logp_of_logits, logits, picks, weights)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        if m <= 5:  # every pick real: the complete form too
            got = _logp_and_grad(lambda x, p: picks_logp_of_logits(x, p, complete=True), logits, picks, weights)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def _reranker_with_weights(dim: int, lexical: bool, seed: int) -> ResidualLinearReranker:
    reranker = ResidualLinearReranker(dim, lexical_feature=lexical)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in reranker.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return reranker


@pytest.mark.parametrize("explore", [True, False])
@pytest.mark.parametrize("lexical", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_rows_path_selects_what_the_dispatched_reference_does(monkeypatch: pytest.MonkeyPatch, explore: bool,
                                                              lexical: bool, batch: int) -> None:
    """Full candidate rows go through `rerank_rows`; the same picks, scores, log μ and noise, bit for bit,
    as the gathered reference behind `rerank` (what every row took before), folded query or not."""
    rerankers = {through_rows: _reranker_with_weights(D, lexical, seed=batch) for through_rows in (True, False)}
    rng = torch.Generator().manual_seed(5)
    calls = {"rows": 0}
    real_rows = reranker_module.rerank_rows

    def counting_rows(*args: object, **kwargs: object) -> object:
        calls["rows"] += 1
        return real_rows(*args, **kwargs)

    def select(through_rows: bool, cands: list[Candidates], seed: int) -> list[Selection]:
        with monkeypatch.context() as patch:
            patch.setattr(reranker_module, "rerank_rows", counting_rows)
            if not through_rows:
                patch.setattr(reranker_module, "_rows_path", lambda *_: False)
            return rerankers[through_rows].select(cands, 4, tau=0.3, explore=explore,
                                                  generator=torch.Generator().manual_seed(seed))

    for turn in range(3 * D):  # past D/2 query rows: the folded query serves the later turns
        cands = [_candidates(rng, 10, lexical) for _ in range(batch)]
        fast, plain = select(True, cands, turn), select(False, cands, turn)
        for got, expected in zip(fast, plain):
            assert got.chosen == expected.chosen
            assert torch.equal(got.scores, expected.scores)
            for mine, reference in ((got.logp, expected.logp), (got.noise, expected.noise)):
                assert (mine is None) == (reference is None) == (not explore)
                assert mine is None or torch.equal(mine, reference)
    assert calls["rows"] == 3 * D
    assert all(reranker._folded is not None for reranker in rerankers.values())


def test_rows_path_marks_picks_past_the_finite_keys_like_the_reference() -> None:
    """Rows whose scores are `-inf` (overflowing embeddings) leave picks -1 with log μ 0, as gathered."""
    gen = torch.Generator().manual_seed(2)
    memories = torch.randn(2, 6, D, generator=gen)
    memories[0, 1:4] = 0.0
    memories[0, 1:4, 0] = float("-inf")  # three candidates score -inf: row 0 has 3 finite keys for 5 picks
    queries = torch.randn(2, D, generator=gen)
    queries[:, 0] = 1.0
    ids = torch.arange(12).view(2, 6)
    for explore in (True, False):
        got = rerank_rows(queries, memories, 5, 0.5, explore=explore, generator=torch.Generator().manual_seed(0))
        expected = rerank_reference(queries, memories.reshape(-1, D), ids, 5, 0.5, explore=explore,
                                    generator=torch.Generator().manual_seed(0))
        assert got.indices[0, 3:].tolist() == [-1, -1] and (got.indices[1] >= 0).all()
        assert torch.equal(got.indices, expected.indices) and torch.equal(got.logp, expected.logp)
        assert torch.equal(got.scores, expected.scores)


def test_rows_path_on_a_misaligned_or_strided_block_equals_the_gathered_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Embeddings that are a view at an odd offset, or every other row of a bigger block, are copied
    to a fresh block first (as the reference's gather does): the same scores, bit for bit."""
    gen = torch.Generator().manual_seed(9)
    storage = torch.randn(1 + 2 * 10 * D, generator=gen)
    q = torch.randn(D, generator=gen)
    views = {"offset": storage[1 : 1 + 10 * D].view(10, D), "strided": storage[: 20 * D].view(20, D)[::2]}
    for name, mem in views.items():
        assert not (mem.is_contiguous() and mem.data_ptr() % 64 == 0), name
        assert reranker_module._aligned(mem).data_ptr() % 64 == 0
        cand = Candidates("q", [str(i) for i in range(10)], mem @ q, mem, q)
        sides = {}
        for through_rows in (True, False):
            reranker = _reranker_with_weights(D, False, seed=4)
            with monkeypatch.context() as patch:
                if not through_rows:
                    patch.setattr(reranker_module, "_rows_path", lambda *_: False)
                sides[through_rows] = reranker.select([cand], 4, explore=True, generator=torch.Generator().manual_seed(1))[0]
        assert sides[True].chosen == sides[False].chosen, name
        assert torch.equal(sides[True].scores, sides[False].scores) and torch.equal(sides[True].logp, sides[False].logp)


def test_rerank_rows_refuses_inputs_outside_what_it_states() -> None:
    gen = torch.Generator().manual_seed(0)
    memories, queries = torch.randn(2, 5, D, generator=gen), torch.randn(2, D, generator=gen)
    for bad_m in (0, 6):
        with pytest.raises(ValueError, match="1 <= m <= K"):
            rerank_rows(queries, memories, bad_m, 0.5, explore=False)
    with pytest.raises(ValueError, match="float32"):
        rerank_rows(queries.double(), memories.double(), 2, 0.5, explore=False)
    with pytest.raises(ValueError, match=r"queries \[B, d\]"):
        rerank_rows(queries[:1], memories, 2, 0.5, explore=False)
