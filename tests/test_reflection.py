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


# ---- the fallback's output, frozen (it was made faster; it must not change) ---------------------
GARDEN = ["Tomato seedlings need sunlight in the garden", "Garden tomato plants want compost and water",
          "Watering garden seedlings every morning helps", "Compost makes tomato garden soil richer"]
# topics that come back across sessions (merges, two merges into one memory in a session, the
# merge cap), an empty turn, and sessions too short to segment
CONVERSATION = [("u:S1", HIKING + COOKING), ("u:S2", COOKING[::-1] + GARDEN),
                ("u:S3", HIKING[1:] + ["", "ok"] + GARDEN[:3]), ("u:S4", GARDEN + HIKING + COOKING),
                ("u:S5", ["hi", "yo"]), ("u:S6", COOKING[:3]), ("u:S7", HIKING * 3)]
# Frozen from the code before the fallback was sped up: (id, refs as "session:turns", merged_from).
FROZEN_TOUCHED = [["m001", "m002"], ["m002", "m004"], ["m001", "m004"], ["m007", "m008", "m009"], ["m010"],
                  ["m011"], ["m008", "m001", "m015", "m017"]]
FROZEN_MEMORIES = [
    ("m001", "S1:0-3 S3:0-2 S3:4 S7:2-3", ["m005", "m013"], ("time-u:S1", "time-u:S7")),
    ("m002", "S1:4-7 S2:0-3", ["m003"], ("time-u:S1", "time-u:S2")),
    ("m004", "S2:4-7 S3:5-7", ["m006"], ("time-u:S2", "time-u:S3")),
    ("m007", "S4:0-3", [], ("time-u:S4", "time-u:S4")),
    ("m008", "S4:4-7 S7:0-1 S7:4-5 S7:8-9", ["m012", "m014", "m016"], ("time-u:S4", "time-u:S7")),
    ("m009", "S4:8-11", [], ("time-u:S4", "time-u:S4")),
    ("m010", "S5:0-1", [], ("time-u:S5", "time-u:S5")),
    ("m011", "S6:0-2", [], ("time-u:S6", "time-u:S6")),
    ("m015", "S7:6-7", [], ("time-u:S7", "time-u:S7")),
    ("m017", "S7:10-11", [], ("time-u:S7", "time-u:S7")),
]


def _refs(spec: str) -> list[str]:
    """'S1:0-3 S3:4' → ['u:S1:0', …, 'u:S1:3', 'u:S3:4']."""
    out = []
    for part in spec.split():
        sid, span = part.split(":")
        first, _, last = span.partition("-")
        out += [f"u:{sid}:{i}" for i in range(int(first), int(last or first) + 1)]
    return out


class CountingEncoder(BagOfWordsEncoder):
    """Records every text it encodes, to check nothing is encoded twice."""

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def encode_passages(self, texts: list[str]) -> torch.Tensor:
        self.encoded += texts
        return super().encode_passages(texts)


def _reflect_conversation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encoder: BagOfWordsEncoder):
    ids = iter(f"m{i:03d}" for i in range(1, 1000))
    monkeypatch.setattr(Memory, "new_id", staticmethod(lambda: next(ids)))  # deterministic ids
    bank = MemoryBank(tmp_path / "frozen", encoder, device="cpu")
    reflector = ProspectiveReflector(bank, None, merge_threshold=0.5, max_merged_turns=10)
    touched = [[m.id for m in reflector.reflect(session(sid, texts))] for sid, texts in CONVERSATION]
    return bank, reflector, touched


def test_fallback_output_is_unchanged_on_a_fixed_conversation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = BagOfWordsEncoder()
    bank, reflector, touched = _reflect_conversation(tmp_path, monkeypatch, encoder)
    with bank:
        assert touched == FROZEN_TOUCHED
        stored = bank.memories("u")
        assert [(m.id, m.refs, m.merged_from, m.time_span) for m in stored] == [
            (i, _refs(spec), merged, span) for i, spec, merged, span in FROZEN_MEMORIES]
        lines = {t.id: f"{t.speaker}: {t.text}" for sid, texts in CONVERSATION for t in session(sid, texts).turns}
        for m in stored:  # text and source follow from the refs: the turns joined, labelled once
            assert m.kind == "topic" and m.text == "\n".join(lines[r] for r in m.refs)
            assert m.source_text == f"{EXTRACTIVE_LABEL}\n{m.text}"
        vectors = bank.embeddings("u", [m.id for m in stored])  # each stored vector is its text's
        assert torch.allclose(vectors, encoder.encode_passages([m.text for m in stored]), atol=1e-6)
        s = reflector.stats
        assert (s.sessions, s.extracted, s.added, s.merged) == (7, 17, 10, 7)


def test_fallback_encodes_each_turn_topic_and_merge_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = CountingEncoder()
    bank, _, touched = _reflect_conversation(tmp_path, monkeypatch, encoder)
    bank.close()
    assert touched == FROZEN_TOUCHED
    # turns of the sessions long enough to cut (S1 8, S2 8, S3 7 non-empty, S4 12, S7 12; S5 and S6
    # are too short), each topic once (its vector serves the search and the add), and each memory
    # a session merged into once
    assert len(encoder.encoded) == 47 + 17 + 5


def test_reflect_many_builds_the_same_memories_in_two_calls_plus_one_per_merging_session(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class CallCounting(CountingEncoder):
        calls = 0

        def encode_passages(self, texts: list[str]) -> torch.Tensor:
            self.calls += 1
            return super().encode_passages(texts)

    ids = iter(f"m{i:03d}" for i in range(1, 1000))
    monkeypatch.setattr(Memory, "new_id", staticmethod(lambda: next(ids)))
    encoder = CallCounting()
    with MemoryBank(tmp_path / "many", encoder, device="cpu") as bank:
        reflector = ProspectiveReflector(bank, None, merge_threshold=0.5, max_merged_turns=10)
        touched = reflector.reflect_many([session(sid, texts) for sid, texts in CONVERSATION])
        assert [[m.id for m in ms] for ms in touched] == FROZEN_TOUCHED
        assert [(m.id, m.refs, m.merged_from, m.time_span) for m in bank.memories("u")] == [
            (i, _refs(spec), merged, span) for i, spec, merged, span in FROZEN_MEMORIES]
        s = reflector.stats
        assert (s.sessions, s.extracted, s.added, s.merged) == (7, 17, 10, 7)
    assert len(encoder.encoded) == 47 + 17 + 5
    # all turns, all topics, then one per session that merged (S2; S3 and S7 merge into two each)
    assert encoder.calls == 2 + 3


def test_reflect_many_of_named_speakers_and_empty_sessions(bank: MemoryBank) -> None:
    empty = Session(id="u:S0", user_id="u", turns=[], time=None)
    reflector = ProspectiveReflector(bank, None)
    first, second = reflector.reflect_many([empty, session()], speakers=["Ana"])
    ana = {t.id for t in session().turns if t.speaker == "Ana"}
    assert first == [] and second and all(set(m.refs) <= ana for m in second)
    assert reflector.stats.sessions == 2
    assert reflector.reflect_many([]) == []
