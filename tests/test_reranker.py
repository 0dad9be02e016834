"""Residual-linear reranker: Eq. 1, the folded inference path, and Top-M selection."""

from __future__ import annotations

import math

import pytest
import torch

from rmm.errors import DimensionMismatchError
from rmm.policy.optimizer import make_optimizer
from rmm.policy.recipes import LearnerConfig
from rmm.policy.reranker import ResidualLinearReranker
from rmm.policy.sampling import plackett_luce_logp
from rmm.types import Candidates

DIM = 12


def make_candidates(k: int, dim: int = DIM, seed: int = 0, query: str = "q") -> Candidates:
    """Dot-product retrieval output in shuffled order (retriever_scores = q·m)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(dim, generator=gen)
    m = torch.randn(k, dim, generator=gen)
    return Candidates(query, [f"{query}-{i}" for i in range(k)], m @ q, m, q, user_id="u")


def randomise(reranker: ResidualLinearReranker, seed: int = 0, scale: float = 0.3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        reranker.W_q.weight.copy_(torch.randn(reranker.dim, reranker.dim, generator=gen) * scale)
        reranker.W_m.weight.copy_(torch.randn(reranker.dim, reranker.dim, generator=gen) * scale)


def test_untrained_reranker_reproduces_retriever_order() -> None:
    reranker = ResidualLinearReranker(DIM)
    cands = [make_candidates(20, seed=s) for s in range(5)]
    for sel, c in zip(reranker.select(cands, 5), cands):
        expected = torch.argsort(c.retriever_scores, descending=True)[:5].tolist()
        assert sel.chosen == expected
        torch.testing.assert_close(sel.scores, c.retriever_scores)
        assert sel.logp is None and sel.noise is None and not sel.explore
        assert sel.memory_ids == [c.memory_ids[i] for i in expected]


def test_folded_query_matrix_equals_plain_form() -> None:
    reranker = ResidualLinearReranker(DIM)
    randomise(reranker)
    q = torch.randn(4, DIM)
    m = torch.randn(4, 9, DIM)
    plain = reranker(q, m)
    torch.testing.assert_close(reranker.fast_scores(q, m), plain, rtol=1e-4, atol=1e-4)
    eye = torch.eye(DIM)
    a = (eye + reranker.W_q.weight).T @ (eye + reranker.W_m.weight)
    torch.testing.assert_close(reranker.query_matrix(), a)
    torch.testing.assert_close(((q @ a).unsqueeze(1) * m).sum(-1), plain, rtol=1e-4, atol=1e-4)
    # The transposed convention would be wrong for non-symmetric weights.
    wrong = (eye + reranker.W_m.weight).T @ (eye + reranker.W_q.weight)
    assert not torch.allclose(((q @ wrong).unsqueeze(1) * m).sum(-1), plain, atol=1e-2)


def test_folded_cache_follows_weight_changes() -> None:
    reranker = ResidualLinearReranker(DIM)
    q, m = torch.randn(2, DIM), torch.randn(2, 5, DIM)
    before = reranker.fast_scores(q, m)
    with torch.no_grad():
        reranker.W_q.weight.add_(0.5)  # in-place: bumps _version
    after = reranker.fast_scores(q, m)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, reranker(q, m).detach(), rtol=1e-4, atol=1e-4)
    reranker.W_m.weight.data = torch.randn(DIM, DIM)  # swapped storage
    torch.testing.assert_close(reranker.fast_scores(q, m), reranker(q, m).detach(), rtol=1e-4, atol=1e-4)
    opt = torch.optim.SGD(reranker.parameters(), lr=0.1)
    reranker(q, m).sum().backward()
    opt.step()
    torch.testing.assert_close(reranker.fast_scores(q, m), reranker(q, m).detach(), rtol=1e-4, atol=1e-4)
    reranker.invalidate()
    torch.testing.assert_close(reranker.fast_scores(q, m), reranker(q, m).detach(), rtol=1e-4, atol=1e-4)


def test_folded_cache_follows_a_fused_adam_step_outside_the_learner() -> None:
    """torch's fused Adam writes the weights without moving `_version`; `make_optimizer`'s step post-hook
    moves it, so after a plain `opt.step()` (no `Learner.update`, so no `invalidate()`) the next select
    scores with the new weights. A fused Adam made elsewhere needs `invalidate()`, as the cache's comment
    says."""
    reranker = ResidualLinearReranker(DIM, lexical_feature=True)
    opt = make_optimizer(reranker, LearnerConfig(lr=0.05))
    assert type(opt) is torch.optim.Adam and opt.param_groups[0].get("fused")
    cands = [make_candidates(6, seed=s) for s in range(DIM)]  # DIM query rows: past DIM/2, the query folds
    reranker.select(cands, 3)
    assert reranker._folded is not None
    for step in range(2):
        for p in reranker.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
        opt.step()
        for sel, c in zip(reranker.select(cands, 3), cands):
            plain = reranker(c.query_embedding[None], c.embeddings[None])[0].detach()
            torch.testing.assert_close(sel.scores, plain, rtol=1e-4, atol=1e-4)
        assert reranker._folded is not None  # refolded with the new weights, not dropped
    own = torch.optim.Adam(reranker.parameters(), lr=0.05, fused=True)
    versions = [p._version for p in reranker.parameters()]
    for p in reranker.parameters():
        p.grad = torch.ones_like(p)
    own.step()
    assert [p._version for p in reranker.parameters()] == versions  # why make_optimizer hooks the step
    reranker.invalidate()
    torch.testing.assert_close(reranker.select(cands[:1], 3)[0].scores,
                               reranker(cands[0].query_embedding[None], cands[0].embeddings[None])[0].detach(),
                               rtol=1e-4, atol=1e-4)


def test_gradients_reach_only_the_reranker_weights() -> None:
    reranker = ResidualLinearReranker(DIM)
    q, m = torch.randn(3, DIM), torch.randn(3, 6, DIM)
    scores = reranker(q, m)
    assert scores.requires_grad
    logp = plackett_luce_logp(scores, torch.tensor([[0, 1], [2, 3], [4, 5]]), 0.5)
    logp.sum().backward()
    for weight in (reranker.W_q.weight, reranker.W_m.weight):
        assert weight.grad is not None and weight.grad.abs().sum() > 0
    assert q.grad is None and m.grad is None
    assert q.is_leaf and not q.requires_grad and m.is_leaf and not m.requires_grad
    assert [n for n, _ in reranker.named_parameters()] == ["W_q.weight", "W_m.weight"]
    assert reranker.fast_scores(q, m).requires_grad is False


def test_select_ragged_and_empty_candidate_lists() -> None:
    reranker = ResidualLinearReranker(DIM)
    randomise(reranker, seed=1)
    cands = [make_candidates(20, seed=1), make_candidates(3, seed=2), make_candidates(0, seed=3)]
    for explore in (False, True):
        sels = reranker.select(cands, 5, explore=explore, generator=torch.Generator().manual_seed(0))
        assert [len(s.chosen) for s in sels] == [5, 3, 0]
        assert [s.scores.shape[0] for s in sels] == [20, 3, 0]
        for sel, c in zip(sels, cands):
            assert sel.candidates is c and sel.explore is explore
            assert len(set(sel.chosen)) == len(sel.chosen) and all(0 <= i < len(c) for i in sel.chosen)
            expected = reranker.fast_scores(c.query_embedding[None], c.embeddings[None])[0]
            torch.testing.assert_close(sel.scores, expected)
            if explore:
                assert sel.logp is not None and sel.logp.shape == (len(sel.chosen),)
                assert sel.noise is not None and sel.noise.shape == (len(c),)
                assert torch.isfinite(sel.logp).all()
            else:
                assert sel.chosen == torch.argsort(sel.scores, descending=True)[: len(sel.chosen)].tolist()
    # The short list's picks, ragged or alone, are the same greedy order.
    alone = reranker.select([cands[1]], 5)[0]
    assert alone.chosen == reranker.select(cands, 5)[1].chosen


def test_explore_logp_is_plackett_luce_and_seeded() -> None:
    reranker = ResidualLinearReranker(DIM)
    randomise(reranker, seed=2)
    cands = [make_candidates(20, seed=s) for s in range(3)]
    a = reranker.select(cands, 5, tau=0.5, explore=True, generator=torch.Generator().manual_seed(5))
    b = reranker.select(cands, 5, tau=0.5, explore=True, generator=torch.Generator().manual_seed(5))
    assert [s.chosen for s in a] == [s.chosen for s in b]
    for sel in a:
        expected = plackett_luce_logp(sel.scores[None], torch.tensor([sel.chosen]), 0.5)[0]
        torch.testing.assert_close(sel.logp, expected)
    many = reranker.select(cands * 30, 5, explore=True, generator=torch.Generator().manual_seed(6))
    assert len({tuple(s.chosen) for s in many}) > 3  # exploration actually varies the picks


def test_select_refuses_bad_input() -> None:
    reranker = ResidualLinearReranker(DIM)
    assert reranker.select([], 5) == []
    with pytest.raises(DimensionMismatchError):
        reranker.select([make_candidates(5, dim=DIM + 1)], 2)
    bm25 = Candidates("q", ["a", "b"], torch.tensor([2.0, 1.0]))
    with pytest.raises(ValueError, match="embeddings"):
        reranker.select([bm25], 1)
    with pytest.raises(ValueError, match="m must be"):
        reranker.select([make_candidates(5)], -1)
    (none,) = reranker.select([make_candidates(5)], 0, explore=True)  # m clipped to an empty bank
    assert none.chosen == [] and none.scores.shape == (5,) and none.logp.shape == (0,)
    with pytest.raises(ValueError, match="tau"):
        reranker.select([make_candidates(5)], 2, tau=0.0, explore=True)
    with pytest.raises(ValueError):
        ResidualLinearReranker(0)


def test_a_per_user_reranker_holds_its_two_matrices_and_nothing_more_until_it_has_served() -> None:
    """A server builds a reranker (and a learner) for every user it sees: until used, one holds its two
    d×d weights only — no buffers, no folded `A` (one more d×d, built after d/2 query rows), no Adam
    moments (two more per weight, made at the first step)."""
    from rmm.policy.learner import Learner

    reranker = ResidualLinearReranker(DIM)
    held = [t for t in (*reranker.parameters(), *reranker.buffers())]
    assert sum(t.numel() for t in held) == 2 * DIM * DIM and reranker._folded is None
    learner = Learner(reranker, LearnerConfig(batch_size=2))
    assert not learner.optimizer.state
    for seed in range(DIM // 2 - 1):  # fewer query rows than folding takes
        reranker.select([make_candidates(6, seed=seed)], 3)
    assert reranker._folded is None
    reranker.select([make_candidates(6, seed=DIM)], 3)
    assert reranker._folded is not None and reranker._folded[1].shape == (DIM, DIM)


def test_policy_scores_equal_forward_in_values_and_gradients() -> None:
    reranker = ResidualLinearReranker(DIM)
    randomise(reranker, seed=4)
    q, m = torch.randn(3, DIM), torch.randn(3, 7, DIM)
    weights = torch.randn(3, 7)
    plain = reranker(q, m)
    (plain * weights).sum().backward()
    plain_grads = [p.grad.clone() for p in reranker.parameters()]
    reranker.zero_grad()
    policy = reranker.policy_scores(q, m)
    torch.testing.assert_close(policy, plain, rtol=1e-4, atol=1e-4)
    (policy * weights).sum().backward()
    for got, expected in zip((p.grad for p in reranker.parameters()), plain_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_query_transform_folds_only_once_weights_hold_still() -> None:
    reranker = ResidualLinearReranker(DIM)
    randomise(reranker, seed=5)
    q, m = torch.randn(1, DIM), torch.randn(1, 4, DIM)
    expected = reranker(q, m).detach()
    for _ in range(DIM // 2 - 1):  # unfolded path: two d×d products per query
        torch.testing.assert_close(reranker.fast_scores(q, m), expected, rtol=1e-4, atol=1e-4)
    assert reranker._folded is None
    torch.testing.assert_close(reranker.fast_scores(q, m), expected, rtol=1e-4, atol=1e-4)
    assert reranker._folded is not None  # d/2 rows served by these weights: A is built
    torch.testing.assert_close(reranker.fast_scores(q, m), expected, rtol=1e-4, atol=1e-4)
    big = torch.randn(DIM, DIM)  # a batch as large as the fold's cost folds at once
    reranker.invalidate()
    torch.testing.assert_close(reranker.transform_queries(big), big @ reranker.query_matrix(), rtol=1e-4, atol=1e-4)
    assert reranker._folded is not None


# ---- exclusion (MemR³'s mask): masked before the Gumbel top-M ----------------------------------
def _brute_force_logp(logits: list[float], order: list[int]) -> float:
    """log P(order) under Plackett–Luce(logits), written out pick by pick."""
    remaining, total = list(range(len(logits))), 0.0
    for item in order:
        total += logits[item] - math.log(sum(math.exp(logits[i]) for i in remaining))
        remaining.remove(item)
    return total


def test_excluded_candidates_are_never_picked_and_logp_is_over_the_rest() -> None:
    reranker = ResidualLinearReranker(DIM)
    randomise(reranker, seed=7)
    cands = [make_candidates(10, seed=s, query=f"q{s}") for s in range(3)]
    exclude = [{"q0-0", "q0-3", "q0-9", "elsewhere"}, set(), {f"q2-{i}" for i in range(8)}]
    full_scores = [reranker.fast_scores(c.query_embedding[None], c.embeddings[None])[0] for c in cands]
    for draw in range(20):
        sels = reranker.select(cands, 4, tau=0.5, explore=True, exclude=exclude,
                               generator=torch.Generator().manual_seed(draw))
        assert [len(s.chosen) for s in sels] == [4, 4, 2]  # row 2 has only two candidates left
        for sel, c, excluded, scores in zip(sels, cands, exclude, full_scores):
            assert not set(sel.memory_ids) & excluded
            # the Selection holds only what the sample drew from, so the learner's recomputation is right
            assert sel.candidates.memory_ids == [i for i in c.memory_ids if i not in excluded]
            kept = [c.memory_ids.index(i) for i in sel.candidates.memory_ids]
            torch.testing.assert_close(sel.scores, scores[kept])
            torch.testing.assert_close(sel.candidates.embeddings, c.embeddings[kept])
            assert sel.noise is not None and sel.noise.shape == (len(kept),)
            logits = (sel.scores / 0.5).tolist()
            expected = [_brute_force_logp(logits, sel.chosen[: j + 1]) - _brute_force_logp(logits, sel.chosen[:j])
                        for j in range(len(sel.chosen))]
            torch.testing.assert_close(sel.logp, torch.tensor(expected), rtol=1e-5, atol=1e-5)
            # the learner's path: policy scores of the kept candidates under the same weights
            policy = reranker.policy_scores(sel.candidates.query_embedding[None], sel.candidates.embeddings[None])
            relearned = plackett_luce_logp(policy, torch.tensor([sel.chosen]), 0.5)[0]
            torch.testing.assert_close(sel.logp, relearned.detach(), rtol=1e-4, atol=1e-4)
    assert reranker.select(cands, 4, explore=True, exclude=exclude)[1].candidates is cands[1]  # nothing hit: as is


def test_excluded_sampling_is_plackett_luce_over_the_remaining_candidates() -> None:
    reranker = ResidualLinearReranker(4)  # untrained: scores are q·m
    q = torch.tensor([1.0, 0.0, 0.0, 0.0])
    m = torch.tensor([[1.2, 0, 0, 0], [0.9, 0, 0, 0], [0.6, 0, 0, 0], [0.2, 0, 0, 0], [-0.3, 0, 0, 0]])
    cands = Candidates("q", ["a", "b", "c", "d", "e"], m @ q, m, q)
    draws = 3000
    sels = reranker.select([cands] * draws, 2, tau=0.5, explore=True, exclude=[{"a", "c"}] * draws,
                           generator=torch.Generator().manual_seed(11))
    counts: dict[tuple[str, ...], int] = {}
    for sel in sels:
        counts[tuple(sel.memory_ids)] = counts.get(tuple(sel.memory_ids), 0) + 1
    logits = [0.9 / 0.5, 0.2 / 0.5, -0.3 / 0.5]  # b, d, e
    names = ["b", "d", "e"]
    expected = {(names[i], names[j]): math.exp(_brute_force_logp(logits, [i, j]))
                for i in range(3) for j in range(3) if i != j}
    assert set(counts) <= set(expected)
    for order, p in expected.items():
        assert abs(counts.get(order, 0) / draws - p) < 0.025, (order, counts.get(order, 0) / draws, p)


def test_greedy_exclusion_and_bad_exclude_arguments() -> None:
    reranker = ResidualLinearReranker(DIM)
    c = make_candidates(6, seed=3)
    order = torch.argsort(c.retriever_scores, descending=True).tolist()
    (sel,) = reranker.select([c], 3, exclude=[{c.memory_ids[order[0]]}])
    assert sel.memory_ids == [c.memory_ids[i] for i in order[1:4]] and sel.logp is None
    (none,) = reranker.select([c], 3, explore=True, exclude=[set(c.memory_ids)])
    assert none.chosen == [] and len(none.candidates) == 0 and none.logp.shape == (0,)
    with pytest.raises(ValueError, match="one collection"):
        reranker.select([c], 3, exclude=[set(), set()])
    with pytest.raises(TypeError, match="collection of memory ids"):
        reranker.select([c], 3, exclude=["q-1"])
