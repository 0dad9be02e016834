"""The online-training figure: exactly the numbers the report's table prints, drawn.

Left panel: prequential recall@K (each question scored before its own update) as a running mean
over the training questions the table's headline covers — for LoCoMo categories 1–4, not the
adversarial category 5 that is reported apart — so the curves end at the table's figures. Both
panels are in percent, like the table.
Right panel: the held-out comparison, the headline result — the retriever alone, the retriever
+ the learned reranker on its top-K, and a whole-bank search with the learned query transform.

`plot_series` is what the figure draws, as data, so a test can hold it against the report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rmm.training.online import OnlineReport

__all__ = ["PlotSeries", "figure", "plot", "plot_series", "running_mean"]

PREQUENTIAL_LABELS = {"retriever": "retriever alone", "reranker": "retriever + reranker"}


@dataclass
class PlotSeries:
    """What the figure draws: one running-mean curve per system, one bar per held-out system."""

    metric: str
    prequential: dict[str, list[float]]  # legend label → running mean (%), in stream order
    prequential_title: str
    heldout: dict[str, float]  # bar label → held-out figure (%, the table's)
    heldout_title: str


def running_mean(values: list[float]) -> list[float]:
    """The mean of the first i values, for every i."""
    return [total / (i + 1) for i, total in enumerate(accumulate(values))]


def plot_series(report: OnlineReport) -> PlotSeries:
    """The figure's data, taken from the report (the same questions as its table)."""
    metric = f"recall@{report.config['eval_k']}"
    questions = report.headline_questions
    prequential = {label: [100 * v for v in report.prequential_curve.get(name, [])]
                   for name, label in PREQUENTIAL_LABELS.items()}
    n_train = report.reranker_prequential.get("n", 0)
    heldout = {
        "retriever alone": 100 * report.retriever_heldout.get(metric, math.nan),
        "+ reranker (top-K)": 100 * report.reranker_heldout.get(metric, math.nan),
        "+ reranker, whole-bank\nsearch (learned query)": 100 * report.reranker_heldout_whole_bank.get(metric, math.nan),
    }
    n_held = report.reranker_heldout.get("n", 0)
    return PlotSeries(
        metric=metric,
        prequential=prequential,
        prequential_title=f"Prequential {metric}, {n_train} training questions\n({questions})",
        heldout=heldout,
        heldout_title=f"Held-out {metric}, {n_held} questions\n({questions})",
    )


def figure(report: OnlineReport) -> Figure:
    """Two panels: the prequential running means (left) and the held-out comparison (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = plot_series(report)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for label, ys in series.prequential.items():
        left.plot(range(1, len(ys) + 1), ys, label=f"{label} (ends at {ys[-1]:.1f})" if ys else label)
    left.set_xlabel("training questions seen (stream order)")
    left.set_ylabel(f"{series.metric} (%), running mean")
    left.set_title(series.prequential_title, fontsize=10)
    left.legend(loc="best")
    names, values = list(series.heldout), list(series.heldout.values())
    bars = right.bar(range(len(names)), values, color=["tab:blue", "tab:orange", "tab:green"][: len(names)])
    right.bar_label(bars, labels=[f"{v:.1f}" for v in values], padding=2)
    right.set_xticks(range(len(names)), names, fontsize=8)
    right.set_ylabel(f"{series.metric} (%)")
    finite = [v for v in values if math.isfinite(v)]
    right.set_ylim(0, min(100.0, max(finite, default=100.0) * 1.2) or 100.0)
    right.set_title(series.heldout_title, fontsize=10)
    fig.suptitle(f"Online reranker — citer: {report.citer}", fontsize=10)
    fig.tight_layout()
    return fig


def plot(report: OnlineReport, path: str | Path) -> Path:
    """Write `figure(report)` as a PNG; returns its path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = figure(report)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
