"""Online reranker training from citations (RMM retrospective reflection), measured prequentially.

For every question of the training conversations, in dialogue order:
  1. retrieve K with the frozen retriever;
  2. score the *current* reranker greedily (top-M) — the prequential metric, computed before the
     question's own update ever happens;
  3. sample M with Gumbel, let the citer cite, turn citations into rewards, let the learner learn.
After training, held-out questions are scored greedily, beside the retriever alone on the same
questions. Shared mode holds out whole conversations; per-user mode (one reranker per user) holds
out the last questions of every conversation.

Resumable: with an output directory, the learners (one `LearnerRegistry` under `rerankers/`: the
shared one at its root, per-user ones under `rerankers/users/`, the layout the agent and
`rmm serve` use) and the stream position (`state.json`) are checkpointed every `checkpoint_every`
questions; every random draw is derived from (seed, epoch, question), so a resumed run draws
exactly what an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import tempfile
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rmm.training.online_plot import plot, running_mean
from tqdm.auto import tqdm

from rmm.errors import CheckpointError, ConfigError
from rmm.eval.retrieval import (
    SEPARATE_CATEGORIES,
    GoldScorer,
    RetrievalReport,
    scorable,
    summarize,
)
from rmm.llm.simulated import SimulatedCiter
from rmm.memory.bank import MemoryBank
from rmm.policy.citations import parse_citations
from rmm.policy.learner import Learner, LearnerConfig, rewards_from_citations
from rmm.policy.registry import SHARED, LearnerRegistry
from rmm.policy.retrieve import RerankedRetriever
from rmm.types import Candidates, Dataset, Question

__all__ = ["OnlineConfig", "OnlineReport", "OnlineTrainer", "Split", "headline", "headline_questions", "plot",
           "split_questions"]

log = logging.getLogger(__name__)

CITERS = ("simulated",)
STATE_VERSION = 2  # 2: learners in a LearnerRegistry under rerankers/ (1 had rerankers/0000, …)

@dataclass
class OnlineConfig:
    k: int = 20
    m: int = 5
    tau: float = 0.5
    baseline: float | str = 0.5
    lr: float = 1e-3
    batch_size: int = 4
    estimator: str = "plackett-luce"
    optimizer: str = "adam"
    epochs: int = 1
    per_user: bool = False
    heldout_fraction: float = 0.3
    seed: int = 0
    citer: str = "simulated"
    precision: float = 0.876
    recall: float = 0.858
    eval_k: int = 5
    checkpoint_every: int = 200
    recipe: str = "paper"

    def __post_init__(self) -> None:
        if self.citer not in CITERS:
            raise ValueError(f"citer must be one of {CITERS} (a real LLM citer arrives with the agent); got {self.citer!r}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.m > self.k:
            raise ValueError(f"M={self.m} must not exceed K={self.k}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be ≥ 1, got {self.epochs}")

    def learner_config(self) -> LearnerConfig:
        return LearnerConfig(lr=self.lr, batch_size=self.batch_size, baseline=self.baseline, tau=self.tau,
                             estimator=self.estimator, optimizer=self.optimizer)


@dataclass
class Split:
    """Which questions train and which are held out, printed so a reader can check it."""

    train: list[Question]
    heldout: list[Question]
    train_users: list[str]
    heldout_users: list[str]
    description: str


def split_questions(dataset: Dataset, questions: list[Question], cfg: OnlineConfig) -> Split:
    by_user: dict[str, list[Question]] = defaultdict(list)
    for q in questions:
        by_user[q.user_id].append(q)
    users = [u for u in dataset.users if by_user[u]]
    if cfg.per_user:
        train, held = [], []
        for u in users:
            cut = len(by_user[u]) - max(1, round(len(by_user[u]) * cfg.heldout_fraction))
            train += by_user[u][:cut]
            held += by_user[u][cut:]
        desc = (f"per-user: first {1 - cfg.heldout_fraction:.0%} of each conversation's questions train, "
                f"last {cfg.heldout_fraction:.0%} held out ({len(train)} / {len(held)} questions, {len(users)} users)")
        return Split(train, held, users, users, desc)
    if len(users) < 2:
        raise ValueError("a shared reranker needs ≥ 2 users to hold one out; use per_user=True")
    shuffled = users[:]
    random.Random(cfg.seed).shuffle(shuffled)
    n_held = min(len(users) - 1, max(1, round(len(users) * cfg.heldout_fraction)))
    held_users, train_users = sorted(shuffled[:n_held]), [u for u in users if u not in shuffled[:n_held]]
    train = [q for u in train_users for q in by_user[u]]
    held = [q for u in held_users for q in by_user[u]]
    desc = (f"shared reranker: train on {', '.join(train_users)} ({len(train)} questions); "
            f"held out {', '.join(held_users)} ({len(held)} questions)")
    return Split(train, held, train_users, held_users, desc)


@dataclass
class OnlineReport:
    retriever: dict[str, Any]
    reranker_prequential: dict[str, Any]
    retriever_heldout: dict[str, Any]
    reranker_heldout: dict[str, Any]
    reranker_heldout_whole_bank: dict[str, Any]
    citer: str
    split: str
    config: dict[str, Any]
    cited_ratio: list[float] = field(default_factory=list)
    prequential_curve: dict[str, list[float]] = field(default_factory=dict)  # running means, headline questions
    learner: dict[str, Any] = field(default_factory=dict)
    headline_questions: str = ""  # which questions the table's figures and the curves cover

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class OnlineTrainer:
    """Holds the stream, the learner(s) and the metrics; `run()` is the whole program."""

    def __init__(self, dataset: Dataset, bank: MemoryBank, cfg: OnlineConfig, *,
                 output_dir: str | Path | None = None, progress: bool = True,
                 wandb_run: Any | None = None) -> None:
        self.dataset, self.bank, self.cfg = dataset, bank, cfg
        self.output_dir = Path(output_dir) if output_dir else None
        self.progress, self.wandb_run = progress, wandb_run
        self.scorer = GoldScorer.for_dataset(dataset, "turn")
        self.split = split_questions(dataset, scorable(dataset.questions, self.scorer), cfg)
        root = self.output_dir / "rerankers" if self.output_dir else None
        self.learners = LearnerRegistry(bank.dim, cfg.learner_config(), encoder_name=bank.encoder.fingerprint,
                                        device=bank.device, root=root, subdir="users")
        self.refs: dict[str, list[str]] = {}
        # Stream state (everything a resume needs besides the learners).
        self.position = 0
        self._recorded: set[str] = set()  # keys whose checkpoints state.json vouches for
        self.rows: dict[str, dict[str, dict[str, float]]] = {"retriever": {}, "reranker": {}}
        self.cited_ratio: list[float] = []

    # -- pieces -----------------------------------------------------------------------------
    def learner_for(self, user: str) -> Learner:
        key = user if self.cfg.per_user else SHARED
        if key not in self.learners:
            torch.manual_seed(self.cfg.seed)
            if key not in self._recorded:  # a checkpoint state.json does not name is a half-done save's
                self.learners.drop(key, delete_checkpoint=True)
        return self.learners.get(key)

    def candidates(self, questions: list[Question]) -> dict[str, Candidates]:
        """The frozen retriever's top-K for every question, computed once per user."""
        by_user: dict[str, list[Question]] = defaultdict(list)
        for q in questions:
            by_user[q.user_id].append(q)
        out: dict[str, Candidates] = {}
        for user, qs in by_user.items():
            for q, c in zip(qs, self.bank.search([q.text for q in qs], user, self.cfg.k)):
                out[q.id] = c
            self.refs.update({m.id: m.refs for m in self.bank.memories(user)})
        return out

    def score(self, cand: Candidates, order: list[int], q: Question) -> dict[str, float]:
        ranked = [self.refs[cand.memory_ids[i]] for i in order[: self.cfg.eval_k]]
        return self.scorer.score(ranked, q, [self.cfg.eval_k])

    def greedy(self, cand: Candidates, user: str) -> list[int]:
        """The current reranker's full order of the candidates (scored at eval_k, like the retriever)."""
        return self.learner_for(user).reranker.select([cand], len(cand))[0].chosen

    def step(self, q: Question, cand: Candidates, epoch: int) -> None:
        """One question of the stream: prequential score, then sample → cite → reward → learn."""
        learner = self.learner_for(q.user_id)
        if epoch == 0:
            self.rows["retriever"][q.id] = self.score(cand, list(range(len(cand))), q)
            self.rows["reranker"][q.id] = self.score(cand, self.greedy(cand, q.user_id), q)
        draw = _seed(self.cfg.seed, epoch, q.id)
        m = min(self.cfg.m, len(cand))
        selection = learner.reranker.select([cand], m, tau=self.cfg.tau, explore=True,
                                            generator=torch.Generator().manual_seed(draw))[0]
        gold = self.scorer.gold(q)
        hits = [bool(set(self.refs[mid]) & gold) for mid in selection.memory_ids]
        text = SimulatedCiter(self.cfg.precision, self.cfg.recall, seed=draw).respond(hits)
        citation = parse_citations(text, m)
        self.cited_ratio.append(len(citation.cited or []) / m)
        loss = learner.record(selection, rewards_from_citations(m, citation.cited, citation.no_cite))
        if self.wandb_run is not None:
            self.wandb_run.log({"cited_ratio": self.cited_ratio[-1], "epoch": epoch,
                                **({"loss": loss} if loss is not None else {})})

    # -- the program --------------------------------------------------------------------------
    def run(self) -> OnlineReport:
        cfg = self.cfg
        log.info("%s", self.split.description)
        cands = self.candidates(self.split.train + self.split.heldout)
        stream = [(e, q) for e in range(cfg.epochs) for q in self.split.train]
        if self.output_dir and (self.output_dir / "state.json").exists():
            self._resume()
        elif self.output_dir and (self.output_dir / "rerankers").exists():
            raise CheckpointError(f"{self.output_dir} holds reranker checkpoints but no state.json to resume from; "
                                  "use another --output directory")
        bar = tqdm(total=len(stream), initial=self.position, desc="online training", unit="q",
                   disable=not self.progress)
        while self.position < len(stream):
            epoch, q = stream[self.position]
            self.step(q, cands[q.id], epoch)
            self.position += 1
            bar.update(1)
            if self.output_dir and self.position % cfg.checkpoint_every == 0:
                self._checkpoint()
        bar.close()
        for key in self.learners:
            self.learners.get(key).flush()
        if self.output_dir:
            self._checkpoint()
        held: dict[str, dict[str, dict[str, float]]] = {"retriever": {}, "reranker": {}, "reranker_bank": {}}
        for q in self.split.heldout:
            c = cands[q.id]
            held["retriever"][q.id] = self.score(c, list(range(len(c))), q)
            held["reranker"][q.id] = self.score(c, self.greedy(c, q.user_id), q)
        for user in dict.fromkeys(q.user_id for q in self.split.heldout):
            # Reranker-aware first stage: search the whole bank with the learned query transform.
            qs = [q for q in self.split.heldout if q.user_id == user]
            whole = RerankedRetriever(self.bank, self.learner_for(user).reranker, k=cfg.k, m=cfg.m, scope="bank")
            for q, sel in zip(qs, whole.select([q.text for q in qs], user)):
                held["reranker_bank"][q.id] = self.score(sel.candidates, sel.chosen, q)
        return self._report(held)

    def _report(self, held: dict[str, dict[str, dict[str, float]]]) -> OnlineReport:
        def summary(rows: dict[str, dict[str, float]], qs: list[Question]) -> dict[str, Any]:
            rep: RetrievalReport = summarize(self.dataset, rows, qs, retriever="", granularity="turn",
                                             ks=[self.cfg.eval_k])
            return {**rep.overall, "by_category": rep.by_category}

        train_qs = [q for q in self.split.train if q.id in self.rows["reranker"]]
        # The curves cover the questions `summarize` puts in the headline, so they end at the table's figures.
        separate = set(SEPARATE_CATEGORIES.get(self.dataset.name, ()))
        metric = f"recall@{self.cfg.eval_k}"
        curve = {name: running_mean([rows[q.id][metric] for q in train_qs if q.category not in separate])
                 for name, rows in self.rows.items()}
        learners = {k: asdict(learner.stats) for k, learner in self.learners.items()}
        return OnlineReport(
            retriever=summary(self.rows["retriever"], train_qs),
            reranker_prequential=summary(self.rows["reranker"], train_qs),
            retriever_heldout=summary(held["retriever"], self.split.heldout),
            reranker_heldout=summary(held["reranker"], self.split.heldout),
            reranker_heldout_whole_bank=summary(held["reranker_bank"], self.split.heldout),
            citer=f"{self.cfg.citer} (precision {self.cfg.precision}, recall {self.cfg.recall})",
            split=self.split.description, config=asdict(self.cfg), cited_ratio=self.cited_ratio,
            prequential_curve=curve, learner=learners if self.cfg.per_user else learners.get(SHARED, {}),
            headline_questions=headline_questions(self.dataset),
        )

    def _checkpoint(self) -> None:
        """Learners first, then the stream state that names how far each one got."""
        assert self.output_dir is not None
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.learners.save()  # those that learned since the last checkpoint
        state = {"version": STATE_VERSION, "position": self.position, "rows": self.rows,
                 "cited_ratio": self.cited_ratio, "learners": {k: _progress(lr) for k, lr in self.learners.items()},
                 "config": asdict(self.cfg)}
        _atomic_write_json(self.output_dir / "state.json", state)

    def _resume(self) -> None:
        assert self.output_dir is not None
        state = json.loads((self.output_dir / "state.json").read_text())
        if state.get("version") != STATE_VERSION:
            raise CheckpointError(f"{self.output_dir} holds a run written by an older rmm (another checkpoint "
                                  "layout); it cannot be resumed: use another --output directory")
        if state["config"] != asdict(self.cfg):
            raise ConfigError(f"{self.output_dir} holds a run with a different configuration; "
                              "use another --output directory or the same settings")
        self.position, self.rows, self.cited_ratio = state["position"], state["rows"], state["cited_ratio"]
        self._recorded = set(state["learners"])
        for key, progress in state["learners"].items():
            if _progress(self.learners.get(key)) != progress:  # loaded from rerankers/
                who = repr(key) if key else "the shared learner"
                raise CheckpointError(f"{self.output_dir}: the reranker checkpoint of {who} does not match "
                                      "state.json (interrupted while saving); use another --output directory")
        log.info("resumed at question %d of the stream", self.position)


