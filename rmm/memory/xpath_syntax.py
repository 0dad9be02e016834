"""Semantic XPath's query language (Liu et al., §3.2 and App. A): a parser into a typed AST.

Only the syntax lives here; executing a query over the memory tree (weighted node sets, scorers)
is `rmm.memory.xpath_exec`, which reads the AST this module returns. Pure, no I/O, no imports
above `rmm.errors`, so it sits in the memory layer beside the tree it walks.

Grammar (EBNF; whitespace may separate any two tokens; ``{x}`` is zero or more, ``[x]`` optional)::

    query      = { step } ;                                  (* the empty query is the root *)
    step       = axis , node_test , [ position ] , [ predicate ] ;
    axis       = "/" | "//" ;                                (* children | descendants *)
    node_test  = NAME | "*" ;
    position   = "[" , index , "]" | "[" , index , ":" , index , "]" ;
    index      = [ minus ] , INT ;                           (* non-zero: 1 first, -1 last *)
    predicate  = bracket ;
    bracket    = "[" , ( local | relevance ) , "]" ;
    local      = NAME , ( "~" | "~=" ) , STRING ;           (* NAME "node": the whole node *)
    relevance  = "1" , minus , relevance                     (* 1-P *)
               | product ;
    product    = factor , { times , factor } ;               (* P·P, left-associative *)
    factor     = bracket                                     (* a local, or grouping *)
               | "(" , relevance , "+" , relevance , ")" , "/" , "2"       (* mean *)
               | ( "min" | "max" ) , "(" , relevance , "," , relevance , ")"
               | ( "avg" | "min" | "max" | "gmean" ) , "(" , step , ")" ;  (* aggregate *)
    minus      = "-" | "−" ;                                 (* ASCII hyphen or U+2212 *)
    times      = "*" | "·" ;                                 (* asterisk or U+00B7 *)
    NAME       = a Python identifier (Unicode letters, digits, "_"; not starting with a digit) ;
    INT        = decimal digits ;
    STRING     = '"' ... '"' | "'" ... "'" ;   (* escapes: \\ \" \' only; not blank *)

Choices where the paper is silent or ambiguous (its examples are the authority on surface form):

- **Brackets.** The paper's examples write a step's relevance in brackets (``//Day[avg(...)]``,
  ``/POI[1-[node~="workshop"]]``) and a local match with its own brackets, shared with the step's
  when it stands alone (``//Version[node~="..."]``). So a bracket holds a local match or any
  relevance expression, and inside an expression a bracket also groups: ``[1-[node~"a"]]*[node~"b"]``.
- **Precedence** is arithmetic: the product binds tighter than ``1-``, so ``1-A*B`` is
  ``1-(A*B)``; ``(1-A)*B`` is written ``[1-A]*B``, and ``A*1-B`` is refused (it would read
  ``(A*1)-B``). ``1-1-A`` is ``1-(1-A)``. ``(P+P)/2`` admits exactly two terms and the literal 2.
- **min / max** are both a binary operator and an aggregate: an argument starting with an axis
  (``min(/Turn[...])``) is an aggregate's step, otherwise two relevances separated by a comma.
- **An aggregate takes one step** (App. A's S′ = A N R P′) and that step must carry a relevance
  predicate: without P′ there is nothing to aggregate.
- **Positions** are 1-based; ``[-i]`` is the i-th from the end; ``[i:j]`` is inclusive at both
  ends and either bound may count from the end, so ``[-3:-1]`` is "the last three". 0 is refused,
  as is a slice whose bounds have the same sign and run backwards (``[3:1]``: always empty).
  A step takes at most one position and one predicate, the position first (App. A applies R
  before P).
- ``~`` and the paper's ``~=`` are the same soft match; ``node`` names the whole node, so no
  attribute can be called ``node``. Function names are lower-case.
- **Canonical text** (``str``) is compact with ASCII operators: ``-``, ``*``, ``~``, double quotes, no
  spaces, the fewest brackets; ``parse(str(q)) == q`` for every AST.

Every malformed input raises `QuerySyntaxError` (an `RmmError` and a `ValueError`) naming the
1-based column and what was expected there; nesting is capped at `MAX_DEPTH` so no input can
reach Python's recursion limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Union

from rmm.errors import RmmError

__all__ = [
    "MAX_DEPTH", "Aggregate", "AggregateFunction", "Axis", "Complement", "Index", "Local", "Maximum",
    "Mean", "Minimum", "Position", "Product", "Query", "QuerySyntaxError", "Relevance", "Slice", "Step",
    "parse",
]

MAX_DEPTH = 64  # brackets, parentheses, functions and complements nested inside each other


class QuerySyntaxError(RmmError, ValueError):
    """A query that is not in the grammar: where (1-based column), what was expected, what was found."""

    def __init__(self, query: str, offset: int, expected: str, found: str) -> None:
        self.query = query
        self.offset = offset
        self.column = offset + 1
        self.expected = expected
        self.found = found
        super().__init__(f"column {self.column}: expected {expected}, found {found}")

    def __reduce__(self) -> tuple:  # picklable across processes despite the extra arguments
        return (type(self), (self.query, self.offset, self.expected, self.found))


class Axis(str, Enum):
    """How a step moves from each node of the working set (App. A.2)."""

    CHILD = "/"
    DESCENDANT = "//"


class AggregateFunction(str, Enum):
    """How an aggregate folds the relevances of the nodes its inner step reaches (App. A.5)."""

    AVG = "avg"
    MIN = "min"
    MAX = "max"
    GMEAN = "gmean"


_NAME = re.compile(r"[^\W\d]\w*")
NODE = "node"  # the reserved attribute name of a whole-node soft match


def _is_name(text: str) -> bool:
    return _NAME.fullmatch(text) is not None


@dataclass(frozen=True)
class Index:
    """``[i]`` (i ≥ 1, the i-th) or ``[-i]`` (the i-th from the end) of the working set."""

    index: int

    def __post_init__(self) -> None:
        if self.index == 0:
            raise ValueError("positions count from 1 (or -1 from the end); 0 is not a position")

    def __str__(self) -> str:
        return f"[{self.index}]"


@dataclass(frozen=True)
class Slice:
    """``[i:j]``: the i-th through the j-th, both included; either may count from the end."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.start == 0 or self.stop == 0:
            raise ValueError("positions count from 1 (or -1 from the end); 0 is not a position")
        if (self.start > 0) == (self.stop > 0) and self.start > self.stop:
            raise ValueError(f"slice [{self.start}:{self.stop}] is always empty")

    def __str__(self) -> str:
        return f"[{self.start}:{self.stop}]"


