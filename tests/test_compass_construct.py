"""CompassMem's construction (rmm.reflection.events, rmm.prompts.compass_*): the App. F.1 prompts'
parsers on malformed replies, the LLM path with one retry then the fallback, fusion (merge rewires
edges, overlap links), the topic layer (k-means sizes, re-clustering generations), the LLM-free
fallback graph on both stores, calibration on training users only, and `rmm eval --granularity event`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fakes import BagOfWordsEncoder, ScriptedGoalLLM
from test_bm25_over_dense import fake_minilm  # noqa: F401 - every encoder name loads a bag of words, private cache
from test_chat import isolated_cache  # noqa: F401 - the bag-of-words encoder in place of MiniLM, a private cache

from rmm.cli import main
from rmm.errors import LLMError
from rmm.memory.bank import MemoryBank
from rmm.memory.graph import Edge
from rmm.prompts.compass_parse import parse_events, parse_fusion, parse_relations
from rmm.prompts.compass_render import events_messages, fusion_messages, relations_messages, session_turn_ids
from rmm.prompts.parse import PromptParseError
from rmm.training.splits import split_users_in_order
from rmm.reflection.segment import SegmenterConfig
from rmm.reflection.events import (
    FALLBACK_LABEL,
    EventGraphConfig,
    Thresholds,
    build_event_graph,
    calibrate_thresholds,
    current_topics,
    kmeans,
    n_topics,
    thresholds_for,
)
from rmm.types import Dataset, Session, Turn

TEST_THRESHOLDS = Thresholds(merge=0.95, topic=0.3, similar=0.5, source="test")


def session(sid: str, lines: list[tuple[str, str]], when: str | None = "1 May 2023", user: str = "ana") -> Session:
    return Session(sid, user, [Turn(f"{sid}:{i}", sid, who, text) for i, (who, text) in enumerate(lines)], when)


PUPPY = session("A", [("Ana", "I adopted a golden retriever puppy named Biscuit"), ("Bo", "Lovely puppy, congratulations"),
                      ("Ana", "Also booked flights to Lisbon for summer"), ("Bo", "Lisbon flights sound wonderful")])
CELLO = session("B", [("Ana", "Biscuit the golden retriever puppy chewed my shoes"), ("Bo", "Naughty puppy"),
                      ("Ana", "Tonight I play cello with the orchestra"), ("Bo", "Enjoy the orchestra concert")],
                "9 May 2023")
IDS = session_turn_ids(PUPPY)


class ScriptedCompassLLM(ScriptedGoalLLM):
    """Replies per construction prompt (events | relations | fusion) from a script."""

    def __init__(self, **script) -> None:
        super().__init__(**script)
        self.name = "scripted-compass"

    @staticmethod
    def kind(system: str) -> str:
        if "Given a multi-turn dialog" in system:
            return "events"
        if "Given a list of extracted events" in system:
            return "relations"
        return "fusion" if system.startswith("You are an expert at analyzing events") else "other"


class FailingLLM(ScriptedCompassLLM):
    def _generate(self, batch, **options):
        raise LLMError("connection refused")


def events_reply(*events: tuple[str, list[int], list[str]], time: str = "1 May 2023") -> str:
    return json.dumps({"events": [{"id": f"E{i + 1}", "summary": s, "turns": t, "people": p, "time": time}
                                  for i, (s, t, p) in enumerate(events)]})


GOOD_A = events_reply(("Ana adopted a golden retriever puppy named Biscuit", [0, 1], ["Ana", "Bo"]),
                      ("Ana booked flights to Lisbon for the summer", [2, 3], ["Ana", "Bo"]))
GOOD_B = events_reply(("Ana adopted a golden retriever puppy named Biscuit", [0, 1], ["Ana"]),
                      ("Ana plays cello in the orchestra concert tonight", [2, 3], ["Ana", "Bo"]), time="9 May 2023")


def by_session(prompt: str) -> str:
    return GOOD_A if "Lisbon" in prompt else GOOD_B


RELATIONS = '{"relations": [{"source": "E1", "target": "E2", "type": "temporal before", "evidence": [2]}]}'


@pytest.fixture(params=["sqlite", "postgresql"])
def bank(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MemoryBank]:
    location = tmp_path / "bank" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    with MemoryBank(location, BagOfWordsEncoder(), device="cpu") as b:
        yield b


@pytest.fixture
def sqlite_bank(tmp_path: Path) -> Iterator[MemoryBank]:
    with MemoryBank(tmp_path / "bank", BagOfWordsEncoder(), device="cpu") as b:
        yield b


def config(**fields) -> EventGraphConfig:
    return EventGraphConfig(thresholds=fields.pop("thresholds", TEST_THRESHOLDS), **fields)


def events_of(bank: MemoryBank, user: str = "ana"):
    return [m for m in bank.memories(user) if m.kind == "event"]


# ---- the parsers -------------------------------------------------------------------------------------
def test_event_parser_refuses_bad_json_and_wrong_keys_with_clear_messages() -> None:
    with pytest.raises(PromptParseError, match="no JSON object with a 'events' list"):
        parse_events("Sure! Here are the events: E1 Ana adopted a puppy.", IDS)
    with pytest.raises(PromptParseError, match=r"keys found: memories"):
        parse_events('{"memories": [{"summary": "x", "turns": [0]}]}', IDS)
    with pytest.raises(PromptParseError, match="must be a list of events"):
        parse_events('{"events": 3}', IDS)
    with pytest.raises(PromptParseError, match="no usable event"):
        parse_events('{"events": [{"id": "E1", "turns": [0]}]}', IDS)  # no summary


def test_event_parser_cuts_participants_and_drops_unknown_turns() -> None:
    reply = ('```json\n{"events": [{"id": "E1", "summary": "Ana and friends planned a trip", "turns": [0, 7, "A:3", '
             '"Turn 1"], "participants": ["Ana", "Bo", "Cy", "Di"], "time": "May"}, '
             '{"id": "E2", "summary": "Nobody said this", "turns": [12, "X:1"], "people": ["Ana"]}]}\n```')
    events = parse_events(reply, IDS)
    assert len(events) == 1
    (event,) = events
    assert event.refs == ["A:0", "A:3", "A:1"] and event.participants == ["Ana", "Bo", "Cy"] and event.time == "May"
    joined = " ".join(events.warnings)
    assert "turn 7" in joined and "first 3 of 4 people" in joined and "no valid turn" in joined
    with pytest.raises(PromptParseError, match="no usable event"):
        parse_events('{"events": [{"summary": "x", "turns": [40, 41]}]}', IDS)


def test_event_parser_drops_a_copy_of_the_example() -> None:
    example = ("Maya signed up for the pottery class on Fifth Street downtown, starting the following Monday; her "
               "grandmother owned a pottery wheel when Maya was a child.")
    with pytest.raises(PromptParseError):
        parse_events(json.dumps({"events": [{"summary": example, "turns": [0]}]}), IDS)


def test_relation_parser_keeps_only_relations_between_shown_events() -> None:
    reply = json.dumps({"relations": [
        {"source": "E1", "target": "E2", "type": "Follow up", "evidence": [1, 99]},
        {"source": "E1", "target": "E9", "type": "causal"},
        {"source": "E2", "target": "E2", "type": "causal"},
        {"source": "E2", "target": "E1", "type": ""},
        {"from": "Event 2", "to": "e1", "relation": "contrast"}]})
    relations = parse_relations(reply, ["E1", "E2"], IDS)
    assert [(r.source, r.target, r.label, r.evidence) for r in relations] == [
        (0, 1, "follow_up", ("A:1",)), (1, 0, "contrast", ())]
    assert any("E9" in w for w in relations.warnings) and any("itself" in w for w in relations.warnings)
    assert parse_relations('{"relations": []}', ["E1", "E2"], IDS) == []
    with pytest.raises(PromptParseError, match="relations"):
        parse_relations('[1, 2, 3] no relations here', ["E1", "E2"], IDS)
    with pytest.raises(PromptParseError):
        parse_relations("not json", ["E1", "E2"], IDS)


def test_fusion_parser_needs_both_booleans() -> None:
    decision = parse_fusion('Answer: {"same_event": "no", "has_overlap": "yes", "relation_type": "Follow-up", '
                            '"reasoning": "same class"}')
    assert (decision.same_event, decision.has_overlap, decision.relation_type) == (False, True, "follow_up")
    assert parse_fusion('{"same_event": true, "has_overlap": false, "relation_type": null}').has_overlap
    with pytest.raises(PromptParseError, match="keys found: same"):
        parse_fusion('{"same": true}')
    with pytest.raises(PromptParseError, match="booleans"):
        parse_fusion('{"same_event": "maybe", "has_overlap": false}')
    with pytest.raises(PromptParseError):
        parse_fusion("yes they are the same")


def test_renderers_number_the_turns_the_parsers_read() -> None:
    events = events_messages(PUPPY)
    assert events[0]["role"] == "system" and "6-10" in events[0]["content"] and "(at most 3)" in events[0]["content"]
    assert "Turn 3 - Bo: Lisbon flights sound wonderful" in events[-1]["content"]
    relations = relations_messages(PUPPY, [("E1", "puppy", ["A:0", "A:1"]), ("E2", "flights", ["A:2"])])
    assert "E1: puppy (turns 0, 1)" in relations[-1]["content"]
    fusion = fusion_messages(("new one", "9 May", ["Ana"]), ("old one", None, []))
    assert "Event A (time unknown; people unknown): old one" in fusion[-1]["content"]
    with pytest.raises(ValueError):
        relations_messages(PUPPY, [("E1", "only one", ["A:0"])])


# ---- the LLM path ----------------------------------------------------------------------------------
def test_llm_path_stores_events_relations_and_merges_rewiring_edges(bank: MemoryBank) -> None:
    llm = ScriptedCompassLLM(events=[by_session], relations=[RELATIONS],
                             fusion=['{"same_event": true, "has_overlap": true, "relation_type": null}'])
    report = build_event_graph(bank, "ana", [PUPPY, CELLO], llm, config())
    assert (report.llm_sessions, report.fallback_sessions, report.events_merged, report.events_inserted) == (2, 0, 1, 3)
    events = {m.text.split(" [time")[0]: m for m in events_of(bank)}
    puppy = events["Ana adopted a golden retriever puppy named Biscuit\nAna adopted a golden retriever puppy named Biscuit"]
    assert puppy.refs == ["A:0", "A:1", "B:0", "B:1"] and puppy.time_span == ("1 May 2023", "9 May 2023")
    cello = next(m for m in events.values() if "cello" in m.text)
    assert "[time: 9 May" not in cello.text and "Ana: Tonight I play cello" in cello.source_text
    # session B's relation E1 -> E2 was its puppy event's: rewired onto the stored event it merged into
    out = bank.store.neighbours("ana", puppy.id, "out")
    assert Edge(puppy.id, cello.id, "temporal_before", ("B:2",)) in out
    assert bank.store.participants("ana", [puppy.id]) == {puppy.id: ("Ana", "Bo")}  # fixed at insertion
    assert llm.kinds.count("fusion") == 1 and report.llm_calls == 5


def test_fusion_overlap_links_and_no_overlap_inserts(sqlite_bank: MemoryBank) -> None:
    llm = ScriptedCompassLLM(events=[by_session], relations=['{"relations": []}'],
                             fusion=['{"same_event": false, "has_overlap": true, "relation_type": "follow up", '
                                     '"reasoning": "same dog"}'])
    report = build_event_graph(sqlite_bank, "ana", [PUPPY, CELLO], llm, config())
    assert report.events_merged == 0 and report.events_inserted == 4 and report.edges["follow_up"] == 1
    twins = [m for m in events_of(sqlite_bank) if m.text.startswith("Ana adopted")]
    new, old = sorted(twins, key=lambda m: m.refs[0], reverse=True)
    assert sqlite_bank.store.neighbours("ana", new.id, "out", "follow_up") == [Edge(new.id, old.id, "follow_up")]


def test_malformed_extraction_is_retried_once_then_the_session_falls_back(sqlite_bank: MemoryBank) -> None:
    llm = ScriptedCompassLLM(events=[GOOD_A, "I'm sorry, here you go: events!", '{"evts": []}'],
                             relations=[RELATIONS])
    build_event_graph(sqlite_bank, "ana", [PUPPY], llm, config())
    stored = {m.id: m for m in events_of(sqlite_bank)}
    report = build_event_graph(sqlite_bank, "ana", [CELLO], llm, config())
    assert (report.fallback_sessions, report.extraction_failures, report.llm_sessions) == (1, 2, 0)
    fallback = [m for m in events_of(sqlite_bank) if m.id not in stored]
    assert fallback and all(m.source_text == FALLBACK_LABEL for m in fallback)
    assert sorted(r for m in fallback for r in m.refs) == [t.id for t in CELLO.turns]
    assert all(m in events_of(sqlite_bank) for m in stored.values())  # nothing stored before is lost
    assert report.edges["next"] == len(fallback) - 1


def test_one_bad_reply_then_a_good_one_keeps_the_llm_events(sqlite_bank: MemoryBank) -> None:
    bad_refs = events_reply(("Ana did something", [17, 18], ["Ana"]))  # refs to turns the session lacks
    llm = ScriptedCompassLLM(events=[bad_refs, GOOD_A], relations=[RELATIONS])
    report = build_event_graph(sqlite_bank, "ana", [PUPPY], llm, config())
    assert (report.llm_sessions, report.extraction_failures, report.fallback_sessions) == (1, 1, 0)
    assert len(events_of(sqlite_bank)) == 2


def test_too_many_participants_are_cut_to_three(sqlite_bank: MemoryBank) -> None:
    crowd = events_reply(("Ana, Bo, Cy and Di met at the Lisbon airport", [0, 1, 2, 3], ["Ana", "Bo", "Cy", "Di"]))
    build_event_graph(sqlite_bank, "ana", [PUPPY], ScriptedCompassLLM(events=[crowd]), config())
    (event,) = events_of(sqlite_bank)
    assert sqlite_bank.store.participants("ana", [event.id])[event.id] == ("Ana", "Bo", "Cy")


def test_unusable_relations_and_fusion_fall_back_to_rules(sqlite_bank: MemoryBank) -> None:
    llm = ScriptedCompassLLM(events=[by_session], relations=["E1 causes E2", "still prose"],
                             fusion=['{"same_event": "perhaps"}'])
    build_event_graph(sqlite_bank, "ana", [PUPPY], llm, config())
    report = build_event_graph(sqlite_bank, "ana", [CELLO], llm, config())
    assert report.relation_failures == 1 and report.fusion_failures == 1
    assert report.events_merged == 1  # the threshold rule: the identical summary merges
    assert report.edges["next"] == 1


def test_a_failing_llm_falls_back_and_a_failed_write_loses_nothing(sqlite_bank: MemoryBank, monkeypatch) -> None:
    report = build_event_graph(sqlite_bank, "ana", [PUPPY], FailingLLM(), config())
    assert report.fallback_sessions == 1 and report.extraction_failures == 2
    before = {m.id for m in events_of(sqlite_bank)}
    edges_before = [sqlite_bank.store.neighbours("ana", i, "out") for i in sorted(before)]

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(sqlite_bank.store, "add_events", broken)
    with pytest.raises(RuntimeError):
        build_event_graph(sqlite_bank, "ana", [CELLO], None, config())
    monkeypatch.undo()
    assert {m.id for m in events_of(sqlite_bank)} == before
    assert [sqlite_bank.store.neighbours("ana", i, "out") for i in sorted(before)] == edges_before
    again = build_event_graph(sqlite_bank, "ana", [PUPPY, CELLO], None, config())  # CELLO was not recorded as built
    assert (again.skipped_sessions, again.sessions) == (1, 1)


# ---- topics ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "k"), [(1, 1), (2, 2), (9, 2), (10, 2), (15, 3), (249, 49), (1000, 50)])
def test_cluster_count_is_the_papers(n: int, k: int) -> None:
    assert n_topics(n) == k


def test_kmeans_finds_separated_clusters_every_one_non_empty() -> None:
    generator = torch.Generator().manual_seed(1)
    centres = torch.eye(8)[:3] * 5
    x = torch.cat([c + 0.1 * torch.randn(10, 8, generator=generator) for c in centres])
    assign = kmeans(x, 3, seed=3)
    assert sorted(torch.bincount(assign).tolist()) == [10, 10, 10]
    assert all(len(set(assign[i:i + 10].tolist())) == 1 for i in (0, 10, 20))
    assert torch.equal(assign, kmeans(x, 3, seed=3))
    assert len(set(kmeans(torch.ones(5, 4), 3).tolist())) == 3  # identical rows still fill every cluster
    with pytest.raises(ValueError):
        kmeans(x, 31)


WORDS = ["pottery clay bowl glaze", "lisbon conference robot arm", "puppy walk park leash", "guitar concert music band",
         "garden tomato basil soil", "marathon running shoes training"]


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def story(n_sessions: int, user: str = "ana", turns: int = 12) -> list[Session]:
    """Sessions whose turns drift through WORDS in runs of three (a segmenter finds the runs)."""
    return [session(f"S{s}", [("Ana" if i % 2 == 0 else "Bo", f"we talked about {WORDS[(i // 3 + s) % len(WORDS)]} note{LETTERS[s]}{LETTERS[i]}")
                              for i in range(turns)], f"{s + 1} June 2023", user) for s in range(n_sessions)]


def test_topics_start_with_kmeans_and_recluster_every_t_sessions(sqlite_bank: MemoryBank) -> None:
    cfg = config(recluster_every=2, thresholds=Thresholds(1.0, 0.3, 0.5, "test"))
    first = build_event_graph(sqlite_bank, "ana", story(1), None, cfg)
    topics = current_topics(sqlite_bank.store, "ana")
    assert len(topics) == n_topics(first.events_inserted) and {t.id[:4] for t in topics} == {"g001"}
    report = build_event_graph(sqlite_bank, "ana", story(4)[1:], None, cfg)
    assert report.reclusterings == 2  # sessions 2 and 4
    topics = current_topics(sqlite_bank.store, "ana")
    events = {m.id for m in events_of(sqlite_bank)}
    members = [m for t in topics for m in t.members]
    assert {t.id[:4] for t in topics} == {"g003"} and sorted(members) == sorted(events)  # each event once
    assert len(topics) == n_topics(len(events))
    assert len(sqlite_bank.store.topics("ana")) > len(topics)  # older generations stay stored, unread


@pytest.mark.parametrize(("delta", "grows"), [(-1.0, False), (1.0, True)])
def test_new_events_join_the_nearest_topic_above_delta_or_start_one(sqlite_bank: MemoryBank, delta: float,
                                                                     grows: bool) -> None:
    cfg = config(recluster_every=100, thresholds=Thresholds(1.0, delta, 0.5, "test"))
    build_event_graph(sqlite_bank, "ana", story(1), None, cfg)
    before = len(current_topics(sqlite_bank.store, "ana"))
    report = build_event_graph(sqlite_bank, "ana", story(2)[1:], None, cfg)
    after = current_topics(sqlite_bank.store, "ana")
    assert len(after) == (before + report.events_inserted if grows else before)
    assert sorted(m for t in after for m in t.members) == sorted(m.id for m in events_of(sqlite_bank))


# ---- the fallback graph ------------------------------------------------------------------------------
def test_fallback_graph_on_both_stores(bank: MemoryBank) -> None:
    sessions = story(3)
    report = build_event_graph(bank, "ana", sessions, None, config(thresholds=Thresholds(1.0, 0.3, 0.6, "test")))
    events = events_of(bank)
    assert report.fallback_sessions == 3 and report.llm_calls == 0 and len(events) == report.events_inserted
    assert all(m.source_text == FALLBACK_LABEL and m.time_span[0].endswith("June 2023") for m in events)
    assert sorted(r for m in events for r in m.refs) == sorted(t.id for s in sessions for t in s.turns)
    per_session = {s.id: sum(m.refs[0].startswith(s.id + ":") for m in events) for s in sessions}
    assert report.edges["next"] == sum(n - 1 for n in per_session.values())
    for edge in (e for m in events for e in bank.store.neighbours("ana", m.id, "out", "next")):
        assert len(edge.evidence) == 2
    similar = [e for m in events for e in bank.store.neighbours("ana", m.id, "out", "similar")]
    assert similar and len(similar) == report.edges["similar"]
    session_of = {m.id: m.refs[0].split(":")[0] for m in events}
    assert all(session_of[e.source] > session_of[e.target] for e in similar)  # to earlier sessions only
    hits = bank.search(["robot arm conference in lisbon"], "ana", 2)[0].memory_ids
    assert all("lisbon" in bank.get("ana", [h])[0].text for h in hits)
    assert build_event_graph(bank, "ana", sessions, None, config()).skipped_sessions == 3  # built once


def test_fallback_merge_rewires_edges_onto_the_stored_event(sqlite_bank: MemoryBank) -> None:
    lines = [("Ana", "pottery clay bowl glaze kiln"), ("Bo", "pottery clay bowl glaze kiln"),
             ("Ana", "lisbon robot conference arm"), ("Bo", "lisbon robot conference arm")]
    cfg = config(thresholds=Thresholds(0.99, 0.3, 0.99, "test"), segmenter=SegmenterConfig(min_size=2, max_size=2))
    build_event_graph(sqlite_bank, "ana", [session("A", lines)], None, cfg)
    (pottery,) = [m for m in events_of(sqlite_bank) if "pottery" in m.text]
    report = build_event_graph(sqlite_bank, "ana", [session("B", lines[:2] + [("Ana", "tomato basil garden soil"),
                                                                              ("Bo", "tomato basil garden soil")])],
                               None, cfg)
    assert report.events_merged == 1 and report.events_inserted == 1
    (garden,) = [m for m in events_of(sqlite_bank) if "tomato" in m.text]
    merged = sqlite_bank.get("ana", [pottery.id])[0]
    assert merged.refs == ["A:0", "A:1", "B:0", "B:1"] and len(merged.merged_from) == 1
    assert Edge(pottery.id, garden.id, "next", ("B:1", "B:2")) in sqlite_bank.store.neighbours("ana", pottery.id)
    vector = sqlite_bank.embeddings("ana", [pottery.id])[0]
    assert torch.allclose(vector, BagOfWordsEncoder().encode_passages([merged.text])[0], atol=1e-5)


def test_an_event_needs_a_time_so_a_timeless_session_names_itself(sqlite_bank: MemoryBank) -> None:
    build_event_graph(sqlite_bank, "ana", [session("Z", [("Ana", "pottery clay bowl"), ("Bo", "nice glaze")], None)],
                      None, config())
    assert {m.time_span for m in events_of(sqlite_bank)} == {("session Z", "session Z")}


def test_sessions_of_another_user_are_refused(sqlite_bank: MemoryBank) -> None:
    with pytest.raises(ValueError, match="another user"):
        build_event_graph(sqlite_bank, "bo", [PUPPY], None, config())


# ---- calibration -----------------------------------------------------------------------------------
def test_calibration_reads_only_the_users_it_is_given() -> None:
    users = {u: story(3, u) for u in ("u1", "u2", "u3")}
    dataset = Dataset("tiny", users, [])
    found = calibrate_thresholds(dataset, ["u1", "u2"], BagOfWordsEncoder())
    t = found.thresholds
    assert -1 <= t.similar <= t.merge <= 1 and found.users == ["u1", "u2"] and "u1, u2" in t.source
    changed = Dataset("tiny", {**users, "u3": [session("X", [("Ana", "completely different words here")] * 6,
                                                      user="u3")]}, [])
    assert calibrate_thresholds(changed, ["u1", "u2"], BagOfWordsEncoder()).thresholds == t
    assert calibrate_thresholds(dataset, ["u1", "u3"], BagOfWordsEncoder()).samples["own_centroid"] > 0
    with pytest.raises(ValueError, match="unknown"):
        calibrate_thresholds(dataset, ["u1", "conv-30"], BagOfWordsEncoder())


def test_calibrated_on_locomo_training_users_only() -> None:

    locomo = ["conv-26", "conv-30", "conv-41", "conv-42", "conv-43", "conv-44", "conv-47", "conv-48", "conv-49",
              "conv-50"]
    assert split_users_in_order(locomo, 0.3, 0)[0] == ["conv-26", "conv-41", "conv-42", "conv-43", "conv-44", "conv-47",
                                              "conv-50"]
    minilm = type("Enc", (), {"fingerprint": "bert-d384-mean-l2:ac926ec96732d916", "name": "minilm"})()
    source = thresholds_for(minilm).source
    assert "calibrated" in source and not any(u in source for u in ("conv-30", "conv-48", "conv-49"))
    assert thresholds_for(BagOfWordsEncoder()).source.startswith("paper")


# ---- rmm eval --granularity event ------------------------------------------------------------------------
def test_eval_event_granularity(tiny_data_dir, tmp_path, capsys, isolated_cache) -> None:  # noqa: F811
    out = tmp_path / "eval.json"
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--granularity", "topic", "event", "--k", "5",
                 "--device", "cpu", "--json", str(out)]) == 0
    reports = json.loads(out.read_text())
    event = reports["minilm/event"]
    assert "fallback event graph" in event["retriever"] and event["overall"]["recall@5"] > 0.5
    printed = capsys.readouterr().out
    assert "memory granularity" in printed and "topic / event" in printed
    (folder,) = (tmp_path / "cache" / "banks").glob("locomo-event-*")
    with MemoryBank(folder, BagOfWordsEncoder(), device="cpu") as cached:
        assert all(m.kind == "event" for u in cached.users() for m in cached.memories(u))
        assert all(current_topics(cached.store, u) for u in cached.users())
        generations = {u: cached.store.generation(u) for u in cached.users()}
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--granularity", "event", "--k", "5",
                 "--device", "cpu"]) == 0  # cached: built once
    with MemoryBank(folder, BagOfWordsEncoder(), device="cpu") as cached:
        assert {u: cached.store.generation(u) for u in cached.users()} == generations


def test_train_event_granularity(tiny_data_dir, tmp_path, fake_minilm) -> None:  # noqa: F811
    out = tmp_path / "train.json"
    assert main(["train", "--data-dir", str(tiny_data_dir), "--granularity", "event", "--k", "4", "--m", "2",
                 "--heldout", "0.34", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["granularity"] == "event" and "recall@2" in report["reranker_heldout"]
    assert report["questions"]["scorable"] > 0
