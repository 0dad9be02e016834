"""What an online-training run persists besides its learners, and how it is written.

With many questions in flight, the stream has no single "position": replies arrive out of order.
The state therefore names the stream items whose rewards reached a learner (`Done`), so a resumed
run re-asks every other one — those that were in flight, or waiting in the delay queue, when the
run stopped — and counts none twice. Learners are checkpointed first and the state after it,
with each learner's progress, so a crash between the two is detected on resume.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rmm.policy.learner import Learner

__all__ = ["STATE_VERSION", "Done", "atomic_write_json", "learner_progress"]

# 2: learners in a LearnerRegistry under rerankers/ (1 had rerankers/0000, …)
# 3: `done` (items rewarded, in any order) replaces `position`; generation statistics
STATE_VERSION = 3


@dataclass
class Done:
    """The stream items already rewarded: every index below `below`, plus `beyond` (sorted)."""

    below: int = 0
    beyond: set[int] = field(default_factory=set)

    def add(self, index: int) -> None:
        if index in self:
            raise ValueError(f"stream item {index} was already rewarded")
        self.beyond.add(index)
        while self.below in self.beyond:
            self.beyond.remove(self.below)
            self.below += 1

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and (index < self.below or index in self.beyond)

    def __len__(self) -> int:
        return self.below + len(self.beyond)

    def missing(self, total: int) -> Iterator[int]:
        """The items of a stream of `total` still to ask, in stream order."""
        return (i for i in range(self.below, total) if i not in self.beyond)

    def to_json(self) -> dict[str, Any]:
        return {"below": self.below, "beyond": sorted(self.beyond)}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Done:
        done = cls(int(value["below"]))
        for index in value["beyond"]:
            done.add(int(index))
        return done

    @classmethod
    def of(cls, indices: Iterable[int]) -> Done:
        done = cls()
        for index in indices:
            done.add(index)
        return done


def learner_progress(learner: Learner) -> list[int]:
    """How far a learner got: what a resumed run checks its checkpoint against."""
    return [learner.stats.records, learner.stats.skipped_no_citation, learner.pending, learner.stats.step]


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write JSON through a temporary sibling and an atomic rename: never half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
