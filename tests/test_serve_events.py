"""The event graph over HTTP (issue 33 item 6): the `events` reflection job, the neighbours endpoint
whose sampled slates a client-side explorer learns from through `/v1/feedback`, event memories
checked like `add_events`, and the graph in a user's export and back; on both stores."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import BagOfWordsEncoder, loopback_server
from fastapi.testclient import TestClient
from plackett_luce_helpers import naive_pl_logp
from test_serve_hardening import ALPHA, A, assert_error, cite_first_shown, make_app, store  # noqa: F401 - both stores

from rmm.data.jsonl import JsonlDataError, read_jsonl, write_jsonl
from rmm.llm.base import LLM, Usage
from rmm.memory.graph import Edge, Topic
from rmm.serve.app import create_app
from rmm.serve.client import AsyncRmmClient, RmmClient
from rmm.serve.config import load_config
from rmm.serve.export import export_user, import_user
from rmm.serve.scoping import scoped
from rmm.serve.service import RetrievalService

ANA = scoped("alpha", "ana")
HUB_TEXT = "Ana planned the family summer holiday"
NEIGHBOURS = {  # id -> text; every one joined to the hub
    "n0": "Ana booked flights to Lisbon for the holiday",
    "n1": "Ana packed hiking boots and mountain gear",
    "n2": "Ana bought sourdough bread for the picnic",
    "n3": "Ana rented a beach house near Lisbon",
    "n4": "Ana adopted a golden retriever puppy",
    "n5": "Ana practised cello before the orchestra concert",
}
SESSION = [("ana", "I booked flights to Lisbon for our summer holiday"),
           ("assistant", "Lovely, when do you leave?"),
           ("ana", "In July, we rented a beach house near the old town"),
           ("ana", "Separately, my golden retriever puppy started obedience classes"),
           ("assistant", "How is the puppy doing?"),
           ("ana", "The puppy learned to sit and stay after two lessons")]


def service_of(client: TestClient) -> RetrievalService:
    return client.app.state.service  # type: ignore[attr-defined]


@pytest.fixture
def client(tmp_path: Path, store: str | None) -> Iterator[TestClient]:  # noqa: F811
    with TestClient(make_app(tmp_path, store, reflection_events=True, learner={"batch_size": 1}),
                    raise_server_exceptions=False) as c:
        yield c


def event_json(memory_id: str, text: str, **fields: Any) -> dict[str, Any]:
    return {"id": memory_id, "kind": "event", "text": text, "refs": [f"t:{memory_id}"], "time": "2024-06-01",
            **fields}


def add_hub(client: TestClient) -> None:
    """hub -> n0..n4 (``next``, ``causes`` to n1), n5 -> hub (``before``), all events posted over HTTP."""
    events = [event_json("hub", HUB_TEXT, participants=["Ana", "Bo"])] + \
             [event_json(i, text) for i, text in NEIGHBOURS.items()]
    response = client.post("/v1/users/ana/memories", json={"memories": events}, headers=A)
    assert response.status_code == 201, response.text
    edges = [Edge("hub", f"n{i}", "next", (f"t:{i}",)) for i in range(5)] + [Edge("hub", "n1", "causes"),
                                                                            Edge("n5", "hub", "before")]
    service_of(client).bank.store.add_events(ANA, [], edges)


def neighbours(client: TestClient, event: str = "hub", user: str = "ana", **body: Any):
    return client.post(f"/v1/users/{user}/events/{event}/neighbours", json={"query": "Lisbon holiday", **body},
                       headers=A)


def wait_jobs(client: TestClient, *job_ids: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = [client.get(f"/v1/jobs/{j}", headers=A).json() for j in job_ids]
        if all(j["status"] in ("done", "failed", "cancelled") for j in jobs):
            return jobs
        assert time.monotonic() < deadline, jobs
        time.sleep(0.05)


def event_count(client: TestClient) -> int:
    return sum(m["kind"] == "event" for m in client.get("/v1/users/ana/memories", headers=A).json()["memories"])


# ---- the events job ------------------------------------------------------------------------------
def test_the_events_job_builds_the_graph_once_per_session(client: TestClient) -> None:
    body = {"session_id": "ana-s1", "time": "2024-06-01", "turns": [{"speaker": s, "text": t} for s, t in SESSION]}
    first = client.post("/v1/users/ana/sessions", json=body, headers=A).json()
    assert first["kind"] == "reflect" and first["events_job_id"]
    reflect, events = wait_jobs(client, first["job_id"], first["events_job_id"])
    assert reflect["status"] == "done" and reflect["result"]["events_job"] == first["events_job_id"]
    assert events["status"] == "done" and events["kind"] == "events", events
    assert events["result"]["built"] and events["result"]["method"].startswith("fallback")
    built = events["result"]["events"]
    assert built and event_count(client) == len(built)
    store = service_of(client).bank.store
    assert len(built) >= 2  # the fallback's segments, consecutive ones linked by `next` over their boundary turns
    nexts = [e for i in built for e in store.neighbours(ANA, i, "out") if e.label == "next"]
    assert len(nexts) == len(built) - 1 and all(set(e.evidence) <= {f"ana-s1:{n}" for n in range(6)} for e in nexts)
    assert store.topics(ANA) and all(t.members for t in store.topics(ANA))
    slate = neighbours(client, event=nexts[0].source, m=1, visited=[]).json()  # the built graph is served
    assert slate["neighbours"] >= 1 and len(slate["memories"]) == 1
    # posted again: the same two jobs answer, nothing is built twice
    again = client.post("/v1/users/ana/sessions", json=body, headers=A).json()
    assert (again["job_id"], again["events_job_id"]) == (first["job_id"], first["events_job_id"])
    assert event_count(client) == len(built)
    # an ended open session gets its own events job
    assert client.post("/v1/users/ana/turns", json={"turns": [{"speaker": "ana", "text": t} for _, t in SESSION[3:]]},
                       headers=A).status_code == 201
    ended = client.post("/v1/users/ana/sessions/end", headers=A).json()
    assert ended["events_job_id"] not in (None, first["events_job_id"])
    (events2,) = wait_jobs(client, ended["events_job_id"])
    assert events2["status"] == "done" and events2["result"]["built"]


def test_without_the_setting_no_events_job_is_queued(tmp_path: Path) -> None:
    with TestClient(make_app(tmp_path, None)) as c:
        job = c.post("/v1/users/ana/sessions", json={"turns": [{"speaker": "ana", "text": "I love tea"}]},
                     headers=A).json()
        assert job["events_job_id"] is None
        (done,) = wait_jobs(c, job["job_id"])
        assert done["status"] == "done" and "events_job" not in done["result"]


class GarbageLLM(LLM):
    """Answers every prompt with text no parser can read (a small model's worst day)."""

    def __init__(self) -> None:
        super().__init__("garbage")

    def _generate(self, batch, *, json_schema=None, max_tokens=512, temperature=0.0):
        self._record(Usage(calls=len(batch), prompt_tokens=10, completion_tokens=5))
        return ["Sure! Here are the events you asked for: {oops" for _ in batch]


def test_with_an_llm_the_events_job_uses_it_and_falls_back_on_unusable_replies(tmp_path: Path) -> None:
    config = load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": {ALPHA: "alpha"}, "device": "cpu",
                                "reflection_events": True}, environ={})
    llm = GarbageLLM()
    with TestClient(create_app(config, encoder=BagOfWordsEncoder(), llm=llm)) as c:
        body = {"session_id": "s1", "turns": [{"speaker": s, "text": t} for s, t in SESSION]}
        job = c.post("/v1/users/ana/sessions", json=body, headers=A).json()
        _, events = wait_jobs(c, job["job_id"], job["events_job_id"])
        assert events["status"] == "done" and events["result"]["method"] == "llm"
        report = events["result"]["report"]
        assert report["llm_calls"] >= 2 and report["extraction_failures"] >= 2  # asked, asked again, then
        assert report["fallback_sessions"] == 1 and events["result"]["events"]  # the labelled fallback
        assert llm.usage.calls >= 2