Position = Union[Index, Slice]


@dataclass(frozen=True)
class Local:
    """``[attr~"text"]`` (one attribute) or ``[node~"text"]`` (``attribute`` None: the whole node)."""

    attribute: str | None
    text: str

    def __post_init__(self) -> None:
        if self.attribute is not None and (not _is_name(self.attribute) or self.attribute == NODE):
            raise ValueError(f"attribute name {self.attribute!r} is not an identifier other than {NODE!r}")
        if not self.text.strip():
            raise ValueError("a soft match needs a non-blank text")

    def __str__(self) -> str:
        escaped = self.text.replace("\\", "\\\\").replace('"', '\\"')
        return f'[{self.attribute or NODE}~"{escaped}"]'


@dataclass(frozen=True)
class Complement:
    """``1-P``."""

    operand: Relevance

    def __str__(self) -> str:
        return f"1-{self.operand}"


@dataclass(frozen=True)
class Product:
    """``P*P`` (the paper's P·P)."""

    left: Relevance
    right: Relevance

    def __str__(self) -> str:
        left = f"[{self.left}]" if isinstance(self.left, Complement) else str(self.left)
        right = f"[{self.right}]" if isinstance(self.right, (Complement, Product)) else str(self.right)
        return f"{left}*{right}"


@dataclass(frozen=True)
class Mean:
    """``(P+P)/2``."""

    left: Relevance
    right: Relevance

    def __str__(self) -> str:
        return f"({self.left}+{self.right})/2"


