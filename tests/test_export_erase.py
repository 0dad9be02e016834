"""Export and erase: `export_user` / `rmm data export` write everything stored for a user;
`delete_user` leaves none of the user's text in the SQLite files' bytes or PostgreSQL's tables.

(The store's `users` table keeps a deleted user's id with its generation counter, so a re-created
user's caches never mistake an old snapshot for a new one: the id stays, the content does not.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import BagOfWordsEncoder

from rmm import Memory
from rmm.cli import main
from rmm.data import load_dataset
from rmm.errors import DataError, UnknownUserError

# strings that occur nowhere but in what the user "ana" stored (memories, turns, queries)
SECRETS = ["Quetzalcoatlus wingspan notes", "Xylophagous beetle diary", "Zanzibar ferry ticket 88412",
           "Vermilion kayak named Ophelia", "Oubliette escape riddle", "Jacaranda street apartment 7"]
OTHER = "Bo collects Marimba recordings"
# what only ana's event graph holds (rmm.memory.graph): event text, participant, edge label and evidence, topic
GRAPH_SECRETS = ["Harpsichord recital in Quito", "Participant Evangelina", "prompted-by-Wolfhound",
                 "evidence-turn-Nightjar", "Topic about Obsidian quarries"]


def open_memory(location: Path | str, **settings) -> Memory:
    return Memory.open(location, encoder=BagOfWordsEncoder(), device="cpu", reranker_per="user",
                       learner={"batch_size": 1}, **settings)


def fill(memory: Memory) -> None:
    """Every kind of thing a user leaves: memories, a reflected session, a posted session with its
    turns stored, an open session, selections with feedback (the per-user reranker learns)."""
    memory.add_memories("ana", [SECRETS[0], {"text": SECRETS[1], "kind": "topic", "id": "diary", "refs": ["x:1"]}])
    memory.add_turns("ana", [("ana", SECRETS[2]), ("assistant", "Safe travels!")])
    assert memory.end_session("ana", wait=True).status == "done"
    job = memory.add_session("ana", [("ana", SECRETS[3])], session_id="ana-s2", time="2024-02-03", store_turns=True,
                             wait=True)
    assert job.status == "done"
    memory.add_turns("ana", [("ana", SECRETS[4])])  # left open
    hit = memory.retrieve_one("ana", f"{SECRETS[5]}?", k=3, m=2, explore=True)
    assert memory.feedback(hit.selection_id, cited=[0]).learned  # (PostgreSQL: learned in the background)
    memory.add_memories("bo", [OTHER])
    memory.checkpoint()


def add_graph(memory: Memory) -> None:
    """Events of ana's with every graph row: participants, an edge with label and evidence, a topic."""
    from rmm.memory.graph import Edge, Event, Topic
    from rmm.serve.scoping import scoped
    from rmm.types import Memory as Record

    user = scoped(memory.tenant, "ana")
    events = [Record(id=f"ev{i}", user_id=user, kind="event", text=text, refs=["x:1"], time_span=("2024-02-03", None))
              for i, text in enumerate([GRAPH_SECRETS[0], "a second event"])]
    memory.service.bank.store.add_events(user, [Event(events[0], (GRAPH_SECRETS[1],)), events[1]],
                                         [Edge("ev0", "ev1", GRAPH_SECRETS[2], (GRAPH_SECRETS[3],))],
                                         [Topic("topic0", GRAPH_SECRETS[4], ("ev0", "ev1"))])


def bytes_under(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())


def found(blob: bytes, texts: list[str]) -> list[str]:
    return [t for t in texts if t.encode() in blob]


# ---- export -----------------------------------------------------------------------------------------
def test_export_writes_everything_in_the_dataset_format(tmp_path: Path) -> None:
    with open_memory(tmp_path / "bank") as memory:
        fill(memory)
        manifest = memory.export_user("ana", tmp_path / "out")
        with pytest.raises(DataError, match="not empty"):
            memory.export_user("ana", tmp_path / "out")
        with pytest.raises(UnknownUserError):
            memory.export_user("nobody", tmp_path / "out2")
    out = tmp_path / "out"
    assert json.loads((out / "manifest.json").read_text()) == manifest
    counts = manifest["counts"]
    assert (counts["sessions"], counts["turns"], counts["selections"], counts["feedback"]) == (3, 4, 1, 1)
    assert counts["memory_kinds"]["turn"] == 2 and counts["memories"] >= 4  # one added, one stored turn
    assert manifest["reranker"] == "reranker" and (out / "reranker").is_dir()
    assert set(manifest["files"]) >= {"data.jsonl"} and len(manifest["files"]) > 1
    text = (out / "data.jsonl").read_text(encoding="utf-8")
    assert found(text.encode(), SECRETS) == SECRETS and OTHER not in text
    dataset = load_dataset(f"jsonl:{out / 'data.jsonl'}")
    assert dataset.users == ["ana"]
    sessions = dataset.sessions["ana"]
    assert [s.id for s in sessions][1] == "ana-s2" and sessions[1].time == "2024-02-03"
    assert sessions[-1].turns[0].text == SECRETS[4]  # the open session too
    records = [json.loads(line) for line in text.splitlines()]
    (feedback,) = [r for r in records if r["type"] == "feedback"]
    assert feedback["cited"] == [0] and feedback["learned"] and feedback["query"] == f"{SECRETS[5]}?"


