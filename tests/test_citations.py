"""Citation parsing: the paper's free-text format, JSON, and messy LLM output — never raising."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmm.policy.citations import Citation, format_response, parse_citations, parse_json_citations


@pytest.mark.parametrize(
    ("text", "cited", "answer"),
    [
        ("You enjoy hiking, playing the guitar, and stargazing. [0, 1, 2]", [0, 1, 2],
         "You enjoy hiking, playing the guitar, and stargazing."),
        ("You enjoy hiking **[0, 2]**", [0, 2], "You enjoy hiking"),
        ("You enjoy hiking `[0,2]`.", [0, 2], "You enjoy hiking."),
        ("answer\n```\n[0, 2]\n```", [0, 2], "answer"),
        ("Answer text.\n\nCitations: [1]", [1], "Answer text."),
        ("**Citations:** [0, 1]", [0, 1], ""),
        ("Done [0][2]", [0, 2], "Done"),
        ("Done [0], [2] and [3].", [0, 2, 3], "Done."),
        ("[Memory 0, Memory 2]", [0, 2], ""),
        ("[0, 1, and 2]", [0, 1, 2], ""),
        ("\\[0, 1\\]", [0, 1], ""),
        ("Sure ［1］", [1], "Sure"),
        ("[laughs] ok [simulated answer] [1]", [1], "[laughs] ok [simulated answer]"),
        # mid-text integer lists are answer text when a citation list ends the reply
        ("The codes were [1, 2, 3], I think. [4]", [4], "The codes were [1, 2, 3], I think."),
        # the inline `[i]` style: every single-index marker counts
        ("You like hiking [0] and guitar [1].", [0, 1], "You like hiking and guitar."),
    ],
)
def test_free_text_citations(text: str, cited: list[int], answer: str) -> None:
    result = parse_citations(text, 5)
    assert result.cited == cited
    assert result.answer == answer
    assert not result.no_cite


def test_no_cite() -> None:
    result = parse_citations("I don’t have enough information to answer that. [NO_CITE]", 5)
    assert result == Citation("I don’t have enough information to answer that.", [], True, [])
    for variant in ("[no cite]", "[No-Cite]", "**[NO_CITE]**", "NO_CITE", "[]"):
        r = parse_citations(f"Hmm. {variant}", 3)
        assert r.no_cite and r.cited == [], variant


def test_last_marker_wins_with_a_warning() -> None:
    r = parse_citations("You hike. [NO_CITE] Actually [1]", 3)
    assert r.cited == [1] and not r.no_cite and r.warnings
    r = parse_citations("x [1] y [NO_CITE]", 3)
    assert r.cited == [] and r.no_cite and r.warnings
    r = parse_citations("As shown [0, 2], you like tea.", 3)  # not at the end: still used
    assert r.cited == [0, 2] and any("not at the end" in w for w in r.warnings)
    assert r.answer == "As shown, you like tea."


def test_bad_indices_are_dropped_with_warnings(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rmm.policy.citations"):
        r = parse_citations("ok [0, 0, -1, 9, 2]", 5)
    assert r.cited == [0, 2]
    assert len(r.warnings) == 3 and "duplicate" in caplog.text and "out-of-range" in caplog.text
    r = parse_citations("ok [7]", 5)  # cited something, but nothing usable: skip, not punish
    assert r.cited is None and not r.no_cite
    r = parse_citations("ok [99999999999999999999999999]", 5)
    assert r.cited is None


def test_unparseable_is_none_and_keeps_the_text() -> None:
    assert parse_citations("nothing cited here", 3) == Citation("nothing cited here", None, False, [])
    r = parse_citations("I met her in [2019] and we talked", 3)
    assert r.cited is None and r.answer == "I met her in [2019] and we talked"


@pytest.mark.parametrize(
    ("text", "cited", "no_cite", "answer"),
    [
        ('{"answer": "hi", "citations": [0, 2]}', [0, 2], False, "hi"),
        ('```json\n{"answer": "hi", "citations": [0, 2]}\n```', [0, 2], False, "hi"),
        ('Sure! Here it is: {"answer": "x", "citations": [2, "1"]} hope it helps', [2, 1], False, "x"),
        ('{"answer": "x", "citations": []}', [], True, "x"),
        ('{"answer": "x", "citations": "NO_CITE"}', [], True, "x"),
        ('{"answer": "x", "citations": ["[NO_CITE]"]}', [], True, "x"),
        ('{"answer": "x", "citations": [0, 9, 0, true]}', [0], False, "x"),
        ('{"answer": "x", "citations": 1}', [1], False, "x"),
        ('{"answer": "x", "citations": null}', None, False, "x"),
        ('{"answer": "x", "citations": ["a", "b"]}', None, False, "x"),
        ('{"answer": "[0, 1] are codes", "citations": [2]}', [2], False, "[0, 1] are codes"),
    ],
)
def test_json_citations(text: str, cited: list[int] | None, no_cite: bool, answer: str) -> None:
    for parse in (parse_json_citations, parse_citations):
        r = parse(text, 3)
        assert (r.cited, r.no_cite, r.answer) == (cited, no_cite, answer)


def test_json_parser_falls_back_to_free_text() -> None:
    r = parse_json_citations("You like tea. [1]", 3)
    assert r.cited == [1] and any("free text" in w for w in r.warnings)
    r = parse_json_citations('{"answer": "no citations key"} [0]', 3)
    assert r.cited == [0]


def test_format_response_round_trips() -> None:
    assert format_response("Hi.", [0, 2]) == "Hi. [0, 2]"
    assert format_response("Hi.", []) == "Hi. [NO_CITE]"
    assert parse_citations(format_response("Hi [3].", [0, 2]), 3).cited == [0, 2]


def test_bad_arguments_raise_typed_errors() -> None:
    with pytest.raises(ValueError):
        parse_citations("[0]", -1)
    with pytest.raises(TypeError):
        parse_citations(None, 3)  # type: ignore[arg-type]
    assert parse_citations("[0]", 0).cited is None


# ---- properties ------------------------------------------------------------------------------
citation_like = st.lists(
    st.one_of(
        st.text(max_size=30),
        st.sampled_from(["[", "]", "[0, 2]", "[NO_CITE]", "**", "`", "{", '"citations": [1, 7]', "\\[", ",", "-1", "[]"]),
        st.lists(st.integers(-5, 12), max_size=6).map(lambda xs: "[" + ", ".join(map(str, xs)) + "]"),
        st.builds(
            lambda a, cs: '{"answer": %r, "citations": %s}' % (a, cs),
            st.text(max_size=10), st.lists(st.integers(-3, 9), max_size=4),
        ),
    ),
    max_size=8,
).map("".join)


def check_invariants(result: Citation, n_shown: int) -> None:
    assert isinstance(result.answer, str)
    if result.cited is not None:
        assert all(isinstance(i, int) and 0 <= i < n_shown for i in result.cited)
        assert len(set(result.cited)) == len(result.cited)
    if result.no_cite:
        assert result.cited == []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(max_size=300), citation_like), n_shown=st.integers(0, 8))
def test_never_raises_stays_in_range_and_is_deterministic(text: str, n_shown: int) -> None:
    for parse in (parse_citations, parse_json_citations):
        first = parse(text, n_shown)
        check_invariants(first, n_shown)
        assert parse(text, n_shown) == first


@settings(max_examples=150, deadline=None)
@given(
    answer=st.text(alphabet=st.characters(blacklist_characters="[]{}\\［］【】"), max_size=40),
    cited=st.lists(st.integers(0, 7), unique=True, min_size=1, max_size=8),
)
def test_paper_format_round_trips(answer: str, cited: list[int]) -> None:
    result = parse_citations(f"{answer} {list(cited)}", 8)
    assert result.cited == cited
