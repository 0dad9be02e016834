"""What `rmm` logs to the screen: rmm's INFO and everyone's warnings by default, rmm's DEBUG with
-v, third-party DEBUG only with -vv, even from a library that sets DEBUG on its own logger."""

from __future__ import annotations

import logging

import pytest

import rmm.cli.data
from rmm.cli import main


@pytest.fixture
def chatty_command(monkeypatch):
    """`rmm data download` replaced by a run that logs at every level, from rmm and from a
    dependency whose logger is set to DEBUG (as bm25s does on import)."""
    dependency = logging.getLogger("chatty_dependency")
    monkeypatch.setattr(dependency, "level", logging.DEBUG)

    def run(args) -> int:
        dependency.debug("dependency debug")
        dependency.info("dependency info")
        dependency.warning("dependency warning")
        logging.getLogger("rmm.memory.bm25").debug("rmm debug")
        logging.getLogger("rmm.memory.bm25").info("rmm info")
        logging.getLogger("rmm.eval").warning("rmm warning")
        return 0

    monkeypatch.setattr(rmm.cli.data, "run", run)


@pytest.mark.parametrize(("flags", "shown", "hidden"), [
    ([], {"rmm info", "rmm warning", "dependency warning"}, {"rmm debug", "dependency debug", "dependency info"}),
    (["-v"], {"rmm debug", "rmm info", "rmm warning", "dependency warning"}, {"dependency debug", "dependency info"}),
    (["-vv"], {"rmm debug", "rmm info", "dependency debug", "dependency info", "dependency warning"}, set()),
])
def test_screen_logging_by_verbosity(flags, shown, hidden, chatty_command, capsys) -> None:
    root, ours = logging.getLogger(), logging.getLogger("rmm")
    before = (list(root.handlers), root.level, ours.level)
    assert main(["data", "download", "locomo", *flags]) == 0
    err = capsys.readouterr().err
    assert all(line in err for line in shown), err
    assert not any(line in err for line in hidden), err
    assert (list(root.handlers), root.level, ours.level) == before  # main leaves logging as it found it


def test_eval_with_bm25_shows_no_bm25s_debug_lines(tiny_data_dir, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("RMM_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["eval", "--data-dir", str(tiny_data_dir), "--retriever", "bm25", "--k", "5"]) == 0
    err = capsys.readouterr().err
    assert logging.getLogger("bm25s").level == logging.DEBUG  # the dependency still asks for DEBUG …
    assert "bm25s" not in err and "DEBUG" not in err  # … and the screen stays clean
    assert "INFO rmm.cli.eval: evaluated bm25/turn" in err  # rmm's own progress is shown
