"""Markdown tables from `scripts/reranker_ablations.py` JSON lines, so no figure is typed by hand.

    python scripts/ablation_table.py /work/notes/s3/b2/msc_ablations.jsonl            # prequential rows
    python scripts/ablation_table.py runs.jsonl --heldout                               # per-category held-out

Prequential rows give recall@5 of the retriever and of the reranker on the training stream, the
lift over the stream and over its second half, the candidates' recall@20 (the ceiling), headroom
captured and the share of sampled selections that showed a gold memory ranked below M.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("ablation_table")


def pct(value: float | None, signed: bool = False) -> str:
    if value is None or value == "None":
        return "n/a"
    return f"{100 * value:+.1f}" if signed else f"{100 * value:.1f}"


def overrides_text(row: dict[str, Any]) -> str:
    items = row.get("overrides", {})
    text = ", ".join(f"{k}={v}" for k, v in items.items()) or "recipe auto"
    return text + (" · prefix stripped" if row.get("strip_prefix") else "")


def prequential_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [("| run | dataset · retriever · limit | settings | R@5 retriever → reranker | lift | lift, 2nd half | "
           "R@20 (ceiling) | headroom captured | promoting draws |"),
           "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = r["prequential"]
        hc = p["headroom_captured"]
        memories = "" if r.get("granularity", "turn") == "turn" else f" · {r['granularity']} memories"
        out.append(f"| {r['name']} | {r['dataset']} · {r['retriever']}{memories} · {r.get('limit') or 'all'} | "
                   f"{overrides_text(r)} | {pct(p['retriever'])} → {pct(p['reranker'])} | {pct(p['lift'], True)} | "
                   f"{pct(p['lift_second_half'], True)} | {pct(p['ceiling_recall@20'])} | "
                   f"{'n/a' if hc is None else f'{100 * hc:.0f}%'} | {pct(p['promoting_selections'])}% |")
    return out


def heldout_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [("| dataset · memories · retriever | run | questions | group | R@5 alone | R@5 reranked | R@20 | "
           "nDCG@5 alone | nDCG@5 reranked | headroom captured |"),
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    trained = {(r["dataset"], r.get("granularity", "turn"), r["retriever"]) for r in rows if r["name"] != "alone"}
    for r in rows:
        if r["name"] == "alone" and (r["dataset"], r.get("granularity", "turn"), r["retriever"]) in trained:
            continue  # the trained run's "alone" columns are the same retriever on the same questions
        for group, f in r.get("heldout", {}).items():
            hc = f["headroom_captured"]
            out.append(f"| {r['dataset']} · {r.get('granularity', 'turn')} · {r['retriever']} | {r['name']} | "
                       f"{f['questions']} | {group} | {pct(f['base recall@5'])} | {pct(f['reranked recall@5'])} | "
                       f"{pct(f['base recall@20'])} | {pct(f['base ndcg@5'])} | {pct(f['reranked ndcg@5'])} | "
                       f"{'n/a' if hc is None else f'{100 * hc:.0f}%'} |")
    return out


def headline_table(rows: list[dict[str, Any]]) -> list[str]:
    """One row per dataset · memories · first stage: the held-out headline questions only."""
    trained = {(r["dataset"], r.get("granularity", "turn"), r["retriever"]) for r in rows if r["name"] != "alone"}
    kept = [r for r in rows if "heldout" in r and not (
        r["name"] == "alone" and (r["dataset"], r.get("granularity", "turn"), r["retriever"]) in trained)]
    rank = {"turn": 0, "session": 1, "topic": 2, "bm25": 0, "minilm": 1, "hybrid": 2}
    kept.sort(key=lambda r: (r["dataset"], rank.get(r.get("granularity", "turn"), 9), rank.get(r["retriever"], 9)))
    out = [("| dataset · memories · first stage | R@5 alone | R@5 + reranker | lift | R@20 | "
           "nDCG@5 alone → + reranker | headroom captured |"),
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in kept:
        h = r["heldout"]["headline"]
        base, reranked = h["base recall@5"], h["reranked recall@5"]
        ndcg = pct(h["base ndcg@5"]) + ("" if reranked is None else f" → {pct(h['reranked ndcg@5'])}")
        lift = "n/a" if reranked is None else pct(reranked - base, True)
        hc = h["headroom_captured"]
        out.append(f"| {r['dataset']} · {r.get('granularity', 'turn')} · {r['retriever']} | {pct(base)} | "
                   f"{pct(reranked)} | {lift} | {pct(h['base recall@20'])} | {ndcg} | "
                   f"{'n/a' if hc is None else f'{100 * hc:.0f}%'} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--heldout", action="store_true", help="per-category held-out tables (final candidates)")
    parser.add_argument("--headline", action="store_true", help="held-out headline rows only, one per first stage")
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.files for line in path.read_text().splitlines() if line.strip()]
    lines = headline_table(rows) if args.headline else heldout_table(rows) if args.heldout else prequential_table(rows)
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
