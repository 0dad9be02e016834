"""Gumbel top-M sampling is exact Plackett–Luce sampling; the log-probabilities are right."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from plackett_luce_helpers import naive_pl_logp

from rmm.policy.sampling import (
    gumbel_noise,
    gumbel_top_m,
    paper_literal_logp,
    plackett_luce_logp,
    top_m,
)


def pl_probability(logits: list[float], order: tuple[int, ...]) -> float:
    """Plackett–Luce probability of an ordered selection, written out independently."""
    remaining = list(range(len(logits)))
    prob = 1.0
    for item in order:
        z = sum(math.exp(logits[i]) for i in remaining)
        prob *= math.exp(logits[item]) / z
        remaining.remove(item)
    return prob


def ordering_frequencies(chosen: torch.Tensor) -> dict[tuple[int, ...], float]:
    counts: dict[tuple[int, ...], int] = {}
    for row in chosen.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return {k: v / chosen.shape[0] for k, v in counts.items()}


def chi_square(freqs: dict, expected: dict, n: int) -> float:
    return sum(n * (freqs.get(k, 0.0) - p) ** 2 / p for k, p in expected.items())


SCORES = [1.0, 0.3, -0.5, 0.0]
TAU = 0.5
N = 20_000


def test_gumbel_top_m_matches_plackett_luce_over_full_orderings() -> None:
    scores = torch.tensor(SCORES).expand(N, 4)
    chosen, noise = gumbel_top_m(scores, 2, TAU, generator=torch.Generator().manual_seed(1234))
    assert chosen.shape == (N, 2) and noise.shape == (N, 4)
    freqs = ordering_frequencies(chosen)
    logits = [s / TAU for s in SCORES]
    orders = list(itertools.permutations(range(4), 2))
    expected = {o: pl_probability(logits, o) for o in orders}
    assert set(freqs) <= set(expected)
    stat = chi_square(freqs, expected, N)
    assert stat < 35.0  # 11 dof: p ≈ 2.5e-4
    assert max(abs(freqs.get(o, 0.0) - expected[o]) for o in orders) < 0.012
    # The same samples are far from what a τ-blind sampler (logits = s) would give: the test
    # discriminates the decision "divide by τ before adding noise".
    wrong = {o: pl_probability(SCORES, o) for o in orders}
    assert chi_square(freqs, wrong, N) > 500


def test_plackett_luce_logp_matches_closed_form_and_normalises() -> None:
    scores = torch.tensor(SCORES)
    logits = [s / TAU for s in SCORES]
    orders = torch.tensor(list(itertools.permutations(range(4), 2)))
    logp = plackett_luce_logp(scores.expand(len(orders), 4), orders, TAU)
    total = logp.sum(-1).exp()
    expected = torch.tensor([pl_probability(logits, tuple(o)) for o in orders.tolist()])
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-7)
    assert total.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_lower_tau_is_more_deterministic() -> None:
    scores = torch.tensor(SCORES).expand(N, 4)
    gen = torch.Generator().manual_seed(7)
    top_first = {}
    for tau in (0.1, 0.5, 2.0):
        chosen, _ = gumbel_top_m(scores, 1, tau, generator=gen)
        top_first[tau] = (chosen[:, 0] == 0).float().mean().item()
    assert top_first[0.1] > 0.99
    assert top_first[0.1] > top_first[0.5] + 0.1 > top_first[2.0] + 0.2


def test_plackett_luce_logp_gradient_matches_naive_loop() -> None:
    torch.manual_seed(0)
    scores = torch.randn(3, 6, requires_grad=True)
    chosen = torch.tensor([[5, 0, 2], [1, 2, 3], [0, 4, 1]])
    fast = plackett_luce_logp(scores, chosen, 0.7)
    naive = naive_pl_logp(scores, chosen, 0.7)
    torch.testing.assert_close(fast, naive)
    weights = torch.randn(3, 3)
    (g_fast,) = torch.autograd.grad((fast * weights).sum(), scores)
    (g_naive,) = torch.autograd.grad((naive * weights).sum(), scores)
    torch.testing.assert_close(g_fast, g_naive)


def test_padding_picks_score_zero_and_leave_the_real_ones_as_the_naive_loop() -> None:
    """-1 pads rows with fewer picks: 0 with zero gradient, the real picks exactly as unpadded,
    finite gradients where a row took every valid candidate before its padding."""
    scores = torch.randn(3, 6, generator=torch.Generator().manual_seed(4), requires_grad=True)
    mask = torch.tensor([[True] * 6, [True] * 5 + [False], [True] * 3 + [False] * 3])
    chosen = torch.tensor([[5, 0, 2, 4], [1, 3, -1, -1], [2, 0, 1, -1]])
    got = plackett_luce_logp(scores, chosen, 0.7, mask)
    naive = naive_pl_logp(scores, chosen, 0.7, mask)
    torch.testing.assert_close(got, naive)
    assert got[1, 2:].tolist() == [0.0, 0.0] and got[2, 3].item() == 0.0
    weights = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    (g_got,) = torch.autograd.grad((got * weights).sum(), scores)
    (g_naive,) = torch.autograd.grad((naive * weights).sum(), scores)
    assert torch.isfinite(g_got).all()
    torch.testing.assert_close(g_got, g_naive)
    # the same rows unpadded give the same real log-probabilities
    torch.testing.assert_close(plackett_luce_logp(scores[1:2], chosen[1:2, :2], 0.7, mask[1:2])[0], got[1, :2])
    literal = paper_literal_logp(scores, torch.zeros(3, 6), chosen, 0.7, mask)
    assert literal[1, 2:].tolist() == [0.0, 0.0] and torch.isfinite(literal).all()


def test_leading_batch_dims_give_each_row_what_it_gets_alone() -> None:
    """A `[2, 3, K]` block (some candidates masked per row): every row's picks are the top-M of its own
    perturbed logits, and its log-probabilities and top-M equal those of the row computed alone
    (and the naive loop's)."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 7, generator=gen) * 2
    mask = torch.rand(2, 3, 7, generator=gen) > 0.3
    mask[..., :3] = True  # at least M valid per row
    tau = 0.5
    chosen, noise = gumbel_top_m(scores, 3, tau, generator=torch.Generator().manual_seed(1), mask=mask)
    assert chosen.shape == (2, 3, 3) and noise.shape == (2, 3, 7)
    logp = plackett_luce_logp(scores, chosen, tau, mask)
    literal = paper_literal_logp(scores, noise, chosen, tau, mask)
    best = top_m(scores, 2, mask=mask)
    for i, j in itertools.product(range(2), range(3)):
        s, n, c, k = scores[i, j], noise[i, j], chosen[i, j], mask[i, j]
        perturbed = (s / tau + n).masked_fill(~k, float("-inf"))
        assert c.tolist() == perturbed.topk(3).indices.tolist() and bool(k[c].all())
        alone = plackett_luce_logp(s[None], c[None], tau, k[None])[0]
        torch.testing.assert_close(logp[i, j], alone, rtol=0, atol=1e-6)
        torch.testing.assert_close(logp[i, j], naive_pl_logp(s, c, tau, k), rtol=0, atol=1e-5)
        written = torch.log_softmax(((s + n) / tau).masked_fill(~k, float("-inf")), -1)[c]
        torch.testing.assert_close(literal[i, j], written, rtol=0, atol=1e-5)
        assert best[i, j].tolist() == s.masked_fill(~k, float("-inf")).topk(2).indices.tolist()


def test_mask_excludes_padding_and_logp_equals_unpadded() -> None:
    torch.manual_seed(3)
    real = torch.randn(4)
    padded = torch.cat([real, torch.tensor([100.0, 100.0])]).expand(2000, 6)
    mask = torch.tensor([True] * 4 + [False] * 2).expand(2000, 6)
    chosen, _ = gumbel_top_m(padded, 3, 0.5, generator=torch.Generator().manual_seed(0), mask=mask)
    assert chosen.max().item() < 4
    assert top_m(padded, 3, mask=mask).max().item() < 4
    logp_padded = plackett_luce_logp(padded[:5], chosen[:5], 0.5, mask=mask[:5])
    logp_plain = plackett_luce_logp(real.expand(5, 4), chosen[:5], 0.5)
    torch.testing.assert_close(logp_padded, logp_plain)
    literal_padded = paper_literal_logp(padded[:5], torch.zeros(5, 6), chosen[:5], 0.5, mask=mask[:5])
    literal_plain = paper_literal_logp(real.expand(5, 4), torch.zeros(5, 4), chosen[:5], 0.5)
    torch.testing.assert_close(literal_padded, literal_plain)


def test_m_larger_than_valid_count_raises() -> None:
    scores = torch.randn(2, 5)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    with pytest.raises(ValueError, match="valid candidates"):
        gumbel_top_m(scores, 3, 0.5, mask=mask)
    with pytest.raises(ValueError, match="valid candidates"):
        top_m(scores, 6)
    with pytest.raises(ValueError, match="tau"):
        gumbel_top_m(scores, 2, 0.0)
    with pytest.raises(ValueError, match="m must be"):
        top_m(scores, -1)


def paper_literal_reference(scores: list[float], noise: list[float], order: tuple[int, ...], tau: float) -> list[float]:
    """The paper's estimator written out: every pick read off one softmax of (s + g)/τ over all K,
    with no renormalisation after earlier picks."""
    logits = [(s + g) / tau for s, g in zip(scores, noise)]
    log_z = math.log(sum(math.exp(x) for x in logits))
    return [logits[c] - log_z for c in order]


def test_paper_literal_logp_against_a_hand_computation() -> None:
    # (s + g)/τ = [2.2, 3.4, 1.4]; log Σ exp = 3.762230…; picks 1 then 0.
    got = paper_literal_logp(torch.tensor([[1.0, 2.0, 0.5]]), torch.tensor([[0.1, -0.3, 0.2]]), torch.tensor([[1, 0]]), 0.5)
    assert got[0].tolist() == pytest.approx([-0.3622301, -1.5622301], abs=1e-6)
    g = torch.Generator().manual_seed(5)
    scores, noise = torch.randn(4, 6, generator=g), gumbel_noise((4, 6), generator=g)
    chosen = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(4)])
    got = paper_literal_logp(scores, noise, chosen, 0.3)
    for row in range(4):
        expected = paper_literal_reference(scores[row].tolist(), noise[row].tolist(), tuple(chosen[row].tolist()), 0.3)
        assert got[row].tolist() == pytest.approx(expected, abs=1e-5)


