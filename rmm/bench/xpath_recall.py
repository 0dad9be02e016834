"""Semantic XPath template queries vs flat turns on LoCoMo, no LLM (issue 30's figure): R@5 / R@10 per category.

For each conversation (default: the held-out conv-30, conv-48, conv-49) LoCoMo's native tree is
built (`rmm.reflection.xpath_tree.build_locomo_tree`: Conversation → Session → Turn, each session's
vector the mean of its turns'), and every question with evidence is asked as

* ``flat``: the question's cosine with every turn, ranked (what a dense turn bank returns);
* the template queries, Q = the question: ``//Session[max(/Turn[node~Q])]/Turn[node~Q]`` and its
  ``avg`` / ``gmean`` variants, and ``//Session[node~Q]/Turn[node~Q]``,

each with the cosine scorer and, given `--reranker FOLDER` (a trained checkpoint), the reranker's
scorer (an untrained reranker scores exactly as the cosine, so it is left out without one). A
template's ranking is its result's Turn memories by XPath weight; recall counts gold turns in the
top K (`rmm.eval.metrics.recall_at_k`). Prints one table and, with `--json`, one line per row.

    python -m rmm.bench.xpath_recall [--users conv-30 conv-48 conv-49] [--encoder minilm] [--threads 1]
    python -m rmm.bench.xpath_recall --llm hf:PATH --limit 50     # an LLM writing the queries instead

With `--llm`, the controller's query step (`XPathFrontend.query`) runs on the first `--limit`
headline questions: the share of queries that ran as the LLM wrote them, after the one retry
showing the parser's message, or fell back to the template, and R@K of what ran beside the
template's on the same questions.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from pathlib import Path

import numpy as np
import torch

from rmm.data.locomo import load_locomo
from rmm.encoders.protocol import EncoderLike
from rmm.encoders.presets import load_encoder
from rmm.eval.metrics import recall_at_k
from rmm.memory.bank import MemoryBank
from rmm.memory.xpath_exec import Scorer, TreeView, execute
from rmm.memory.xpath_scorers import CosineScorer
from rmm.memory.xpath_syntax import Aggregate, AggregateFunction, Axis, Local, Query, Step
from rmm.paths import data_dir
from rmm.policy.reranker import ResidualLinearReranker
from rmm.policy.xpath_scorer import RerankerScorer
from rmm.reflection.xpath_tree import build_locomo_tree
from rmm.types import Dataset

if TYPE_CHECKING:
    from rmm.llm.base import LLM

log = logging.getLogger(__name__)

HELD_OUT = ("conv-30", "conv-48", "conv-49")
HEADLINE = (1, 2, 3, 4)  # docs/results.md's headline categories; 5 (adversarial) is reported apart
HEADLINE_NAME = "headline 1-4"


def templates(question: str) -> dict[str, Query]:
    """The issue's LLM-free queries for a question."""
    q = Local(None, " ".join(question.split()))
    turn = Step(Axis.CHILD, "Turn", None, q)
    out = {f"{f.value}(/Turn)": Query((Step(Axis.DESCENDANT, "Session", None, Aggregate(f, turn)), turn))
           for f in (AggregateFunction.MAX, AggregateFunction.AVG, AggregateFunction.GMEAN)}
    out["Session[node]"] = Query((Step(Axis.DESCENDANT, "Session", None, q), turn))
    return out


def ranked_turns(execution, turn_ids: set[str]) -> list[str]:
    out = []
    for j in execution.order():
        node = execution.view.nodes[int(execution.indices[j])]
        if node is not None and node.memory_id in turn_ids:
            out.append(node.memory_id)
    return out


@dataclass
class Measured:
    """Per (method, category): each question's recall at each K; per method: execution seconds per query."""

    recalls: dict[tuple[str, str], dict[int, list[float]]]
    seconds: dict[str, list[float]]

    def mean(self, method: str, category: str, k: int) -> float:
        return 100 * float(np.mean(self.recalls[(method, category)][k]))


