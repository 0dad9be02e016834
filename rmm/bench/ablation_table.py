"""Markdown tables from `rmm/bench/ablations.py` JSON lines, so no figure is typed by hand.

    python -m rmm.bench.ablation_table docs/results/s3/msc_ablations.jsonl            # prequential rows
    python -m rmm.bench.ablation_table runs.jsonl --heldout                               # per-category held-out

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

log = logging.getLogger("rmm.bench.ablation_table")


def pct(value: float | None, signed: bool = False) -> str:
    if value is None or value == "None" or value != value:  # None, or NaN: no question had the figure
        return "n/a"
    return f"{100 * value:+.1f}" if signed else f"{100 * value:.1f}"


def command_cell(row: dict[str, Any]) -> str:
    """The row's own command (rows written before commands were recorded have none)."""
    return f"`{row['command']}`" if row.get("command") else "n/a"


def one_commit(rows: list[dict[str, Any]]) -> str | None:
    """The commit every row was measured at; a `SystemExit` naming them when rows disagree (a table
    mixing code versions is not one measurement). None when no row records its commit (older files)."""
    commits = sorted({str(r.get("commit")) for r in rows})
    if len(commits) > 1:
        raise SystemExit(f"error: the rows were measured at {len(commits)} commits ({', '.join(commits)}); "
                         "re-measure them at one, or pass --mixed-commits to show them anyway")
    return rows[0].get("commit") if rows else None


def arrow(row: dict[str, Any], metric: str) -> str:
    """`alone → + reranker` of one metric ("alone" only where the row has no reranker)."""
    base, reranked = row.get(f"base {metric}"), row.get(f"reranked {metric}")
    return pct(base) + ("" if reranked is None else f" → {pct(reranked)}")


def overrides_text(row: dict[str, Any]) -> str:
    items = row.get("overrides", {})
    text = ", ".join(f"{k}={v}" for k, v in items.items()) or "recipe auto"
    return text + (" · prefix stripped" if row.get("strip_prefix") else "")


