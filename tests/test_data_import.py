"""`rmm data import`: a dataset in rmm's format into a live bank, resumable with no duplicates,
refused whole (with line numbers) before anything is written when malformed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import BagOfWordsEncoder

from rmm import Memory
from rmm.cli import main

USERS = {
    "ana": [("ana:s1", "2024-05-01", [("ana", "My parcel never arrived"), ("assistant", "Sorry! Which order?"),
                                      ("ana", "Order 4411, a green kayak")]),
            ("ana:s2", "2024-05-03", [("ana", "I go hiking in the Alps every June"), ("assistant", "Lovely!")])],
    "bo": [("bo:s1", None, [("bo", "I play the cello in a community orchestra"), ("assistant", "Since when?"),
                            ("bo", "Since I was nine")])],
}
MEMORY = {"type": "memory", "id": "bo-note", "user": "bo", "kind": "topic", "text": "Bo rehearses on Tuesdays",
          "refs": ["bo:s1:0"], "created_at": 1700000000.0, "updated_at": 1700000001.0}


def write_dataset(path: Path) -> Path:
    records: list[dict] = [{"type": "dataset", "format": 1, "name": "tiny"}, {"type": "user", "id": "cy"}]
    for user, sessions in USERS.items():
        for sid, time, turns in sessions:
            records.append({"type": "session", "id": sid, "user": user, "time": time})
            records += [{"type": "turn", "id": f"{sid}:{n}", "session": sid, "speaker": speaker, "text": text}
                        for n, (speaker, text) in enumerate(turns)]
    records.append(MEMORY)
    records.append({"type": "question", "id": "q1", "user": "ana", "text": "Where does Ana hike?"})
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def test_encoder(monkeypatch):
    """The command opens banks with the test's encoder (no model download)."""
    import rmm.embedded

    opened = rmm.embedded.Memory.open
    monkeypatch.setattr(rmm.embedded.Memory, "open",
                        classmethod(lambda cls, *a, **k: opened(*a, **{"encoder": BagOfWordsEncoder(), **k})))


def content(location: str | Path, **options) -> dict[str, list[tuple]]:
    with Memory.open(location, encoder=BagOfWordsEncoder(), device="cpu", **options) as memory:
        return {u: sorted((m.id, m.kind, m.text) for m in memory.memories(u)) for u in sorted(memory.users())}


EXPECTED = {
    "ana": sorted((f"{sid}:{n}", "turn", f"{speaker}: {text}")
                  for sid, _, turns in USERS["ana"] for n, (speaker, text) in enumerate(turns)),
    "bo": sorted([("bo-note", "topic", MEMORY["text"])]
                 + [(f"bo:s1:{n}", "turn", f"{s}: {t}") for n, (s, t) in enumerate(USERS["bo"][0][2])]),
}


