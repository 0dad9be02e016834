"""The Algorithm 1 agent: citations → rewards → learner, sessions, reflection, persistence."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder

from rmm.frontends.agent import ASSISTANT, Agent
from rmm.llm.base import LLM, Message, Usage
from rmm.memory.bank import MemoryBank
from rmm.policy.learner import LearnerConfig
from rmm.prompts import is_answer_prompt, parse_shown_memories
from rmm.reflection import ProspectiveReflector
from rmm.types import Memory


class ScriptedLLM(LLM):
    """Answers with a function of the shown memory texts; extraction prompts get `extraction`."""

    def __init__(self, answer: Callable[[list[str]], str], extraction: str = "NO_TRAIT") -> None:
        super().__init__("scripted")
        self.answer, self.extraction = answer, extraction
        self.seen: list[list[str]] = []

    def _generate(self, batch: list[list[Message]], *, json_schema=None, max_tokens=512, temperature=0.0):
        out = []
        for conversation in batch:
            if is_answer_prompt(conversation):
                shown = parse_shown_memories(conversation)
                self.seen.append(shown)
                out.append(self.answer(shown))
            else:
                out.append(self.extraction)
        self._record(Usage(calls=1))
        return out


FACTS = ["Ana hikes mountain trails every weekend", "Ana bakes sourdough bread", "Ana plays cello in an orchestra",
         "Ana adopted a golden retriever puppy", "Ana works as a nurse at the hospital",
         "Ana reads detective novels set in Tokyo", "Ana booked a summer trip to Lisbon"]


def cite_mentions(word: str) -> Callable[[list[str]], str]:
    def answer(shown: list[str]) -> str:
        cited = [i for i, text in enumerate(shown) if word in text]
        return f"Here is what I remember. [{', '.join(map(str, cited))}]" if cited else "No idea. [NO_CITE]"
    return answer


@contextmanager
def facts_bank(path: Path) -> Iterator[MemoryBank]:
    """A bank holding Ana's FACTS as topic memories (bag-of-words encoder: shared words → near)."""
    with MemoryBank(path, BagOfWordsEncoder(), device="cpu") as b:
        b.add("ana", [Memory(id=f"f{i}", user_id="ana", kind="topic", text=t, refs=[f"s:{i}"])
                      for i, t in enumerate(FACTS)])
        yield b


@pytest.fixture
def bank(tmp_path: Path):
    with facts_bank(tmp_path / "bank") as b:
        yield b


def make_agent(bank: MemoryBank, llm: LLM, **kwargs) -> Agent:
    kwargs.setdefault("learner_config", LearnerConfig(batch_size=2))
    return Agent(bank, llm, k=5, m=3, **kwargs)


def test_citations_become_rewards_for_the_learner(bank: MemoryBank) -> None:
    agent = make_agent(bank, ScriptedLLM(cite_mentions("cello")))
    response = agent.respond("ana", "What instrument does Ana play in the orchestra, the cello?")
    assert len(response.shown) == 3 and response.selection is not None
    assert [m.text for m in response.cited] == ["Ana plays cello in an orchestra"]
    assert response.answer == "Here is what I remember."
    rewards = response.feedback.rewards
    assert rewards is not None and sorted(rewards) == [-1.0, -1.0, 1.0]
    assert rewards[[m.id for m in response.shown].index("f2")] == 1.0
    assert agent.learner("ana").stats.records == 1
    agent.respond("ana", "Does Ana play the cello?")
    assert agent.learner("ana").stats.updates == 1  # batch of 2 → one REINFORCE update


def test_no_cite_punishes_every_shown_memory(bank: MemoryBank) -> None:
    agent = make_agent(bank, ScriptedLLM(lambda shown: "I don't know. [NO_CITE]"))
    response = agent.respond("ana", "What is Ana's favourite colour?")
    assert response.feedback.rewards == [-1.0, -1.0, -1.0] and response.cited == []
    assert agent.learner("ana").stats.records == 1


def test_unparseable_citation_is_skipped(bank: MemoryBank) -> None:
    agent = make_agent(bank, ScriptedLLM(lambda shown: "Something without any marker"))
    response = agent.respond("ana", "Where does Ana travel?")
    assert response.feedback.rewards is None and response.cited == []
    stats = agent.learner("ana").stats
    assert stats.records == 0 and stats.skipped_no_citation == 1