def test_import_restores_an_export_in_another_bank(tmp_path: Path) -> None:
    with open_memory(tmp_path / "bank") as memory:
        fill(memory)
        memory.export_user("ana", tmp_path / "out")
        before = {m.id: m for m in memory.memories("ana")}
        steps = memory.service.learner("local:ana").stats.step
    with open_memory(tmp_path / "other") as memory:
        restored = memory.import_user(tmp_path / "out", user="ana2")
        assert restored == {"memories": len(before), "sessions_reflected": 0, "reranker": 1}
        after = {m.id: m for m in memory.memories("ana2")}
        assert {i: (m.text, m.kind, m.refs, m.created_at, m.time_span) for i, m in after.items()} == \
               {i: (m.text, m.kind, m.refs, m.created_at, m.time_span) for i, m in before.items()}
        assert memory.service.learner("local:ana2").stats.step == steps
        assert memory.import_user(tmp_path / "out" / "data.jsonl", user="ana3", reflect=True)["sessions_reflected"] == 3


def test_export_command(tmp_path: Path, monkeypatch, capsys) -> None:
    import rmm.embedded

    opened = rmm.embedded.Memory.open
    monkeypatch.setattr(rmm.embedded.Memory, "open",  # the command with the test's encoder (as the bank was built)
                        classmethod(lambda cls, *a, **k: opened(*a, **{"encoder": BagOfWordsEncoder(), **k})))
    with open_memory(tmp_path / "bank") as memory:
        fill(memory)
    config = tmp_path / "serve.yaml"
    config.write_text("reranker_per: user\n")
    assert main(["data", "export", "--user", "ana", "--bank", str(tmp_path / "bank"), "--config", str(config),
                 str(tmp_path / "out")]) == 0
    assert "ana: exported to" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["reranker"] == "reranker"
    assert main(["data", "export", "--user", "nobody", "--bank", str(tmp_path / "bank"), str(tmp_path / "o2")]) == 2
    assert "unknown user 'nobody'" in capsys.readouterr().out


# ---- erase ------------------------------------------------------------------------------------------
def test_delete_user_leaves_no_text_in_the_sqlite_files(tmp_path: Path) -> None:
    folder = tmp_path / "bank"
    with open_memory(folder) as memory:
        fill(memory)
        add_graph(memory)
        memory.checkpoint()
        assert found(bytes_under(folder), SECRETS + GRAPH_SECRETS) == SECRETS + GRAPH_SECRETS  # the scan sees what is stored
        counts = memory.delete_user("ana")
        assert counts["session_turns"] == 1 and counts["selections"] == 1
        assert found(bytes_under(folder), SECRETS + GRAPH_SECRETS) == []  # while open: the logs were truncated
        assert not [p for p in folder.rglob("*") if "local_ana" in p.name]  # index file, reranker folder
        assert [m.text for m in memory.memories("bo")] == [OTHER]
    blob = bytes_under(folder)
    assert found(blob, SECRETS + GRAPH_SECRETS) == [] and OTHER.encode() in blob


def test_delete_user_leaves_no_text_in_the_postgresql_tables(tmp_path: Path, pg_url: str) -> None:
    import psycopg

    from rmm.memory.pg_connect import parse_location

    location = parse_location(pg_url)

    def table_text() -> str:
        with psycopg.connect(location.conninfo, autocommit=True) as conn:
            tables = [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s",
                                                 (location.schema,))]
            return "\n".join(str(row[0]) for table in tables
                             for row in conn.execute(f'SELECT t::text FROM "{location.schema}"."{table}" t'))

    with open_memory(pg_url, folder=tmp_path / "sessions") as memory:
        fill(memory)
        add_graph(memory)
        assert found(table_text().encode(), SECRETS) == [s for s in SECRETS if s != SECRETS[4]]  # open: folder
        assert found(table_text().encode(), GRAPH_SECRETS) == GRAPH_SECRETS
        manifest = memory.export_user("ana", tmp_path / "out")
        assert manifest["store"] == "postgresql" and manifest["counts"]["feedback"] == 1
        memory.delete_user("ana")
        assert found(table_text().encode(), SECRETS + GRAPH_SECRETS) == []
        assert OTHER in table_text()
    assert found(bytes_under(tmp_path / "sessions"), SECRETS) == []


def test_export_command_on_postgresql(tmp_path: Path, pg_url: str, monkeypatch) -> None:
    import rmm.embedded

    opened = rmm.embedded.Memory.open
    monkeypatch.setattr(rmm.embedded.Memory, "open",
                        classmethod(lambda cls, *a, **k: opened(*a, **{"encoder": BagOfWordsEncoder(), **k})))
    with open_memory(pg_url, folder=tmp_path / "sessions") as memory:
        memory.add_memories("bo", [OTHER])
        memory.add_turns("bo", [("bo", "still talking")])
    assert main(["data", "export", "--user", "bo", "--store", pg_url, "--sessions-folder", str(tmp_path / "sessions"),
                 str(tmp_path / "out")]) == 0
    dataset = load_dataset(f"jsonl:{tmp_path / 'out' / 'data.jsonl'}")
    assert dataset.turns("bo")[0].text == "still talking"
    assert OTHER in (tmp_path / "out" / "data.jsonl").read_text()
