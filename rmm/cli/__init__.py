"""The `rmm` command: evaluate retrievers, train the reranker online, chat, serve, fetch data.

Applications wire objects and report; the work happens in the library. Each command lives in
its own module (`register` adds its parser, `run` does it) and imports what is heavy only when
it runs, so `rmm --help` stays fast. Bad flags are refused by the parser (one `error:` line,
exit 2) before any work; errors rmm raises on bad input are printed as one clear line (exit 2),
never as a traceback.
"""

from __future__ import annotations

import argparse
import sys

from rich.markup import escape

from rmm.cli import chat, data, eval_controller, eval_qa, llm, logs, ope, pretrain, serve, train
from rmm.cli import eval as eval_command
from rmm.cli.arguments import CheckedParser
from rmm.cli.common import console
from rmm.errors import RmmError

__all__ = ["build_parser", "main"]

# In the order `rmm --help` lists them.
COMMANDS = (eval_command, chat, eval_qa, eval_controller, train, pretrain, serve, ope, llm, data)


def build_parser() -> argparse.ArgumentParser:
    """`rmm`'s parser: every command's subparser, with its argument types and cross-flag checks."""
    parser = CheckedParser(prog="rmm", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    restore_logging = logs.to_stderr(getattr(args, "verbose", 0))
    logs.quiet_progress_bars()
    try:
        return args.func(args)
    except RmmError as error:
        console.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        return 2
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    finally:
        restore_logging()


if __name__ == "__main__":
    sys.exit(main())