@pytest.mark.parametrize("reply", [
    "You love hiking in the mountains on weekends and playing guitar at open-mic nights. [0, 2]",
    "I don't know which countries you visited last summer. [NO_CITE]",
    ('{"answer": "You love hiking in the mountains on weekends and playing guitar at open-mic nights.", '
    '"citations": [0, 2]}'),
])
def test_a_reply_copying_the_prompts_worked_example_teaches_nothing(bank: MemoryBank, reply: str) -> None:
    agent = make_agent(bank, ScriptedLLM(lambda shown: reply), structured=reply.startswith("{"))
    response = agent.respond("ana", "What does Ana do for fun?")
    assert response.feedback.rewards is None and response.cited == []
    assert any("worked example" in w for w in response.feedback.citation.warnings)
    assert agent.learner("ana").stats.records == 0


def test_an_answer_that_only_shares_words_with_the_example_still_counts(bank: MemoryBank) -> None:
    agent = make_agent(bank, ScriptedLLM(lambda shown: "You love hiking in the mountains. [0]"))
    response = agent.respond("ana", "Where does Ana hike?")
    assert response.feedback.rewards is not None and len(response.cited) == 1


def test_not_learning_is_greedy_and_records_nothing(bank: MemoryBank) -> None:
    agent = make_agent(bank, ScriptedLLM(cite_mentions("cello")), learn=False)
    a = agent.respond("ana", "cello orchestra")
    b = agent.respond("ana", "cello orchestra")
    assert [m.id for m in a.shown] == [m.id for m in b.shown] and a.shown[0].id == "f2"
    assert a.selection is not None and not a.selection.explore
    assert agent.learner("ana").stats.records == 0


def test_empty_bank_answers_without_memories(tmp_path: Path) -> None:
    with MemoryBank(tmp_path / "empty", BagOfWordsEncoder(), device="cpu") as bank:
        llm = ScriptedLLM(lambda shown: "Hello! [NO_CITE]")
        agent = make_agent(bank, llm)
        response = agent.respond("newbie", "hi there")
        assert response.answer == "Hello!" and response.shown == [] and response.selection is None
        assert llm.seen == [[]]


def test_session_turns_are_logged_and_end_session_stores_topics(bank: MemoryBank) -> None:
    extraction = '{"extracted_memories": [{"summary": "Ana is learning the violin", "reference": [0]}]}'
    llm = ScriptedLLM(cite_mentions("violin"), extraction=extraction)
    agent = make_agent(bank, llm)
    agent.respond("ana", "I started learning the violin")
    session = agent.sessions.current("ana")
    assert [(t.speaker, t.text) for t in session.turns] == [
        ("ana", "I started learning the violin"), (ASSISTANT, "No idea.")]
    touched = agent.end_session("ana")
    assert [(m.kind, m.text, m.refs) for m in touched] == [("topic", "Ana is learning the violin", [session.turns[0].id])]
    assert agent.sessions.current("ana").turns == []
    assert any(m.text == "Ana is learning the violin" for m in bank.memories("ana"))
    assert agent.end_session("ana") == []  # nothing open


def test_end_session_can_also_store_raw_turns(bank: MemoryBank) -> None:
    agent = make_agent(bank, ScriptedLLM(cite_mentions("cello")), store_turns=True,
                       reflector=ProspectiveReflector(bank, None))
    agent.respond("ana", "My sister visits next week")
    kinds = sorted(m.kind for m in agent.end_session("ana"))
    assert kinds.count("turn") == 2 and "topic" in kinds


