"""Off-policy evaluation (issue 32): inclusion probabilities against enumeration, estimators against
a known truth on synthetic logs, degenerate logs (π = μ, zero overlap)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from rmm.ope import (
    LoggedSelection,
    OverlapError,
    RerankerTarget,
    UniformTarget,
    behaviour_mismatch,
    evaluate,
    exact_inclusion,
    logged_from_selection,
    monte_carlo_inclusion,
    retriever_target,
    row_weights,
)
from rmm.ope.inclusion import exact_cost, greedy_inclusion, inclusion
from rmm.policy.reranker import ResidualLinearReranker
from rmm.policy.sampling import plackett_luce_logp
from rmm.types import Candidates


def _ordered_slates(logits: torch.Tensor, m: int, mask: torch.Tensor | None = None):
    """Every ordered pick sequence of m with its Plackett–Luce probability (brute force)."""
    p = torch.exp(logits.double())
    if mask is not None:
        p = p * mask.double()
    valid = [i for i in range(len(p)) if p[i] > 0]
    for seq in itertools.permutations(valid, m):
        prob, left = 1.0, float(p.sum())
        for j in seq:
            prob *= float(p[j]) / left
            left -= float(p[j])
        yield seq, prob


def _brute_inclusion(logits: torch.Tensor, m: int, mask: torch.Tensor | None = None) -> np.ndarray:
    out = np.zeros(len(logits))
    for seq, prob in _ordered_slates(logits, m, mask):
        out[list(seq)] += prob
    return out


@pytest.mark.parametrize(("k", "m"), [(1, 1), (4, 1), (5, 2), (6, 3), (7, 7), (8, 4)])
def test_exact_inclusion_matches_enumeration(k: int, m: int) -> None:
    g = torch.Generator().manual_seed(k * 10 + m)
    logits = torch.randn(3, k, generator=g) * 2
    mask = torch.ones(3, k, dtype=torch.bool)
    if k - m >= 2:
        mask[1, -1] = False  # a masked candidate is never picked
    exact = exact_inclusion(logits, m, mask)
    brute = np.stack([_brute_inclusion(row, m, mk) for row, mk in zip(logits, mask)])
    assert np.abs(exact - brute).max() < 1e-12
    assert np.allclose(exact.sum(-1), m)
    assert (exact[~mask.numpy()] == 0).all()


def test_monte_carlo_within_its_stated_error() -> None:
    """Rao–Blackwellised estimates land within a few of their own standard errors of the exact value,
    about as often as a normal error would (|z| > 3 in well under 1% of items)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(60, 9, generator=g) * 1.5
    exact = exact_inclusion(logits, 3)
    est, stderr = monte_carlo_inclusion(logits, 3, samples=2000, seed=5)
    live = stderr > 1e-9
    z = np.abs(est - exact)[live] / stderr[live]
    assert (z > 3).mean() < 0.01 and (z > 2).mean() < 0.1
    assert np.all(np.abs(est - exact)[~live] < 1e-9)  # items certain under every race are certain
    assert stderr.max() < 0.01
    assert (est > 0).all()  # never zero for a valid item: a shown memory never gets an infinite weight


def test_inclusion_picks_exact_for_small_k_and_states_monte_carlo_otherwise() -> None:
    logits = torch.randn(2, 12)
    assert inclusion(logits, 3).method == "exact"
    mc = inclusion(logits, 3, exact_limit=exact_cost(12, 3) - 1, samples=300)
    assert mc.method == "monte-carlo" and mc.samples == 300 and mc.stderr is not None
    same, _ = monte_carlo_inclusion(logits, 3, samples=300, seed=0)
    assert np.array_equal(mc.probs, same)  # common random numbers: one seed, one set of races


def test_greedy_inclusion_is_the_top_m() -> None:
    probs = greedy_inclusion(torch.tensor([[0.1, 3.0, -1.0, 2.0]]), 2)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 1.0]]


# ---- synthetic logs with a known truth ---------------------------------------------------------------
D, K, M, TAU = 8, 6, 2, 1.0


