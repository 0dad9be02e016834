"""The simulated citer hits the configured precision/recall, is seeded, and speaks the format."""

from __future__ import annotations

import random

import pytest

from rmm.llm.simulated import SimulatedCiter
from rmm.policy.citations import parse_citations


def gold_patterns(n: int, seed: int = 0, shown: int = 5) -> list[list[bool]]:
    rng = random.Random(seed)
    return [[rng.random() < 0.3 for _ in range(shown)] for _ in range(n)]


@pytest.mark.parametrize(("precision", "recall"), [(0.876, 0.858), (0.6, 0.5), (1.0, 1.0)])
def test_empirical_precision_and_recall(precision: float, recall: float) -> None:
    citer = SimulatedCiter(precision=precision, recall=recall, seed=1)
    true_cites = false_cites = gold_shown = 0
    for hits in gold_patterns(20_000):
        cited = citer.cite(hits)
        true_cites += sum(hits[i] for i in cited)
        false_cites += sum(not hits[i] for i in cited)
        gold_shown += sum(hits)
    assert true_cites / gold_shown == pytest.approx(recall, abs=0.01)
    assert true_cites / (true_cites + false_cites) == pytest.approx(precision, abs=0.01)


def test_no_gold_shown_means_no_cites() -> None:
    citer = SimulatedCiter()
    assert all(citer.cite([False] * 5) == [] for _ in range(100))
    assert citer.cite([]) == []
    assert citer.respond([False, False]) == "[simulated answer] [NO_CITE]"


def test_false_cite_rate_is_capped() -> None:
    citer = SimulatedCiter(precision=0.1, recall=1.0)
    assert citer.false_cite_rate(n_gold=4, n_other=1) == 1.0
    assert citer.false_cite_rate(n_gold=0, n_other=5) == 0.0
    assert citer.false_cite_rate(n_gold=3, n_other=0) == 0.0
    assert SimulatedCiter(precision=0.5, recall=0.5).false_cite_rate(2, 4) == pytest.approx(0.25)


def test_seeded_and_repeatable() -> None:
    patterns = gold_patterns(200, seed=3)
    a = [SimulatedCiter(seed=5).cite(h) for h in patterns[:1]]
    first, second, other = SimulatedCiter(seed=5), SimulatedCiter(seed=5), SimulatedCiter(seed=6)
    run_a = [first.cite(h) for h in patterns]
    assert run_a[:1] == a
    assert run_a == [second.cite(h) for h in patterns]
    assert run_a != [other.cite(h) for h in patterns]
    first.reset()
    assert run_a == [first.cite(h) for h in patterns]


def test_respond_reads_back_through_the_parser() -> None:
    responder, citer = SimulatedCiter(seed=2), SimulatedCiter(seed=2)
    for hits in gold_patterns(300, seed=4):
        text = responder.respond(hits)
        assert text.startswith("[simulated answer]")
        expected = citer.cite(hits)
        parsed = parse_citations(text, len(hits))
        assert parsed.cited == expected
        assert parsed.no_cite == (not expected)
    assert SimulatedCiter.label == "simulated"


@pytest.mark.parametrize(
    "kwargs", [{"precision": 0.0}, {"precision": 1.1}, {"recall": -0.1}, {"recall": 1.5}, {"seed": "x"}]
)
def test_argument_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SimulatedCiter(**kwargs)
