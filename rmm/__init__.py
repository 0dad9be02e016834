"""rmm — Reflective Memory Management for long-term dialogue agents."""

from rmm.types import Candidates, Dataset, Memory, Question, Selection, Session, Turn

__version__ = "0.1.0"
__all__ = ["Candidates", "Dataset", "Memory", "Question", "Selection", "Session", "Turn", "__version__"]
