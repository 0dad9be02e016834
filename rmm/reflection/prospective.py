"""Prospective reflection (paper §5, App. D.1): a finished session becomes topic memories.

Two steps, as in the paper. **Extract**: for each speaker, one LLM call (all speakers batched)
returns topic summaries with the turn ids they came from. **Update**: each summary is compared
with the top-K most similar *topic* memories of the same user, and the LLM answers `Add()` or
`Merge(index, merged_summary)`; a merge rewrites that memory's text, unions its refs, appends to
its lineage (`merged_from`) and widens its time span.

LLM output is untrusted. An unusable extraction (transport error, unparseable reply) is logged
and counted, and the session falls back to the non-LLM segmentation so it still leaves memories;
an unusable update decision becomes `Add()`, so nothing extracted is ever dropped. With
`llm=None` the whole pipeline is the labelled fallback: embedding-based topic segmentation
(`rmm.reflection.segment`) and a cosine-threshold merge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rmm.errors import RmmError
from rmm.reflection.segment import (
    EXTRACTIVE_LABEL,
    SegmenterConfig,
    TopicSegmenter,
    turn_line,
)
from rmm.types import Memory, Session, Turn

if TYPE_CHECKING:
    from rmm.llm.base import LLM
    from rmm.memory.bank import MemoryBank
    from rmm.prompts import ExtractedMemory

__all__ = ["Extractive", "ProspectiveReflector", "ReflectionStats"]

log = logging.getLogger(__name__)

DEFAULT_MERGE_THRESHOLD = 0.8


@dataclass
class Extractive:
    """A fallback topic: the segment's turns, joined (an extractive 'summary')."""

    summary: str
    refs: list[str]


@dataclass
class ReflectionStats:
    sessions: int = 0
    extracted: int = 0
    added: int = 0
    merged: int = 0
    llm_calls: int = 0
    extraction_failures: int = 0  # speakers whose extraction reply was unusable
    update_failures: int = 0  # update replies that were unusable (→ Add)
    fallback_sessions: int = 0  # sessions segmented without the LLM because its output failed
    seconds: float = 0.0


@dataclass
class _Context:
    """What an update needs of the session a memory came from."""

    turns: dict[str, Turn] = field(default_factory=dict)
    time: str | None = None


