"""Prospective reflection: extract → update (Add / Merge), malformed LLM output, the fallback."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rmm.errors import LLMError
from rmm.llm.base import LLM, Message, Usage
from rmm.memory.bank import MemoryBank
from rmm.reflection import (
    EXTRACTIVE_LABEL,
    ProspectiveReflector,
    SegmenterConfig,
    TopicSegmenter,
)
from rmm.types import Memory, Session, Turn

DIM = 64


class BagOfWordsEncoder:
    """Hashed bag of words: texts sharing words are similar, disjoint vocabularies are orthogonal."""

    name, dim, fingerprint = "bow", DIM, "bow-v1"

    def _vector(self, text: str) -> torch.Tensor:
        v = torch.zeros(DIM)
        for word in re.findall(r"[a-z]+", text.lower()):
            if len(word) > 3:  # skip short function words: they would link unrelated topics
                v[int(hashlib.md5(word.encode()).hexdigest(), 16) % DIM] += 1.0
        return v / v.norm() if v.norm() > 0 else v + 1e-3

    def encode_queries(self, texts: list[str]) -> torch.Tensor:
        return torch.stack([self._vector(t) for t in texts])

    encode_passages = encode_queries


class ScriptedLLM(LLM):
    """Replies from a script: a list consumed in order, or a function of the conversation."""

    def __init__(self, script: list[str] | Callable[[list[Message]], str]) -> None:
        super().__init__("scripted")
        self.script = script
        self.prompts: list[str] = []
        self.schemas: list[dict | None] = []

    def _generate(self, batch, *, json_schema=None, max_tokens=512, temperature=0.0) -> list[str]:
        self.schemas.append(json_schema)
        out = []
        for conversation in batch:
            self.prompts.append(conversation[-1]["content"])
            out.append(self.script(conversation) if callable(self.script) else self.script.pop(0))
        self._record(Usage(calls=1))
        return out


HIKING = ["I love hiking mountain trails every weekend", "Which mountain trails are your favourite for hiking",
          "The granite ridge trail near the mountain lake hiking route", "Mountain hiking trails sound wonderful"]
COOKING = ["I started baking sourdough bread recipes", "Sourdough bread baking needs patience and flour",
           "My sourdough starter bread recipe uses rye flour", "Baking bread with flour recipes is relaxing"]


def session(sid: str = "u:S1", texts: list[str] = HIKING + COOKING, user: str = "u") -> Session:
    turns = [Turn(id=f"{sid}:{i}", session_id=sid, speaker="Ana" if i % 2 == 0 else "Ben", text=t)
             for i, t in enumerate(texts)]
    return Session(id=sid, user_id=user, turns=turns, time=f"time-{sid}")


@pytest.fixture
def bank(tmp_path: Path):
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as b:
        yield b


def extraction(*memories: tuple[str, list[int]]) -> str:
    return json.dumps({"extracted_memories": [{"summary": s, "reference": r} for s, r in memories]})


def topic(user: str, text: str, refs: list[str]) -> Memory:
    return Memory(id=Memory.new_id(), user_id=user, kind="topic", text=text, refs=refs, source_text=text,
                  time_span=("t0", "t0"))


# ---- LLM path -----------------------------------------------------------------------------------
def test_extract_batches_speakers_and_maps_refs_to_turn_ids(bank: MemoryBank) -> None:
    llm = ScriptedLLM([extraction(("Ana loves mountain hiking", [0, 2])), "NO_TRAIT"])
    reflector = ProspectiveReflector(bank, llm)
    extracted = reflector.extract(session())
    assert len(llm.prompts) == 2 and llm.usage.calls == 1  # one batched call, one prompt per speaker
    assert [(e.summary, e.refs) for e in extracted] == [("Ana loves mountain hiking", ["u:S1:0", "u:S1:2"])]


def test_structured_extraction_asks_for_the_schema_and_an_empty_list_means_no_trait(bank: MemoryBank) -> None:
    from rmm.prompts import EXTRACTION_SCHEMA

    llm = ScriptedLLM([extraction(("Ana loves mountain hiking", [0, 2])), extraction()])
    reflector = ProspectiveReflector(bank, llm, structured=True)
    extracted = reflector.extract(session())
    assert llm.schemas == [EXTRACTION_SCHEMA]
    assert [(e.summary, e.refs) for e in extracted] == [("Ana loves mountain hiking", ["u:S1:0", "u:S1:2"])]
    assert reflector.stats.extraction_failures == 0
    assert reflector.settings_key != ProspectiveReflector(bank, llm).settings_key


def test_update_adds_into_an_empty_bank_without_asking(bank: MemoryBank) -> None:
    llm = ScriptedLLM([extraction(("Ana loves mountain hiking", [0, 2]))])
    reflector = ProspectiveReflector(bank, llm)
    s = session()
    (memory,) = reflector.reflect(s, speakers=["Ana"])
    assert memory.kind == "topic" and memory.text == "Ana loves mountain hiking"
    assert memory.refs == ["u:S1:0", "u:S1:2"]
    assert HIKING[0] in memory.source_text and HIKING[2] in memory.source_text and HIKING[1] not in memory.source_text
    assert memory.time_span == ("time-u:S1", "time-u:S1")
    assert len(llm.prompts) == 1  # nothing to merge with: no update call
    assert [m.id for m in bank.memories("u")] == [memory.id]


def test_update_merge_unions_refs_keeps_lineage_and_widens_span(bank: MemoryBank) -> None:
    old = topic("u", "Ana hikes mountain trails", ["u:S0:3"])
    other = topic("u", "Ana bakes sourdough bread", ["u:S0:5"])
    bank.add("u", [old, other])
    llm = ScriptedLLM([extraction(("Ana loves mountain hiking on weekends", [0, 2])),
                       "Merge(0, Ana hikes mountain trails every weekend.)"])
    reflector = ProspectiveReflector(bank, llm)
    (merged,) = reflector.reflect(session(), speakers=["Ana"])
    assert merged.id == old.id and merged.text == "Ana hikes mountain trails every weekend."
    assert merged.refs == ["u:S0:3", "u:S1:0", "u:S1:2"]
    assert len(merged.merged_from) == 1
    assert merged.time_span == ("t0", "time-u:S1")
    assert merged.updated_at > old.updated_at and merged.created_at == old.created_at
    assert "Ana hikes mountain trails" in llm.prompts[-1]  # the neighbour was shown to the LLM
    stored = {m.id: m for m in bank.memories("u")}
    assert len(stored) == 2 and stored[old.id].text == merged.text
    # the merged text is what search now finds
    hit = bank.search(["hikes mountain trails every weekend"], "u", 1)[0]
    assert hit.memory_ids == [old.id]
    assert reflector.stats.merged == 1 and reflector.stats.added == 0


@pytest.mark.parametrize("reply", ["Merge(7, out of range)", "I think these are related!", "", "Merge(zero, x)"])
def test_unusable_update_decision_adds_and_loses_nothing(bank: MemoryBank, reply: str) -> None:
    old = topic("u", "Ana hikes mountain trails", ["u:S0:3"])
    bank.add("u", [old])
    llm = ScriptedLLM([extraction(("Ana loves mountain hiking", [0])), reply])
    reflector = ProspectiveReflector(bank, llm)
    (memory,) = reflector.reflect(session(), speakers=["Ana"])
    assert memory.id != old.id and memory.text == "Ana loves mountain hiking"
    assert {m.id for m in bank.memories("u")} == {old.id, memory.id}
    assert bank.get("u", [old.id])[0].text == old.text
    assert reflector.stats.update_failures == 1


@pytest.mark.parametrize("replies", [["{not json", "also junk"], ['Sure! Here are the memories:', "```\n[1,2]\n```"]])
def test_unusable_extraction_falls_back_to_segmentation(bank: MemoryBank, replies: list[str]) -> None:
    reflector = ProspectiveReflector(bank, ScriptedLLM(replies))
    memories = reflector.reflect(session())
    assert memories, "the session must still leave memories"
    assert all(EXTRACTIVE_LABEL in m.source_text for m in memories)
    assert sorted(r for m in memories for r in m.refs) == sorted(t.id for t in session().turns)
    assert reflector.stats.extraction_failures == 2 and reflector.stats.fallback_sessions == 1


def test_llm_transport_error_falls_back(bank: MemoryBank) -> None:
    class Down(ScriptedLLM):
        def _generate(self, batch, **kwargs):
            raise LLMError("connection refused")

    reflector = ProspectiveReflector(bank, Down([]))
    assert reflector.reflect(session())
    assert reflector.stats.fallback_sessions == 1


def test_one_speaker_failing_keeps_the_other_speakers_memories(bank: MemoryBank) -> None:
    llm = ScriptedLLM([extraction(("Ana loves mountain hiking", [0])), "garbage"])
    reflector = ProspectiveReflector(bank, llm)
    memories = reflector.reflect(session())
    assert [m.text for m in memories] == ["Ana loves mountain hiking"]
    assert reflector.stats.extraction_failures == 1 and reflector.stats.fallback_sessions == 0


def test_no_trait_everywhere_stores_nothing(bank: MemoryBank) -> None:
    reflector = ProspectiveReflector(bank, ScriptedLLM(["NO_TRAIT", "NO_TRAIT"]))
    assert reflector.reflect(session()) == []
    assert reflector.stats.extraction_failures == 0


def test_invented_turn_references_are_dropped(bank: MemoryBank) -> None:
    llm = ScriptedLLM([extraction(("Ana loves mountain hiking", [0, 99]))])
    (memory,) = ProspectiveReflector(bank, llm).reflect(session(), speakers=["Ana"])
    assert memory.refs == ["u:S1:0"]


# ---- the non-LLM fallback -------------------------------------------------------------------------
def test_fallback_segments_two_obvious_topics_with_correct_refs(bank: MemoryBank) -> None:
    segments = TopicSegmenter(BagOfWordsEncoder()).segments(session())
    assert len(segments) >= 2
    ids = [[t.id for t in seg] for seg in segments]
    assert [i for seg in ids for i in seg] == [t.id for t in session().turns]  # every turn once, in order
    boundary = {seg[0] for seg in ids}
    assert "u:S1:4" in boundary  # the topic change is a boundary
    memories = ProspectiveReflector(bank, None).reflect(session())
    assert len(memories) >= 2
    for m in memories:
        assert m.kind == "topic" and EXTRACTIVE_LABEL in m.source_text
        assert all(ref.split(":")[-1].isdigit() for ref in m.refs)
        assert m.text == "\n".join(f"{t.speaker}: {t.text}" for t in session().turns if t.id in m.refs)


def test_fallback_for_named_speakers_never_stores_the_other_side(bank: MemoryBank) -> None:
    """The agent reflects on the user only: a reply echoing its prompt must not become a memory."""
    ana = {t.id for t in session().turns if t.speaker == "Ana"}
    memories = ProspectiveReflector(bank, None).reflect(session(), speakers=["Ana"])
    assert memories and all(set(m.refs) <= ana for m in memories)
    assert all("Ben:" not in m.text for m in memories)


def test_segment_sizes_are_bounded() -> None:
    config = SegmenterConfig(window=1, min_size=2, max_size=3)
    segments = TopicSegmenter(BagOfWordsEncoder(), config).segments(session(texts=HIKING * 3))
    assert all(2 <= len(s) <= 3 for s in segments)
    assert sum(len(s) for s in segments) == 12
    assert len(TopicSegmenter(BagOfWordsEncoder()).segments(session(texts=HIKING[:1]))) == 1
    assert TopicSegmenter(BagOfWordsEncoder()).segments(session(texts=[])) == []
    with pytest.raises(ValueError):
        SegmenterConfig(min_size=3, max_size=2)


def test_fallback_merge_threshold(tmp_path: Path) -> None:
    encoder = BagOfWordsEncoder()
    first, again = session("u:S1", HIKING[:2]), session("u:S2", HIKING[:2])
    with MemoryBank(tmp_path / "merge", encoder, device="cpu") as bank:
        reflector = ProspectiveReflector(bank, None, merge_threshold=0.9)
        (a,) = reflector.reflect(first)
        (b,) = reflector.reflect(again)  # the same topic again: merged
        assert b.id == a.id and b.refs == [*a.refs, "u:S2:0", "u:S2:1"] and len(b.merged_from) == 1
        assert b.source_text.count(EXTRACTIVE_LABEL) == 1
        (c,) = reflector.reflect(session("u:S3", COOKING[:2]))  # another topic: added
        assert c.id != a.id and len(bank.memories("u")) == 2
    with MemoryBank(tmp_path / "never", encoder, device="cpu") as bank:
        reflector = ProspectiveReflector(bank, None, merge_threshold=1.01)  # nothing is that similar
        reflector.reflect(first)
        reflector.reflect(again)
        assert len(bank.memories("u")) == 2 and reflector.stats.merged == 0


def test_fallback_merge_is_capped(bank: MemoryBank) -> None:
    reflector = ProspectiveReflector(bank, None, merge_threshold=0.5, max_merged_turns=3)
    reflector.reflect(session("u:S1", HIKING[:2]))
    reflector.reflect(session("u:S2", HIKING[:2]))  # 4 turns > cap → added, not merged
    assert len(bank.memories("u")) == 2


def test_only_topic_memories_are_merge_targets(bank: MemoryBank) -> None:
    raw = Memory(id="u:S0:0", user_id="u", kind="turn", text="\n".join(HIKING[:2]), refs=["u:S0:0"])
    bank.add("u", [raw])
    (memory,) = ProspectiveReflector(bank, None, merge_threshold=0.1).reflect(session("u:S1", HIKING[:2]))
    assert memory.id != raw.id and bank.get("u", [raw.id])[0].text == raw.text


def test_settings_key_changes_with_settings(bank: MemoryBank) -> None:
    a = ProspectiveReflector(bank, None).settings_key
    assert a != ProspectiveReflector(bank, None, merge_threshold=0.5).settings_key
    assert a != ProspectiveReflector(bank, ScriptedLLM([])).settings_key


def test_fill_topics_resumes_an_interrupted_build(bank: MemoryBank) -> None:
    from rmm.eval.benchmark_bank import documents, fill_topics
    from rmm.types import Dataset

    dataset = Dataset("tiny", {"u": [session("u:S1"), session("u:S2", COOKING)],
                               "v": [session("v:S1", HIKING, user="v")]}, [])
    bank.add("u", [topic("u", "half-built leftover", ["u:S1:0"])])  # an interrupted build: no done mark
    fill_topics(bank, dataset, ProspectiveReflector(bank, None), progress=False)
    texts = [m.text for m in bank.memories("u")]
    assert "half-built leftover" not in texts and texts
    refs = {r for m in bank.memories("u") for r in m.refs}
    assert refs == {t.id for s in dataset.sessions["u"] for t in s.turns}  # every turn is in some topic
    generation = bank.store.generation("u")
    fill_topics(bank, dataset, ProspectiveReflector(bank, None), progress=False)
    assert bank.store.generation("u") == generation  # done users are skipped
    with pytest.raises(ValueError, match="prospective reflection"):
        documents(dataset, "u", "topic")
