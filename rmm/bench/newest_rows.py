"""Merge held-out JSON-line files so the newest reading of each row wins (ablation_table.py keeps
every row it is given, so a row read twice would show twice).

    python -m rmm.bench.newest_rows OLD.jsonl ... NEW.jsonl > merged.jsonl

A row is (name, dataset, granularity, retriever); a later file (and a later line) replaces an
earlier one. Each kept row gets a "source" field naming its file; the replaced readings are
listed on stderr so the docs can say what was dropped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    kept: dict[tuple[str, str, str, str], dict] = {}
    for name in sys.argv[1:]:
        path = Path(name)
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            key = (row["name"], row["dataset"], row.get("granularity", "turn"), row["retriever"])
            if key in kept:
                sys.stderr.write(f"replaced {' · '.join(key)}: {kept[key]['source']} -> {path}\n")
            row["source"] = str(path)
            kept[key] = row
    for row in kept.values():
        sys.stdout.write(json.dumps(row) + "\n")
    for key, row in sorted(kept.items()):
        sys.stderr.write(f"kept {' · '.join(key)}: {row['source']}\n")


if __name__ == "__main__":
    main()