def test_log_probs_against_brute_force_enumeration_of_every_ordered_subset() -> None:
    """K = 5, M = 3: all 60 ordered selections. Plackett–Luce log-probs are exact (they sum to 1);
    the paper's estimator, without noise, agrees on the first pick only and is no distribution."""
    k, m, tau = 5, 3, 0.7
    scores = [0.9, -0.4, 0.3, 1.6, -1.1]
    logits = [s / tau for s in scores]
    orders = list(itertools.permutations(range(k), m))
    chosen = torch.tensor(orders)
    batch = torch.tensor(scores).expand(len(orders), k)
    pl = plackett_luce_logp(batch, chosen, tau)
    exact = [pl_probability(logits, o) for o in orders]
    assert pl.sum(-1).exp().tolist() == pytest.approx(exact, rel=1e-5)
    assert sum(exact) == pytest.approx(1.0, abs=1e-12)
    literal = paper_literal_logp(batch, torch.zeros(len(orders), k), chosen, tau)
    torch.testing.assert_close(literal[:, 0], pl[:, 0])
    assert not torch.allclose(literal[:, 1:], pl[:, 1:])  # no renormalisation after a pick
    assert literal.sum(-1).exp().sum().item() < 0.5  # its "probabilities" of the orderings do not sum to 1


