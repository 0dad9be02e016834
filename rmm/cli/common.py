"""What several commands share: the console, the common options, loading data and LLMs, JSON output.

Nothing heavy is imported at module level: every command module imports this one, and
`rmm --help` must stay fast.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from rmm.cli.arguments import add_check, device, m_within_k, positive_int

__all__ = [
    "DEFAULT_RETRIEVER", "add_common_options", "add_dedup_option", "add_k_m_options", "add_verbose", "console", "fmt",
    "llm_options", "load_benchmark", "load_llm", "write_json",
]

console = Console()

DEFAULT_RETRIEVER = "minilm"


def add_verbose(p: argparse.ArgumentParser) -> None:
    """-v: rmm's debug lines; -vv: every library's too."""
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="-v: rmm's debug logging; -vv: third-party libraries' debug logging too")


def add_common_options(p: argparse.ArgumentParser) -> None:
    """Where data and cached banks live, the device, the encoder batch size; -v."""
    p.add_argument("--data-dir", help="benchmark data folder (default: $RMM_DATA_DIR, else the user data dir)")
    p.add_argument("--cache-dir",
                   help="where built banks are cached (default: $RMM_CACHE_DIR, else the user cache dir)")
    p.add_argument("--device", type=device, default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="encoder batch size")
    p.add_argument("--no-download", action="store_true", help="fail instead of downloading a missing dataset")
    add_verbose(p)


def add_k_m_options(p: argparse.ArgumentParser, k_help: str = "retrieved candidates K",
                    m_help: str = "memories shown M (at most K)") -> None:
    """--k and --m, positive, with M ≤ K checked right after parsing."""
    p.add_argument("--k", type=positive_int, default=20, help=k_help)
    p.add_argument("--m", type=positive_int, default=5, help=m_help)
    add_check(p, m_within_k)


def add_dedup_option(p: argparse.ArgumentParser) -> None:
    """--no-dedup: every command that reads a benchmark reads LoCoMo without its repeated questions by default."""
    p.add_argument("--no-dedup", action="store_true",
                   help="LoCoMo: keep the 12 repeated questions (1,986; default: drop them as MemR³ App. C.3 does, "
                        "1,974 questions, category counts 282 / 321 / 96 / 830 / 445)")


def load_benchmark(args: argparse.Namespace) -> Any:
    """The dataset `--dataset` names (downloaded unless --no-download), LoCoMo without its repeated
    questions unless --no-dedup (a command without the flag reads the deduplicated set too)."""
    from rmm.data import load_dataset

    return load_dataset(args.dataset, data_dir=args.data_dir, download=not args.no_download,
                        dedup=not getattr(args, "no_dedup", False))


def load_llm(spec: str, **options: Any) -> Any:
    """`rmm.llm.load_llm`, looked up at call time (tests stand a scripted LLM in for it)."""
    from rmm import llm

    return llm.load_llm(spec, **options)


def llm_options(args: argparse.Namespace) -> dict[str, Any]:
    """Constructor options for the `--llm` backend from the flags that apply to it (--llm-threads)."""
    threads = getattr(args, "llm_threads", None)
    return {"threads": threads} if threads and args.llm.startswith("hf:") else {}


def write_json(path: str | None, obj: Any) -> None:
    """Write `obj` as JSON to `path` (if given), creating its folder; `--json` is the machine format."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2))
        console.print(f"wrote {path}")


def fmt(value: Any) -> str:
    """A fraction as a percentage with one decimal; anything else as it prints."""
    return f"{100 * value:.1f}" if isinstance(value, float) else str(value)
