"""Old module paths, kept importable for one release (0.1 → 0.2) with a DeprecationWarning.

The flat `rmm/` of 0.1 was grouped by concept (memory, policy, frontends, …; see
docs/architecture.md). `import rmm.bank` still works: a meta-path finder hands back the module at
its new home, the same module object, so `isinstance` checks and monkeypatches stay consistent.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED_MODULES", "install"]

MOVED_MODULES: dict[str, str] = {
    "rmm.store": "rmm.memory.store",
    "rmm.index": "rmm.memory.index",
    "rmm.bank": "rmm.memory.bank",
    "rmm.bm25": "rmm.memory.bm25",
    "rmm.session_log": "rmm.memory.sessions",
    "rmm.corpus": "rmm.eval.benchmark_bank",
    "rmm.reranker": "rmm.policy.reranker",
    "rmm.sampling": "rmm.policy.sampling",
    "rmm.learner": "rmm.policy.learner",
    "rmm.citations": "rmm.policy.citations",
    "rmm.retrieve": "rmm.policy.retrieve",
    "rmm.agent": "rmm.frontends.agent",
    "rmm.llm.serve": "rmm.llm.vllm_server",
    "rmm.llm.simulated_backend": "rmm.llm.simulated",
    "rmm.serve.cli": "rmm.cli.serve",
    "rmm.training.pretrain_cli": "rmm.cli.pretrain",
}


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new_name}; the old path will be removed in rmm 0.3",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new_name)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at its new home is already executed."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new_name = MOVED_MODULES.get(fullname)
        if new_name is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(new_name))


def install() -> None:
    """Put the finder on `sys.meta_path` once (idempotent)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
