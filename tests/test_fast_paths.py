"""The per-turn fast paths equal the plain formulations they replace.

- The learner's update writes the d×d gradients into kept buffers from the taps' gradients
  (`Learner._backward`, `ResidualLinearReranker.weight_grads`) instead of autograd allocating them:
  the same weights after many updates as `loss.backward()`.
- `plackett_luce_picks_logp`, the one Plackett–Luce log-probability (the kernels' reference and the
  learner), computes the M normalisers from one masked `[M, K]` block; the plain formulation is a
  loop over the picks.
- The learner pads rows with fewer picks with -1 (scored 0) where it padded with repeats of pick 0
  and zeroed them afterwards: the same weights, update after update.
- The `[M, K]` block of available candidates is built from the picks' ranks (one scatter), not
  one-hot rows and a cumsum: the same values and gradients bit for bit, `complete=True` too.
- `select` scores full candidate rows in place (`rerank_rows`) instead of gathering them through
  the dispatched reference: the same picks, scores, log μ and noise bit for bit.
- `optimizer_step` calls fused Adam's kernel without `Optimizer.step`'s wrappers: the same weights
  and states bit for bit.
"""

from __future__ import annotations

import logging

import pytest
import torch
from plackett_luce_helpers import naive_pl_logp
from rmm.kernels.reference import (
    picks_logp_of_logits,
    rerank_reference,
    rerank_rows,
)
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

import rmm.policy.learner as learner_module
import rmm.policy.optimizer as optimizer_module
import rmm.policy.reranker as reranker_module
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.optimizer import OptimizerStepError, _direct_fused_adam, optimizer_step
from rmm.policy.reranker import PolicyTaps, ResidualLinearReranker
from rmm.policy.rewarded import RewardedSelection
from rmm.types import Candidates, Selection

D = 24


class PlainBackwardLearner(Learner):
    """The update as it was: scored through `policy_scores`, autograd allocates the weight gradients."""

    def loss(self, batch: list[RewardedSelection], taps: list[PolicyTaps] | None = None) -> Tensor:
        return super().loss(batch)  # no taps: scored through `policy_scores`

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


# ---- the optimizer step ----------------------------------------------------------------------------
def _two_groups(seed: int, fused: bool = True, sgd: bool = False, **adam: object
                ) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(D, D, generator=gen)) for _ in range(2)]
    params.append(torch.nn.Parameter(torch.tensor(0.3)))
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}]
    opt = torch.optim.SGD(groups, lr=3e-4) if sgd else torch.optim.Adam(groups, lr=3e-4, fused=fused, **adam)
    return params, opt


def _step_both(ours: list[torch.nn.Parameter], opt: torch.optim.Optimizer, theirs: list[torch.nn.Parameter],
               ref: torch.optim.Optimizer, steps: int = 12) -> None:
    """`optimizer_step(opt)` against `ref.step()` on the same gradients, one step without a gradient
    for the scalar, one with large gradients."""
    gen = torch.Generator().manual_seed(1)
    for it in range(steps):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen) * (10.0 if it == 3 else 1.0)
            b.grad = a.grad.clone()
        if it == 5:
            ours[2].grad = theirs[2].grad = None
        optimizer_step(opt)
        ref.step()


def _assert_same(ours: list[torch.nn.Parameter], opt: torch.optim.Optimizer, theirs: list[torch.nn.Parameter],
                 ref: torch.optim.Optimizer) -> None:
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    for mine, reference in zip(opt.state.values(), ref.state.values()):
        assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in mine)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_optimizer_step_is_step_bit_for_bit(weight_decay: float) -> None:
    """`optimizer_step` (fused Adam's kernel called directly, L2 weight decay passed on) leaves the weights
    and states `step()` does, including a step where one parameter has no gradient."""
    (ours, opt), (theirs, ref) = (_two_groups(0, weight_decay=weight_decay) for _ in range(2))
    calls = {"kernel": 0}
    real = optimizer_module._fused_adam_kernel

    def counting(*args: object) -> None:
        calls["kernel"] += 1
        real(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optimizer_module, "_fused_adam_kernel", counting)
        _step_both(ours, opt, theirs, ref)
    assert calls["kernel"] > 12  # the direct path ran, from the second step on (two groups each)
    _assert_same(ours, opt, theirs, ref)
    assert _direct_fused_adam(opt) is not None


