"""The layers of docs/architecture.md, enforced: no module imports from a layer above its own.

Every `import` counts, including the lazy ones inside functions (an upward import deferred to
call time is still a dependency running the wrong way).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom (0) to top; a module may import its own layer and those below. Longest prefix wins.
LAYERS: dict[str, int] = {
    "rmm.types": 0, "rmm.errors": 0, "rmm.config": 0, "rmm.paths": 0, "rmm.device": 0, "rmm.kernels": 0,
    "rmm.encoders": 1, "rmm.data": 1, "rmm.eval.metrics": 1,
    "rmm.memory": 2,
    "rmm.policy": 3, "rmm.ope": 3, "rmm.llm": 3, "rmm.prompts": 3,
    "rmm.reflection": 4,
    "rmm.frontends": 5,
    "rmm.eval": 6,
    "rmm.cli": 7, "rmm.serve": 7, "rmm.training": 7, "rmm.embedded": 7, "rmm.bench": 7,
}
# The package face re-exports records; `python -m rmm`.
UNLAYERED = {"rmm", "rmm.__main__"}

SOURCE_ROOTS = {"rmm": "rmm", "training": "rmm.training", "kernels": "rmm.kernels"}


def _modules() -> list[tuple[str, Path]]:
    found = []
    for folder, package in SOURCE_ROOTS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append((".".join((package, *parts)), path))
    return found


def _layer(module: str) -> int | None:
    best = None
    for prefix, rank in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, rank)
    return None if best is None else best[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append((node.lineno, node.module))
            names += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if _layer(f"{node.module}.{alias.name}") != _layer(node.module)]
    return [(line, name) for line, name in names if name == "rmm" or name.startswith("rmm.")]


def test_every_module_has_a_layer() -> None:
    unplaced = [name for name, _ in _modules() if name not in UNLAYERED and _layer(name) is None]
    assert not unplaced, f"add these modules to a layer in docs/architecture.md and LAYERS: {unplaced}"


def test_no_import_runs_upward() -> None:
    upward = []
    for name, path in _modules():
        own = _layer(name)
        if own is None:
            continue
        for line, target in _imports(path):
            theirs = _layer(target)
            if theirs is not None and theirs > own:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({name}, layer {own}) imports {target} (layer {theirs})")
    assert not upward, "imports running upward:\n" + "\n".join(upward)


@pytest.mark.parametrize("folder", ["llm", "prompts"])
def test_llm_and_prompts_do_not_import_each_other(folder: str) -> None:
    other = {"llm": "rmm.prompts", "prompts": "rmm.llm"}[folder]
    offending = [f"{path.relative_to(ROOT)}:{line} imports {target}"
                 for path in sorted((ROOT / "rmm" / folder).rglob("*.py"))
                 for line, target in _imports(path) if target == other or target.startswith(other + ".")]
    assert not offending, "\n".join(offending)


def _circles(package: str) -> list[list[str]]:
    """The import circles among `package`'s modules (each a strongly connected set of two or more;
    every import counts, lazy ones too, as for the layers)."""
    modules = {name: path for name, path in _modules() if name == package or name.startswith(package + ".")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for _, target in _imports(path):
            while target and target not in modules:  # `from rmm.serve.pending import X` → the module
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    reach = {name: set() for name in graph}  # transitive closure: few modules, so plain search is enough
    for name in graph:
        todo = list(graph[name])
        while todo:
            step = todo.pop()
            if step not in reach[name]:
                reach[name].add(step)
                todo.extend(graph[step])
    circles = {frozenset([n, *(m for m in reach[n] if n in reach[m])]) for n in graph if n in reach[n]}
    return sorted(sorted(c) for c in circles)


@pytest.mark.parametrize("package", ["rmm.serve", "rmm.memory"])
def test_no_import_circles(package: str) -> None:
    """A circle (`pending` ↔ `pg_pending`, `index` ↔ `faiss_index`) means shared pieces that belong
    one level down: the module both import."""
    assert not _circles(package), f"import circles in {package}: {_circles(package)}"


def test_the_circle_finder_sees_a_lazy_circle(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "a.py").write_text("from rmm.x.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    import rmm.x.a\n")
    (tmp_path / "c.py").write_text("import rmm.x.a\n")
    monkeypatch.setattr(sys.modules[__name__], "_modules",
                        lambda: [(f"rmm.x.{n}", tmp_path / f"{n}.py") for n in ("a", "b", "c")])
    assert _circles("rmm.x") == [["rmm.x.a", "rmm.x.b"]]


def test_import_rmm_installs_no_finder_and_keeps_no_old_paths() -> None:
    """Nothing was released before the grouping by concept, so no module answers at a 0.1 path and
    `import rmm` leaves `sys.meta_path` alone (a fresh interpreter: this one has imported plenty)."""
    code = ("import importlib, sys\n"
            "before = list(sys.meta_path)\n"
            "import rmm\n"
            "assert sys.meta_path == before, sys.meta_path\n"
            "for old in ('rmm.bank', 'rmm.learner', 'rmm.agent', 'rmm.eval.goal_recall', 'rmm.cli.eval_goal'):\n"
            "    try:\n"
            "        importlib.import_module(old)\n"
            "    except ModuleNotFoundError:\n"
            "        continue\n"
            "    raise AssertionError(old + ' still imports')\n")
    result = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from rmm.frontends.agent import Agent\n")
    ((_, target),) = [(line, t) for line, t in _imports(module) if t == "rmm.frontends.agent"]
    assert _layer(target) == 5 > _layer("rmm.memory.bank") == 2


def test_serve_holds_no_encoder_code() -> None:
    """`rmm.serve` is HTTP, the service and its stores: a model, a kernel or a query engine lives in
    `rmm.encoders` (the query path on a CPU in `rmm.encoders.query`)."""
    offending = []
    for path in sorted((ROOT / "rmm" / "serve").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "nn" for a in node.names):
                offending.append(f"{path.relative_to(ROOT)}:{node.lineno} imports torch.nn")
            elif isinstance(node, ast.Import) and any(a.name.startswith("torch.nn") for a in node.names):
                offending.append(f"{path.relative_to(ROOT)}:{node.lineno} imports torch.nn")
            elif isinstance(node, ast.ClassDef) and any(ast.unparse(base).endswith("Module") for base in node.bases):
                offending.append(f"{path.relative_to(ROOT)}:{node.lineno} defines a torch module {node.name}")
    assert not offending, "\n".join(offending)