@dataclass(frozen=True)
class Minimum:
    """``min(P,P)``."""

    left: Relevance
    right: Relevance

    def __str__(self) -> str:
        return f"min({self.left},{self.right})"


@dataclass(frozen=True)
class Maximum:
    """``max(P,P)``."""

    left: Relevance
    right: Relevance

    def __str__(self) -> str:
        return f"max({self.left},{self.right})"


@dataclass(frozen=True)
class Aggregate:
    """``avg|min|max|gmean(S)``: the relevances of the nodes ``step`` reaches from a node, folded."""

    function: AggregateFunction
    step: Step

    def __post_init__(self) -> None:
        if self.step.predicate is None:
            raise ValueError("an aggregate's step needs a relevance predicate")

    def __str__(self) -> str:
        return f"{self.function.value}({self.step})"


Relevance = Union[Local, Complement, Product, Mean, Minimum, Maximum, Aggregate]


@dataclass(frozen=True)
class Step:
    """``A N [R] [P]``: an axis, a node type (None for ``*``), an optional position and relevance."""

    axis: Axis
    node_type: str | None
    position: Position | None = None
    predicate: Relevance | None = None

    def __post_init__(self) -> None:
        if self.node_type is not None and not _is_name(self.node_type):
            raise ValueError(f"node type {self.node_type!r} is not an identifier")

    def __str__(self) -> str:
        text = self.axis.value + (self.node_type or "*")
        if self.position is not None:
            text += str(self.position)
        if isinstance(self.predicate, Local):
            text += str(self.predicate)
        elif self.predicate is not None:
            text += f"[{self.predicate}]"
        return text


@dataclass(frozen=True)
class Query:
    """A sequence of steps, executed from the root; no steps selects the root itself."""

    steps: tuple[Step, ...] = ()

    def __str__(self) -> str:
        return "".join(str(step) for step in self.steps)


def parse(text: str) -> Query:
    """The AST of ``text``, or `QuerySyntaxError` with the column of the first thing out of place."""
    if not isinstance(text, str):
        raise TypeError(f"a query is text, not {type(text).__name__}")
    return _Parser(text).query()


# -- tokens -------------------------------------------------------------------------------------

_PUNCT = {
    "//": "//", "/": "/", "*": "*", "·": "*", "[": "[", "]": "]", "(": "(", ")": ")", ",": ",",
    ":": ":", "+": "+", "-": "-", "−": "-", "~=": "~", "~": "~",
}
_ESCAPES = {"\\": "\\", '"': '"', "'": "'"}


@dataclass(frozen=True)
class _Token:
    kind: str  # a canonical punctuation, "NAME", "INT", "STRING", "END", or "BAD" (a lexical error)
    text: str  # the value (a string's unescaped content), or a BAD token's "expected" phrase
    offset: int
    source: str  # the characters as written, for messages


def _tokens(query: str) -> list[_Token]:
    """Every token up to the first lexical error, which becomes a BAD token the parser raises on
    only when it gets there (so an earlier syntax error is reported first)."""
    out: list[_Token] = []
    i, n = 0, len(query)
    while True:
        while i < n and query[i].isspace():
            i += 1
        if i == n:
            out.append(_Token("END", "", i, "end of query"))
            return out
        c = query[i]
        two = query[i:i + 2]
        if len(two) == 2 and two in _PUNCT:
            out.append(_Token(_PUNCT[two], two, i, repr(two)))
            i += 2
        elif c in _PUNCT:
            out.append(_Token(_PUNCT[c], c, i, repr(c)))
            i += 1
        elif c.isdigit() and c.isascii():
            j = i
            while j < n and query[j].isdigit() and query[j].isascii():
                j += 1
            out.append(_Token("INT", query[i:j], i, query[i:j]))
            i = j
        elif (name := _NAME.match(query, i)) is not None:
            out.append(_Token("NAME", name.group(), i, repr(name.group())))
            i = name.end()
        elif c in "\"'":
            chars: list[str] = []
            j = i + 1
            while j < n and query[j] != c:
                if query[j] == "\\":
                    if j + 1 < n and query[j + 1] in _ESCAPES:
                        chars.append(_ESCAPES[query[j + 1]])
                        j += 2
                        continue
                    bad = query[j:j + 2]
                    out.append(_Token("BAD", "an escape \\\\, \\\" or \\'", j, repr(bad)))
                    return out
                chars.append(query[j])
                j += 1
            if j == n:
                out.append(_Token("BAD", f"{c} to close the string opened at column {i + 1}", n, "end of query"))
                return out
            out.append(_Token("STRING", "".join(chars), i, repr(query[i:j + 1])))
            i = j + 1
        else:
            out.append(_Token("BAD", "a token of the query language", i, f"character {c!r}"))
            return out


