"""rmm — Reflective Memory Management for long-term dialogue agents.

`rmm.Memory` is the embedded API (`rmm.embedded`: a bank opened in your own process, the
server's verbs without HTTP), `rmm.AsyncMemory` its asyncio twin. They and the records (`Turn`,
`Session`, …; a stored memory's record is `rmm.types.Memory`) are loaded on first use, so
`import rmm` and `import rmm.serve.client` in an agent process stay light: no torch until used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["AsyncMemory", "Candidates", "Dataset", "Memory", "Question", "Selection", "Session", "Turn",
           "__version__"]
_EMBEDDED = {"Memory", "AsyncMemory"}  # rmm.embedded; every other name is a record of rmm.types

if TYPE_CHECKING:
    from rmm.embedded import AsyncMemory, Memory
    from rmm.types import (
        Candidates,
        Dataset,
        Question,
        Selection,
        Session,
        Turn,
    )


def __getattr__(name: str) -> Any:
    if name in _EMBEDDED:
        from rmm import embedded

        return getattr(embedded, name)
    if name in __all__ and name != "__version__":
        from rmm import types

        return getattr(types, name)
    raise AttributeError(f"module 'rmm' has no attribute {name!r}")
