"""Credit assignment and the off-policy correction: hand-computed gradients for each credit form,
the truncated importance ratio, and unbiasedness of the corrected estimator for stale samples."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rmm.policy.credit import (
    ROUNDING_TOLERANCE,
    log_importance,
    pick_weights,
    truncated_importance,
)
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.reranker import ResidualLinearReranker
from rmm.policy.rewarded import rewarded
from rmm.policy.sampling import plackett_luce_logp
from rmm.types import Candidates, Selection

# ---- the tiny example: K = 3 candidates, M = 2 picks -----------------------------------------
# Memories are the unit vectors, so with zero reranker weights the scores are the query itself and
# dL/dW_q = g qᵀ, g = dL/ds (s_i = (q + W_q q)·(m_i + W_m m_i) at W = 0).
QUERY = torch.tensor([0.4, -0.2, 0.1])
MEMORIES = torch.eye(3)
TAU = 0.5
CHOSEN = [2, 0]
REWARDS = [1.0, -1.0]
BASELINE = 0.5  # advantages A = (0.5, -1.5)

# the weight of log π_1, log π_2 under each form, written out by hand from A = (0.5, -1.5)
HAND_WEIGHTS = {
    "per-pick": (0.5, -1.5),  # A_j
    "reward-to-go": (0.5 - 1.5, -1.5),  # G_1 = A_1 + A_2, G_2 = A_2
    "sequence": (0.5 - 1.5, 0.5 - 1.5),  # (Σ r − M b) for every pick
}


def tiny_selection(logp: list[float] | None = None) -> Selection:
    cand = Candidates("q", ["a", "b", "c"], MEMORIES @ QUERY, MEMORIES.clone(), QUERY.clone())
    return Selection(cand, list(CHOSEN), MEMORIES @ QUERY, logp=None if logp is None else torch.tensor(logp),
                     explore=True, tau=TAU, version=0)


def hand_score_gradient(weights: tuple[float, float], rho: float = 1.0) -> torch.Tensor:
    """dL/ds for L = −ρ (w_1 log π_1 + w_2 log π_2), computed with math only.

    log π_1 = z_2 − log Σ_{0,1,2} e^z  →  d/dz = e_2 − softmax(z)
    log π_2 = z_0 − log Σ_{0,1} e^z    →  d/dz = e_0 − softmax(z over {0, 1}), 0 at item 2
    and z = s/τ.
    """
    z = [v / TAU for v in QUERY.tolist()]
    full = [math.exp(v) for v in z]
    p = [v / sum(full) for v in full]
    rest = [math.exp(z[0]), math.exp(z[1])]
    p2 = [rest[0] / sum(rest), rest[1] / sum(rest), 0.0]
    d1 = [(1.0 if i == 2 else 0.0) - p[i] for i in range(3)]
    d2 = [(1.0 if i == 0 else 0.0) - p2[i] for i in range(3)]
    w1, w2 = weights
    return torch.tensor([-rho * (w1 * d1[i] + w2 * d2[i]) / TAU for i in range(3)])


def sgd_step_gradient(config: LearnerConfig, selection: Selection) -> torch.Tensor:
    """Record one selection with SGD at lr 1 and return dL/ds recovered from the W_q step."""
    learner = Learner(ResidualLinearReranker(3), config)
    assert isinstance(learner.record(selection, torch.tensor(REWARDS)), float)
    step = -learner.reranker.W_q.weight.detach()  # = dL/dW_q = g qᵀ
    return step @ QUERY / QUERY.dot(QUERY)


def tiny_config(credit: str, **kwargs: object) -> LearnerConfig:
    return LearnerConfig(lr=1.0, optimizer="sgd", batch_size=1, baseline=BASELINE, tau=TAU, credit=credit, **kwargs)


@pytest.mark.parametrize("credit", ["per-pick", "reward-to-go", "sequence"])
def test_each_credit_form_gives_its_hand_computed_gradient(credit: str) -> None:
    got = sgd_step_gradient(tiny_config(credit), tiny_selection())
    torch.testing.assert_close(got, hand_score_gradient(HAND_WEIGHTS[credit]), rtol=1e-5, atol=1e-6)
    for other, weights in HAND_WEIGHTS.items():  # the forms really differ on this example
        if other != credit:
            assert not torch.allclose(got, hand_score_gradient(weights), atol=1e-3)


def test_pick_weights_with_padding() -> None:
    advantage = torch.tensor([[0.5, -1.5, 0.0], [1.0, 2.0, -0.5]])  # row 0 has one padding pick
    assert pick_weights(advantage, "per-pick").tolist() == advantage.tolist()
    assert pick_weights(advantage, "reward-to-go").tolist() == [[-1.0, -1.5, 0.0], [2.5, 1.5, -0.5]]
    assert pick_weights(advantage, "sequence").tolist() == [[-1.0, -1.0, -1.0], [2.5, 2.5, 2.5]]
    with pytest.raises(ValueError, match="credit"):
        pick_weights(advantage, "per-memory")


# ---- the truncated importance ratio ------------------------------------------------------------
def on_policy_logp() -> list[float]:
    return plackett_luce_logp(QUERY[None], torch.tensor([CHOSEN]), TAU)[0].tolist()


@pytest.mark.parametrize(
    ("ratio", "config", "rho"),
    [
        (4.0, {}, 1.0),  # π/μ = 4 truncated at the default clip 1
        (4.0, {"is_clip": 2.0}, 2.0),
        (4.0, {"is_clip": math.inf}, 4.0),
        (0.25, {}, 0.25),  # below the clip: the ratio itself
        (0.25, {"importance": False}, 1.0),  # --no-is
        (4.0, {"importance": False}, 1.0),
    ],
)
def test_stale_selections_are_weighted_by_the_truncated_ratio(ratio: float, config: dict, rho: float) -> None:
    """μ recorded at sampling time differs from π now by a known factor; the step scales by ρ."""
    shift = math.log(ratio) / 2  # spread over the two picks: Σ log μ = Σ log π − log ratio
    behaviour = [v - shift for v in on_policy_logp()]
    got = sgd_step_gradient(tiny_config("per-pick", **config), tiny_selection(behaviour))
    torch.testing.assert_close(got, hand_score_gradient(HAND_WEIGHTS["per-pick"], rho=rho), rtol=1e-5, atol=1e-6)


def test_normalized_ratios_weight_the_batch_by_rho_over_its_mean() -> None:
    """Weighted importance sampling: ratios 2 (4 clipped at 2) and 0.5 become 1.6 and 0.4."""
    config = tiny_config("per-pick", is_clip=2.0, is_normalize=True)
    config.batch_size = 2
    learner = Learner(ResidualLinearReranker(3), config)
    for ratio in (4.0, 0.5):
        shift = math.log(ratio) / 2
        learner.record(tiny_selection([v - shift for v in on_policy_logp()]), torch.tensor(REWARDS))
    got = -learner.reranker.W_q.weight.detach() @ QUERY / QUERY.dot(QUERY)
    expected = (hand_score_gradient(HAND_WEIGHTS["per-pick"], rho=1.6)
                + hand_score_gradient(HAND_WEIGHTS["per-pick"], rho=0.4)) / 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert learner.stats.importance_sum == pytest.approx(2.5, rel=1e-5)  # the stats keep the raw ρ


def test_importance_diagnostics_are_counted() -> None:
    config = LearnerConfig(lr=1e-9, optimizer="sgd", batch_size=1, tau=TAU, is_clip=2.0)  # π stays put
    learner = Learner(ResidualLinearReranker(3), config)
    for ratio in (4.0, 0.5, 1.0):
        shift = math.log(ratio) / 2
        learner.record(tiny_selection([v - shift for v in on_policy_logp()]), torch.tensor(REWARDS))
    s = learner.stats
    assert s.importance_count == 3 and s.importance_clipped == 1
    assert s.importance_sum == pytest.approx(2.0 + 0.5 + 1.0, rel=1e-5)
    assert s.staleness_count == 3 and s.staleness_sum == 0 + 1 + 2  # sampled at version 0, updated at 0, 1, 2


def test_ratio_is_computed_in_log_space_and_rounding_counts_as_on_policy() -> None:
    huge = log_importance(torch.tensor([[0.0, 0.0]]), torch.tensor([[-400.0, -400.0]]))
    assert truncated_importance(huge, 1.0).item() == 1.0  # e^800 would overflow
    assert math.isfinite(truncated_importance(huge, 1e6).item())
    tiny = log_importance(torch.tensor([[0.0]]), torch.tensor([[-ROUNDING_TOLERANCE / 2]]))
    assert tiny.item() == 0.0
    with pytest.raises(ValueError):
        truncated_importance(tiny, 0.0)


# ---- unbiasedness for stale samples ------------------------------------------------------------
# d = 2, K = 3, M = 2: the samples come from old weights θ0 (zero), the gradient is taken at θ1.
D2_QUERY = torch.tensor([1.0, 0.5])
D2_MEMORIES = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-0.6, 0.9]])
ITEM_REWARD = torch.tensor([1.0, -1.0, 1.0])  # r of a pick depends on the picked item only
SEQUENCES = list(itertools.permutations(range(3), 2))


def current_weights(reranker: ResidualLinearReranker) -> ResidualLinearReranker:
    with torch.no_grad():
        reranker.W_q.weight.copy_(torch.tensor([[0.5, -1.2], [0.9, 0.3]]))
        reranker.W_m.weight.copy_(torch.tensor([[-0.4, 0.2], [0.7, 0.1]]))
    return reranker


def seq_logp(reranker: ResidualLinearReranker, seq: tuple[int, ...]) -> torch.Tensor:
    scores = reranker.policy_scores(D2_QUERY[None], D2_MEMORIES[None])
    return plackett_luce_logp(scores, torch.tensor([seq]), TAU)[0]


def exact_gradient() -> torch.Tensor:
    """∇ E_π[Σ_j r_j] at θ1, by enumerating every ordered pair."""
    reranker = current_weights(ResidualLinearReranker(2))
    expected = sum(seq_logp(reranker, s).sum().exp() * ITEM_REWARD[list(s)].sum() for s in SEQUENCES)
    return torch.cat([g.flatten() for g in torch.autograd.grad(expected, list(reranker.parameters()))])


def d2_selection(seq: tuple[int, ...], behaviour: torch.Tensor) -> Selection:
    cand = Candidates("q", ["a", "b", "c"], D2_MEMORIES @ D2_QUERY, D2_MEMORIES, D2_QUERY)
    return Selection(cand, list(seq), D2_MEMORIES @ D2_QUERY, logp=behaviour, explore=True, tau=TAU, version=0)


def estimator_gradient(learner: Learner, selections: list[Selection]) -> torch.Tensor:
    """The mean of the learner's estimator over `selections`: −∇ of its batch loss at θ1."""
    batch = [rewarded(s, ITEM_REWARD[s.chosen], 2, TAU) for s in selections]
    loss = learner.loss(batch)
    return -torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(learner.reranker.parameters()))])