def measure(dataset: Dataset, users: Sequence[str], encoder: EncoderLike, *, reranker: ResidualLinearReranker | None = None,
            ks: Sequence[int] = (5, 10), depth: int = 20, folder: str | Path | None = None) -> Measured:
    """Every question with evidence of `users`, ranked flat and by each template (module docstring)."""
    scorers: dict[str, Scorer] = {"cosine": CosineScorer(encoder)}
    if reranker is not None:
        scorers["reranker"] = RerankerScorer(reranker, encoder)
    recalls: dict[tuple[str, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    seconds: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp, MemoryBank(Path(folder or tmp) / "bank", encoder, device="cpu") as bank:
        for user in users:
            build_locomo_tree(bank, user, dataset.sessions[user])
            view = TreeView.from_store(bank.store, user)
            turn_ids = [t.id for s in dataset.sessions[user] for t in s.turns]
            turn_set = set(turn_ids)
            turn_vectors = torch.nn.functional.normalize(bank.embeddings(user, turn_ids), dim=-1).numpy()
            for q in (q for q in dataset.questions if q.user_id == user and q.evidence_turns):
                category = f"{q.category} {q.category_name}"
                cosine = turn_vectors @ scorers["cosine"].query_vector(q.text)
                flat = [turn_ids[i] for i in np.argsort(-cosine, kind="stable")]
                methods = {"flat turns · cosine": flat}
                rerank = None
                if "reranker" in scorers:
                    score = dict(zip(turn_ids, turn_vectors @ scorers["reranker"].query_vector(q.text)))

                    def rerank(ranking: list[str]) -> list[str]:
                        head = sorted(ranking[:depth], key=lambda i: -score[i])  # stable: ties keep their order
                        return head + ranking[depth:]

                    methods[f"flat turns · cosine · reranked top-{depth}"] = rerank(flat)
                    methods["flat turns · reranker (whole bank)"] = sorted(turn_ids, key=lambda i: -score[i])
                for sname, scorer in scorers.items():
                    for tname, query in templates(q.text).items():
                        started = time.perf_counter()
                        execution = execute(query, view, scorer)
                        seconds[f"{tname} · {sname}"].append(time.perf_counter() - started)
                        methods[f"{tname} · {sname}"] = ranked_turns(execution, turn_set)
                        if rerank is not None and sname == "cosine":
                            methods[f"{tname} · {sname} · reranked top-{depth}"] = rerank(methods[f"{tname} · {sname}"])
                for method, ranking in methods.items():
                    units = [[i] for i in ranking]
                    for k in ks:
                        r = recall_at_k(units, q.evidence_turns, k)
                        recalls[(method, category)][k].append(r)
                        if q.category in HEADLINE:
                            recalls[(method, HEADLINE_NAME)][k].append(r)
    return Measured(recalls, seconds)


@dataclass
class QueryWriting:
    """How an LLM wrote the questions' queries: how many ran as written, after the retry, or fell back to the
    template; R@K of what ran beside the template's on the same questions; the attempts' errors."""

    questions: int = 0
    first: int = 0
    retried: int = 0
    fallback: int = 0
    errors: list[str] = field(default_factory=list)
    ran: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    template: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    examples: list[str] = field(default_factory=list)


def llm_queries(dataset: Dataset, users: Sequence[str], encoder: EncoderLike, llm: LLM, *, limit: int,
                ks: Sequence[int] = (5, 10)) -> QueryWriting:
    """The first `limit` headline questions of `users`: the controller's query step (`XPathFrontend.query`:
    the LLM's query, one retry with the parser's message, the template) with the cosine scorer, no answer."""
    from rmm.frontends.agent import Agent
    from rmm.frontends.xpath import XPathConfig, XPathFrontend, template_query
    from rmm.frontends.xpath_trace import XPathTrace

    out = QueryWriting()
    with tempfile.TemporaryDirectory() as tmp, MemoryBank(Path(tmp) / "bank", encoder, device="cpu") as bank:
        for user in users:
            build_locomo_tree(bank, user, dataset.sessions[user])
        agent = Agent(bank, llm, learn=False, checkpoint_every=0)
        frontend = XPathFrontend(agent, XPathConfig(answer=False))
        questions = [q for q in dataset.questions if q.user_id in users and q.evidence_turns and q.category in HEADLINE]
        for q in questions[:limit]:
            trace = XPathTrace(question=q.text, user=q.user_id)
            execution = frontend.query(q.user_id, q.text, trace)
            turns = {n.memory_id for n in execution.view.nodes if n is not None and n.type == "Turn"}
            template = execute(template_query(q.text, "Turn", "Session"), execution.view, frontend.scorer(q.user_id))
            out.questions += 1
            if trace.fallback == "template":
                out.fallback += 1
            elif trace.fallback == "retry":
                out.retried += 1
            else:
                out.first += 1
            out.errors += [a.error for a in trace.attempts if a.error]
            if len(out.examples) < 5:
                out.examples.append(f"{q.text} -> {trace.attempts[0].text or trace.attempts[0].raw[:80]!r}")
            for k in ks:
                out.ran[k].append(recall_at_k([[i] for i in ranked_turns(execution, turns)], q.evidence_turns, k))
                out.template[k].append(recall_at_k([[i] for i in ranked_turns(template, turns)], q.evidence_turns, k))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", nargs="+", default=list(HELD_OUT))
    p.add_argument("--encoder", default="minilm")
    p.add_argument("--reranker", help="a trained reranker checkpoint folder: adds the reranker scorer's rows")
    p.add_argument("--k", type=int, nargs="+", default=[5, 10])
    p.add_argument("--depth", type=int, default=20, help="candidates the reranker reorders (rmm train --k)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", help="append one JSON line per row")
    p.add_argument("--llm", help="also let this LLM write the queries (hf:PATH, openai:URL@MODEL, vllm:PATH): the share "
                                 "that parse, retries, fallbacks, and R@K of what ran vs the template")
    p.add_argument("--limit", type=int, default=50, help="--llm: the first N headline questions of --users")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    dataset = load_locomo(data_dir(args.data_dir) / "locomo" / "locomo10.json", dedup=True)
    encoder = load_encoder(args.encoder, device="cpu")
    reranker = None
    if args.reranker:
        from rmm.policy.learner import Learner

        reranker = Learner.load(args.reranker, encoder_name=encoder.fingerprint, dim=encoder.dim, device="cpu").reranker
    if args.llm:
        from rmm.llm import load_llm

        writing = llm_queries(dataset, args.users, encoder, load_llm(args.llm), limit=args.limit, ks=args.k)
        n = max(writing.questions, 1)
        print(f"{args.llm} writing queries for {writing.questions} headline questions: ran as written "
              f"{100 * writing.first / n:.1f}%, after the retry {100 * writing.retried / n:.1f}%, template fallback "
              f"{100 * writing.fallback / n:.1f}%")
        print("R@K of the queries that ran vs the template on the same questions: " + ", ".join(
            f"R@{k} {100 * np.mean(writing.ran[k]):.1f} vs {100 * np.mean(writing.template[k]):.1f}" for k in args.k))
        for error in list(dict.fromkeys(writing.errors))[:8]:
            print(f"  error: {error[:140]}")
        for example in writing.examples:
            print(f"  {example[:160]}")
        if args.json:
            with open(args.json, "a", encoding="utf-8") as out:
                out.write(json.dumps({"llm": args.llm, "questions": writing.questions, "first": writing.first,
                                      "retried": writing.retried, "fallback": writing.fallback,
                                      **{f"R@{k}:llm": 100 * float(np.mean(writing.ran[k])) for k in args.k},
                                      **{f"R@{k}:template": 100 * float(np.mean(writing.template[k])) for k in args.k},
                                      "errors": writing.errors}) + "\n")
        return 0
    measured = measure(dataset, args.users, encoder, reranker=reranker, ks=args.k, depth=args.depth)
    rows = measured.recalls
    methods = list(dict.fromkeys(m for m, _ in rows))
    cats = sorted({c for _, c in rows if c != HEADLINE_NAME}) + [HEADLINE_NAME]
    print(f"LoCoMo {', '.join(args.users)} · {args.encoder} · R@{'/R@'.join(map(str, args.k))} (%) · n per category: "
          + ", ".join(f"{c} {len(rows[(methods[0], c)][args.k[0]])}" for c in cats))
    print(f"{'method':48s}" + "".join(f"{c[:12]:>13s}" for c in cats))
    for method in methods:
        cells = "".join(f"{'/'.join(f'{measured.mean(method, c, k):.1f}' for k in args.k):>13s}" for c in cats)
        ms = f"  {1000 * np.mean(measured.seconds[method]):.1f} ms/query" if method in measured.seconds else ""
        print(f"{method:48s}{cells}{ms}")
        if args.json:
            with open(args.json, "a", encoding="utf-8") as out:
                out.write(json.dumps({"method": method, "users": args.users, "encoder": args.encoder,
                                      "reranker": args.reranker,
                                      **{f"R@{k}:{c}": measured.mean(method, c, k) for c in cats for k in args.k},
                                      "n": len(rows[(method, HEADLINE_NAME)][args.k[0]])}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