def prequential_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [("| run | dataset · retriever · limit | settings | R@5 retriever → reranker | lift | lift, 2nd half | "
           "R@20 (ceiling) | headroom captured | promoting draws | command |"),
           "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        p = r["prequential"]
        hc = p["headroom_captured"]
        memories = "" if r.get("granularity", "turn") == "turn" else f" · {r['granularity']} memories"
        out.append(f"| {r['name']} | {r['dataset']} · {r['retriever']}{memories} · {r.get('limit') or 'all'} | "
                   f"{overrides_text(r)} | {pct(p['retriever'])} → {pct(p['reranker'])} | {pct(p['lift'], True)} | "
                   f"{pct(p['lift_second_half'], True)} | {pct(p['ceiling_recall@20'])} | "
                   f"{'n/a' if hc is None else f'{100 * hc:.0f}%'} | {pct(p['promoting_selections'])}% | "
                   f"{command_cell(r)} |")
    return out


def _where(row: dict[str, Any], retriever: str | None = None) -> tuple[str, str, str]:
    return row["dataset"], row.get("granularity", "turn"), retriever or row["retriever"]


_ALONE = ("base recall@5", "base recall@20", "base ndcg@5")


def superseded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows a table shows: an "alone" row is left out where a trained run's "alone" columns are
    the same retriever on the same questions — its own name, or for plain `bm25` a trained
    `bm25:DENSE` run (BM25 over a dense bank's store) whose alone figures are equal, figure for figure."""
    trained = {_where(r): r for r in rows if r["name"] != "alone"}

    def covered(r: dict[str, Any]) -> bool:
        if _where(r) in trained:
            return True
        if r["retriever"] != "bm25":
            return False
        alone = r.get("heldout", {})
        return any(where[:2] == _where(r)[:2] and where[2].startswith("bm25:") and all(
            t.get("heldout", {}).get(group, {}).get(key) == figures.get(key)
            for group, figures in alone.items() for key in _ALONE) for where, t in trained.items())

    return [r for r in rows if not (r["name"] == "alone" and covered(r))]


def _rank(retriever: str) -> int:
    """Table order of first stages: BM25 (plain or over a dense bank), the dense encoder, the hybrid."""
    family = retriever.split(":", 1)[0]
    return {"bm25": 0, "minilm": 1, "hybrid": 2}.get(family, 9)


def ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By dataset, then memories (turn, session, topic), then first stage (`_rank`); stable otherwise."""
    memories = {"turn": 0, "session": 1, "topic": 2}
    return sorted(rows, key=lambda r: (r["dataset"], memories.get(r.get("granularity", "turn"), 9),
                                       _rank(r["retriever"])))


def heldout_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [("| dataset · memories · retriever | run | questions | group | R@5 alone | R@5 reranked | R@20 | "
           "R@15t alone → reranked | R@25t alone → reranked | nDCG@5 alone | nDCG@5 reranked | headroom captured | "
           "command |"),
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in ordered(superseded(rows)):
        for n, (group, f) in enumerate(r.get("heldout", {}).items()):
            hc = f["headroom_captured"]
            command = command_cell(r) if n == 0 else "〃"  # one command measures every group of the run
            out.append(f"| {r['dataset']} · {r.get('granularity', 'turn')} · {r['retriever']} | {r['name']} | "
                       f"{f['questions']} | {group} | {pct(f['base recall@5'])} | {pct(f['reranked recall@5'])} | "
                       f"{pct(f['base recall@20'])} | {arrow(f, 'recall_turns@15')} | {arrow(f, 'recall_turns@25')} | "
                       f"{pct(f['base ndcg@5'])} | {pct(f['reranked ndcg@5'])} | "
                       f"{'n/a' if hc is None else f'{100 * hc:.0f}%'} | {command} |")
    return out


def headline_table(rows: list[dict[str, Any]]) -> list[str]:
    """One row per dataset · memories · first stage: the held-out headline questions only, each with
    the command that measured it. R@T reads the M memories shown within T dialogue turns, so memories
    of different sizes compare at the same amount of dialogue shown."""
    kept = ordered([r for r in superseded(rows) if "heldout" in r])
    out = [("| dataset · memories · first stage | questions | R@5 alone | R@5 + reranker | lift | R@20 | "
            "R@15t alone → + reranker | R@25t alone → + reranker | nDCG@5 alone → + reranker | headroom captured | "
            "command |"),
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in kept:
        h = r["heldout"]["headline"]
        base, reranked = h["base recall@5"], h["reranked recall@5"]
        lift = "n/a" if reranked is None else pct(reranked - base, True)
        hc = h["headroom_captured"]
        out.append(f"| {r['dataset']} · {r.get('granularity', 'turn')} · {r['retriever']} | {h['questions']} | "
                   f"{pct(base)} | {pct(reranked)} | {lift} | {pct(h['base recall@20'])} | "
                   f"{arrow(h, 'recall_turns@15')} | {arrow(h, 'recall_turns@25')} | {arrow(h, 'ndcg@5')} | "
                   f"{'n/a' if hc is None else f'{100 * hc:.0f}%'} | {command_cell(r)} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--heldout", action="store_true", help="per-category held-out tables (final candidates)")
    parser.add_argument("--headline", action="store_true", help="held-out headline rows only, one per first stage")
    parser.add_argument("--mixed-commits", action="store_true",
                        help="show rows measured at different commits (refused by default)")
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.files for line in path.read_text().splitlines() if line.strip()]
    measured_at = None if args.mixed_commits else one_commit(rows)
    if measured_at:
        sys.stdout.write(f"measured at commit {measured_at}\n\n")
    lines = headline_table(rows) if args.headline else heldout_table(rows) if args.heldout else prequential_table(rows)
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
