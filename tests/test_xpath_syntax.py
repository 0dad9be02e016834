"""Semantic XPath's query language: every construct, precedence, positions, errors with columns,
and (hypothesis) random well-formed queries round-tripping through the canonical text."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmm.errors import RmmError
from rmm.memory.xpath_syntax import (
    MAX_DEPTH, Aggregate, AggregateFunction, Axis, Complement, Index, Local, Maximum, Mean, Minimum,
    Product, Query, QuerySyntaxError, Relevance, Slice, Step, parse,
)

A, B, C = Local(None, "a"), Local(None, "b"), Local("title", "c")
CHILD, DESC = Axis.CHILD, Axis.DESCENDANT


def pred(text: str) -> Relevance:
    """The predicate of the only step of `//X[...]`."""
    query = parse(f"//X[{text}]")
    assert len(query.steps) == 1 and query.steps[0].predicate is not None
    return query.steps[0].predicate


# -- the paper's and the issue's examples ------------------------------------------------------------

def test_paper_example_q1_aggregate_over_an_inner_step() -> None:
    inner = Step(CHILD, "POI", predicate=Local(None, "conference"))
    assert parse('//Day[avg(/POI[node~="conference"])]') == Query(
        (Step(DESC, "Day", predicate=Aggregate(AggregateFunction.AVG, inner)),))


def test_paper_example_q2_position_then_complement() -> None:
    assert parse('//Day[3]/POI[1-[node~="workshop"]]') == Query((
        Step(DESC, "Day", position=Index(3)),
        Step(CHILD, "POI", predicate=Complement(Local(None, "workshop"))),
    ))


def test_issue_template_and_revision_lookup() -> None:
    turn = Step(CHILD, "Turn", predicate=Local(None, "Q"))
    assert parse('//Session[max(/Turn[node~"Q"])]/Turn[node~"Q"]') == Query((
        Step(DESC, "Session", predicate=Aggregate(AggregateFunction.MAX, turn)), turn))
    query = parse('//Version[node~="deletepostersession"]//POI[node~="poster"]')
    assert [s.axis for s in query.steps] == [DESC, DESC]
    assert [s.node_type for s in query.steps] == ["Version", "POI"]


# -- each construct ------------------------------------------------------------------------------

def test_axes_node_types_and_wildcard() -> None:
    assert parse("/Conversation//*/Turn") == Query((
        Step(CHILD, "Conversation"), Step(DESC, None), Step(CHILD, "Turn")))
    assert parse("//Séance").steps[0].node_type == "Séance"
    assert parse("  / A   //  B ") == parse("/A//B")


def test_empty_query_is_the_root() -> None:
    assert parse("") == parse("  \n") == Query(())
    assert str(Query(())) == ""


@pytest.mark.parametrize(("text", "position"), [
    ("[1]", Index(1)), ("[3]", Index(3)), ("[-1]", Index(-1)), ("[−2]", Index(-2)), ("[ - 2 ]", Index(-2)),
    ("[007]", Index(7)), ("[1:3]", Slice(1, 3)), ("[2:2]", Slice(2, 2)), ("[-3:-1]", Slice(-3, -1)),
    ("[1:-1]", Slice(1, -1)), ("[-2:5]", Slice(-2, 5)),
])
def test_positions(text: str, position: Index | Slice) -> None:
    assert parse(f"//Turn{text}").steps[0].position == position
    assert parse(f'//Turn{text}[node~"x"]').steps[0] == Step(DESC, "Turn", position, Local(None, "x"))


def test_local_matches_on_node_or_attribute() -> None:
    assert pred('node~"a"') == A
    assert pred('node~="a"') == A
    assert pred("node ~ 'a'") == A
    assert pred('title~"c"') == C
    assert pred(r'node~"say \"hi\" \\ \'x\'"') == Local(None, "say \"hi\" \\ 'x'")
    assert pred('[node~"a"]') == A  # a redundant bracket groups nothing


def test_binary_operators() -> None:
    assert pred('([node~"a"]+[node~"b"])/2') == Mean(A, B)
    assert pred('[node~"a"]*[node~"b"]') == Product(A, B)
    assert pred('[node~"a"]·[node~"b"]') == Product(A, B)
    assert pred('min([node~"a"],[node~"b"])') == Minimum(A, B)
    assert pred('max([node~"a"], [node~"b"])') == Maximum(A, B)
    assert pred('1-[node~"a"]') == pred('1 − [node~"a"]') == Complement(A)


@pytest.mark.parametrize("function", list(AggregateFunction))
def test_aggregates(function: AggregateFunction) -> None:
    inner = Step(DESC, "Turn", Index(-1), Local(None, "a"))
    assert pred(f'{function.value}(//Turn[-1][node~"a"])') == Aggregate(function, inner)


def test_nested_aggregates_and_wildcards() -> None:
    inner = Step(CHILD, "Turn", predicate=Local(None, "a"))
    outer = Step(CHILD, "Session", predicate=Aggregate(AggregateFunction.GMEAN, inner))
    assert pred('avg(/Session[gmean(/Turn[node~"a"])])') == Aggregate(AggregateFunction.AVG, outer)
    assert pred('min(/*[node~"a"])') == Aggregate(AggregateFunction.MIN, Step(CHILD, None, None, A))


# -- precedence ----------------------------------------------------------------------------------

def test_product_binds_tighter_than_complement() -> None:
    assert pred('1-[node~"a"]*[node~"b"]') == Complement(Product(A, B))
    assert pred('[1-[node~"a"]]*[node~"b"]') == Product(Complement(A), B)
    assert str(Product(Complement(A), B)) == '[1-[node~"a"]]*[node~"b"]'


def test_product_is_left_associative_and_brackets_group() -> None:
    assert pred('[node~"a"]*[node~"b"]*[title~"c"]') == Product(Product(A, B), C)
    assert pred('[node~"a"]*[[node~"b"]*[title~"c"]]') == Product(A, Product(B, C))
    assert str(Product(A, Product(B, C))) == '[node~"a"]*[[node~"b"]*[title~"c"]]'


def test_complement_nests_to_the_right() -> None:
    assert pred('1-1-[node~"a"]') == Complement(Complement(A))


def test_operands_of_functions_are_full_relevances() -> None:
    assert pred('min(1-[node~"a"]*[node~"b"],([node~"a"]+1-[node~"b"])/2)') == Minimum(
        Complement(Product(A, B)), Mean(A, Complement(B)))


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("query", "column", "expected"), [
    ("Day", 1, "'/' or '//' to start a step"),
    ("/", 2, "a node type or '*'"),
    ("//Day/", 7, "a node type or '*'"),
    ("///Day", 3, "a node type or '*'"),
    ("//Day[", 7, "a relevance"),                              # unclosed bracket
    ("//Day[3", 8, "':' or ']' to close the '[' at column 6"),
    ('//Day[node~"x"', 15, "']' to close the '[' at column 6"),
    ('//Day[avg(/POI[node~"x"]]', 25, "')' to close avg("),
    ('//Day[node~"x', 14, '" to close the string opened at column 12'),
    ("//Day[]", 7, "a predicate"),                             # empty predicate
    ('//Day[node~""]', 12, "a non-blank text"),
    ("//Day[node~   ]", 15, "a quoted string after '~'"),
    ('//Day[node="x"]', 11, "'~' after 'node'"),               # bad operators
    ('//Day[2-[node~"x"]]', 7, "a relevance"),
    ('//Day[[node~"a"]+[node~"b"]]', 17, "']' to close the '[' at column 6"),
    ('//Day[[node~"a"]/[node~"b"]]', 17, "']' to close"),
    ('//Day[[node~"a"]*1-[node~"b"]]', 18, "brackets: [1-P]"),
    ('//D[([node~"a"]+[node~"b"])/3]', 29, "'2' after (P+P)/"),
    ('//D[([node~"a"]+[node~"b"]+[node~"c"])/3]', 27, "')' to close the '(' at column 5"),
    ('//D[([node~"a"])]', 16, "'+'"),
    ('//D[AVG(/A[node~"a"])]', 5, "a relevance"),
    ("//D[avg(/POI)]", 13, "a relevance predicate on the step avg aggregates"),
    ('//D[avg(/A[node~"a"]/B)]', 21, "an aggregate takes one step"),
    ('//D[gmean([node~"a"],[node~"b"])]', 11, "a step"),
    ('//D[min([node~"a"])]', 19, "','"),
    ("//Day[0]", 7, "a position from 1"),
    ("//Day[-0]", 8, "a position from 1"),
    ("//Day[3:1]", 6, "a slice whose start is not after its end"),
    ("//Day[-1:-3]", 6, "a slice whose start is not after its end"),
    ("//Day[1:]", 9, "an integer position"),
    ("//Day[-]", 8, "an integer position"),
    ("//Day[2][3]", 9, "one position per step"),
    ('//Day[node~"a"][2]', 16, "the position before the predicate"),
    ('//Day[node~"a"][b~"c"]', 16, "one predicate per step"),
    ("//Day]", 6, "'/' or '//' (a next step) or the end"),  # stray tokens
    ('//Day[node~"a"]]', 16, "'/' or '//' (a next step) or the end"),
    ("//Day x", 7, "'/' or '//' (a next step) or the end"),
    ("//Day & //Night", 7, "a token of the query language"),
    (r'//D[node~"a\q"]', 12, r"an escape"),
])
def test_malformed_queries_name_the_column_and_what_was_expected(query: str, column: int, expected: str) -> None:
    with pytest.raises(QuerySyntaxError) as caught:
        parse(query)
    error = caught.value
    assert (error.column, error.offset) == (column, column - 1), str(error)
    assert expected in error.expected, str(error)
    assert str(error).startswith(f"column {column}: expected ")
    assert error.query == query
    assert isinstance(error, RmmError) and isinstance(error, ValueError)


def test_the_error_survives_pickling() -> None:
    with pytest.raises(QuerySyntaxError) as caught:
        parse("//Day[")
    copy = pickle.loads(pickle.dumps(caught.value))
    assert (str(copy), copy.column, copy.expected, copy.found) == (
        str(caught.value), 7, caught.value.expected, "end of query")


def test_an_earlier_syntax_error_wins_over_a_later_bad_character() -> None:
    with pytest.raises(QuerySyntaxError) as caught:
        parse("Day & x")
    assert caught.value.column == 1


@pytest.mark.parametrize("query", [
    "//A" + "[1-" * 1000, "[" * 10_000, "//A[" + "(" * 5000, "//A[" + "avg(/A[" * 2000,
    "//A[" + "[" * (MAX_DEPTH + 1) + 'node~"a"' + "]" * (MAX_DEPTH + 1) + "]",
])
def test_deep_nesting_is_a_syntax_error_not_a_recursion_error(query: str) -> None:
    with pytest.raises(QuerySyntaxError):
        parse(query)


def test_nesting_up_to_the_cap_parses() -> None:
    depth = MAX_DEPTH - 1
    assert parse("//A" + "[" * depth + 'node~"a"' + "]" * depth).steps[0].predicate == A


def test_constructing_an_ast_that_has_no_text_is_refused() -> None:
    with pytest.raises(ValueError):
        Index(0)
    with pytest.raises(ValueError):
        Slice(3, 1)
    with pytest.raises(ValueError):
        Local("node", "x")  # the whole node is attribute None
    with pytest.raises(ValueError):
        Local(None, "  ")
    with pytest.raises(ValueError):
        Step(CHILD, "no spaces")
    with pytest.raises(ValueError):
        Aggregate(AggregateFunction.AVG, Step(CHILD, "Turn"))


def test_canonical_text_is_ascii_and_compact() -> None:
    query = parse("// Day [ -3 : -1 ] [ 1 − [ node ~= 'a' ] · "
                  "max( [ title ~ \"c\" ] , avg( / * [ node ~ 'b' ] ) ) ]")
    assert str(query) == '//Day[-3:-1][1-[node~"a"]*max([title~"c"],avg(/*[node~"b"]))]'


# -- properties ----------------------------------------------------------------------------------

_NAMES = st.one_of(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True), st.sampled_from(["Séance", "日記"]))
_NONZERO = st.integers(-12, 12).filter(bool)


@st.composite
def _slices(draw: st.DrawFn) -> Slice:
    start, stop = draw(_NONZERO), draw(_NONZERO)
    if (start > 0) == (stop > 0) and start > stop:
        start, stop = stop, start
    return Slice(start, stop)


_POSITIONS = st.one_of(st.none(), st.builds(Index, _NONZERO), _slices())
_LOCALS = st.builds(Local, st.one_of(st.none(), _NAMES.filter(lambda n: n != "node")),
                    st.text(min_size=1, max_size=12).filter(str.strip))


def _steps(predicates: st.SearchStrategy) -> st.SearchStrategy[Step]:
    return st.builds(Step, st.sampled_from(list(Axis)), st.one_of(st.none(), _NAMES), _POSITIONS, predicates)


def _extend(children: st.SearchStrategy[Relevance]) -> st.SearchStrategy[Relevance]:
    return st.one_of(
        st.builds(Complement, children),
        *(st.builds(kind, children, children) for kind in (Product, Mean, Minimum, Maximum)),
        st.builds(Aggregate, st.sampled_from(list(AggregateFunction)), _steps(children)),
    )


_RELEVANCES = st.recursive(_LOCALS, _extend, max_leaves=6)
_QUERIES = st.builds(Query, st.lists(_steps(st.one_of(st.none(), _RELEVANCES)), max_size=4).map(tuple))


@st.composite
def _surface(draw: st.DrawFn, query: Query) -> str:
    """`query` written as someone might: random spacing, Unicode or ASCII operators, `~` or `~=`,
    either quote, leading zeros and redundant brackets. Every choice leaves the AST unchanged."""
    gap = lambda: draw(st.sampled_from(["", "", " ", "  ", "\n", "\t"]))  # noqa: E731
    join = lambda *parts: gap().join(parts)  # noqa: E731

    def number(value: int) -> str:
        text = str(abs(value)).zfill(draw(st.integers(1, 3)))
        return join(draw(st.sampled_from(["-", "−"])), text) if value < 0 else text

    def string(text: str) -> str:
        quote = draw(st.sampled_from(['"', "'"]))
        return quote + text.replace("\\", "\\\\").replace(quote, "\\" + quote) + quote

    def bracketed(relevance: Relevance) -> str:
        if isinstance(relevance, Local):
            local = join("[", relevance.attribute or "node", draw(st.sampled_from(["~", "~="])),
                         string(relevance.text), "]")
            return join("[", local, "]") if draw(st.booleans()) else local
        return join("[", rel(relevance), "]")

    def factor(relevance: Relevance) -> str:
        if isinstance(relevance, (Complement, Product)) or draw(st.integers(0, 4)) == 0:
            return bracketed(relevance)
        return rel(relevance)

    def rel(relevance: Relevance) -> str:
        if isinstance(relevance, Local):
            return bracketed(relevance)
        if isinstance(relevance, Complement):
            return join("1", draw(st.sampled_from(["-", "−"])), rel(relevance.operand))
        if isinstance(relevance, Product):
            left = rel(relevance.left) if isinstance(relevance.left, Product) else factor(relevance.left)
            return join(left, draw(st.sampled_from(["*", "·"])), factor(relevance.right))
        if isinstance(relevance, Mean):
            return join("(", rel(relevance.left), "+", rel(relevance.right), ")", "/", "2")
        if isinstance(relevance, (Minimum, Maximum)):
            name = "min" if isinstance(relevance, Minimum) else "max"
            return join(name, "(", rel(relevance.left), ",", rel(relevance.right), ")")
        assert isinstance(relevance, Aggregate)
        return join(relevance.function.value, "(", step(relevance.step), ")")

    def step(s: Step) -> str:
        parts = [s.axis.value, s.node_type or "*"]
        if isinstance(s.position, Index):
            parts.append(join("[", number(s.position.index), "]"))
        elif isinstance(s.position, Slice):
            parts.append(join("[", number(s.position.start), ":", number(s.position.stop), "]"))
        if s.predicate is not None:
            parts.append(bracketed(s.predicate))
        return join(*parts)

    return gap() + "".join(join(step(s), "") for s in query.steps)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), query=_QUERIES)
def test_random_well_formed_queries_round_trip(data: st.DataObject, query: Query) -> None:
    text = data.draw(_surface(query))
    parsed = parse(text)
    assert parsed == query, text
    assert parse(str(parsed)) == parsed
    assert str(parse(str(parsed))) == str(parsed)


_QUERY_ALPHABET = st.sampled_from(list("/*[]()~=:,+-−·12 0\"'\\") + ["node", "avg", "min", "Day", "a"])


@settings(max_examples=400, deadline=None)
@given(text=st.one_of(st.text(max_size=40), st.lists(_QUERY_ALPHABET, max_size=30).map("".join)))
def test_any_string_parses_or_raises_a_query_syntax_error(text: str) -> None:
    try:
        query = parse(text)
    except QuerySyntaxError as error:
        assert 1 <= error.column <= len(text) + 1
    else:
        assert parse(str(query)) == query
