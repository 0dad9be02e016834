"""The sessions in progress, persisted: Algorithm 1's `S`, one open session per user.

A chat process may stop at any time; the turns of a session that has not been reflected on yet
must survive it, so every append commits to SQLite (WAL) next to the bank. Ending a session
returns it and clears it (its content now lives in the bank as topic memories).
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from pathlib import Path

from rmm.types import Session, Turn

__all__ = ["SessionLog"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (user TEXT PRIMARY KEY, session_id TEXT NOT NULL, started TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS turns (session_id TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL,
    speaker TEXT NOT NULL, text TEXT NOT NULL, time TEXT, PRIMARY KEY (session_id, seq));
"""


class SessionLog:
    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = path
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        if str(path) != ":memory:":
            self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA secure_delete=ON")  # a cleared session's text is zeroed in the file
        self._conn.executescript(_SCHEMA)

    def current(self, user: str) -> Session:
        """The user's open session (an empty new one when none is open)."""
        with self._lock:
            row = self._conn.execute("SELECT session_id, started FROM sessions WHERE user = ?", (user,)).fetchone()
            if row is None:
                return Session(id=_new_session_id(user), user_id=user, turns=[], time=_now())
            turns = [Turn(id=r[0], session_id=row[0], speaker=r[1], text=r[2], time=r[3]) for r in self._conn.execute(
                "SELECT id, speaker, text, time FROM turns WHERE session_id = ? ORDER BY seq", (row[0],))]
            return Session(id=row[0], user_id=user, turns=turns, time=row[1])

    def append(self, user: str, speaker_texts: list[tuple[str, str]]) -> list[Turn]:
        """Append turns `(speaker, text)` to the user's open session (opening one if needed)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._conn.execute("SELECT session_id FROM sessions WHERE user = ?", (user,)).fetchone()
                if row is None:
                    session_id = _new_session_id(user)
                    self._conn.execute("INSERT INTO sessions VALUES (?, ?, ?)", (user, session_id, _now()))
                else:
                    session_id = row[0]
                (seq,) = self._conn.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM turns WHERE session_id = ?",
                                            (session_id,)).fetchone()
                out = []
                for offset, (speaker, text) in enumerate(speaker_texts):
                    turn = Turn(id=f"{session_id}:{seq + offset}", session_id=session_id, speaker=speaker,
                                text=text, time=_now())
                    self._conn.execute("INSERT INTO turns VALUES (?, ?, ?, ?, ?, ?)",
                                       (session_id, seq + offset, turn.id, speaker, text, turn.time))
                    out.append(turn)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return out

    def clear(self, user: str) -> None:
        """Forget the user's open session (after it was reflected into the bank)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            row = self._conn.execute("SELECT session_id FROM sessions WHERE user = ?", (user,)).fetchone()
            if row is not None:
                self._conn.execute("DELETE FROM turns WHERE session_id = ?", (row[0],))
                self._conn.execute("DELETE FROM sessions WHERE user = ?", (user,))
            self._conn.execute("COMMIT")

    def close(self) -> None:
        self._conn.close()


def _new_session_id(user: str) -> str:
    return f"{user}:live-{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