def test_a_failing_events_job_is_recorded_and_loses_nothing(client: TestClient, monkeypatch) -> None:
    add_hub(client)
    before = client.get("/v1/users/ana/memories", headers=A).json()["memories"]
    jobs = service_of(client).reflection.event_graph

    def fail(user: str, sessions: list) -> None:
        raise RuntimeError("relation store exploded")

    monkeypatch.setattr(jobs._get_builder(), "build", fail)
    job = client.post("/v1/users/ana/sessions", json={"turns": [{"speaker": "ana", "text": t} for _, t in SESSION]},
                      headers=A).json()
    reflect, events = wait_jobs(client, job["job_id"], job["events_job_id"])
    assert reflect["status"] == "done"
    assert events["status"] == "failed" and "relation store exploded" in events["error"] and ANA not in events["error"]
    after = {m["id"]: m for m in client.get("/v1/users/ana/memories", headers=A).json()["memories"]}
    assert all(after[m["id"]] == m for m in before)  # every stored memory as it was
    assert len(service_of(client).bank.store.neighbours(ANA, "hub", "both")) == 7


# ---- the neighbours endpoint ---------------------------------------------------------------------
def test_a_neighbours_slate_is_a_sample_of_the_unvisited_with_its_edges(client: TestClient) -> None:
    add_hub(client)
    seen: set[str] = set()
    for _ in range(12):
        response = neighbours(client, m=2, visited=["n0", "n3", "unknown-id"], explore=True)
        assert response.status_code == 200, response.text
        slate = response.json()
        assert slate["explore"] and slate["selection_id"] and (slate["neighbours"], slate["unvisited"]) == (6, 4)
        shown = [m["id"] for m in slate["memories"]]
        assert len(shown) == 2 and not {"n0", "n3", "hub"} & set(shown)
        seen.update(shown)
        for m in slate["memories"]:
            assert m["kind"] == "event" and m["refs"] == [f"t:{m['id']}"] and m["time_span"] == ["2024-06-01"] * 2
            directions = {(e["label"], e["direction"]) for e in m["edges"]}
            assert directions == {"n1": {("next", "out"), ("causes", "out")}, "n5": {("before", "in")}}.get(
                m["id"], {("next", "out")})
    assert len(seen) >= 3  # sampled, not always the same top-2
    out = neighbours(client, m=5, direction="out", label="next", visited=["n0"]).json()
    assert (out["neighbours"], out["unvisited"]) == (5, 4)
    assert sorted(m["id"] for m in out["memories"]) == ["n1", "n2", "n3", "n4"]
    assert not out["explore"]  # all the unvisited shown: nothing was chosen, so no sample
    scores = [m["score"] for m in out["memories"]]
    assert scores == sorted(scores, reverse=True)
    hub_in = neighbours(client, event="n5", m=3).json()["memories"]
    assert [(m["id"], m["participants"], m["edges"]) for m in hub_in] == \
           [("hub", ["Ana", "Bo"], [{"label": "before", "direction": "out", "evidence": []}])]
    alone = neighbours(client, event="hub", visited=list(NEIGHBOURS)).json()
    assert alone["memories"] == [] and alone["selection_id"] is None and alone["unvisited"] == 0