# -- parser -------------------------------------------------------------------------------------

_STARTS_RELEVANCE = "'[', '(', '1-', avg, min, max or gmean"


class _Parser:
    """Recursive descent over the token list; `depth` counts nesting for `MAX_DEPTH`."""

    def __init__(self, query: str) -> None:
        self.text = query
        self.tokens = _tokens(query)
        self.i = 0

    # helpers
    def peek(self, ahead: int = 0) -> _Token:
        return self.tokens[min(self.i + ahead, len(self.tokens) - 1)]

    def fail(self, expected: str, token: _Token | None = None) -> QuerySyntaxError:
        token = token or self.peek()
        if token.kind == "BAD":  # a lexical error where the parser wanted something: say that
            return QuerySyntaxError(self.text, token.offset, token.text, token.source)
        return QuerySyntaxError(self.text, token.offset, expected, token.source)

    def take(self, kind: str, expected: str) -> _Token:
        token = self.peek()
        if token.kind != kind:
            raise self.fail(expected)
        self.i += 1
        return token

    def deeper(self, depth: int) -> int:
        if depth >= MAX_DEPTH:
            raise self.fail(f"at most {MAX_DEPTH} levels of nesting")
        return depth + 1

    # grammar
    def query(self) -> Query:
        steps: list[Step] = []
        while self.peek().kind in ("/", "//"):
            steps.append(self.step(0))
        if self.peek().kind != "END":
            raise self.fail("'/' or '//' to start a step" if not steps else "'/' or '//' (a next step) or the end")
        return Query(tuple(steps))

    def step(self, depth: int) -> Step:
        token = self.peek()
        if token.kind not in ("/", "//"):
            raise self.fail("'/' or '//'")
        self.i += 1
        axis = Axis(token.kind)
        token = self.peek()
        if token.kind == "NAME":
            node_type: str | None = token.text
        elif token.kind == "*":
            node_type = None
        else:
            raise self.fail("a node type or '*'")
        self.i += 1
        position: Position | None = None
        predicate: Relevance | None = None
        while self.peek().kind == "[":
            if self.is_position():
                if predicate is not None:
                    raise self.fail("the position before the predicate (Step[i][P])")
                if position is not None:
                    raise self.fail("one position per step")
                position = self.position()
            else:
                if predicate is not None:
                    raise self.fail("one predicate per step (combine them with '*', min, max or (P+P)/2)")
                predicate = self.bracket(depth)
        return Step(axis, node_type, position, predicate)

    def is_position(self) -> bool:
        first, second = self.peek(1), self.peek(2)
        # No relevance starts with '-', and only "1-" starts one with a number.
        return first.kind == "-" or (first.kind == "INT" and second.kind in ("]", ":", "END"))

    def index(self) -> int:
        negative = self.peek().kind == "-"
        if negative:
            self.i += 1
        token = self.take("INT", "an integer position")
        if int(token.text) == 0:
            raise self.fail("a position from 1 (or -1 from the end)", token)
        return -int(token.text) if negative else int(token.text)

    def position(self) -> Position:
        opening = self.take("[", "'['")
        start = self.index()
        if self.peek().kind == ":":
            self.i += 1
            stop = self.index()
            self.take("]", f"']' to close the '[' at column {opening.offset + 1}")
            if (start > 0) == (stop > 0) and start > stop:
                raise QuerySyntaxError(self.text, opening.offset, "a slice whose start is not after its end",
                                       f"[{start}:{stop}]")
            return Slice(start, stop)
        self.take("]", f"':' or ']' to close the '[' at column {opening.offset + 1}")
        return Index(start)

    def bracket(self, depth: int) -> Relevance:
        depth = self.deeper(depth)
        opening = self.take("[", "'['")
        closing = f"']' to close the '[' at column {opening.offset + 1}"
        first, second = self.peek(), self.peek(1)
        if first.kind == "]":
            raise self.fail(f'a predicate: node~"text", attribute~"text" or a relevance ({_STARTS_RELEVANCE})')
        if first.kind == "NAME" and second.kind == "~":
            self.i += 2
            text = self.take("STRING", "a quoted string after '~'")
            if not text.text.strip():
                raise self.fail("a non-blank text to match", text)
            result: Relevance = Local(None if first.text == NODE else first.text, text.text)
        elif first.kind == "NAME" and second.kind != "(":
            expected = f"'~' after {first.source} (a soft match is name~\"text\")"
            if second.kind == "BAD" and second.source.startswith("character"):  # e.g. node="x"
                raise QuerySyntaxError(self.text, second.offset, expected, second.source)
            raise self.fail(expected, second)
        else:
            result = self.relevance(depth)
        self.take("]", closing)
        return result

    def relevance(self, depth: int) -> Relevance:
        token = self.peek()
        if token.kind == "INT":
            if int(token.text) != 1 or self.peek(1).kind != "-":
                raise self.fail(f"a relevance ({_STARTS_RELEVANCE}); the only number that starts one is 1 in 1-P")
            depth = self.deeper(depth)
            self.i += 2
            return Complement(self.relevance(depth))
        result = self.factor(depth)
        while self.peek().kind == "*":
            self.i += 1
            result = Product(result, self.factor(depth))
        return result

    def factor(self, depth: int) -> Relevance:
        token = self.peek()
        if token.kind == "[":
            return self.bracket(depth)
        if token.kind == "(":
            depth = self.deeper(depth)
            self.i += 1
            left = self.relevance(depth)
            self.take("+", "'+' (a mean is written (P+P)/2)")
            right = self.relevance(depth)
            self.take(")", f"')' to close the '(' at column {token.offset + 1} (a mean is (P+P)/2)")
            self.take("/", "'/2' after (P+P)")
            two = self.take("INT", "'2' after (P+P)/")
            if int(two.text) != 2:
                raise self.fail("'2' after (P+P)/", two)
            return Mean(left, right)
        if token.kind == "NAME" and token.text in {f.value for f in AggregateFunction}:
            depth = self.deeper(depth)
            self.i += 1
            self.take("(", f"'(' after {token.text}")
            function = AggregateFunction(token.text)
            if self.peek().kind in ("/", "//"):
                inner = self.step(depth)
                if inner.predicate is None:
                    raise self.fail(f'a relevance predicate on the step {token.text} aggregates '
                                    f'(e.g. {token.text}(/Turn[node~"..."]))')
                self.take(")", f"')' to close {token.text}( (an aggregate takes one step)")
                return Aggregate(function, inner)
            if function not in (AggregateFunction.MIN, AggregateFunction.MAX):
                raise self.fail(f"a step ('/' or '//') to aggregate in {token.text}(...)")
            left = self.relevance(depth)
            self.take(",", f"',' between the two relevances of {token.text}(P,P), or a step to aggregate")
            right = self.relevance(depth)
            self.take(")", f"')' to close {token.text}(P,P)")
            return Minimum(left, right) if function is AggregateFunction.MIN else Maximum(left, right)
        if token.kind == "INT":
            raise self.fail("a relevance term; a complement inside a product needs brackets: [1-P]")
        raise self.fail(f"a relevance ({_STARTS_RELEVANCE})")