def test_everything_persists_across_a_new_agent(tmp_path: Path) -> None:
    encoder = BagOfWordsEncoder()
    path = tmp_path / "bank"
    with MemoryBank(path, encoder, device="cpu") as bank:
        bank.add("ana", [Memory(id=f"f{i}", user_id="ana", kind="topic", text=t) for i, t in enumerate(FACTS)])
        agent = make_agent(bank, ScriptedLLM(cite_mentions("cello")))
        for _ in range(3):
            agent.respond("ana", "Which instrument, the cello?")
        weights = agent.learner("ana").reranker.W_q.weight.detach().clone()
        stats = agent.learner("ana").stats
        agent.close()
    assert (path / "reranker" / "meta.json").exists()
    with MemoryBank(path, encoder, device="cpu") as bank:
        agent = make_agent(bank, ScriptedLLM(cite_mentions("cello")))
        assert len(agent.sessions.current("ana").turns) == 6  # the open session survived
        learner = agent.learner("ana")
        assert learner.stats.records == stats.records == 3 and learner.pending == 1
        assert torch.equal(learner.reranker.W_q.weight, weights)
        agent.close()


def test_periodic_checkpoint_and_per_user_rerankers(bank: MemoryBank) -> None:
    bank.add("ben", [Memory(id="b0", user_id="ben", kind="topic", text="Ben plays cello too")])
    agent = make_agent(bank, ScriptedLLM(cite_mentions("cello")), per_user=True, checkpoint_every=1)
    agent.respond("ana", "cello?")
    agent.respond("ben", "cello?")
    assert agent.learner("ana") is not agent.learner("ben")
    saved = list((Path(bank.path) / "reranker" / "users").iterdir())
    assert len(saved) == 2 and all((p / "meta.json").exists() for p in saved)
    agent.close()


def test_the_learner_recipe_follows_the_encoders_normalisation(bank: MemoryBank) -> None:
    from types import SimpleNamespace

    llm = ScriptedLLM(cite_mentions("cello"))
    plain = Agent(bank, llm)  # the bag-of-words double declares no normalisation: the paper's recipe
    assert plain.tau == 0.5 and plain.learner_config.baseline == 0.5 and plain.learner_config.lr == 1e-3
    bank.encoder.config = SimpleNamespace(normalize=True)  # like MiniLM: cosines, sharper τ
    auto = Agent(bank, llm)
    assert auto.tau == 0.05 and auto.learner_config.baseline == "mean" and auto.learner_config.lr == 3e-4
    assert Agent(bank, llm, tau=0.3).learner_config.tau == 0.3
    assert Agent(bank, llm, recipe="paper").tau == 0.5
    with pytest.raises(ValueError, match="unknown recipe"):
        Agent(bank, llm, recipe="fast")


def test_bad_arguments(bank: MemoryBank) -> None:
    with pytest.raises(ValueError):
        Agent(bank, ScriptedLLM(cite_mentions("x")), k=2, m=3)


@pytest.mark.slow
def test_smollm2_runs_a_locomo_session_through_extract_update_respond(tmp_path: Path, data_root: Path,
                                                                       minilm_path: Path, smollm2_gguf: Path) -> None:
    """The real small model end to end; quality is not judged, every malformed output must be handled."""
    from rmm.data import load_locomo
    from rmm.encoders import load_encoder
    from rmm.llm.hf import HFLLM

    llm = HFLLM(smollm2_gguf, device="cpu", threads=1)
    dataset = load_locomo(data_root / "locomo" / "locomo10.json")
    user = dataset.users[0]
    # The first 8 turns of the first two sessions (CPU time); the second exercises Add/Merge decisions.
    sessions = [replace(s, turns=s.turns[:8]) for s in dataset.sessions[user][:2]]
    with MemoryBank(tmp_path / "bank", load_encoder("minilm", device="cpu"), device="cpu") as bank:
        reflector = ProspectiveReflector(bank, llm, max_tokens=160)
        for session in sessions:
            memories = reflector.reflect(session)
            assert memories, "every session leaves memories (LLM topics or the fallback)"
        stored = bank.memories(user)
        assert stored and all(m.kind == "topic" for m in stored)
        known = {t.id for s in sessions for t in s.turns}
        assert all(set(m.refs) <= known for m in stored)
        agent = Agent(bank, llm, reflector=reflector, k=10, m=3, max_tokens=96)
        response = agent.respond(user, dataset.questions_of(user)[0].text)
        assert isinstance(response.answer, str) and 0 < len(response.shown) <= 3
        assert agent.learner(user).stats.records + agent.learner(user).stats.skipped_no_citation == 1
        agent.close()
    print(f"SmolLM2 prospective reflection, 2 sessions: {reflector.stats}; usage {llm.usage}")