def test_feedback_on_a_neighbours_selection_updates_the_learner_as_sampled(client: TestClient) -> None:
    add_hub(client)
    service = service_of(client)
    learner = service.learner("alpha")
    step, version = learner.stats.step, learner.reranker.version
    slate = neighbours(client, m=2, visited=["n0"], explore=True).json()
    pending = cite_first_shown(client, slate["selection_id"], step)
    # stored as sampled: the unvisited candidates only, behaviour log-probs of each pick under scores/τ
    assert "n0" not in pending.memory_ids and "hub" not in pending.memory_ids and len(pending.memory_ids) == 5
    assert pending.explore and pending.version == version and pending.logp is not None
    expected = naive_pl_logp(pending.scores, torch.as_tensor(pending.chosen), pending.tau)  # pick by pick
    assert torch.allclose(pending.logp, expected, atol=1e-5)
    assert [pending.memory_ids[i] for i in pending.chosen] == [m["id"] for m in slate["memories"]]
    again = client.post("/v1/feedback", json={"selection_id": slate["selection_id"], "cited": [0]}, headers=A)
    assert_error(again, 409, code="selection_used")
    greedy = neighbours(client, m=6).json()  # every neighbour shown: greedy, stored, not learned
    unlearned = client.post("/v1/feedback", json={"selection_id": greedy["selection_id"], "no_cite": True},
                            headers=A).json()
    assert not greedy["explore"] and not unlearned["learned"] and "explore=false" in unlearned["reason"]