def _progress(learner: Learner) -> list[int]:
    """How far a learner got: what a resumed run checks its checkpoint against."""
    return [learner.stats.records, learner.stats.skipped_no_citation, learner.pending, learner.stats.step]


def _seed(seed: int, epoch: int, qid: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}|{epoch}|{qid}".encode()).digest()[:8], "little") >> 1


def _atomic_write_json(path: Path, obj: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def headline_questions(dataset: Dataset) -> str:
    """Which questions the headline figures cover, in words (e.g. LoCoMo without category 5)."""
    separate = SEPARATE_CATEGORIES.get(dataset.name, ())
    if not separate:
        return "all categories"
    kept = sorted(c for c in dataset.categories if c not in separate)
    run = len(kept) > 2 and kept == list(range(kept[0], kept[-1] + 1))
    span = f"{kept[0]}–{kept[-1]}" if run else ", ".join(map(str, kept))
    left_out = ", ".join(f"{c} {dataset.categories.get(c, '')}".strip() for c in separate)
    return f"{dataset.name} categories {span}; {left_out} reported apart"


def headline(report: OnlineReport) -> list[tuple[str, float, float]]:
    """(metric, retriever, reranker) rows for the before/after table."""
    k = report.config["eval_k"]
    rows = []
    for metric in (f"recall@{k}", f"recall_any@{k}", f"ndcg@{k}"):
        rows.append((f"prequential {metric}", report.retriever.get(metric, math.nan),
                     report.reranker_prequential.get(metric, math.nan)))
    for metric in (f"recall@{k}", f"recall_any@{k}", f"ndcg@{k}"):
        rows.append((f"held-out {metric}", report.retriever_heldout.get(metric, math.nan),
                     report.reranker_heldout.get(metric, math.nan)))
    rows.append((f"held-out recall@{k}, whole-bank search", report.retriever_heldout.get(f"recall@{k}", math.nan),
                 report.reranker_heldout_whole_bank.get(f"recall@{k}", math.nan)))
    return rows
