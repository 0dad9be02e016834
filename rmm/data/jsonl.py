"""rmm's own dataset format: JSON Lines, one record per line (docs/dataset-format.md).

Every line is one JSON object whose `type` says what it is: `dataset` (an optional header: name,
category names), `user`, `session` (its user, its time), `turn` (its session, speaker, text, time),
`question` (its user, text, answer, optional gold turn and session ids, category), and the kinds
an export of a live bank adds (`memory`, `feedback`, the event graph's `edge` and `topic`, and
Semantic XPath's tree `node`, one line per version; `rmm.embedded.Memory.export_user`), which
`read_jsonl` checks and keeps beside the `Dataset` (a `Dataset` has no field for them).

Why one record per line rather than one user per line: a user's history runs to thousands of
turns (a LongMemEval haystack is ~500 sessions), so a user-per-line file has megabyte lines that
no editor, `grep` or `jq -c` handles well, and a problem deep inside one can only be reported as
"line 3"; a record per line streams, appends (a new session is new lines at the end), diffs
line by line, and names the exact line and field of every problem.

Reading is all or nothing: every line is checked (JSON, type, fields and their types, unknown
fields, duplicate ids, references to users / sessions / turns that are not in the data), every
problem is collected with its file, line and field, and one `JsonlDataError` lists them all, so
no half-loaded dataset ever reaches a caller. The writer emits exactly what the reader reads: a
benchmark written and read back is an equal `Dataset` (`tests/test_dataset_jsonl.py`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rmm.errors import DataError
from rmm.types import MEMORY_KINDS, Dataset, Question, Session, Turn

__all__ = [
    "FORMAT_VERSION",
    "RECORD_FIELDS",
    "JsonlContent",
    "JsonlDataError",
    "Problem",
    "dataset_records",
    "load_jsonl",
    "read_jsonl",
    "write_jsonl",
]

FORMAT_VERSION = 1
_SHOWN_PROBLEMS = 50  # in the exception's message; `problems` holds every one

# type → {field: (accepted JSON types, required)}; `type` itself is implied
_STR, _OPT_STR = (str,), (str, type(None))
_STR_LIST = (list,)
RECORD_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "dataset": {"name": (_STR, False), "categories": ((dict,), False), "format": ((int,), False)},
    "user": {"id": (_STR, True)},
    "session": {"id": (_STR, True), "user": (_STR, True), "time": (_OPT_STR, False)},
    "turn": {"id": (_STR, True), "session": (_STR, True), "speaker": (_STR, True), "text": (_STR, True),
             "time": (_OPT_STR, False)},
    "question": {"id": (_STR, True), "user": (_STR, True), "text": (_STR, True), "answer": (_STR, False),
                 "gold_turns": (_STR_LIST, False), "gold_sessions": (_STR_LIST, False),
                 "category": ((int, type(None)), False), "category_name": (_STR, False),
                 "time": (_OPT_STR, False), "abstention": ((bool,), False)},
    "memory": {"id": (_STR, True), "user": (_STR, True), "kind": (_STR, True), "text": (_STR, True),
               "refs": (_STR_LIST, False), "source_text": (_STR, False), "created_at": ((int, float), False),
               "updated_at": ((int, float), False), "merged_from": (_STR_LIST, False),
               "time_span": ((list, type(None)), False), "participants": (_STR_LIST, False)},
    # the event graph (rmm.memory.graph): a directed labelled edge between two event memories, a topic
    "edge": {"user": (_STR, True), "source": (_STR, True), "target": (_STR, True), "label": (_STR, True),
             "evidence": (_STR_LIST, False)},
    "topic": {"id": (_STR, True), "user": (_STR, True), "summary": (_STR, False), "members": (_STR_LIST, False)},
    # Semantic XPath's tree (rmm.memory.tree): one version of one node; the highest version is the node
    "node": {"id": (_STR, True), "user": (_STR, True), "node_type": (_STR, True), "parent": (_OPT_STR, False),
             "position": ((int,), False), "attributes": ((dict,), False), "memory": (_OPT_STR, False),
             "version": ((int,), False), "revision": ((int,), False), "text": (_OPT_STR, False)},
    "feedback": {"selection": (_STR, True), "user": (_STR, True), "query": (_STR, True), "shown": (_STR_LIST, True),
                 "cited": ((list, type(None)), False), "no_cite": ((bool,), False),
                 "rewards": ((list, type(None)), False), "learned": ((bool,), False), "reason": (_OPT_STR, False),
                 "explore": ((bool,), False), "created_at": ((int, float), False),
                 "rewarded_at": ((int, float, type(None)), False)},
}


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one line: where (file, line, field) and what."""

    path: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.field + ': ' if self.field else ''}{self.message}"


