"""The one tokenisation of a memory's text, shared by BM25 (`rmm.memory.bm25`) and the candidate
features' word overlap (`rmm.memory.features`), so "the words a memory holds" means one thing.

Lower-cased runs of letters and digits (Unicode-aware: "café" stays one word; `_` and punctuation
split), two characters or more, minus `STOPWORDS`; no stemming. Repeats are kept (BM25 counts
them); `content_words` is the set the overlap features compare.
"""

from __future__ import annotations

import re

__all__ = ["STOPWORDS", "content_words", "tokenize"]

# Generic English function words plus question scaffolding ("what do you know about"): words that
# say nothing about which memory answers. Deliberately short — content words are what is compared.
# It holds every word of bm25s's English list (Lucene's 33), which BM25 used before the two were one.
STOPWORDS: frozenset[str] = frozenset("""
a about above after again all am an and any are as at be been before being below between both but
by can could did do does doing down during each few for from had has have having he her here hers
herself him himself his how i if in into is it its itself just know like me more most my myself no
nor not now of off on once only or other our ours out over own same she should so some such than
that the their theirs them then there these they this those through to too under until up very was
we were what when where which while who whom why will with would you your yours yourself
""".split())  # noqa: SIM905 — one readable block of words

_WORD = re.compile(r"[^\W_]{2,}")  # two or more letters or digits (\w without the underscore)


def tokenize(text: str) -> list[str]:
    """The words of `text` in order, repeats kept: lower-cased, ≥ 2 letters or digits, no stopwords."""
    return [t for t in _WORD.findall(text.lower()) if t not in STOPWORDS]


def content_words(text: str) -> set[str]:
    """The distinct words of `text` (`tokenize` as a set)."""
    return set(tokenize(text))
