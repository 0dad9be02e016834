"""Benchmarks are the package `rmm.bench` and one-off research programs live in `research/`
(issue 37 item 2): each indexed, none reaching another through `sys.path` or into `tests/`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import rmm.bench

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "rmm" / "bench"
RESEARCH = ROOT / "research"
HELPERS = {"embedded_pg", "reranker_features", "crash_store"}  # imported by others, not run


def _path_tricks(path: Path, root: Path = ROOT, forbidden: frozenset[str] = frozenset(
        {"tests", "conftest", "fakes", "script_modules", "embedded_pg"})) -> list[str]:
    """`sys.path` edits, file-path module loading and imports of `forbidden` top-level modules (the
    tests' own, or the embedded PostgreSQL by its old path) in `path`, in line order."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
            found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno} touches sys.path"))
        elif isinstance(node, ast.Attribute) and node.attr == "spec_from_file_location":
            found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno} loads a module by file path"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name.split(".")[0] in forbidden:
                    found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno} imports {name}"))
    return [message for _, message in sorted(found)]


def test_scripts_holds_only_the_gpu_report() -> None:
    assert sorted(p.name for p in (ROOT / "scripts").iterdir() if p.name != "__pycache__") == ["gpu_check.sh"]


def test_every_benchmark_is_indexed_and_runnable_as_a_module() -> None:
    doc = rmm.bench.__doc__ or ""
    modules = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")
    unindexed = [m for m in modules if f"\n    {m} " not in doc]
    assert not unindexed, f"add a line to rmm/bench/__init__.py's index for {unindexed}"
    no_main = [m for m in modules if m not in HELPERS and 'if __name__ == "__main__"' not in (BENCH / f"{m}.py").read_text()]
    assert not no_main, f"not runnable as python -m rmm.bench.NAME: {no_main}"


def test_every_research_program_is_indexed() -> None:
    index = (RESEARCH / "README.md").read_text()
    missing = [p.name for p in sorted(RESEARCH.glob("*.py")) if f"`{p.name}`" not in index]
    assert not missing, f"add a row to research/README.md for {missing}"


@pytest.mark.parametrize("folder", ["rmm/bench", "research", "tests"])
def test_no_path_tricks(folder: str) -> None:
    """Shared helpers are imported as modules; a research program's own folder is already on its path."""
    paths = sorted((ROOT / folder).glob("*.py"))
    forbidden = frozenset({"tests", "conftest", "fakes", "script_modules", "embedded_pg"})
    if folder == "tests":  # conftest puts tests/ on the path for the tests' own doubles (fakes); test_bank
        # loads its own file in a subprocess; this file holds the checker's example
        paths = [p for p in paths if p.name not in {"conftest.py", "test_bank.py", "test_bench_package.py"}]
        forbidden = frozenset({"script_modules", "embedded_pg"})
    found = [trick for path in paths for trick in _path_tricks(path, ROOT, forbidden)]
    assert not found, "\n".join(found)


def test_the_checker_sees_path_tricks(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys\nsys.path.insert(0, 'scripts')\nfrom embedded_pg import start_server\n"
                      "from tests.fakes import X\n")
    found = [line.split(" ", 1)[1] for line in _path_tricks(script, tmp_path)]
    assert found == ["touches sys.path", "imports embedded_pg", "imports tests.fakes"]


def test_a_research_program_imports_its_sibling_and_rmm_bench_from_the_repository_root() -> None:
    """`python research/NAME.py` from a fresh clone: its sibling (reranker_ceiling) and rmm.bench both import."""
    result = subprocess.run([sys.executable, "research/reranker_online_features.py", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