class JsonlDataError(DataError):
    """A dataset file with problems; `problems` lists every one (the message shows the first 50)."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        shown = "\n".join(f"  {p}" for p in problems[:_SHOWN_PROBLEMS])
        more = f"\n  … and {len(problems) - _SHOWN_PROBLEMS} more" if len(problems) > _SHOWN_PROBLEMS else ""
        super().__init__(f"{len(problems)} problem(s) in the dataset; nothing was loaded:\n{shown}{more}")


@dataclass
class JsonlContent:
    """What a file holds: the `Dataset`, plus an export's memory, feedback, edge, topic and tree node
    records (plain dicts, `type` removed) in file order (`nodes`: every version of every node)."""

    dataset: Dataset
    memories: list[dict[str, Any]] = field(default_factory=list)
    feedback: list[dict[str, Any]] = field(default_factory=list)
    edges: list[dict[str, Any]] = field(default_factory=list)
    topics: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Line:
    path: str
    number: int
    record: dict[str, Any]
    ok: bool = True


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix == ".jsonl" and p.is_file())
        if not found:
            raise DataError(f"{path} holds no .jsonl file")
        return found
    if not path.is_file():
        raise DataError(f"dataset file {path} does not exist")
    return [path]


def _parse(files: list[Path], problems: list[Problem], rejected: set[str]) -> list[_Line]:
    """Every non-blank line that is a JSON object with a known type and well-typed fields; the ids
    of the lines refused go into `rejected` (what refers to them is not reported a second time)."""
    lines: list[_Line] = []
    for file in files:
        where = str(file)
        try:
            handle = file.open(encoding="utf-8")
        except OSError as exc:
            problems.append(Problem(where, 0, "", f"cannot be read: {exc}"))
            continue
        with handle:
            try:
                for number, text in enumerate(handle, start=1):
                    if not text.strip():
                        continue
                    line = _check_line(where, number, text, problems)
                    if line is None:
                        continue
                    if line.ok:
                        lines.append(line)
                    elif isinstance(line.record.get("id"), str):
                        rejected.add(line.record["id"])
            except UnicodeDecodeError as exc:
                problems.append(Problem(where, 0, "", f"is not UTF-8 text: {exc}"))
    return lines


def _check_line(where: str, number: int, text: str, problems: list[Problem]) -> _Line | None:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        problems.append(Problem(where, number, "", f"not valid JSON ({exc.msg} at column {exc.colno})"))
        return None
    if not isinstance(record, dict):
        problems.append(Problem(where, number, "", f"a line must be a JSON object, got {type(record).__name__}"))
        return None
    kind = record.get("type")
    if kind not in RECORD_FIELDS:
        problems.append(Problem(where, number, "type", f"must be one of {sorted(RECORD_FIELDS)}, got {kind!r}"))
        return None
    fields = RECORD_FIELDS[kind]
    ok = True
    for name in record:
        if name != "type" and name not in fields:
            problems.append(Problem(where, number, name, f"unknown field for a {kind} (known: {sorted(fields)})"))
            ok = False
    for name, (types, required) in fields.items():
        if name not in record:
            if required:
                problems.append(Problem(where, number, name, f"missing (required for a {kind})"))
                ok = False
            continue
        value = record[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            problems.append(Problem(where, number, name, f"must be {wanted}, got {type(value).__name__}"))
            ok = False
        elif types is _STR and required and not value.strip():
            problems.append(Problem(where, number, name, "must not be empty"))
            ok = False
        elif types is _STR_LIST and not all(isinstance(v, str) for v in value):
            problems.append(Problem(where, number, name, "must be a list of strings"))
            ok = False
    return _Line(where, number, record, ok)


def _unique(lines: Iterable[_Line], key: str, what: str, problems: list[Problem]) -> dict[str, _Line]:
    seen: dict[str, _Line] = {}
    for line in lines:
        value = line.record[key]
        if value in seen:
            first = seen[value]
            problems.append(Problem(line.path, line.number, key,
                                    f"duplicate {what} id {value!r} (first at {first.path}:{first.number})"))
        else:
            seen[value] = line
    return seen


def read_jsonl(path: str | os.PathLike[str], name: str | None = None) -> JsonlContent:
    """Read a `.jsonl` file, or every `.jsonl` file of a folder (in name order), all or nothing.

    Raises `JsonlDataError` listing every problem with its file, line and field."""
    root = Path(path).expanduser()
    files = _files(root)
    problems: list[Problem] = []
    rejected: set[str] = set()
    lines = _parse(files, problems, rejected)
    by_type: dict[str, list[_Line]] = {kind: [] for kind in RECORD_FIELDS}
    for line in lines:
        by_type[line.record["type"]].append(line)

    headers = by_type["dataset"]
    names = {h.record["name"] for h in headers if "name" in h.record}
    if len(names) > 1:
        problems.append(Problem(headers[-1].path, headers[-1].number, "name", f"the files name different datasets: {sorted(names)}"))
    categories: dict[int, str] = {}
    for header in headers:
        if header.record.get("format", FORMAT_VERSION) > FORMAT_VERSION:
            problems.append(Problem(header.path, header.number, "format",
                                    f"version {header.record['format']} is newer than this rmm reads ({FORMAT_VERSION})"))
        for key, label in header.record.get("categories", {}).items():
            try:
                number = int(key)
            except ValueError:
                problems.append(Problem(header.path, header.number, "categories", f"key {key!r} is not an integer"))
                continue
            if not isinstance(label, str):
                problems.append(Problem(header.path, header.number, "categories", f"name of {key} must be a string"))
            elif categories.get(number, label) != label:
                problems.append(Problem(header.path, header.number, "categories",
                                        f"category {number} named both {categories[number]!r} and {label!r}"))
            else:
                categories[number] = label

    users: dict[str, list[Session]] = {}
    declared = _unique(by_type["user"], "id", "user", problems)
    for user in declared:
        users[user] = []
    sessions = _unique(by_type["session"], "id", "session", problems)
    session_of: dict[str, Session] = {}
    for sid, line in sessions.items():
        user = line.record["user"]
        session = Session(id=sid, user_id=user, turns=[], time=line.record.get("time"))
        users.setdefault(user, []).append(session)
        session_of[sid] = session
    turn_user: dict[str, str] = {}
    first_turns = _unique(by_type["turn"], "id", "turn", problems)
    for line in by_type["turn"]:  # a repeated id's line is checked too, then left out
        tid = line.record["id"]
        session = session_of.get(line.record["session"])
        if session is None and line.record["session"] in rejected:
            continue  # its session's line is reported already
        if session is None:
            problems.append(Problem(line.path, line.number, "session", f"unknown session {line.record['session']!r}"))
            continue
        if first_turns[tid] is not line:
            continue
        session.turns.append(Turn(id=tid, session_id=session.id, speaker=line.record["speaker"],
                                  text=line.record["text"], time=line.record.get("time")))
        turn_user[tid] = session.user_id

    first_questions = _unique(by_type["question"], "id", "question", problems)
    questions = [q for line in by_type["question"]
                 if (q := _question(line, users, turn_user, session_of, problems, rejected, categories)) is not None
                 and first_questions[line.record["id"]] is line]
    memories = _owned(_unique(by_type["memory"], "id", "memory", problems).values(), users, problems)
    for line in memories:
        if line.record["kind"] not in MEMORY_KINDS:
            problems.append(Problem(line.path, line.number, "kind", f"must be one of {list(MEMORY_KINDS)}, "
                                                                   f"got {line.record['kind']!r}"))
        elif line.record.get("participants") and line.record["kind"] != "event":
            problems.append(Problem(line.path, line.number, "participants", "only event memories have participants"))
    edges, topics = _graph(by_type, memories, users, problems)
    nodes = _tree(by_type["node"], memories, users, problems)
    feedback = _owned(_unique(by_type["feedback"], "selection", "feedback selection", problems).values(), users,
                      problems)
    if problems:
        order = {str(f): n for n, f in enumerate(files)}
        raise JsonlDataError(sorted(problems, key=lambda p: (order.get(p.path, -1), p.line)))
    label = name or (next(iter(names)) if names else (root.stem if root.is_file() else root.name))
    strip = lambda line: {k: v for k, v in line.record.items() if k != "type"}  # noqa: E731
    return JsonlContent(Dataset(name=label, sessions=users, questions=questions, categories=categories),
                        memories=[strip(line) for line in memories], feedback=[strip(line) for line in feedback],
                        edges=[strip(line) for line in edges], topics=[strip(line) for line in topics],
                        nodes=[strip(line) for line in nodes])


_NAME = re.compile(r"[^\W\d]\w*")  # the query language's NAME: node types and attribute names


def _tree(lines: list[_Line], memories: list[_Line], users: dict[str, list[Session]],
          problems: list[Problem]) -> list[_Line]:
    """The tree's `node` records: each (user, id, version) once, of a declared user; types and
    attribute names are identifiers (queries name them; an attribute is never ``node``), attribute
    values text, versions and positions ≥ 0 (position < 2³¹). A node is its highest version: its
    `parent` must be a node of that user in the data (no cycle), its `memory` a memory of that
    user in the data — what the stores refuse otherwise. Older versions are history, not checked
    against the rest."""
    owned = {(line.record["user"], line.record["id"]) for line in memories}
    seen: dict[tuple[str, str, int], _Line] = {}
    for line in _owned(lines, users, problems):
        r = line.record
        version = r.get("version", 1)
        key = (r["user"], r["id"], version)
        if key in seen:
            first = seen[key]
            problems.append(Problem(line.path, line.number, "version",
                                    f"duplicate version {version} of node {r['id']!r} (first at {first.path}:"
                                    f"{first.number})"))
            continue
        before = len(problems)
        if _NAME.fullmatch(r["node_type"]) is None:
            problems.append(Problem(line.path, line.number, "node_type", f"{r['node_type']!r} is not an identifier"))
        for name, value in r.get("attributes", {}).items():
            if _NAME.fullmatch(name) is None or name == "node" or not isinstance(value, str):
                problems.append(Problem(line.path, line.number, "attributes",
                                        f"{name!r}: names are identifiers other than 'node', values are strings"))
        for name in ("version", "revision", "position"):
            if name in r and not 0 <= r[name] < 2**31:
                problems.append(Problem(line.path, line.number, name, "must be between 0 and 2^31 - 1"))
        if len(problems) == before:
            seen[key] = line
    latest: dict[tuple[str, str], _Line] = {}
    for (user, node_id, version), line in seen.items():
        if (user, node_id) not in latest or latest[(user, node_id)].record.get("version", 1) < version:
            latest[(user, node_id)] = line
    for (user, node_id), line in latest.items():
        parent, memory = line.record.get("parent"), line.record.get("memory")
        if parent is not None and (user, parent) not in latest:
            problems.append(Problem(line.path, line.number, "parent", f"not a node of user {user!r} in the data: "
                                                                      f"{parent!r}"))
        if memory is not None and (user, memory) not in owned:
            problems.append(Problem(line.path, line.number, "memory", f"not a memory of user {user!r} in the data: "
                                                                      f"{memory!r}"))
        walk, steps = parent, 0
        while walk is not None and (user, walk) in latest and steps <= len(latest):
            if walk == node_id:
                problems.append(Problem(line.path, line.number, "parent", f"node {node_id!r} is its own ancestor"))
                break
            walk, steps = latest[(user, walk)].record.get("parent"), steps + 1
    return list(seen.values())


def _graph(by_type: dict[str, list[_Line]], memories: list[_Line], users: dict[str, list[Session]],
           problems: list[Problem]) -> tuple[list[_Line], list[_Line]]:
    """The event graph's records: each `edge` once per (user, source, target, label) and each `topic`
    once per (user, id), of a declared user; edge ends and topic members must be `event` memories of
    that user in the data (what the stores refuse otherwise)."""
    events = {(line.record["user"], line.record["id"]) for line in memories if line.record["kind"] == "event"}

    def once(lines: list[_Line], key: Any, what: str) -> list[_Line]:
        seen: dict[Any, _Line] = {}
        for line in _owned(lines, users, problems):
            value = key(line.record)
            if value in seen:
                first = seen[value]
                problems.append(Problem(line.path, line.number, "", f"duplicate {what} (first at {first.path}:"
                                                                    f"{first.number})"))
            else:
                seen[value] = line
        return list(seen.values())

    def require_events(line: _Line, name: str, ids: list[str]) -> None:
        missing = [i for i in ids if (line.record["user"], i) not in events]
        if missing:
            problems.append(Problem(line.path, line.number, name, f"not event memories of user "
                                                                  f"{line.record['user']!r} in the data: {missing[:5]}"))

    edges = once(by_type["edge"], lambda r: (r["user"], r["source"], r["target"], r["label"]), "edge")
    for line in edges:
        if line.record["source"] == line.record["target"]:
            problems.append(Problem(line.path, line.number, "target", "an event is not its own neighbour"))
        require_events(line, "source", [line.record["source"]])
        require_events(line, "target", [line.record["target"]])
    topics = once(by_type["topic"], lambda r: (r["user"], r["id"]), "topic id for its user")
    for line in topics:
        require_events(line, "members", list(line.record.get("members", [])))
    return edges, topics


def _owned(lines: Iterable[_Line], users: dict[str, list[Session]], problems: list[Problem]) -> list[_Line]:
    """Export records whose user the data declares (a memory of an undeclared user is a problem)."""
    out = []
    for line in lines:
        if line.record["user"] not in users:
            problems.append(Problem(line.path, line.number, "user", f"unknown user {line.record['user']!r}"))
        else:
            out.append(line)
    return out


def _question(line: _Line, users: dict[str, list[Session]], turn_user: dict[str, str],
              session_of: dict[str, Session], problems: list[Problem], rejected: set[str],
              categories: dict[int, str]) -> Question | None:
    record, before = line.record, len(problems)
    user = record["user"]
    if user not in users:
        problems.append(Problem(line.path, line.number, "user", f"unknown user {user!r} (no user or session line names it)"))
        return None
    gold_turns = list(record.get("gold_turns", []))
    for tid in gold_turns:
        if tid not in turn_user and tid in rejected:
            continue  # the turn's own line is reported
        if turn_user.get(tid) != user:
            whose = f"a turn of user {turn_user[tid]!r}" if tid in turn_user else "not a turn in the data"
            problems.append(Problem(line.path, line.number, "gold_turns", f"gold turn {tid!r} is {whose}"))
    if "gold_sessions" in record:
        gold_sessions = list(record["gold_sessions"])
        for sid in gold_sessions:
            owner = session_of[sid].user_id if sid in session_of else None
            if owner != user:
                whose = f"a session of user {owner!r}" if owner else "not a session in the data"
                problems.append(Problem(line.path, line.number, "gold_sessions", f"gold session {sid!r} is {whose}"))
    else:  # the sessions holding the gold turns, in order of first mention
        owners = {t.id: s.id for s in users[user] for t in s.turns}
        gold_sessions = list(dict.fromkeys(owners[t] for t in gold_turns if t in owners))
    if len(problems) > before:
        return None
    return Question(id=record["id"], user_id=user, text=record["text"], answer=record.get("answer", ""),
                    evidence_turns=gold_turns, evidence_sessions=gold_sessions, category=record.get("category"),
                    category_name=record.get("category_name", categories.get(record.get("category"), "")),  # type: ignore[arg-type]
                    time=record.get("time"),
                    abstention=record.get("abstention", False))


def load_jsonl(path: str | os.PathLike[str], name: str | None = None) -> Dataset:
    """The `Dataset` of a file or folder in rmm's format (`load_dataset("jsonl:PATH")`)."""
    return read_jsonl(path, name).dataset