def _instance_step(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A `step` patched onto the instance, as LRScheduler and profiler/accelerate wrappers do."""
    opt.calls = 0
    plain = opt.step

    def step(*args: object, **kwargs: object) -> object:
        opt.calls += 1
        return plain(*args, **kwargs)

    opt.step = step
    return opt


_REFUSED = {
    "foreach": lambda: _two_groups(0, fused=False)[1],
    "sgd": lambda: _two_groups(0, sgd=True)[1],
    "amsgrad": lambda: _two_groups(0, amsgrad=True)[1],
    "maximize": lambda: _two_groups(0, maximize=True)[1],
    "decoupled_weight_decay": lambda: _two_groups(0, decoupled_weight_decay=True, weight_decay=0.01)[1],
    "tensor_lr": lambda: _set_group(_two_groups(0)[1], "lr", torch.tensor(3e-4)),
    "capturable": lambda: _set_group(_two_groups(0)[1], "capturable", True),
    "pre_hook": lambda: _hook(_two_groups(0)[1], "register_step_pre_hook"),
    "post_hook": lambda: _hook(_two_groups(0)[1], "register_step_post_hook"),
    "instance_step": lambda: _instance_step(_two_groups(0)[1]),
}


def _set_group(opt: torch.optim.Optimizer, flag: str, value: object) -> torch.optim.Optimizer:
    for group in opt.param_groups:
        group[flag] = value
    return opt


def _hook(opt: torch.optim.Optimizer, register: str) -> torch.optim.Optimizer:
    opt.calls = 0

    def count(*_: object) -> None:
        opt.calls += 1

    getattr(opt, register)(count)
    return opt


@pytest.mark.parametrize("kind", sorted(_REFUSED))
def test_optimizer_step_refuses_the_direct_path_where_step_does_more(kind: str) -> None:
    """Every variant the direct call would get wrong goes through `step()` (and a hook or an instance-level
    `step` runs on every `optimizer_step`), once the states exist as well as before."""
    opt = _REFUSED[kind]()
    for p in (p for group in opt.param_groups for p in group["params"]):
        p.grad = torch.ones_like(p)
    for _ in range(3):
        optimizer_step(opt)
        assert _direct_fused_adam(opt) is None
    assert all(opt.state[p] for group in opt.param_groups for p in group["params"]) or kind == "sgd"
    if kind in ("pre_hook", "post_hook", "instance_step"):
        assert opt.calls == 3


def test_optimizer_step_refuses_the_direct_path_under_a_global_hook() -> None:
    _, opt = _two_groups(0)
    for p in (p for group in opt.param_groups for p in group["params"]):
        p.grad = torch.ones_like(p)
    optimizer_step(opt)
    assert _direct_fused_adam(opt) is not None
    handle = register_optimizer_step_post_hook(lambda *_: None)
    try:
        assert _direct_fused_adam(opt) is None
    finally:
        handle.remove()
    assert _direct_fused_adam(opt) is not None


def test_a_failing_direct_kernel_leaves_what_step_does(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The kernel called directly raises: its step count is put back, `step()` makes the step instead (the
    same weights, states and counts bit for bit), and every later step goes through `step()`, logged once."""
    monkeypatch.setattr(optimizer_module, "_direct_disabled", False)
    calls = {"kernel": 0}

    def broken(*_: object) -> None:
        calls["kernel"] += 1
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(optimizer_module, "_fused_adam_kernel", broken)
    (ours, opt), (theirs, ref) = (_two_groups(0) for _ in range(2))
    with caplog.at_level(logging.WARNING, logger=optimizer_module.__name__):
        _step_both(ours, opt, theirs, ref)
    assert calls["kernel"] == 1  # tried once (the second step: the first makes the states), then step()
    assert optimizer_module._direct_disabled and len(caplog.records) == 1
    _assert_same(ours, opt, theirs, ref)
    assert [float(s["step"]) for s in opt.state.values()] == [12.0, 12.0, 11.0]


def test_a_kernel_failing_after_the_first_group_raises_optimizer_step_error_and_still_bumps_versions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Group 0 stepped, group 1's kernel refused: the part-applied step is a dedicated error (a learner
    must stop, not set the feedback row aside) and every stepped weight's version counter moved."""
    monkeypatch.setattr(optimizer_module, "_direct_disabled", False)
    real = optimizer_module._fused_adam_kernel
    calls = {"kernel": 0}

    def fails_on_group_1(args: tuple, kwargs: dict) -> None:
        calls["kernel"] += 1
        if calls["kernel"] == 2:
            raise RuntimeError("kernel refused group 1")
        real(args, kwargs)

    ours, opt = _two_groups(0)
    for p in ours:
        p.grad = torch.ones_like(p)
    optimizer_step(opt)  # makes the states through step(): the next call goes direct
    monkeypatch.setattr(optimizer_module, "_fused_adam_kernel", fails_on_group_1)
    before = [p._version for p in ours]
    with pytest.raises(OptimizerStepError, match="parameter group 1"):
        optimizer_step(opt)
    assert calls["kernel"] == 2
    assert all(after > was for after, was in zip((p._version for p in ours), before))
    assert issubclass(OptimizerStepError, RuntimeError)


def test_optimizer_step_moves_the_version_counters_fused_adam_leaves() -> None:
    """torch's fused Adam writes the weights without moving `_version`; `optimizer_step` moves it, so a
    cache keyed on it (the reranker's folded query) sees every step."""
    (ours, opt), (theirs, ref) = (_two_groups(0) for _ in range(2))
    for a, b in zip(ours, theirs):
        a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    before = [p._version for p in ours]
    for _ in range(2):  # the first through step() (it makes the states), the second direct
        ref.step()
        optimizer_step(opt)
    assert [p._version for p in theirs] == before  # why optimizer_step bumps them
    assert all(after >= was + 2 for after, was in zip((p._version for p in ours), before))


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