def _simulate(seed: int, n: int = 300, alpha: float = 1.5):
    """Log under μ (an untrained reranker: q·m) on random candidates; P(cite) = σ(2 u·m) per memory,
    independent of its slate-mates. π adds α·u·m to the score (q[0] = 1 and W_q's first column α·u)."""
    g = torch.Generator().manual_seed(seed)
    fixed = torch.Generator().manual_seed(1234)
    u = torch.randn(D, generator=fixed)
    u[0] = 0
    u /= u.norm()
    mu, pi = ResidualLinearReranker(D), ResidualLinearReranker(D)
    with torch.no_grad():
        pi.W_q.weight[:, 0] = alpha * u
    cands = []
    for _ in range(n):
        q = torch.randn(D, generator=g) * 0.5
        q[0] = 1.0
        cands.append(Candidates(query="q", memory_ids=[str(j) for j in range(K)], retriever_scores=torch.zeros(K),
                                embeddings=torch.randn(K, D, generator=g), query_embedding=q))
    rows, expected = [], []
    for c, s in zip(cands, mu.select(cands, M, tau=TAU, explore=True, generator=g)):
        p = torch.sigmoid(2.0 * (c.embeddings @ u))
        cited = torch.rand(M, generator=g) < p[s.chosen]
        rows.append(logged_from_selection(s, cited.float() * 2 - 1))
        expected.append((2 * p.double() - 1).numpy())
    return rows, expected, mu, pi


def _true_value(rows, expected, target) -> float:
    """Expected reward per shown memory of `target` on these queries, by exact inclusion."""
    inc = exact_inclusion(torch.stack(target.logits(rows)), M)
    return float(sum(i @ e for i, e in zip(inc, expected)) / (M * len(rows)))


def test_logged_rows_reproduce_the_behaviour_logp() -> None:
    rows, _, _, _ = _simulate(0, n=20)
    assert max(behaviour_mismatch(rows)) < 1e-4


def test_unbiased_by_full_enumeration() -> None:
    """E_μ[estimate] = π's value exactly: enumerate every ordered slate μ can draw for one query, with
    the expected rewards r̄ as rewards (the estimators are linear in them), and weight each by μ(S)."""
    rows, expected, mu, pi = _simulate(3, n=1)
    base, rbar = rows[0], torch.as_tensor(expected[0])
    mu_logits = base.scores.double() / base.tau
    slates = list(_ordered_slates(mu_logits, M))
    logged = [LoggedSelection(query=base.query, memories=base.memories, scores=base.scores, tau=base.tau,
                              chosen=torch.tensor(seq), rewards=rbar[list(seq)].float(),
                              behaviour_logp=plackett_luce_logp(mu_logits[None], torch.tensor([seq]), 1.0)[0].float())
              for seq, _ in slates]
    target = RerankerTarget(pi, tau=0.7)
    weights = row_weights(logged, target)
    prob = np.array([p for _, p in slates])
    truth = float(weights.pi[0] @ expected[0])
    item = sum(pr * float((weights.pi[i][list(s)] / weights.mu[i][list(s)]) @ expected[0][list(s)])
               for i, ((s, pr)) in enumerate(slates))
    slate = sum(pr * math.exp(weights.slate_log_ratio[i]) * float(expected[0][list(s)].sum())
                for i, ((s, pr)) in enumerate(slates))
    rhat = np.linspace(-0.5, 0.5, K)  # any fixed reward model
    dr = sum(pr * (float(weights.pi[i] @ rhat) + float((weights.pi[i][list(s)] / weights.mu[i][list(s)])
                                                       @ (expected[0][list(s)] - rhat[list(s)])))
             for i, ((s, pr)) in enumerate(slates))
    assert prob.sum() == pytest.approx(1.0, abs=1e-12)
    assert item == pytest.approx(truth, abs=1e-10)
    assert slate == pytest.approx(truth, abs=1e-6)  # μ(S) is logged in float32
    assert dr == pytest.approx(truth, abs=1e-10)


def test_estimates_cover_the_true_value_over_seeds() -> None:
    """On logs where the truth is known, each estimator's 95% interval covers π's value in most seeds
    and their errors average out (no systematic bias)."""
    results: dict[str, list[tuple[bool, float]]] = {}
    for seed in range(8):
        rows, expected, _, pi = _simulate(seed)
        target = RerankerTarget(pi, tau=TAU, name="pi")
        truth = _true_value(rows, expected, target)
        report = evaluate(rows, target, bootstrap=300, seed=seed)
        for e in report.estimates:
            results.setdefault(e.name, []).append((e.low <= truth <= e.high, e.value - truth))
    for name in ("ips", "snips", "dr", "ips-clipped"):
        covered = sum(c for c, _ in results[name])
        bias = float(np.mean([b for _, b in results[name]]))
        assert covered >= 6, (name, covered)
        assert abs(bias) < 0.04, (name, bias)
    # π is better than μ here, and the logged mean is μ's: the estimates must see the difference
    assert np.mean([b for _, b in results["logged"]]) < -0.2