def test_bad_neighbours_requests_answer_the_error_contract(client: TestClient) -> None:
    add_hub(client)
    assert client.post("/v1/users/ana/memories", json={"memories": [{"text": "a plain turn", "id": "turn1"}]},
                       headers=A).status_code == 201
    assert_error(neighbours(client, user="nobody"), 404, code="unknown_user")
    missing = assert_error(neighbours(client, event="nope"), 404, code="unknown_memory")
    assert ANA not in missing["detail"]
    assert "not an event" in assert_error(neighbours(client, event="turn1"), 422, code="bad_request")["detail"]
    for bad in ({"m": 0}, {"m": 10_000}, {"query": "  \u200b"}, {"visited": "n1"}, {"direction": "up"},
                {"colour": "red"}, {"m": "2"}, {"label": ""}):
        assert_error(neighbours(client, **bad), 422)
    assert_error(client.post("/v1/users/ana/events/hub/neighbours", content=b"{oops",
                             headers={**A, "content-type": "application/json"}), 422)
    other = client.post("/v1/users/ana/events/hub/neighbours", json={"query": "x"},
                        headers={"Authorization": "Bearer nope-nope-nope"})
    assert_error(other, 401)


# ---- event memories over /v1/memories --------------------------------------------------------------
def test_event_memories_get_the_checks_add_events_makes(client: TestClient) -> None:
    refusals = {
        "refs": event_json("e1", "no refs", refs=[]),
        "explicit time": {k: v for k, v in event_json("e1", "no time").items() if k != "time"},
        "at most 3": event_json("e1", "crowd", participants=["A", "B", "C", "D"]),
    }
    for needle, memory in refusals.items():
        body = assert_error(client.post("/v1/users/ana/memories", json={"memories": [memory]}, headers=A), 422,
                            code="bad_request")
        assert body["detail"].startswith("memories[0]: event") and needle in body["detail"], body
    mixed = client.post("/v1/users/ana/memories", json={"memories": [{"text": "a turn"}, event_json("e1", "ok")]},
                        headers=A)
    assert "only events" in assert_error(mixed, 422, code="bad_request")["detail"]
    turn = client.post("/v1/users/ana/memories", json={"memories": [{"text": "a turn", "participants": ["A"]}]},
                       headers=A)
    assert "only events have participants" in assert_error(turn, 422)["detail"]
    assert_error(client.get("/v1/users/ana/memories", headers=A), 404, code="unknown_user")  # nothing was stored
    ok = client.post("/v1/users/ana/memories", json={"memories": [event_json("e1", "Ana met Bo", participants=["Ana",
                                                                                                           "Bo"])]},
                     headers=A)
    assert ok.status_code == 201 and ok.json()["ids"] == ["e1"]
    assert service_of(client).bank.store.participants(ANA, ["e1"]) == {"e1": ("Ana", "Bo")}
    hit = client.post("/v1/retrieve", json={"queries": [{"user": "ana", "query": "Ana met Bo"}]}, headers=A).json()
    assert hit["results"][0]["memories"][0]["id"] == "e1"  # an event is searchable like any memory


