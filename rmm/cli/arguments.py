"""Argument types and cross-flag checks: a bad number, name or combination is one `error:` line
from the parser (exit 2) before any work starts, never a traceback from deep in the library.

Types import what they check against lazily (at parse time, not at import), so `rmm --help`
stays fast.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = [
    "RERANK_NEEDS_EMBEDDINGS", "Check", "CheckedParser", "add_check", "cosine", "device", "index_backend",
    "m_within_k", "non_negative_float", "non_negative_int", "open_fraction", "port", "positive_float", "positive_int",
    "positive_probability", "probability", "rerankable_retriever_name", "retriever_name", "store_url",
    "trainable_citer", "unrerankable",
]

Number = TypeVar("Number", int, float)
Check = Callable[[argparse.Namespace], str | None]


def _number(convert: Callable[[str], Number], requirement: str, accept: Callable[[Number], bool],
            name: str) -> Callable[[str], Number]:
    """An argparse type: `convert` the text, then refuse it unless `accept` holds (NaN never does)."""

    def parse(text: str) -> Number:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {requirement}, got {text!r}") from None
        if (isinstance(value, float) and not math.isfinite(value)) or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {requirement}, got {text!r}")
        return value

    parse.__name__ = name
    return parse


positive_int = _number(int, "a positive integer", lambda v: v > 0, "positive_int")
non_negative_int = _number(int, "an integer ≥ 0", lambda v: v >= 0, "non_negative_int")
positive_float = _number(float, "a positive number", lambda v: v > 0, "positive_float")
non_negative_float = _number(float, "a number ≥ 0", lambda v: v >= 0, "non_negative_float")
probability = _number(float, "a probability in [0, 1]", lambda v: 0 <= v <= 1, "probability")
positive_probability = _number(float, "a probability in (0, 1]", lambda v: 0 < v <= 1, "positive_probability")
open_fraction = _number(float, "a fraction strictly between 0 and 1", lambda v: 0 < v < 1, "open_fraction")
cosine = _number(float, "a cosine similarity in [-1, 1]", lambda v: -1 <= v <= 1, "cosine")
port = _number(int, "a port number in 1–65535", lambda v: 1 <= v <= 65535, "port")

_ASSIGNMENT = re.compile(r"[A-Za-z_][\w.-]*=")  # key=value (a config override), not an option
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def device(text: str) -> str:
    """auto | cpu | mps | cuda[:N], by form only: whether this machine has the device is the
    run's question (a deployment file is checked on machines without a GPU)."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, mps or cuda[:N], got {text!r}")
    return text


def index_backend(text: str) -> str:
    """A vector-index backend the bank knows (`rmm.memory.index.BACKENDS`)."""
    from rmm.memory.index import BACKENDS

    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(f"unknown index backend {text!r}; use one of {', '.join(BACKENDS)}")
    return text


def retriever_name(text: str) -> str:
    """A `--retriever` name as `rmm.eval.benchmark_bank.parse_retriever` reads it (`hybrid:`,
    `bm25:bm25` are refused here); whether an encoder preset or folder loads is the run's question."""
    from rmm.errors import RmmError
    from rmm.eval.benchmark_bank import parse_retriever

    try:
        parse_retriever(text)
    except RmmError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


# One message for every command that reranks, from the parser or from a run-time check.
RERANK_NEEDS_EMBEDDINGS = ("the reranker rescores embeddings and plain bm25 has none; use bm25:DENSE (BM25's "
                           "ranking over DENSE's bank, e.g. bm25:minilm) or hybrid[:DENSE]")


def unrerankable(name: str) -> str | None:
    """Why a command that reranks cannot take `name` (plain `bm25`: text only, no embeddings for the
    reranker to rescore), or None; what the run-time checks raise for a name that did not come through the parser."""
    from rmm.eval.benchmark_bank import parse_retriever

    return None if parse_retriever(name).dense is not None else f"--retriever {name}: {RERANK_NEEDS_EMBEDDINGS}"