def stale_learner(credit: str, **config: object) -> Learner:
    cfg = LearnerConfig(baseline=0.5, tau=TAU, credit=credit, is_clip=math.inf, **config)
    return Learner(current_weights(ResidualLinearReranker(2)), cfg)


def expectation_under_old_weights(learner: Learner) -> tuple[torch.Tensor, torch.Tensor]:
    """E_μ[estimator] and its per-sample standard deviation, exactly, over the 6 orderings."""
    old = ResidualLinearReranker(2)
    mus, grads = [], []
    for seq in SEQUENCES:
        behaviour = seq_logp(old, seq).detach()
        mus.append(float(behaviour.sum().exp()))
        grads.append(estimator_gradient(learner, [d2_selection(seq, behaviour)]))
    assert sum(mus) == pytest.approx(1.0, abs=1e-6)
    g = torch.stack(grads)
    mu = torch.tensor(mus)[:, None]
    mean = (mu * g).sum(0)
    return mean, ((mu * (g - mean) ** 2).sum(0)).sqrt()


@pytest.mark.parametrize("credit", ["sequence", "reward-to-go"])
def test_the_corrected_estimator_is_unbiased_for_stale_samples(credit: str) -> None:
    truth = exact_gradient()
    mean, _ = expectation_under_old_weights(stale_learner(credit))
    torch.testing.assert_close(mean, truth, rtol=1e-4, atol=1e-5)
    uncorrected, _ = expectation_under_old_weights(stale_learner(credit, importance=False))
    assert (uncorrected - truth).norm() > 0.2 * truth.norm()  # without the correction it is biased
    per_pick, _ = expectation_under_old_weights(stale_learner("per-pick"))
    assert (per_pick - truth).norm() > 0.05 * truth.norm()  # the paper's form is biased even corrected


def test_empirical_mean_over_sampled_selections_matches_the_exact_gradient() -> None:
    """Sample from the old weights with the real Gumbel sampler; the corrected estimator's mean over
    many samples is the exact gradient at the new weights (within 4 standard errors), the
    uncorrected one is not."""
    n = 5000
    truth = exact_gradient()
    cand = Candidates("q", ["a", "b", "c"], D2_MEMORIES @ D2_QUERY, D2_MEMORIES, D2_QUERY)
    sampled = ResidualLinearReranker(2).select([cand] * n, 2, tau=TAU, explore=True,
                                               generator=torch.Generator().manual_seed(0))
    assert all(s.version == 0 and s.tau == TAU for s in sampled[:5])
    learner = stale_learner("sequence")
    _, spread = expectation_under_old_weights(learner)
    empirical = estimator_gradient(learner, sampled)
    assert ((empirical - truth).abs() <= 4 * spread / math.sqrt(n) + 1e-6).all()
    uncorrected = estimator_gradient(stale_learner("sequence", importance=False), sampled)
    assert ((uncorrected - truth).abs() > 10 * spread / math.sqrt(n)).any()