# ---- export and import -----------------------------------------------------------------------------
def test_export_then_import_keeps_the_graph(client: TestClient, tmp_path: Path) -> None:
    add_hub(client)
    service = service_of(client)
    service.bank.store.add_events(ANA, [], [Edge("n1", "n2", "prompted", ("t:n1", "t:n2"))],
                                  [Topic("g001-t000", "holiday", ("hub", "n0", "n3")), Topic("g001-t001", "pets", ("n4",))])
    manifest = export_user(service, "alpha", "ana", tmp_path / "out")
    assert (manifest["counts"]["edges"], manifest["counts"]["topics"]) == (8, 2)
    records = [json.loads(line) for line in (tmp_path / "out" / "data.jsonl").read_text().splitlines()]
    hub = next(r for r in records if r.get("id") == "hub")
    assert hub["participants"] == ["Ana", "Bo"]
    assert {"type": "edge", "user": "ana", "source": "n1", "target": "n2", "label": "prompted",
            "evidence": ["t:n1", "t:n2"]} in records
    assert {"type": "topic", "id": "g001-t001", "user": "ana", "summary": "pets", "members": ["n4"]} in records
    with TestClient(make_app(tmp_path / "elsewhere", None)) as other:
        restored = import_user(service_of(other), "alpha", tmp_path / "out", user="ana2")
        assert restored["memories"] == 7 and (restored["edges"], restored["topics"]) == (8, 2)
        copy, ana2 = service_of(other).bank.store, scoped("alpha", "ana2")
        original = service.bank.store
        for memory_id in ["hub", *NEIGHBOURS]:
            assert copy.neighbours(ana2, memory_id, "both") == original.neighbours(ANA, memory_id, "both")
        assert copy.topics(ana2) == original.topics(ANA)
        assert copy.participants(ana2, ["hub", "n0"]) == {"hub": ("Ana", "Bo"), "n0": ()}
        slate = other.post("/v1/users/ana2/events/hub/neighbours", json={"query": "Lisbon", "m": 2},
                           headers=A).json()
        assert len(slate["memories"]) == 2 and slate["selection_id"]  # the restored graph is served


def test_a_dataset_import_writes_the_graph_and_a_rerun_adds_nothing(client: TestClient, tmp_path: Path) -> None:
    from rmm.serve.importer import plan_import, run_import

    records = [{"type": "user", "id": "bo"},
               {"type": "memory", "id": "b1", "user": "bo", "kind": "event", "text": "Bo sailed to Crete",
                "refs": ["x:1"], "time_span": ["2024", "2024"], "participants": ["Bo", "Cy"]},
               {"type": "memory", "id": "b2", "user": "bo", "kind": "event", "text": "Bo repaired the boat",
                "refs": ["x:2"], "time_span": ["2024", "2024"]},
               {"type": "edge", "user": "bo", "source": "b2", "target": "b1", "label": "enabled", "evidence": ["x:2"]},
               {"type": "topic", "id": "sea", "user": "bo", "summary": "sailing", "members": ["b1", "b2"]}]
    write_jsonl(records, tmp_path / "bo.jsonl")
    service, bo = service_of(client), scoped("alpha", "bo")
    for _ in range(2):  # a rerun skips the stored events and writes the same graph rows again: no change
        report = run_import(service, "alpha", plan_import(service, "alpha", read_jsonl(tmp_path / "bo.jsonl")),
                            batch_size=1)
        assert (report.edges, report.topics) == (1, 1)
        store = service.bank.store
        assert store.neighbours(bo, "b1", "in") == [Edge("b2", "b1", "enabled", ("x:2",))]
        assert store.topics(bo) == [Topic("sea", "sailing", ("b1", "b2"))]
        assert store.participants(bo, ["b1", "b2"]) == {"b1": ("Bo", "Cy"), "b2": ()}
        assert sorted(m.id for m in store.memories(bo)) == ["b1", "b2"]
    assert report.memories == 0 and report.already_present == 2


