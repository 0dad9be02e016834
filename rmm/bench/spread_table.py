"""Markdown table of rmm/bench/lexical_spread.py's JSON lines (so no spread figure is typed).

    python -m rmm.bench.spread_table docs/results/s4/h6/spread_final.jsonl

Columns: memories, feature definition, training questions, mean per-list spread (max − min over
the K = 20 candidates) of q·m and of f, mean f(rank 1) − f(rank 5), and recall@5 of the first
stage's order, of the cosine order and of the untrained reranker's order q·m + w0·f.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    rows = [json.loads(line) for name in sys.argv[1:] for line in Path(name).read_text().splitlines() if line.strip()]
    inits = sorted({k.removeprefix("untrained_w") for r in rows for k in r if k.startswith("untrained_w")}, key=float)
    head = ["dataset · memories", "feature", "questions", "q·m spread", "f spread", "f rank1 − rank5",
            "R@5 first stage", "R@5 cosine"] + [f"R@5 untrained w0 {w}" for w in inits] + ["load"]
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        cells = [f"{r['dataset']} · {r['granularity']}", r["feature"], str(r["questions"]),
                 f"{r['cos_spread']:.2f}", f"{r['f_spread']:.2f}", f"{r['f_top1_minus_top5']:.2f}",
                 f"{100 * r['first_stage']:.1f}", f"{100 * r['cosine']:.1f}"]
        cells += [f"{100 * r[f'untrained_w{w}']:.1f}" for w in inits] + [f"{r['load']:.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