class ProspectiveReflector:
    """Turns finished sessions into topic memories of a `MemoryBank` (Algorithm 1, lines 8–12).

    `merge_threshold` is the cosine similarity above which the fallback merges an extractive topic
    into an existing one; `max_merged_turns` stops a fallback topic from growing without bound
    (a longer merge is added as a new topic instead: embedding models truncate long texts).
    `structured=True` asks the backend for extraction JSON under the schema (constrained decoding
    on vLLM / OpenAI-compatible servers); an empty list then plays the role of `NO_TRAIT`.
    """

    def __init__(self, bank: MemoryBank, llm: LLM | None = None, top_k: int = 5,
                 merge_threshold: float = DEFAULT_MERGE_THRESHOLD, *, segmenter: SegmenterConfig | None = None,
                 max_merged_turns: int = 24, max_tokens: int = 1024, structured: bool = False) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.bank, self.llm, self.top_k = bank, llm, top_k
        self.merge_threshold = merge_threshold
        self.max_merged_turns = max_merged_turns
        self.max_tokens = max_tokens
        self.structured = structured
        self.segmenter = TopicSegmenter(bank.encoder, segmenter)
        self.stats = ReflectionStats()
        # Called with (session, memories touched) after each reflected session: structures kept beside the
        # bank (Semantic XPath's tree, rmm.reflection.xpath_tree.BankTree.attach) follow its adds and merges.
        self.listeners: list[Callable[[Session, list[Memory]], None]] = []

    @property
    def settings_key(self) -> str:
        """Identifies what this reflector would build (for caching banks built with it)."""
        llm = self.llm.name if self.llm is not None else "fallback"
        schema = "-json" if self.structured and self.llm is not None else ""
        return (f"{llm}{schema}-k{self.top_k}-t{self.merge_threshold}-mt{self.max_merged_turns}-"
                f"{self.segmenter.config.key()}")

    # ---- the two steps ------------------------------------------------------------------
    def reflect(self, session: Session, speakers: list[str] | None = None) -> list[Memory]:
        """Extract the session's topics and merge each into the bank; the memories touched."""
        t0 = time.perf_counter()
        self.stats.sessions += 1
        touched: dict[str, Memory] = {}
        extracted = self.extract(session, speakers)
        if extracted and all(isinstance(e, Extractive) for e in extracted):
            memories = self._update_extractive(session.user_id, extracted, session)  # type: ignore[arg-type]
        else:
            memories = [self.update(session.user_id, e, session) for e in extracted]
        for memory in memories:
            touched[memory.id] = memory
        self.stats.seconds += time.perf_counter() - t0
        self._notify(session, list(touched.values()))
        return list(touched.values())

    def _notify(self, session: Session, touched: list[Memory]) -> None:
        for listener in self.listeners:
            listener(session, touched)

    def reflect_many(self, sessions: Sequence[Session], speakers: list[str] | None = None) -> list[list[Memory]]:
        """`[self.reflect(s, speakers) for s in sessions]`, in that order and with the same memories,
        in far fewer encoder calls when there is no LLM: every session's turns are encoded in one
        call and then every topic in one more (neither depends on the bank), leaving per session
        only the search and one call re-encoding the memories it merged into.
        """
        if self.llm is not None:
            return [self.reflect(s, speakers) for s in sessions]
        t0 = time.perf_counter()
        segmented = self.segmenter.segments_many([self._own(s, speakers) for s in sessions])
        extracted = [self._extractive(segments) for segments in segmented]
        vectors = self._encode_summaries([e.summary for topics in extracted for e in topics])
        out: list[list[Memory]] = []
        offset = 0
        for session, topics in zip(sessions, extracted):
            self.stats.sessions += 1
            out.append(self._update_extractive(session.user_id, topics, session, vectors[offset:offset + len(topics)]))
            offset += len(topics)
            self._notify(session, out[-1])
        self.stats.seconds += time.perf_counter() - t0
        return out

    def extract(self, session: Session, speakers: list[str] | None = None) -> list[ExtractedMemory | Extractive]:
        """Topic summaries with turn refs: one batched LLM call over speakers, else the fallback.

        The LLM sees the whole session and is asked about each speaker; the fallback, which
        cannot tell whose facts a turn states, segments only the named speakers' turns — so what
        the agent said back (possibly a model echoing its prompt) never becomes a memory.
        """
        if not session.turns:
            return []
        own = self._own(session, speakers)
        if self.llm is None:
            return self._segment(own)
        from rmm.prompts import (
            EXTRACTION_SCHEMA,
            PromptParseError,
            extraction_messages,
            parse_extraction,
        )

        speakers = speakers or list(dict.fromkeys(t.speaker for t in session.turns))
        valid = [t.id for t in session.turns]
        try:
            replies = self.llm.generate([extraction_messages(session, s) for s in speakers],
                                        json_schema=EXTRACTION_SCHEMA if self.structured else None,
                                        max_tokens=self.max_tokens)
            self.stats.llm_calls += len(speakers)
        except RmmError as exc:
            log.warning("extraction for session %s failed (%s); using the fallback segmentation", session.id, exc)
            self.stats.extraction_failures += len(speakers)
            return self._fallback(own)
        extracted: list[ExtractedMemory | Extractive] = []
        failed = 0
        for speaker, reply in zip(speakers, replies):
            try:
                extracted.extend(parse_extraction(reply, valid))
            except PromptParseError as exc:
                failed += 1
                log.warning("unusable extraction for %s in session %s: %s", speaker, session.id, exc)
        self.stats.extraction_failures += failed
        if failed and not extracted:
            return self._fallback(own)
        return extracted

    def update(self, user: str, extracted: ExtractedMemory | Extractive, session: Session | None = None) -> Memory:
        """Add the extracted topic to `user`'s bank or merge it into a similar topic memory.

        `session` (the one it was extracted from) supplies the referenced turns' text and time.
        """
        if isinstance(extracted, Extractive) or self.llm is None:
            (memory,) = self._update_extractive(user, [extracted], session)
            return memory
        self.stats.extracted += 1
        context = _context_of(session)
        (neighbours,) = self._neighbours(user, [extracted.summary])
        if not neighbours:
            return self._add(user, extracted, context)
        index, merged = self._decide(extracted.summary, [m for m, _ in neighbours])
        if index is None:
            return self._add(user, extracted, context)
        return self._merge(neighbours[index][0], merged, extracted, context, False)

    def _update_extractive(self, user: str, extracted: list[Extractive], session: Session | None,
                           vectors: torch.Tensor | None = None) -> list[Memory]:
        """The fallback's update, a whole session at once (one search, one add): each segment
        merges into its most similar earlier topic when the cosine reaches `merge_threshold` and
        the result stays within `max_merged_turns`, else it is added.

        Each segment is encoded once (or `vectors` holds its passage vector already), the vector
        serving both the search and the add, and the memories merged into are re-encoded in one
        call (only those whose tokens changed, `_merged_vectors`): encoding is nearly all the
        fallback's time."""
        if not extracted:
            return []
        context = _context_of(session)
        self.stats.extracted += len(extracted)
        if vectors is None:
            vectors = self._encode_summaries([e.summary for e in extracted])
        merged: dict[str, Memory] = {}
        stored_text: dict[str, str] = {}  # each memory merged into: its text before this session
        adds: list[Memory] = []
        added: list[int] = []
        for i, (e, neighbours) in enumerate(zip(extracted, self._neighbours_of(user, vectors))):
            target = neighbours[0][0] if neighbours and neighbours[0][1] >= self.merge_threshold else None
            if target is not None:
                current = merged.get(target.id, target)
                if len(set(current.refs) | set(e.refs)) <= self.max_merged_turns:
                    merged[target.id] = self._merged(current, current.text + "\n" + e.summary, e, context, True)
                    stored_text.setdefault(target.id, target.text)
                    self.stats.merged += 1
                    continue
            adds.append(self._new(user, e, context, extractive=True))
            added.append(i)
        out = [self.bank.update(user, memory, embedding=vector)
               for memory, vector in zip(merged.values(), self._merged_vectors(user, list(merged.values()), stored_text))]
        if adds:
            self.bank.add(user, adds, embeddings=vectors[added])
            self.stats.added += len(adds)
        return out + adds

    def _merged_vectors(self, user: str, memories: list[Memory], stored_text: dict[str, str]) -> torch.Tensor:
        """The passage vectors of the memories a session merged into, those whose text changed for
        the encoder re-encoded together (their new texts do not depend on each other).

        A memory already past the encoder's `max_length` reads the same token ids after a merge
        (the merge appends only what truncation drops): its stored vector is the one the encoder
        would compute — exactly the one a passage cache would hand back — so it is reused, not
        recomputed. Fallback topics grow to `max_merged_turns` turns, far past MiniLM's 256 tokens.
        """
        same = self._same_tokens([(stored_text[m.id], m.text) for m in memories])
        kept = [m.id for m, unchanged in zip(memories, same) if unchanged]
        vectors = torch.zeros(len(memories), int(self.bank.encoder.dim))
        if kept:
            vectors[[i for i, unchanged in enumerate(same) if unchanged]] = self.bank.embeddings(user, kept).float()
        changed = [i for i, unchanged in enumerate(same) if not unchanged]
        if changed:
            vectors[changed] = self._encode_summaries([memories[i].text for i in changed])
        return vectors

    def _same_tokens(self, pairs: list[tuple[str, str]]) -> list[bool]:
        """For each (before, after) text pair, whether the bank's encoder reads both as the same
        passage token ids; False throughout for an encoder that does not expose its tokenizer."""
        encoder = self.bank.encoder
        tokenize = getattr(encoder, "tokenize", None)
        prefix = getattr(getattr(encoder, "config", None), "passage_prefix", None)
        if not pairs or not callable(tokenize) or not isinstance(prefix, str):
            return [False] * len(pairs)
        ids = tokenize([text for pair in pairs for text in pair], prefix)
        return [ids[2 * i] == ids[2 * i + 1] for i in range(len(pairs))]

    def _decide(self, summary: str, existing: list[Memory]) -> tuple[int | None, str]:
        """The LLM's Add/Merge decision; anything unusable means Add (nothing gets lost)."""
        from rmm.prompts import PromptParseError, parse_update, update_messages

        try:
            (reply,) = self.llm.generate([update_messages(summary, existing)], max_tokens=self.max_tokens)
            self.stats.llm_calls += 1
            actions = parse_update(reply, len(existing))
        except (PromptParseError, RmmError, ValueError) as exc:
            log.warning("unusable memory-update decision (%s); adding the memory", exc)
            self.stats.update_failures += 1
            return None, summary
        for action in actions:
            if action.kind == "merge" and action.index is not None and 0 <= action.index < len(existing):
                return action.index, (action.summary or "").strip() or f"{existing[action.index].text} {summary}"
        if not any(a.kind == "add" for a in actions):
            log.warning("memory-update reply held no action; adding the memory")
            self.stats.update_failures += 1
        return None, summary

    def _neighbours(self, user: str, summaries: list[str]) -> list[list[tuple[Memory, float]]]:
        """For each summary, the top-K most similar topic memories of `user` with their cosine."""
        if not summaries or not self.bank.store.has_user(user):
            return [[] for _ in summaries]
        return self._neighbours_of(user, self._encode_summaries(summaries))

    def _neighbours_of(self, user: str, vectors: torch.Tensor) -> list[list[tuple[Memory, float]]]:
        """`_neighbours` for summaries already encoded (passage vectors, one row each)."""
        if not len(vectors) or not self.bank.store.has_user(user):
            return [[] for _ in range(len(vectors))]
        found = self.bank.search_embeddings(vectors, user, k=4 * self.top_k)  # over-fetch: other kinds drop out
        ids = list(dict.fromkeys(i for c in found for i in c.memory_ids))
        memories = {m.id: m for m in self.bank.get(user, ids)} if ids else {}
        out = []
        for vector, c in zip(vectors, found):
            cosine = F.cosine_similarity(c.embeddings, vector, dim=-1).tolist() if c.memory_ids else []
            ranked = sorted(((memories[i], x) for i, x in zip(c.memory_ids, cosine) if memories[i].kind == "topic"),
                            key=lambda mc: -mc[1])
            out.append(ranked[:self.top_k])
        return out

    def _add(self, user: str, extracted: ExtractedMemory | Extractive, context: _Context,
             extractive: bool = False) -> Memory:
        memory = self._new(user, extracted, context, extractive)
        self.bank.add(user, [memory])
        self.stats.added += 1
        return memory

    def _merge(self, target: Memory, text: str, extracted: ExtractedMemory | Extractive, context: _Context,
               extractive: bool) -> Memory:
        self.stats.merged += 1
        return self.bank.update(target.user_id, self._merged(target, text, extracted, context, extractive))

    @staticmethod
    def _new(user: str, extracted: ExtractedMemory | Extractive, context: _Context, extractive: bool) -> Memory:
        return Memory(id=Memory.new_id(), user_id=user, kind="topic", text=extracted.summary,
                      refs=list(dict.fromkeys(extracted.refs)), source_text=_source(extracted.refs, context, extractive),
                      time_span=(context.time, context.time))

    @staticmethod
    def _merged(target: Memory, text: str, extracted: ExtractedMemory | Extractive, context: _Context,
                extractive: bool) -> Memory:
        """`target` with `extracted` folded in: new text, refs union, lineage, wider time span."""
        start, end = target.time_span or (None, None)
        # Sessions arrive in order, so a merge can only extend the span forward.
        span = (start or context.time, context.time or end)
        new_source = _source([r for r in extracted.refs if r not in target.refs], context,
                             extractive and EXTRACTIVE_LABEL not in target.source_text)
        return replace(target, text=text, refs=list(dict.fromkeys([*target.refs, *extracted.refs])),
                       source_text="\n".join(s for s in (target.source_text, new_source) if s),
                       merged_from=[*target.merged_from, Memory.new_id()], time_span=span)

    def _segment(self, session: Session) -> list[Extractive]:
        return self._extractive(self.segmenter.segments(session))

    @staticmethod
    def _extractive(segments: list[list[Turn]]) -> list[Extractive]:
        return [Extractive("\n".join(turn_line(t) for t in seg), [t.id for t in seg]) for seg in segments]

    @staticmethod
    def _own(session: Session, speakers: list[str] | None) -> Session:
        """The session as the fallback sees it: only the named speakers' turns."""
        return replace(session, turns=[t for t in session.turns if t.speaker in speakers]) if speakers else session

    def _encode_summaries(self, summaries: list[str]) -> torch.Tensor:
        if not summaries:
            return torch.zeros(0, int(self.bank.encoder.dim))
        return torch.as_tensor(self.bank.encoder.encode_passages(summaries)).float()

    def _fallback(self, session: Session) -> list[Extractive]:
        self.stats.fallback_sessions += 1
        return self._segment(session)


def _context_of(session: Session | None) -> _Context:
    if session is None:
        return _Context()
    return _Context({t.id: t for t in session.turns}, session.time)


def _source(refs: list[str], context: _Context, extractive: bool) -> str:
    lines = [turn_line(context.turns[r]) for r in refs if r in context.turns]
    if extractive:
        lines.insert(0, EXTRACTIVE_LABEL)
    return "\n".join(lines)
