"""The README's second section, the embedded agent loop, runs as written (a temp folder, a
stand-in `my_llm`; the fake encoder by default, MiniLM with --slow)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fakes import BagOfWordsEncoder

from rmm import Memory

README = Path(__file__).resolve().parents[1] / "README.md"


def agent_loop_snippet() -> str:
    """The first python block of the section right after Quickstart (the README's second `##`)."""
    sections = re.split(r"^## ", README.read_text(encoding="utf-8"), flags=re.M)
    assert sections[1].startswith("Quickstart") and "from rmm import Memory" in sections[2].splitlines()[0]
    (first, *_) = re.findall(r"```python\n(.*?)```", sections[2], flags=re.S)
    return first


def run_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **defaults: object) -> None:
    """Exec the block in `tmp_path`; `defaults` are settings `Memory.open` gets unless the block
    gives them (plumbing: the encoder, the query engine), so the code runs exactly as printed."""
    monkeypatch.chdir(tmp_path)
    opened = Memory.open
    monkeypatch.setattr(Memory, "open", classmethod(lambda cls, *a, **k: opened(*a, **{**defaults, **k})))
    prompts: list[str] = []

    def my_llm(prompt: str) -> str:  # stands in for the reader's LLM: cites the first memory shown
        prompts.append(prompt)
        return "From what you told me [0]."

    exec(compile(agent_loop_snippet(), str(README), "exec"), {"my_llm": my_llm, "__name__": "readme"})
    assert len(prompts) == 2 and all("[0] Ana" in p for p in prompts)
    with Memory.open(tmp_path / "my-bank") as memory:  # the loop's memories and feedback were kept
        assert len(memory.memories("ana")) == 2
        learner = memory.service.learner("local")
        assert learner.stats.records + learner.pending + learner.stats.step > 0


def test_the_snippet_is_an_agent_loop_of_ten_lines() -> None:
    lines = [line for line in agent_loop_snippet().splitlines() if line.strip()]
    assert len(lines) <= 10
    assert any("retrieve" in line for line in lines) and any("feedback" in line for line in lines)


def test_the_readme_agent_loop_runs_and_learns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_snippet(tmp_path, monkeypatch, encoder=BagOfWordsEncoder(), device="cpu")


@pytest.mark.slow
def test_the_readme_agent_loop_runs_with_minilm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                minilm_path: Path) -> None:
    # float32 queries: a cold cache would first time every query engine (~40 s on 2 busy cores)
    run_snippet(tmp_path, monkeypatch, query_precision="float32")
