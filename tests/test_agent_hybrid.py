"""The agent (and the front ends over it) with a hybrid first stage: BM25 + dense candidates that
carry the lexical feature, a bank that grows under BM25, and updates that learn from the feature
as it was recorded at sampling time."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder
from test_agent import ScriptedLLM, cite_mentions, facts_bank

from rmm.errors import RmmError
from rmm.frontends.agent import Agent
from rmm.memory.bank import MemoryBank
from rmm.memory.hybrid import HybridRetriever
from rmm.policy.learner import LearnerConfig
from rmm.types import Memory


@pytest.fixture
def bank(tmp_path: Path):
    with facts_bank(tmp_path / "bank") as b:
        yield b


def hybrid_agent(bank: MemoryBank, llm: ScriptedLLM, **kwargs) -> Agent:
    kwargs.setdefault("learner_config", LearnerConfig(batch_size=1, lexical_feature=True))
    return Agent(bank, llm, first_stage=HybridRetriever(bank), k=5, m=3, **kwargs)


def test_hybrid_candidates_carry_the_lexical_feature(bank: MemoryBank) -> None:
    agent = hybrid_agent(bank, ScriptedLLM(cite_mentions("cello")))
    response = agent.respond("ana", "Does Ana play the cello?")
    c = response.selection.candidates
    assert c.lexical is not None and c.lexical.shape == (len(c),) == (5,)
    assert float(c.lexical.min()) >= 0.0 and float(c.lexical.max()) <= 1.0
    assert c.memory_ids[0] == "f2" and float(c.lexical[0]) == 1.0  # first in both lists
    dense = Agent(bank, ScriptedLLM(cite_mentions("cello")), k=5, m=3, learner_config=LearnerConfig(batch_size=1))
    assert dense.respond("ana", "Does Ana play the cello?").selection.candidates.lexical is None


def test_a_memory_the_reflector_adds_later_is_found_lexically(bank: MemoryBank) -> None:
    extraction = '{"extracted_memories": [{"summary": "Ana is learning the theremin", "reference": [0]}]}'
    agent = hybrid_agent(bank, ScriptedLLM(cite_mentions("theremin"), extraction=extraction))
    first = agent.respond("ana", "Which instrument is Ana learning, the theremin?")  # BM25 built here
    assert all("theremin" not in m.text for m in first.shown)
    agent.respond("ana", "I started learning the theremin")
    (added,) = agent.end_session("ana")  # written into the dense bank by the reflector
    assert bank.get("ana", [added.id])[0].text == "Ana is learning the theremin"
    (lexical_only,) = agent.first_stage.lexical.search(["theremin"], "ana", 3)
    assert lexical_only.memory_ids == [added.id]  # BM25 rebuilt for the grown bank
    again = agent.respond("ana", "Which instrument is Ana learning, the theremin?")
    c = again.selection.candidates
    assert c.memory_ids[0] == added.id and float(c.lexical[0]) == 1.0  # first in BM25 and dense
    assert [m.id for m in again.cited] == [added.id]


def test_bm25_follows_merged_and_deleted_memories(bank: MemoryBank) -> None:
    hybrid = HybridRetriever(bank)
    assert hybrid.lexical.search(["theremin"], "ana", 3)[0].memory_ids == []
    merged = bank.update("ana", Memory(id="f2", user_id="ana", kind="topic", text="Ana plays cello and theremin"))
    assert hybrid.lexical.search(["theremin"], "ana", 3)[0].memory_ids == [merged.id]
    (c,) = hybrid.search(["theremin"], "ana", 3)
    assert c.memory_ids[0] == "f2" and float(c.lexical[0]) == 1.0
    bank.delete("ana", ["f2"])
    (c,) = hybrid.search(["theremin"], "ana", 3)
    assert "f2" not in c.memory_ids and hybrid.lexical.search(["theremin"], "ana", 3)[0].memory_ids == []


def test_the_update_learns_from_the_lexical_values_recorded_at_sampling(bank: MemoryBank) -> None:
    agent = hybrid_agent(bank, ScriptedLLM(cite_mentions("cello")))
    before = copy.deepcopy(agent.learner("ana"))
    w0 = before.reranker.lexical_weight.item()
    response = agent.respond("ana", "Does Ana play the cello in an orchestra?")
    rewards = torch.tensor(response.feedback.rewards)
    learned = agent.learner("ana").reranker
    assert agent.learner("ana").stats.updates == 1 and learned.lexical_weight.item() != w0
    replay = copy.deepcopy(before)  # the same selection fed to the learner as it was before the answer
    replay.record(response.selection, rewards)
    for name, value in learned.state_dict().items():
        assert torch.equal(value, replay.reranker.state_dict()[name]), name
    other = copy.deepcopy(response.selection)  # other lexical values → another update of w
    other.candidates.lexical = torch.zeros_like(other.candidates.lexical)
    changed = copy.deepcopy(before)
    changed.record(other, rewards)
    assert changed.reranker.lexical_weight.item() != learned.lexical_weight.item()


def test_the_hybrid_is_the_first_stage_and_the_bank_is_written_into(bank: MemoryBank) -> None:
    hybrid = HybridRetriever(bank)
    agent = Agent(bank, ScriptedLLM(cite_mentions("cello")), first_stage=hybrid, k=5, m=3)
    assert agent.bank is bank and agent.first_stage is hybrid
    assert agent.reflector.bank is bank
    over = Agent.over(hybrid, ScriptedLLM(cite_mentions("cello")), k=5, m=3)  # one argument, either kind
    assert over.bank is bank and over.first_stage is hybrid and over.reflector.bank is bank
    assert Agent.over(bank, ScriptedLLM(cite_mentions("cello")), k=5, m=3).first_stage is bank
    with pytest.raises(RmmError, match="first_stage="):  # a hybrid is never taken for the bank written into
        Agent(hybrid, ScriptedLLM(cite_mentions("cello")), k=5, m=3)


def test_a_first_stage_over_another_bank_is_refused(bank: MemoryBank, tmp_path: Path) -> None:
    with MemoryBank(tmp_path / "other", BagOfWordsEncoder(), device="cpu") as other, \
            pytest.raises(RmmError, match="agent's own bank"):
        Agent(bank, ScriptedLLM(cite_mentions("x")), first_stage=HybridRetriever(other), k=5, m=3)


# -- the front ends over a hybrid agent ---------------------------------------------------------------
@pytest.fixture
def story_bank(tmp_path: Path):
    from fakes import add_story

    with MemoryBank(tmp_path / "story", BagOfWordsEncoder(), device="cpu") as b:
        add_story(b)
        yield b


def test_goal_mem_selects_through_the_hybrid_first_stage(story_bank: MemoryBank) -> None:
    from fakes import ScriptedGoalLLM
    from test_goal_frontend import (
        CITY,
        KEYS,
        SISTER,
        cite_porto,
        decomposition,
        refinement,
        unify_by_keyword,
    )

    from rmm.frontends.goal import GoalConfig, GoalFrontend

    llm = ScriptedGoalLLM(decompose=[decomposition(SISTER, CITY)],
                          unify=[unify_by_keyword({SISTER: "married"}), unify_by_keyword(KEYS)],
                          refine=[refinement("Clara lives in (x:city).", "Clara moved Porto studies")],
                          answer=[cite_porto])
    agent = Agent(story_bank, llm, first_stage=HybridRetriever(story_bank), k=3, m=3, learn=True,
                  learner_config=LearnerConfig(batch_size=3), checkpoint_every=0)
    response = GoalFrontend(agent, GoalConfig()).respond("ana", "Which city does Ana's sister live in?")
    assert response.selections and all(s.candidates.lexical is not None for s in response.selections)
    assert all(s.candidates.lexical.shape == (len(s.candidates),) for s in response.selections)
    assert agent.learner("ana").stats.updates == 1


def test_memr3_selects_through_the_hybrid_first_stage(story_bank: MemoryBank) -> None:
    from fakes import ScriptedMemR3LLM
    from test_memr3_frontend import QUESTION, cite_evidence, cite_keyword, retrieve

    from rmm.frontends.memr3 import MemR3Config, MemR3Frontend

    llm = ScriptedMemR3LLM(generate=[retrieve("Clara moved Porto studies"), cite_keyword("Porto")],
                           answer=[cite_evidence])
    agent = Agent(story_bank, llm, first_stage=HybridRetriever(story_bank), k=8, m=3, learn=False,
                  checkpoint_every=0)
    response = MemR3Frontend(agent, MemR3Config(n_chk=3)).respond("ana", QUESTION)
    assert len(response.selections) == 2
    assert all(s.candidates.lexical is not None for s in response.selections)
    shown = [i for q in response.trace.queries for i in q.memory_ids]
    assert len(shown) == len(set(shown)) == 6  # the exclusion still holds over hybrid candidates
    assert [m.id for m in response.cited] == ["porto"]