def test_doubly_robust_beats_ips_error() -> None:
    errors = {"ips": [], "dr": []}
    for seed in range(8):
        rows, expected, _, pi = _simulate(100 + seed)
        target = RerankerTarget(pi, tau=TAU)
        truth = _true_value(rows, expected, target)
        report = evaluate(rows, target, bootstrap=50, seed=seed)
        for name in errors:
            errors[name].append(report.get(name).value - truth)
    rmse = {name: float(np.sqrt(np.mean(np.square(e)))) for name, e in errors.items()}
    assert rmse["dr"] < rmse["ips"], rmse


def test_target_equal_to_logging_policy_returns_the_logged_mean() -> None:
    rows, _, mu, _ = _simulate(7)
    report = evaluate(rows, RerankerTarget(mu), bootstrap=200)
    logged = report.get("logged")
    for name in ("ips", "ips-clipped", "snips", "slate"):
        assert report.get(name).value == pytest.approx(logged.value, abs=1e-4), name
        assert report.get(name).cited == pytest.approx(logged.cited, abs=1e-4), name
    dr = report.get("dr")
    assert dr.low <= logged.value <= dr.high and abs(dr.value - logged.value) < 0.03
    assert report.get("ips").ess == pytest.approx(report.shown, rel=1e-3)
    by_monte_carlo = evaluate(rows, RerankerTarget(mu), bootstrap=20, exact_limit=1, samples=50)
    assert by_monte_carlo.inclusion == "monte-carlo"  # π and μ share their races: weights 1 again
    assert by_monte_carlo.get("ips").value == pytest.approx(logged.value, abs=1e-4)
    expected_cited = float(np.mean([float(((r.rewards + 1) / 2).sum()) for r in rows]))
    assert logged.cited == pytest.approx(expected_cited)
    assert logged.value == pytest.approx(float(torch.cat([r.rewards for r in rows]).mean()))


def test_zero_overlap_is_refused() -> None:
    """μ nearly deterministic (τ tiny): the memories it never shows carry no evidence, and a target
    that would show them gets a refusal naming the unsupported mass, not a number."""
    g = torch.Generator().manual_seed(0)
    mu = ResidualLinearReranker(D)
    cands = [Candidates(query="q", memory_ids=[str(j) for j in range(K)], retriever_scores=torch.zeros(K),
                        embeddings=torch.randn(K, D, generator=g) * 3, query_embedding=torch.randn(D, generator=g) * 3)
             for _ in range(30)]
    rows = [logged_from_selection(s, torch.ones(M)) for s in mu.select(cands, M, tau=1e-4, explore=True, generator=g)]
    with pytest.raises(OverlapError, match="inclusion mass on memories the logging policy could not show"):
        evaluate(rows, UniformTarget(), bootstrap=10)


def test_low_effective_sample_size_is_refused() -> None:
    rows, _, _, pi = _simulate(2, n=40, alpha=6.0)
    with pytest.raises(OverlapError, match="effective sample size"):
        evaluate(rows, RerankerTarget(pi, tau=0.05), bootstrap=10, min_ess=40)


def test_report_fields_and_baselines() -> None:
    rows, expected, _, _ = _simulate(4, n=120)
    uniform = evaluate(rows, UniformTarget(), bootstrap=100)
    assert uniform.inclusion == "exact" and uniform.samples == 0 and uniform.unsupported == 0.0
    for e in uniform.estimates:
        assert e.low <= e.high and e.ess > 0 and e.assumption
    assert uniform.get("ips").value == pytest.approx(_true_value(rows, expected, UniformTarget()), abs=0.1)
    retriever = evaluate(rows, retriever_target(rows), bootstrap=50)  # μ here is the untrained reranker
    assert retriever.get("ips").value == pytest.approx(retriever.get("logged").value, abs=1e-4)
    greedy = evaluate(rows, retriever_target(rows, greedy=True), bootstrap=50, min_ess=1)
    assert greedy.get("ips").max_weight > 1.0
    mc = evaluate(rows, UniformTarget(), bootstrap=20, exact_limit=1, samples=200)
    assert mc.inclusion == "monte-carlo" and mc.samples == 200 and mc.max_stderr > 0
    assert mc.get("ips").value == pytest.approx(uniform.get("ips").value, abs=0.05)
    assert set(uniform.to_json()) >= {"target", "estimates", "inclusion", "unsupported", "bootstrap"}


def test_clipping_reports_the_fraction_clipped() -> None:
    rows, _, _, pi = _simulate(5, n=200, alpha=3.0)
    report = evaluate(rows, RerankerTarget(pi, tau=0.5), bootstrap=50, clip=2.0, min_ess=1)
    clipped, ips = report.get("ips-clipped"), report.get("ips")
    assert 0 < clipped.clipped < 1 and clipped.max_weight == pytest.approx(2.0)
    assert ips.max_weight > 2.0 and clipped.ess > ips.ess