def test_gumbel_noise_is_finite_and_standard() -> None:
    g = gumbel_noise((200_000,), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(g).all()
    assert g.mean().item() == pytest.approx(0.5772, abs=0.01)  # Euler–Mascheroni
    assert g.var().item() == pytest.approx(math.pi**2 / 6, abs=0.03)
    same = gumbel_noise((200_000,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(g, same)


def test_gumbel_noise_survives_extreme_uniforms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor([0.0, 1.0, 0.5]))
    g = gumbel_noise((3,))
    assert torch.isfinite(g).all()


def test_sampling_is_seeded() -> None:
    scores = torch.randn(50, 10)
    a, na = gumbel_top_m(scores, 4, 0.5, generator=torch.Generator().manual_seed(9))
    b, nb = gumbel_top_m(scores, 4, 0.5, generator=torch.Generator().manual_seed(9))
    c, _ = gumbel_top_m(scores, 4, 0.5, generator=torch.Generator().manual_seed(10))
    assert torch.equal(a, b) and torch.equal(na, nb)
    assert not torch.equal(a, c)


def test_plackett_luce_logp_keeps_float64_scores_in_float64() -> None:
    """A float64 caller gets float64 log-probabilities (not a silent float32 cast), equal to the loop's."""
    scores = torch.randn(2, 7, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * 30
    chosen = torch.tensor([[6, 2, 0], [1, 4, -1]])
    got = plackett_luce_logp(scores, chosen, 0.01)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, naive_pl_logp(scores, chosen, 0.01), rtol=0, atol=1e-12)
    assert not torch.equal(got, plackett_luce_logp(scores.float(), chosen, 0.01).double())  # τ=0.01: float32 rounds