def test_import_into_sqlite_and_a_rerun_adds_nothing(tmp_path: Path, test_encoder, capsys) -> None:
    data = write_dataset(tmp_path / "tiny.jsonl")
    bank = tmp_path / "bank"
    assert main(["data", "import", str(data), "--bank", str(bank), "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "8 turn memories and 1 memories written, 0 already there" in out and "1 questions" in out
    assert content(bank) == EXPECTED
    with Memory.open(bank, encoder=BagOfWordsEncoder(), device="cpu") as memory:
        (bo_note,) = [m for m in memory.memories("bo") if m.id == "bo-note"]
        assert (bo_note.created_at, bo_note.refs) == (1700000000.0, ["bo:s1:0"])  # provenance kept
        (turn,) = [m for m in memory.memories("ana") if m.id == "ana:s1:0"]
        assert turn.source_text == "My parcel never arrived" and turn.refs == ["ana:s1:0"]
        assert memory.retrieve_one("ana", "hiking Alps June", k=2, m=1).memories[0].id == "ana:s2:0"
    assert main(["data", "import", str(data), "--bank", str(bank)]) == 0
    assert "0 turn memories and 0 memories written, 9 already there" in capsys.readouterr().out
    assert content(bank) == EXPECTED


def test_a_crash_mid_import_then_a_rerun_gives_exactly_the_full_content(tmp_path: Path, test_encoder,
                                                                       monkeypatch) -> None:
    """A crash after the second committed batch (the process dying there is what a kill at that
    point leaves: whole batches), then the rerun: everything once, nothing twice."""
    from rmm.serve.service import RetrievalService

    data = write_dataset(tmp_path / "tiny.jsonl")
    bank = tmp_path / "bank"
    real = RetrievalService.add_memories
    calls = []

    def dying(self, *args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt  # not an RmmError: escapes the command like a signal
        calls.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RetrievalService, "add_memories", dying)
    assert main(["data", "import", str(data), "--bank", str(bank), "--batch-size", "2"]) != 0
    partial = content(bank)
    assert sum(len(v) for v in partial.values()) == 4  # two batches of two, committed
    monkeypatch.setattr(RetrievalService, "add_memories", real)
    assert main(["data", "import", str(data), "--bank", str(bank), "--batch-size", "2"]) == 0
    assert content(bank) == EXPECTED


def stored_rows(bank: Path) -> int:
    import sqlite3

    files = [p for p in bank.glob("*.sqlite") if p.name not in ("jobs.sqlite", "sessions.sqlite")]
    total = 0
    for db in files:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'memories'").fetchone():
                total += conn.execute("SELECT count(*) FROM memories").fetchone()[0]
        except sqlite3.OperationalError:
            pass
        finally:
            conn.close()
    return total


@pytest.mark.slow
def test_a_killed_import_process_then_a_rerun_gives_exactly_the_full_content(tmp_path: Path) -> None:
    """A real SIGKILL of the importing process at a random point of its writes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    data = tmp_path / "big.jsonl"
    records = [{"type": "session", "id": f"u{u}:s{s}", "user": f"u{u}"} for u in range(3) for s in range(20)]
    records += [{"type": "turn", "id": f"u{u}:s{s}:{n}", "session": f"u{u}:s{s}", "speaker": "x",
                 "text": f"user {u} session {s} turn {n} word{n * 7 % 13}"}
                for u in range(3) for s in range(20) for n in range(10)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    bank = tmp_path / "bank"
    tests = Path(__file__).parent
    program = ("import sys; sys.path.insert(0, %r); from fakes import BagOfWordsEncoder; import rmm.embedded;"
               "o = rmm.embedded.Memory.open;"
               "rmm.embedded.Memory.open = classmethod(lambda c, *a, **k: o(*a, encoder=BagOfWordsEncoder(), **k));"
               "from rmm.cli import main; sys.exit(main(sys.argv[1:]))") % str(tests)
    argv = [sys.executable, "-c", program, "data", "import", str(data), "--bank", str(bank), "--batch-size", "5",
            "--no-progress"]
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while stored_rows(bank) < 50 and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.005)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert 0 < stored_rows(bank) < 600  # killed mid-import
    assert subprocess.run(argv, stdout=subprocess.DEVNULL, timeout=300).returncode == 0
    stored = content(bank)
    assert {u: len(v) for u, v in stored.items()} == {f"u{u}": 200 for u in range(3)}
    assert all(len({m[0] for m in v}) == 200 for v in stored.values())


def test_reflect_builds_topic_memories_once(tmp_path: Path, test_encoder, capsys) -> None:
    data = write_dataset(tmp_path / "tiny.jsonl")
    bank = tmp_path / "bank"
    assert main(["data", "import", str(data), "--bank", str(bank), "--reflect", "--no-turns"]) == 0
    assert "3 sessions reflected" in capsys.readouterr().out
    first = content(bank)
    topics = [m for m in first["ana"] if m[1] == "topic"]
    assert topics and not [m for m in first["ana"] if m[1] == "turn"]
    assert main(["data", "import", str(data), "--bank", str(bank), "--reflect", "--no-turns"]) == 0
    assert content(bank) == first  # one reflection job per session: the rerun's answer is the job already there


def test_malformed_input_is_refused_with_line_numbers_before_anything_is_written(tmp_path: Path, test_encoder,
                                                                                capsys) -> None:
    data = write_dataset(tmp_path / "tiny.jsonl")
    lines = data.read_text().splitlines()
    lines[3] = lines[3].replace('"speaker"', '"speker"')
    lines.append("{not json")
    data.write_text("\n".join(lines) + "\n")
    bank = tmp_path / "bank"
    assert main(["data", "import", str(data), "--bank", str(bank)]) == 1
    out = capsys.readouterr().out
    assert f"{data}:4: speker: unknown field" in out and f"{data}:{len(lines)}: not valid JSON" in out
    assert "nothing was imported" in out and not bank.exists()


def test_an_id_stored_with_other_text_is_refused_before_anything_is_written(tmp_path: Path, test_encoder,
                                                                           capsys) -> None:
    data = write_dataset(tmp_path / "tiny.jsonl")
    bank = tmp_path / "bank"
    with Memory.open(bank, encoder=BagOfWordsEncoder(), device="cpu") as memory:
        memory.add_memories("ana", [{"text": "something else", "id": "ana:s2:1"}])
    assert main(["data", "import", str(data), "--bank", str(bank)]) == 2
    assert "memory 'ana:s2:1' is stored with another text" in capsys.readouterr().out
    assert content(bank) == {"ana": [("ana:s2:1", "turn", "something else")]}


def test_import_into_postgresql_and_a_rerun_adds_nothing(tmp_path: Path, pg_url: str, test_encoder) -> None:
    data = write_dataset(tmp_path / "tiny.jsonl")
    argv = ["data", "import", str(data), "--store", pg_url, "--sessions-folder", str(tmp_path / "sessions")]
    assert main(argv) == 0
    assert main(argv) == 0
    assert content(pg_url, folder=tmp_path / "sessions") == EXPECTED


@pytest.mark.parametrize("flag", [[], ["--no-progress"]])
def test_the_progress_bar_shows_on_a_terminal_only_without_no_progress(tmp_path: Path, test_encoder, monkeypatch,
                                                                        flag: list[str]) -> None:
    import io

    from rich.console import Console

    import rmm.cli.data

    screen = io.StringIO()
    monkeypatch.setattr(rmm.cli.data, "console", Console(file=screen, force_terminal=True, width=100))
    data = write_dataset(tmp_path / "tiny.jsonl")
    assert main(["data", "import", str(data), "--bank", str(tmp_path / "bank"), *flag]) == 0
    assert ("importing" in screen.getvalue() and "9/9" in screen.getvalue()) == (not flag)