def rerankable_retriever_name(text: str) -> str:
    """`retriever_name` for a command that reranks its first stage's candidates: plain `bm25` refused."""
    if unrerankable(retriever_name(text)):
        raise argparse.ArgumentTypeError(RERANK_NEEDS_EMBEDDINGS)  # argparse names the flag itself
    return text


def trainable_citer(text: str) -> str:
    """Who cites during `rmm train`: an LLM spec (`rmm.llm.parse_spec`) the online trainer supports.

    Checked as a spec, not against a fixed list, so that LLM citers need no new flag once the
    trainer supports them; until then a valid spec it cannot use is refused here, by name."""
    from rmm.errors import LLMError
    from rmm.llm import parse_spec

    try:
        backend, _ = parse_spec(text)
    except LLMError as error:
        first = str(error).splitlines()[0]
        raise argparse.ArgumentTypeError(f"{first}; use simulated, openai:URL@MODEL, hf:PATH or vllm:PATH") from None
    from rmm.training.online import CITERS

    if backend not in CITERS:
        raise argparse.ArgumentTypeError(f"{text!r} is a {backend} LLM, but online training cites only with "
                                         f"{' or '.join(CITERS)} for now")
    return text


def m_within_k(args: argparse.Namespace) -> str | None:
    """The reranker shows M of the K retrieved candidates, so M cannot exceed K."""
    if args.m > args.k:
        config, overrides = getattr(args, "config", None), getattr(args, "overrides", None)
        sources = ([f"--config {config}"] if config else []) + (["key=value overrides"] if overrides else [])
        after = f", after {' and '.join(sources)}" if sources else ""
        return f"--m {args.m} must not exceed --k {args.k} (M memories are chosen from K candidates{after})"
    return None


class CheckedParser(argparse.ArgumentParser):
    """An `ArgumentParser` that runs cross-flag checks right after parsing; the first message a
    check returns becomes the parser's own error (usage, one `error:` line, exit 2). Subparsers
    made through `add_subparsers` are CheckedParsers too.

    `passthrough` names the attribute that receives, verbatim, every argument after the first
    `--` (arguments for another program); the parser's own options may then come anywhere before it.

    `overrides` names a list positional of `key=value` items: those argparse could not place
    (a second group after some flags: `epochs=1 --device cuda seed=3`) join it, in order.
    """

    def __init__(self, *args: Any, passthrough: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks: list[Check] = []
        self.passthrough = passthrough
        self.overrides: str | None = None

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        passed: list[str] = []
        if self.passthrough is not None:
            args = list(sys.argv[1:] if args is None else args)
            if "--" in args:
                cut = args.index("--")
                args, passed = args[:cut], args[cut + 1:]
        parsed, extras = super().parse_known_args(args, namespace)
        if self.passthrough is not None:
            setattr(parsed, self.passthrough, passed)
        if self.overrides is not None:
            assignments = [item for item in extras if _ASSIGNMENT.match(item)]
            setattr(parsed, self.overrides, [*getattr(parsed, self.overrides, []), *assignments])
            extras = [item for item in extras if not _ASSIGNMENT.match(item)]
        for check in self.checks:
            message = check(parsed)
            if message:
                self.error(message)
        return parsed, extras


def add_check(parser: argparse.ArgumentParser, check: Check, *, first: bool = False) -> None:
    """Run `check` after `parser` parses. Every `rmm` parser is a CheckedParser; a plain
    `ArgumentParser` a caller builds itself has nowhere to run it and leaves the check to the
    library, which validates the same values again when the command runs.

    `first`: run it before the checks added so far — for the step that settles the namespace
    (settings from `--config`), so that cross-flag checks see the effective values."""
    if isinstance(parser, CheckedParser):
        parser.checks.insert(0 if first else len(parser.checks), check)


def store_url(text: str) -> str:
    """A PostgreSQL bank URL (``postgresql://user@host/db[?schema=NAME]``), checked by libpq's rules."""
    from rmm.errors import RmmError
    from rmm.memory.pg_connect import parse_location
    from rmm.memory.storage import is_database_url

    try:
        if not is_database_url(text):
            raise RmmError(f"expected a postgresql:// URL, got {text!r} (a folder bank needs no --store)")
        parse_location(text)
    except RmmError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