# ---- writing ------------------------------------------------------------------------------------
def dataset_records(dataset: Dataset) -> Iterator[dict[str, Any]]:
    """The dataset as records, in the order the reader rebuilds it: the header, then each user
    with its sessions and their turns, then the questions."""
    header: dict[str, Any] = {"type": "dataset", "format": FORMAT_VERSION, "name": dataset.name}
    if dataset.categories:
        header["categories"] = {str(k): v for k, v in sorted(dataset.categories.items())}
    yield header
    for user, sessions in dataset.sessions.items():
        yield {"type": "user", "id": user}
        for session in sessions:
            yield {"type": "session", "id": session.id, "user": user, "time": session.time}
            for turn in session.turns:
                if turn.session_id != session.id:
                    raise DataError(f"turn {turn.id!r} says session {turn.session_id!r} but sits in {session.id!r}")
                yield {"type": "turn", "id": turn.id, "session": session.id, "speaker": turn.speaker,
                       "text": turn.text, "time": turn.time}
    for q in dataset.questions:
        yield {"type": "question", "id": q.id, "user": q.user_id, "text": q.text, "answer": q.answer,
               "gold_turns": list(q.evidence_turns), "gold_sessions": list(q.evidence_sessions),
               "category": q.category, "category_name": q.category_name, "time": q.time,
               "abstention": q.abstention}


def write_jsonl(records: Iterable[dict[str, Any]], out: str | os.PathLike[str] | IO[str]) -> int:
    """Write records one per line (UTF-8, non-ASCII kept); returns how many. A path is written to
    a temporary file renamed into place, so a reader never sees half a file."""
    if not isinstance(out, (str, os.PathLike)):
        return _write(records, out)
    path = Path(out).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("w", encoding="utf-8") as handle:
            count = _write(records, handle)
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return count


def _write(records: Iterable[dict[str, Any]], handle: IO[str]) -> int:
    count = 0
    for record in records:
        handle.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        count += 1
    return count
