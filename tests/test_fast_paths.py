"""The per-turn fast paths equal the plain formulations they replace.

- The learner's update writes the d×d gradients into kept buffers from the taps' gradients
  (`Learner._backward`, `ResidualLinearReranker.weight_grads`) instead of autograd allocating them:
  the same weights after many updates as `loss.backward()`.
- `plackett_luce_picks_logp` computes the M normalisers in one pass (a reverse logcumsumexp over
  the picks); the old formulation built one masked logsumexp row per pick.
"""

from __future__ import annotations

import pytest
import torch
from rmm.kernels.reference import plackett_luce_picks_logp, rerank_reference
from torch import Tensor

from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.reranker import ResidualLinearReranker
from rmm.policy.rewarded import RewardedSelection
from rmm.types import Candidates

D = 24


class PlainBackwardLearner(Learner):
    """The update as it was: scored through `policy_scores`, autograd allocates the weight gradients."""

    def loss(self, batch: list[RewardedSelection]) -> Tensor:
        return self._loss(batch, None)

    def _backward(self, loss: Tensor, tap: object) -> None:
        assert tap is None
        loss.backward()


def _candidates(rng: torch.Generator, k: int, lexical: bool) -> Candidates:
    q = torch.randn(D, generator=rng)
    mem = torch.randn(k, D, generator=rng)
    lex = torch.rand(k, generator=rng) if lexical else None
    return Candidates("q", [str(i) for i in range(k)], mem @ q, mem, q, lexical=lex)


@pytest.mark.parametrize("lexical", [False, True])
@pytest.mark.parametrize("estimator", ["plackett-luce", "paper"])
def test_buffered_update_equals_autograd_update(lexical: bool, estimator: str) -> None:
    config = LearnerConfig(batch_size=3, lr=0.05, estimator=estimator, max_grad_norm=0.5 if lexical else None)
    fast = Learner(ResidualLinearReranker(D, lexical_feature=lexical), config)
    plain = PlainBackwardLearner(ResidualLinearReranker(D, lexical_feature=lexical), config)
    rng = torch.Generator().manual_seed(3)
    losses = []
    for turn in range(24):
        k = 8 if turn % 5 else 6  # some batches padded to a common K
        cand = _candidates(rng, k, lexical and turn % 3 != 0)
        seed = int(torch.randint(0, 2**31, (), generator=rng))
        sel_fast = fast.select([cand], 3, generator=torch.Generator().manual_seed(seed))[0]
        sel_plain = plain.select([cand], 3, generator=torch.Generator().manual_seed(seed))[0]
        assert sel_fast.chosen == sel_plain.chosen
        rewards = torch.tensor([1.0, -1.0, -1.0]) if turn % 2 else torch.tensor([-1.0, 1.0, -1.0])
        losses.append((fast.record(sel_fast, rewards), plain.record(sel_plain, rewards)))
    assert fast.stats.step == plain.stats.step == 8
    for got, expected in losses:
        assert (got is None) == (expected is None) and (got is None or got == pytest.approx(expected, abs=1e-6))
    for got, expected in zip(fast.reranker.parameters(), plain.reranker.parameters()):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for got, expected in zip(fast.optimizer.state.values(), plain.optimizer.state.values()):
        torch.testing.assert_close(got["exp_avg"], expected["exp_avg"], rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in fast.reranker.parameters())


def test_buffered_update_leaves_public_loss_untapped() -> None:
    """`loss` outside an update differentiates to the parameters (callers use autograd.grad on it)."""
    learner = Learner(ResidualLinearReranker(D), LearnerConfig(batch_size=10))
    rng = torch.Generator().manual_seed(0)
    batch: list[RewardedSelection] = []
    for _ in range(2):
        sel = learner.select([_candidates(rng, 6, False)], 2, generator=rng)[0]
        learner.record(sel, torch.tensor([1.0, -1.0]))
    batch = list(learner._buffer)
    grads = torch.autograd.grad(learner.loss(batch), list(learner.reranker.parameters()))
    assert all(g.abs().sum() > 0 for g in grads)


# ---- Plackett–Luce log-probabilities of the picks --------------------------------------------
def loop_picks_logp(scores: Tensor, picks: Tensor, tau: float) -> Tensor:
    """The old formulation, one pick at a time: masked logsumexp over what is left."""
    logits = scores.float() / tau
    out = torch.zeros(picks.shape, dtype=torch.float32)
    for b in range(picks.shape[0]):
        available = logits[b] > float("-inf")
        for j in range(picks.shape[1]):
            c = int(picks[b, j])
            if c < 0:
                continue
            out[b, j] = logits[b, c] - torch.logsumexp(logits[b][available], 0)
            available[c] = False
    return out


@pytest.mark.parametrize("tau", [0.05, 0.5, 2.0])
def test_vectorised_picks_logp_equals_the_loop(tau: float) -> None:
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
        expected = loop_picks_logp(result.scores, result.indices, tau)
        torch.testing.assert_close(result.logp, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(plackett_luce_picks_logp(result.scores, result.indices, tau), expected,
                                   rtol=0, atol=1e-5)
        assert (result.indices[1, 8:] == -1).all()