def test_the_dataset_format_refuses_graph_records_it_cannot_store(tmp_path: Path) -> None:
    base = [{"type": "user", "id": "ana"},
            {"type": "memory", "id": "e1", "user": "ana", "kind": "event", "text": "x", "participants": ["A"]},
            {"type": "memory", "id": "e2", "user": "ana", "kind": "event", "text": "y"},
            {"type": "memory", "id": "t1", "user": "ana", "kind": "turn", "text": "z"}]
    good = tmp_path / "good.jsonl"
    write_jsonl(base + [{"type": "edge", "user": "ana", "source": "e1", "target": "e2", "label": "next"},
                        {"type": "topic", "id": "t", "user": "ana", "members": ["e1"]}], good)
    content = read_jsonl(good)
    assert content.edges == [{"user": "ana", "source": "e1", "target": "e2", "label": "next"}]
    assert content.topics[0]["members"] == ["e1"] and content.memories[0]["participants"] == ["A"]
    bad = tmp_path / "bad.jsonl"
    write_jsonl(base + [{"type": "edge", "user": "ana", "source": "e1", "target": "t1", "label": "next"},
                        {"type": "edge", "user": "ana", "source": "e1", "target": "e1", "label": "loop"},
                        {"type": "edge", "user": "bo", "source": "e1", "target": "e2", "label": "next"},
                        {"type": "topic", "id": "t", "user": "ana", "members": ["missing"]},
                        {"type": "memory", "id": "t2", "user": "ana", "kind": "turn", "text": "w",
                         "participants": ["A"]}], bad)
    with pytest.raises(JsonlDataError) as caught:
        read_jsonl(bad)
    problems = {(p.line, p.field) for p in caught.value.problems}
    assert problems == {(5, "target"), (6, "target"), (7, "user"), (8, "members"), (9, "participants")}


# ---- the README's client-side explorer ------------------------------------------------------------
README = Path(__file__).resolve().parents[1] / "README.md"


def readme_explorer() -> Any:
    """The `explore` function of the README's "Event graph over HTTP" example, as printed."""
    section = README.read_text(encoding="utf-8").split("### Event graph over HTTP", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    namespace: dict[str, Any] = {"__name__": "readme"}
    exec(compile(block.split("\nwith RmmClient(", 1)[0], str(README), "exec"), namespace)
    return namespace["explore"]


def test_a_client_side_explorer_learns_through_feedback(tmp_path: Path) -> None:
    """retrieve → neighbours → feedback with the sync client against a real server."""
    config = load_config(None, {"bank": str(tmp_path / "bank"), "auth.keys": {ALPHA: "alpha"}, "device": "cpu",
                                "learner": {"batch_size": 1}}, environ={})
    app = create_app(config, encoder=BagOfWordsEncoder())
    with loopback_server(app) as url, RmmClient(url, ALPHA) as rmm:
        rmm.add_memories("ana", [event_json("hub", HUB_TEXT)] + [event_json(i, t) for i, t in NEIGHBOURS.items()])
        # on a live server the `events` job writes the edges; here they are written directly
        app.state.service.bank.store.add_events(ANA, [], [Edge("hub", i, "next") for i in NEIGHBOURS])
        learner = app.state.service.learner("alpha")
        kept = readme_explorer()(rmm, "ana", "family summer holiday plans")
        assert kept[0] == "hub" and set(kept) <= {"hub", "n0", "n3"}
        # the hub's 6 neighbours > m=2: its slate was a sample, and its feedback took a step (batch_size 1)
        assert learner.stats.records >= 1 and learner.stats.step >= 1

        async def last_step() -> Any:
            async with AsyncRmmClient(url, ALPHA) as client:
                return await client.neighbours("ana", "hub", "holiday", visited=list(NEIGHBOURS), direction="out")

        done = asyncio.run(last_step())
        assert (done.neighbours, done.unvisited, done.memories, done.selection_id) == (6, 0, [], None)
