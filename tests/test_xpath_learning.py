"""The Semantic XPath controller's reranker learns the XPath weight (issue 30 item 5).

`XPathFrontend` asks the agent's learners for the ``xpath_weight`` candidate feature
(`LearnerRegistry.request_features` → `LearnerConfig.extra_features`): the reranker weighs it after
the hybrid first stage's `CANDIDATE_FEATURES`, from 0. Rewarded selections whose cited leaf is the one
with the highest XPath weight move the weight above 0; the checkpoint round-trips; a checkpoint saved
before (with the first stage's features only, or none: format 4) gains the feature at 0 with its
ranking, its Adam state and its buffered records kept; candidate lists carrying only the leading
features (the hybrid first stage's) count as zeros in the rest, other names are still refused; `rmm
serve` learns it when its `learner` section names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_locomo
from fakes import BagOfWordsEncoder

from rmm.data.locomo import load_locomo
from rmm.errors import CheckpointError, FeatureMismatchError
from rmm.frontends.agent import Agent
from rmm.frontends.xpath import XPATH_FEATURE, XPathConfig, XPathFrontend, best_memories
from rmm.frontends.xpath_trace import XPathTrace
from rmm.llm.base import LLM, Usage
from rmm.memory.bank import MemoryBank
from rmm.memory.features import CANDIDATE_FEATURES
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.registry import LearnerRegistry
from rmm.policy.reranker import ResidualLinearReranker
from rmm.reflection.xpath_tree import build_locomo_tree
from rmm.types import Candidates, Dataset

EXTENDED = (*CANDIDATE_FEATURES, XPATH_FEATURE)
D, K, F = 6, 5, len(CANDIDATE_FEATURES)


class XPathCiter(LLM):
    """Cites the shown memory with the highest XPath weight (`weights`: memory id → weight, set per question;
    `sign=-1`: the lowest)."""

    reads_shown = True

    def __init__(self, sign: float = 1.0) -> None:
        super().__init__("scripted-xpath-citer")
        self.weights: dict[str, float] = {}
        self.sign = sign
        self.cited: list[str] = []

    def _generate(self, batch, *, json_schema=None, max_tokens=512, temperature=0.0, shown=None):
        out = []
        for memories in shown or [[] for _ in batch]:
            if not memories:
                out.append("I don't know. [NO_CITE]")
                continue
            best = max(range(len(memories)), key=lambda i: self.sign * self.weights.get(memories[i].id, 0.0))
            self.cited.append(memories[best].id)
            out.append(f"From memory. [{best}]")
        self._record(Usage(calls=len(batch), prompt_tokens=10, completion_tokens=5))
        return out


@pytest.fixture
def dataset(tmp_path: Path) -> Dataset:
    return load_locomo(write_tiny_locomo(tmp_path / "locomo10.json"))


@pytest.fixture
def bank(tmp_path: Path, dataset: Dataset):
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as b:
        for user in dataset.users:
            build_locomo_tree(b, user, dataset.sessions[user])
        yield b


def config() -> LearnerConfig:
    return LearnerConfig(lr=0.05, tau=0.5, batch_size=2, baseline="mean")


def xpath_agent(bank: MemoryBank, llm: LLM, folder: Path, *, learn: bool = True) -> tuple[Agent, XPathFrontend]:
    agent = Agent(bank, llm, k=10, m=3, learn=learn, checkpoint_dir=folder, checkpoint_every=0,
                  learner_config=config())
    return agent, XPathFrontend(agent, XPathConfig(query_policy="template", leaves=8, m=3))


def train(frontend: XPathFrontend, citer: XPathCiter, dataset: Dataset, rounds: int = 3) -> int:
    """Ask every question `rounds` times, the citer citing the best-XPath-weight shown leaf; returns the count."""
    asked = 0
    for _ in range(rounds):
        for q in dataset.questions:
            execution = frontend.query(q.user_id, q.text, XPathTrace(question=q.text, user=q.user_id, scorer="cosine"))
            assert execution is not None
            citer.weights = dict(zip(*best_memories(execution, 8)))
            frontend.respond(q.user_id, q.text, remember=False)
            asked += 1
    return asked


def xpath_weight(learner: Learner) -> float:
    names = learner.reranker.feature_names
    return float(learner.reranker.feature_weight.detach()[names.index(XPATH_FEATURE)])


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_controller_learns_the_xpath_weight_from_citations_and_it_round_trips(
        tmp_path: Path, bank: MemoryBank, dataset: Dataset, sign: float) -> None:
    """Citing the best-weighted shown leaf moves the weight above 0; citing the worst, below."""
    citer = XPathCiter(sign)
    agent, frontend = xpath_agent(bank, citer, tmp_path / "ckpt")
    learner = agent.learner(dataset.users[0])
    assert learner.reranker.feature_names == EXTENDED and agent.learner_config.extra_features == (XPATH_FEATURE,)
    assert xpath_weight(learner) == 0.0  # untrained: the tree only chooses the K candidates
    asked = train(frontend, citer, dataset)
    learner.flush()
    assert learner.stats.records == asked and learner.stats.step >= asked // 2
    assert len(set(citer.cited)) > 1
    learned = xpath_weight(learner)
    assert sign * learned > 0.05, learned
    # the other features' columns were zeros in every record: their weights never moved
    assert torch.count_nonzero(learner.reranker.feature_weight.detach()[:F]) == 0
    agent.save()
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["feature_names"] == list(EXTENDED) and meta["config"]["extra_features"] == [XPATH_FEATURE]
    again, _ = xpath_agent(bank, XPathCiter(), tmp_path / "ckpt")
    loaded = again.learner(dataset.users[0])
    assert loaded.reranker.feature_names == EXTENDED and xpath_weight(loaded) == pytest.approx(learned)
    assert loaded.config.extra_features == (XPATH_FEATURE,) and loaded.stats.step == learner.stats.step
    # a run without the controller does not ask for the feature: dropping a learned weight is refused
    plain = Agent(bank, citer, k=10, m=3, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=0, learner_config=config())
    with pytest.raises(CheckpointError, match="weighs candidate features"):
        plain.learner(dataset.users[0])


def test_a_greedy_controller_learns_nothing(tmp_path: Path, bank: MemoryBank, dataset: Dataset) -> None:
    citer = XPathCiter()
    agent, frontend = xpath_agent(bank, citer, tmp_path / "ckpt", learn=False)
    train(frontend, citer, dataset, rounds=1)
    learner = agent.learner(dataset.users[0])
    assert learner.stats.records == 0 and learner.stats.step == 0 and xpath_weight(learner) == 0.0


def featured(seed: int, k: int = K, names: tuple[str, ...] = CANDIDATE_FEATURES) -> Candidates:
    g = torch.Generator().manual_seed(seed)
    return Candidates(f"q{seed}", [f"m{i}" for i in range(k)], torch.zeros(k), torch.randn(k, D, generator=g),
                      torch.randn(D, generator=g), lexical=torch.rand(k, generator=g),
                      features=torch.rand(k, len(names), generator=g), feature_names=names)


def trained(features: tuple[str, ...], steps: int = 3, pending: int = 1) -> Learner:
    """A learner `steps` Adam steps in over first-stage candidates, with `pending` records buffered."""
    learner = Learner(ResidualLinearReranker(D, lexical_feature=True, feature_names=features), config())
    g = torch.Generator().manual_seed(3)
    for i in range(steps * learner.config.batch_size + pending):
        (sel,) = learner.select([featured(100 + i)], 2, generator=g)
        learner.record(sel, torch.tensor([1.0, -1.0]))
    assert learner.stats.step == steps and learner.pending == pending
    return learner


@pytest.mark.parametrize("version", [4, 5])
def test_an_older_checkpoint_gains_the_xpath_weight_at_zero(tmp_path: Path, version: int) -> None:
    """Saved by a run with the first stage's features (format 5) or before them (format 4): loaded by the
    XPath controller's registry it gains the missing weights at 0 — same ranking, Adam state kept — and the
    next save and start load it as saved."""
    saved_names = CANDIDATE_FEATURES if version == 5 else ()
    before = trained(saved_names)
    folder = before.save(tmp_path / "ckpt")
    if version == 4:
        meta = json.loads((folder / "meta.json").read_text())
        del meta["feature_names"]
        meta["format_version"] = 4
        (folder / "meta.json").write_text(json.dumps(meta))
    registry = LearnerRegistry(D, config(), root=folder)
    assert registry.request_features((XPATH_FEATURE,)) == []
    learner = registry.get()
    assert learner.reranker.feature_names == EXTENDED
    weights = learner.reranker.feature_weight.detach()
    if version == 5:
        assert torch.equal(weights[:F], before.reranker.feature_weight.detach()) and weights[F] == 0
        moments = learner.optimizer.state[learner.reranker.feature_weight]
        old = before.optimizer.state[before.reranker.feature_weight]
        assert torch.equal(moments["exp_avg"][:F], old["exp_avg"]) and moments["exp_avg"][F] == 0
        assert torch.equal(moments["exp_avg_sq"][:F], old["exp_avg_sq"]) and torch.equal(moments["step"], old["step"])
    else:
        assert torch.count_nonzero(weights) == 0
    # the first stage's candidates rank as before (zeros in the new column); the buffered record was widened
    batch = [featured(s) for s in range(3)]
    plain = [featured(s, names=()) for s in range(3)]
    for c in plain:
        c.features = None
    for a, b in zip(learner.reranker.select(batch, 3), before.reranker.select(batch if version == 5 else plain, 3)):
        assert a.chosen == b.chosen and torch.allclose(a.scores, b.scores)
    kept = learner._buffer[0].features  # a featureless reranker kept none (zeros at the update)
    assert learner.pending == 1 and (kept is None if version == 4 else kept.shape == (K, len(EXTENDED)))
    # XPath-like candidates (the new column set) are learned from, the widened record with them
    xpath = featured(7, names=EXTENDED)
    (sel,) = learner.select([xpath], 2, generator=torch.Generator().manual_seed(0))
    assert learner.record(sel, torch.tensor([1.0, -1.0])) is not None
    assert registry.save() == 1
    restarted = LearnerRegistry(D, config(), root=folder)
    restarted.request_features((XPATH_FEATURE,))
    assert restarted.get().reranker.feature_names == EXTENDED
    assert torch.equal(restarted.get().reranker.feature_weight.detach(), learner.reranker.feature_weight.detach())


def test_candidates_with_the_leading_features_count_as_zeros_in_the_rest() -> None:
    reranker = ResidualLinearReranker(D, lexical_feature=True, feature_names=EXTENDED)
    with torch.no_grad():
        reranker.feature_weight.copy_(torch.linspace(-1.0, 1.0, len(EXTENDED)))
    hybrid = featured(1)
    padded = featured(1)
    padded.features, padded.feature_names = torch.cat([hybrid.features, torch.zeros(K, 1)], -1), EXTENDED
    (a,), (b,) = reranker.select([hybrid], 3), reranker.select([padded], 3)
    assert a.chosen == b.chosen and torch.equal(a.scores, b.scores)
    learner = Learner(reranker, config())
    (sel,) = learner.select([hybrid], 2, generator=torch.Generator().manual_seed(0))
    learner.record(sel, torch.tensor([1.0, -1.0]))
    kept = learner._buffer[0].features
    assert kept.shape == (K, len(EXTENDED)) and torch.count_nonzero(kept[:, F]) == 0
    # other names — reordered, or more than the reranker weighs — are still refused, nothing kept
    for names in (tuple(reversed(EXTENDED)), (*EXTENDED, "other"), (XPATH_FEATURE,)):
        with pytest.raises(FeatureMismatchError):
            reranker.select([featured(2, names=names)], 2)
    (sel,) = learner.select([featured(3)], 2, generator=torch.Generator().manual_seed(0))
    sel.candidates.feature_names = CANDIDATE_FEATURES[::-1]
    with pytest.raises(FeatureMismatchError):
        learner.record(sel, torch.tensor([1.0, -1.0]))
    assert learner.pending == 1


def test_extra_features_are_checked_and_read_from_json_lists() -> None:
    assert LearnerConfig(extra_features=[XPATH_FEATURE]).extra_features == (XPATH_FEATURE,)
    for bad in ((XPATH_FEATURE, XPATH_FEATURE), ("",), (1,), XPATH_FEATURE):
        with pytest.raises(ValueError, match="extra_features"):
            LearnerConfig(extra_features=bad)
    # a name the first stage already computes is not weighed twice
    registry = LearnerRegistry(D, LearnerConfig(extra_features=("jaccard", XPATH_FEATURE)))
    assert registry.feature_names == EXTENDED
    alone = LearnerConfig(candidate_features=False, extra_features=(XPATH_FEATURE,))
    assert LearnerRegistry(D, alone).feature_names == (XPATH_FEATURE,)


def test_a_learner_loaded_before_the_request_keeps_its_terms_and_is_named(caplog: pytest.LogCaptureFixture) -> None:
    registry = LearnerRegistry(D, LearnerConfig())
    registry.get("early")
    assert registry.request_features((XPATH_FEATURE,)) == ["early"]
    assert registry.get("early").reranker.feature_names == CANDIDATE_FEATURES
    assert registry.get("late").reranker.feature_names == EXTENDED
    assert registry.request_features((XPATH_FEATURE,)) == ["early"]  # asking again adds nothing
    assert registry.config.extra_features == (XPATH_FEATURE,)


def test_the_server_learns_the_xpath_weight_when_its_learner_section_asks(tmp_path: Path) -> None:
    """`rmm serve` with ``learner: {extra_features: [xpath_weight]}`` (no serving code of its own): XPath
    slates carry the weight in its column, hybrid /v1/retrieve candidates (the leading features) still
    rank and learn, and feedback on XPath slates citing the best leaf moves the weight above 0."""
    from fastapi.testclient import TestClient
    from test_serve_hardening import A, make_app
    from test_serve_xpath import build, service_of, xpath

    app = make_app(tmp_path, None, retriever="hybrid", learner={"batch_size": 1, "extra_features": [XPATH_FEATURE]})
    with TestClient(app, raise_server_exceptions=False) as client:
        build(client)
        learner = service_of(client).learner("alpha")
        assert learner.reranker.feature_names == EXTENDED and xpath_weight(learner) == 0.0
        hit = client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": "hiking trip"}]}, headers=A)
        assert hit.status_code == 200, hit.text
        fed = client.post("/v1/feedback", json={"selection_id": hit.json()["results"][0]["selection_id"],
                                                "cited": [0]}, headers=A).json()
        assert fed["learned"] and xpath_weight(learner) == 0.0  # zeros in its column: the weight did not move
        for _ in range(6):
            slate = xpath(client, k=5, m=2, explore=True).json()
            weights = [m["retriever_score"] for m in slate["memories"]]
            best = max(range(len(weights)), key=weights.__getitem__)
            fed = client.post("/v1/feedback", json={"selection_id": slate["selection_id"], "cited": [best]},
                              headers=A).json()
            assert fed["learned"], fed
        assert xpath_weight(learner) > 0.0
