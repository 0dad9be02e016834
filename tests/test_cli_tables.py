"""The result tables survive a pipe: rendered to a non-terminal 80-column console they keep every
digit (no "…"), every column (the `n` column is not squeezed away) and, in the usual shapes,
fit in 80 columns; a table that cannot fit is printed wider rather than cut."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console
from rmm.training.online import OnlineReport

from rmm.cli.eval import granularity_figures, report_figures
from rmm.cli.eval_controller import controller_figures
from rmm.cli.eval_qa import qa_figures
from rmm.cli.tables import Figures, print_figures
from rmm.cli.train import train_figures
from rmm.eval.controller_recall import ControllerRecallReport
from rmm.eval.qa import QAReport
from rmm.eval.retrieval import RetrievalReport

CATEGORIES = {"1": "multi-hop", "2": "temporal", "3": "open-domain", "4": "single-hop", "5": "adversarial"}
COUNTS = {"1": 282, "2": 321, "3": 96, "4": 841, "5": 446}


def _report(granularity: str, ks: tuple[int, ...] = (5, 10)) -> RetrievalReport:
    def figures(value: float) -> dict[str, float]:
        return {f"{m}@{k}": value for k in ks for m in ("recall", "recall_any", "recall_all", "ndcg")}

    by_category = {c: {"name": name, "n": COUNTS[c], **figures(0.853)} for c, name in CATEGORIES.items()}
    return RetrievalReport("locomo", "minilm", granularity, list(ks), {"n": 1540, **figures(1.0)}, by_category,
                           separate={"5": by_category["5"]})


def _render(figures: Figures, width: int = 80) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=width)
    assert not console.is_terminal
    print_figures(figures, console)
    return out.getvalue().splitlines()


def _assert_whole(lines: list[str], counts: dict[str, int] | None = None) -> None:
    text = "\n".join(lines)
    assert "…" not in text, text
    for category, n in (counts or {}).items():  # the n column holds every category's count
        (row,) = [line for line in lines if line.startswith(f"{category} ")]
        assert re.search(rf"\s{n}\s", row), row


@pytest.mark.parametrize("figures", [
    pytest.param(report_figures(_report("turn")), id="eval"),
    pytest.param(granularity_figures([_report(g) for g in ("turn", "session", "topic")], "minilm"), id="granularity"),
])
def test_eval_tables_fit_80_columns_with_every_figure(figures: Figures) -> None:
    lines = _render(figures)
    _assert_whole(lines, COUNTS)
    assert max(map(len, lines)) <= 80
    header = next(line for line in lines if line.startswith("category"))
    assert re.search(r"\sn\s", header)
    assert sum(line.count("85.3") for line in lines) == 5 * (len(figures.columns) - 2)


def test_one_line_headers_when_they_fit() -> None:
    lines = _render(granularity_figures([_report(g, ks=(5,)) for g in ("turn", "session", "topic")], "minilm"))
    assert any("session R@5" in line and "topic R@5" in line for line in lines)


def test_a_table_too_wide_for_80_columns_is_printed_wider_not_cut() -> None:
    figures = report_figures(_report("turn", ks=(1, 5, 10, 20)))
    lines = _render(figures)
    _assert_whole(lines, COUNTS)
    assert max(map(len, lines)) > 80
    assert any("nDCG@20" in line for line in lines) and any("5 adversarial (separate)" in line for line in lines)


def test_train_qa_and_goal_tables_keep_every_figure() -> None:
    metrics = {"recall@5": 0.5, "recall_any@5": 0.625, "ndcg@5": 0.4}
    report = OnlineReport(metrics, metrics, metrics, metrics, metrics, "simulated (precision 0.876, recall 0.858)",
                          "split", {"eval_k": 5})
    lines = _render(train_figures(report, "/models/pretrained/minilm-locomo-contrastive-epoch10-final"))
    _assert_whole(lines)
    assert max(map(len, lines)) <= 80 and "epoch10-final" in "".join(lines)
    assert sum("62.5" in line for line in lines) == 2  # recall_any, prequential and held-out

    row = {"n": 282, "judge": 0.5, "f1": 0.4, "cited_precision": 0.9, "shown_recall": 0.8}
    qa = QAReport("locomo", "hf:/models/qwen", None, "turn", False, row,
                  {c: {**row, "name": name, "n": COUNTS[c]} for c, name in CATEGORIES.items()})
    lines = _render(qa_figures(qa))
    _assert_whole(lines, COUNTS)
    assert max(map(len, lines)) <= 80

    goal = ControllerRecallReport("locomo", "hf:/models/qwen", 1, 282, 0.5, 0.4, 37.2, 0.8, 7.3, 12345, 543, 12.5)
    lines = _render(controller_figures(goal))
    _assert_whole(lines)
    assert max(map(len, lines)) <= 80
    assert any(all(cell in line for cell in ("282", "12345", "543", "12.5")) for line in lines)
