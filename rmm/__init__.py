"""rmm — Reflective Memory Management for long-term dialogue agents.

The records (`Memory`, `Turn`, …) are loaded on first use, so `import rmm.serve.client` in an
agent process stays light: it does not pull in torch. Modules that moved in 0.2 stay importable
from their old paths for one release, with a DeprecationWarning (`rmm._compat`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rmm import _compat

__version__ = "0.1.0"
__all__ = ["Candidates", "Dataset", "Memory", "Question", "Selection", "Session", "Turn", "__version__"]

_compat.install()

if TYPE_CHECKING:
    from rmm.types import (
        Candidates,
        Dataset,
        Memory,
        Question,
        Selection,
        Session,
        Turn,
    )


def __getattr__(name: str) -> Any:
    if name in __all__ and name != "__version__":
        from rmm import types

        return getattr(types, name)
    raise AttributeError(f"module 'rmm' has no attribute {name!r}")
