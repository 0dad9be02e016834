"""Online reranker training from citations (RMM retrospective reflection), measured prequentially.

For every question of the training conversations, in dialogue order:
  1. retrieve K with the frozen retriever;
  2. score the *current* reranker greedily (top-M) — the prequential metric, computed before the
     question's own update ever happens;
  3. sample M with Gumbel (the Selection keeps its behaviour log-probability), let the citer cite,
     turn citations into rewards, let the learner learn.
After training, held-out questions are scored greedily, beside the retriever alone on the same
questions (`rmm.training.splits` says which questions train and which are held out).

Questions without gold turn ids (your own logs, rmm's dataset format) still train the reranker
when the citer is a real generator: its citations are the rewards, and nothing in an update reads
gold. They get no prequential scores (recall needs gold), are not held out (nothing to measure
there), and the report measures them by what needs no gold: the cited ratio, the reward per shown
slot and the learning curve of rewards (`online_report.reward_figures`). The simulated citer
cites from the gold, so with it they are left out (counted). In per-user mode the cut by dialogue
time is placed by the gold's sessions, so there too they are left out.

The citer is the simulated one (synchronous) or a real generator (`rmm.training.generation`),
which `rmm.training.stream` keeps busy with many questions in flight: rewards then arrive out of
order while the learner keeps updating, and each selection's own behaviour log-probability lets
the learner correct for the staleness. `delay` holds rewarded selections in a FIFO for that many
learner updates before they are delivered, to measure the effect of staleness.

Resumable: with an output directory, the learners (one `LearnerRegistry` under `rerankers/`: the
shared one at its root, per-user ones under `rerankers/users/`, the layout the agent and
`rmm serve` use) and which stream items were rewarded (`state.json`) are checkpointed every
`checkpoint_every` rewarded questions and when the run stops on an error or Ctrl-C; a resumed
run re-asks the questions that were in flight. Every random draw is derived from (seed, epoch,
question), so a resumed simulated run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import tempfile
import time
from collections import defaultdict, deque
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from rmm.errors import CheckpointError, ConfigError, LLMError
from rmm.eval.retrieval import GoldScorer, scorable
from rmm.llm import LLM, Usage
from rmm.llm.simulated import SimulatedCiter
from rmm.memory.bank import MemoryBank
from rmm.memory.hybrid import HybridRetriever
from rmm.memory.index import BACKENDS
from rmm.policy.learner import Learner, LearnerConfig
from rmm.policy.registry import SHARED, LearnerRegistry
from rmm.policy.reranker import candidate_subset
from rmm.training.generation import GenerationStats, Reply, citer_kind, in_process, simulated_reply
from rmm.training.online_plot import plot
from rmm.training.online_report import OnlineReport, build_report, headline, headline_questions
from rmm.training.online_state import STATE_VERSION, Done, atomic_write_json, learner_progress
from rmm.training.splits import Split, refuse_heldout_on_pretrained, split_questions
from rmm.types import Candidates, Dataset, Memory, Question, Selection

__all__ = ["CITERS", "Asked", "OnlineConfig", "OnlineReport", "OnlineTrainer", "Split", "headline",
           "headline_questions", "plot", "split_questions"]

log = logging.getLogger(__name__)

CITERS = ("simulated", "openai", "hf", "vllm")  # rmm.llm spec kinds
# Settings a resumed run may change: how fast it runs, not what it learns.
RUNTIME_SETTINGS = ("concurrency", "llm_batch", "checkpoint_every", "llm_threads")


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
    eval_k: int | None = None  # cut-off of every reported figure; None = M, what the generator is shown
    checkpoint_every: int = 200
    recipe: str = "paper"
    structured: bool = False  # JSON-schema answers (ANSWER_SCHEMA) from a real generator
    max_tokens: int = 256  # per reply of a real generator
    concurrency: int = 16  # requests in flight on an openai: server
    llm_batch: int = 16  # questions per generate call of an in-process (hf:, vllm:) generator
    llm_threads: int | None = None  # CPU threads of an hf: generator
    delay: int = 0  # learner updates a rewarded selection waits before it is delivered
    limit: int | None = None  # train on the first `limit` training questions only
    credit: str = LearnerConfig.credit  # per-pick | reward-to-go | sequence (rmm.policy.credit)
    importance: bool = LearnerConfig.importance  # weight stale selections by min(is_clip, π/μ)
    is_clip: float = LearnerConfig.is_clip
    lexical_feature: bool = True  # learn a weight for the first stage's scaled BM25 score (rmm.policy.reranker)
    lexical_init: float | None = None  # that weight's start (None: rmm.policy.reranker.LEXICAL_INIT)
    candidate_features: bool = True  # and weights for its per-candidate features (rmm.memory.features)

    def __post_init__(self) -> None:
        try:
            kind = citer_kind(self.citer)
        except LLMError as error:
            raise ValueError(f"citer must be simulated or an LLM spec: {str(error).splitlines()[0]}") from None
        if kind not in CITERS:
            raise ValueError(f"citer must be one of {CITERS}, got {self.citer!r}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.m > self.k:
            raise ValueError(f"M={self.m} must not exceed K={self.k}")
        if self.eval_k is None:
            self.eval_k = self.m
        if not 1 <= self.eval_k <= self.m:  # the whole-bank search shows M: a figure past M would count nothing
            raise ValueError(f"eval_k must be in [1, M={self.m}], got {self.eval_k}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be ≥ 1, got {self.epochs}")
        for name in ("concurrency", "llm_batch", "max_tokens", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.delay < 0 or (self.limit is not None and self.limit < 1):
            raise ValueError(f"delay must be ≥ 0 and limit ≥ 1, got {self.delay}, {self.limit}")

    def learner_config(self) -> LearnerConfig:
        return LearnerConfig(lr=self.lr, batch_size=self.batch_size, baseline=self.baseline, tau=self.tau,
                             estimator=self.estimator, optimizer=self.optimizer, credit=self.credit,
                             importance=self.importance, is_clip=self.is_clip, lexical_feature=self.lexical_feature,
                             lexical_init=self.lexical_init, candidate_features=self.candidate_features)

    def resumable_as(self) -> dict[str, Any]:
        """The settings a resumed run must share with the run it continues."""
        return {k: v for k, v in asdict(self).items() if k not in RUNTIME_SETTINGS}


@dataclass
class Asked:
    """One stream item between its selection and the delivery of its rewards."""

    index: int
    epoch: int
    question: Question
    key: str  # the learner's
    selection: Selection
    shown: list[Memory]
    rows: dict[str, dict[str, float]] = field(default_factory=dict)  # prequential scores, epoch 0
    step: int = 0  # the learner's optimizer step when it sampled


class OnlineTrainer:
    """Holds the stream, the learner(s) and the metrics; `run()` is the whole program."""

    def __init__(self, dataset: Dataset, bank: MemoryBank, cfg: OnlineConfig, *,
                 output_dir: str | Path | None = None, progress: bool = True,
                 wandb_run: Any | None = None, llm: LLM | None = None) -> None:
        self.dataset, self.bank, self.cfg = dataset, bank, cfg
        self.output_dir = Path(output_dir) if output_dir else None
        self.progress, self.wandb_run = progress, wandb_run
        self.kind = citer_kind(cfg.citer)
        self.llm, self._owns_llm = llm, False
        self.scorer = GoldScorer.for_dataset(dataset, "turn")
        self.with_gold = scorable(dataset.questions, self.scorer)
        # a real generator's citations need no gold; the simulated citer and the per-user cut do
        self.gold_free = ([] if self.kind == "simulated" or cfg.per_user else
                          [q for q in dataset.questions if not q.abstention and not self.scorer.gold(q)])
        usable = {q.id for q in self.with_gold} | {q.id for q in self.gold_free}
        split = split_questions(dataset, [q for q in dataset.questions if q.id in usable], cfg)
        # held out means measured, and only gold measures: a held-out user's gold-free questions are unused
        self.heldout_without_gold = sum(1 for q in split.heldout if not self.scorer.gold(q))
        split.heldout = [q for q in split.heldout if self.scorer.gold(q)]
        self.split = split
        if cfg.candidate_features and getattr(bank, "candidate_features", None) is False:
            log.warning("the rerankers weigh candidate features but this hybrid first stage computes none "
                        "(HybridRetriever(candidate_features=True), or candidate_features=false)")
        root = self.output_dir / "rerankers" if self.output_dir else None
        self.learners = LearnerRegistry(bank.dim, cfg.learner_config(), encoder_name=bank.encoder.fingerprint,
                                        device=bank.device, root=root, subdir="users")
        self.refs: dict[str, list[str]] = {}
        self.memories: dict[str, Memory] = {}
        train = self.split.train[: cfg.limit] if cfg.limit else self.split.train
        self.stream: list[tuple[int, Question]] = [(e, q) for e in range(cfg.epochs) for q in train]
        self.cands: dict[str, Candidates] = {}
        # Stream state (everything a resume needs besides the learners).
        self.done = Done()
        self._recorded: set[str] = set()  # keys whose checkpoints state.json vouches for
        self.rows: dict[str, dict[str, dict[str, float]]] = {"retriever": {}, "reranker": {}}
        self.cited_ratio: list[float] = []
        self.mean_reward: list[float] = []  # per rewarded question, in delivery order (the reward curve)
        self.rewarded_gold: list[bool] = []  # per rewarded question: whether it has gold turn ids
        self.slots: dict[str, list[float]] = {"reward": [], "cited": [], "shown": []}  # sums per shown position
        self.stats = GenerationStats()
        self.staleness = {"updates": 0, "sum": 0, "max": 0}
        self._delayed: dict[str, deque[tuple[Asked, list[float]]]] = defaultdict(deque)
        self._settled = True  # False while a delivery is half done: no checkpoint then
        self._usage_seen = Usage()
        self._clock = time.perf_counter()
        self._saved_at = 0

    # -- pieces -----------------------------------------------------------------------------
    def learner_for(self, user: str) -> Learner:
        key = user if self.cfg.per_user else SHARED
        if key not in self.learners:
            torch.manual_seed(self.cfg.seed)
            if key not in self._recorded:  # a checkpoint state.json does not name is a half-done save's
                self.learners.drop(key, delete_checkpoint=True)
        return self.learners.get(key)

    def candidates(self, questions: list[Question], visible: dict[str, frozenset[str]] | None = None
                   ) -> dict[str, Candidates]:
        """The frozen retriever's top-K for every question, computed once per user. A user named in
        `visible` is searched in a copy of the bank holding only the memories of those sessions —
        the bank as it stood then — so nothing said later reaches a candidate or its features
        (BM25's statistics, either half's ranks, the depth list's best cosine). One copy per user
        and call (the split's one cut per user), its embeddings copied, not re-encoded."""
        by_user: dict[str, list[Question]] = defaultdict(list)
        for q in questions:
            by_user[q.user_id].append(q)
        out: dict[str, Candidates] = {}
        with tempfile.TemporaryDirectory(prefix="rmm-bank-as-of-") as folder, ExitStack() as closing:
            earlier: MemoryBank | None = None  # opened for the first user with a cut
            for user, qs in by_user.items():
                memories = self.bank.memories(user)
                self.refs.update({m.id: m.refs for m in memories})
                self.memories.update({m.id: m for m in memories})
                texts = [q.text for q in qs]
                sessions = (visible or {}).get(user)
                if sessions is None:
                    found = self.bank.search(texts, user, self.cfg.k)
                else:
                    shown = [m for m in memories if self._within(m, sessions)]
                    if not shown:  # nothing of this user's existed yet: no candidates
                        found = [candidate_subset(c, []) for c in self.bank.search(texts, user, 1)]
                    else:
                        if earlier is None:
                            earlier = closing.enter_context(self._empty_copy(Path(folder)))
                        found = self._as_of(earlier, user, shown).search(texts, user, self.cfg.k)
                out.update((q.id, c) for q, c in zip(qs, found))
        return out

    def _empty_copy(self, folder: Path) -> MemoryBank:
        """An empty folder bank searching like the trainer's (encoder, index backend and options; a
        PostgreSQL bank's copy searches in process, exactly)."""
        dense = self.bank.bank if isinstance(self.bank, HybridRetriever) else self.bank
        backend = dense.index_backend if dense.index_backend in BACKENDS else "torch"
        options = dense.index_options if dense.path is not None else None
        return MemoryBank(folder / "bank", dense.encoder, index_backend=backend, device=dense.device,
                          index_options=options)

    def _as_of(self, copy: MemoryBank, user: str, memories: list[Memory]) -> MemoryBank | HybridRetriever:
        """`copy` holding `memories` of `user` (with the trainer's embeddings), behind the trainer's first stage."""
        copy.add(user, memories, self.bank.embeddings(user, [m.id for m in memories]))
        return self.bank.over(copy) if isinstance(self.bank, HybridRetriever) else copy

    def _within(self, memory: Memory, sessions: frozenset[str]) -> bool:
        return all(self.scorer.turn_session.get(r) in sessions for r in memory.refs)

    def score(self, cand: Candidates, order: list[int], q: Question) -> dict[str, float]:
        """Metrics at eval_k (M unless a study sets less: the memories the generator is shown) and at
        K: recall@K of the whole candidate list is the ceiling any reordering of it can reach (the
        reranker's headroom, `rmm.eval.retrieval.headroom_captured`). R@T (`recall_turns@T`) walks the
        memories shown, the first eval_k of `order`, for the retriever's order and the reranker's alike."""
        assert self.cfg.eval_k is not None  # set to M by OnlineConfig
        ks = sorted({self.cfg.eval_k, self.cfg.k})
        ranked = [self.refs[cand.memory_ids[i]] for i in order[: max(ks)]]
        row = self.scorer.score(ranked, q, ks, budgets=())
        row.update(self.scorer.turn_budgets(ranked[: self.cfg.eval_k], q))
        return row

    def greedy(self, cand: Candidates, user: str) -> list[int]:
        """The current reranker's full order of the candidates (scored at eval_k, like the retriever)."""
        return self.learner_for(user).reranker.select([cand], len(cand))[0].chosen

    # -- one stream item: ask, answer, deliver ------------------------------------------------------
    def ask(self, index: int) -> Asked:
        """Prequential scores under the current weights, then the Gumbel-sampled selection."""
        epoch, q = self.stream[index]
        cand = self.cands[q.id]
        learner = self.learner_for(q.user_id)
        rows = {}
        if epoch == 0 and self.scorer.gold(q):  # prequential scores need gold; a gold-free question has none
            rows = {"retriever": self.score(cand, list(range(len(cand))), q),
                    "reranker": self.score(cand, self.greedy(cand, q.user_id), q)}
        generator = torch.Generator().manual_seed(_seed(self.cfg.seed, epoch, q.id))
        selection = learner.select([cand], min(self.cfg.m, len(cand)), explore=True, generator=generator)[0]
        return Asked(index, epoch, q, q.user_id if self.cfg.per_user else SHARED, selection,
                     [self.memories[mid] for mid in selection.memory_ids], rows, learner.stats.step)

    def step(self, index: int) -> None:
        """One stream item with the simulated citer: ask, cite, answer — all at once."""
        asked = self.ask(index)
        gold = self.scorer.gold(asked.question)
        hits = [bool(set(m.refs) & gold) for m in asked.shown]
        citer = SimulatedCiter(self.cfg.precision, self.cfg.recall, seed=_seed(self.cfg.seed, asked.epoch,
                                                                               asked.question.id))
        self.answer(asked, simulated_reply(citer, hits))

    def answer(self, asked: Asked, reply: Reply) -> None:
        """A reply arrived: count it; deliver its rewards now, or after `delay` learner updates."""
        self.stats.count(reply, len(asked.selection.chosen))
        if reply.rewards is None or not self.cfg.delay:
            self._deliver(asked, reply.rewards)
            return
        queue = self._delayed[asked.key]
        queue.append((asked, reply.rewards))
        while len(queue) > self.cfg.delay * self.learners.get(asked.key).config.batch_size:
            self._deliver(*queue.popleft())

    def _deliver(self, asked: Asked, rewards: list[float] | None) -> None:
        """Rewards reach the learner, and the item counts as done — together, or not at all."""
        learner = self.learners.get(asked.key)
        self._settled = False
        if rewards is not None:
            lag = learner.stats.step - asked.step
            self.staleness.update(updates=self.staleness["updates"] + 1, sum=self.staleness["sum"] + lag,
                                  max=max(self.staleness["max"], lag))
        loss = learner.record(asked.selection, None if rewards is None else torch.tensor(rewards))
        self.done.add(asked.index)
        for name, row in asked.rows.items():
            self.rows[name][asked.question.id] = row
        if rewards is not None:
            self.cited_ratio.append(sum(r > 0 for r in rewards) / max(len(rewards), 1))
            self.mean_reward.append(sum(rewards) / max(len(rewards), 1))
            self.rewarded_gold.append(bool(self.scorer.gold(asked.question)))
            self._count_slots(rewards)
        self._settled = True
        if self.wandb_run is not None and rewards is not None:
            self.wandb_run.log({"cited_ratio": self.cited_ratio[-1], "epoch": asked.epoch,
                                **({"loss": loss} if loss is not None else {})})
        if self.output_dir and len(self.done) - self._saved_at >= self.cfg.checkpoint_every:
            self._checkpoint()

    def _count_slots(self, rewards: list[float]) -> None:
        """Add one selection's rewards to the sums per shown position (the order the generator saw)."""
        for name in ("reward", "cited", "shown"):
            self.slots[name] += [0.0] * (len(rewards) - len(self.slots[name]))
        for position, reward in enumerate(rewards):
            self.slots["reward"][position] += reward
            self.slots["cited"][position] += reward > 0
            self.slots["shown"][position] += 1

    def drain(self) -> None:
        """End of the stream: every delayed reward is delivered, every buffer updates."""
        for queue in self._delayed.values():
            while queue:
                self._deliver(*queue.popleft())
        for key in self.learners:
            self.learners.get(key).flush()

    # -- the program --------------------------------------------------------------------------
    def run(self) -> OnlineReport:
        log.debug("split: %s", self.split.description)  # every user; `rmm train` prints `split_summary`
        # the split as it will run (a caller may have set its own): none held out that the encoder trained on
        refuse_heldout_on_pretrained(getattr(self.bank, "encoder", None), self.dataset.name, self.split,
                                     self.cfg.per_user)
        self.cands = self.candidates(self.split.train, self.split.visible_sessions)
        self.cands.update(self.candidates(self.split.heldout))
        if self.output_dir and (self.output_dir / "state.json").exists():
            self._resume()
        elif self.output_dir and (self.output_dir / "rerankers").exists():
            raise CheckpointError(f"{self.output_dir} holds reranker checkpoints but no state.json to resume from; "
                                  "use another --output directory")
        todo = list(self.done.missing(len(self.stream)))
        bar = tqdm(total=len(self.stream), initial=len(self.done), desc=f"online training ({self.kind} citer)",
                   unit="q", disable=not self.progress)
        self._clock = time.perf_counter()
        try:
            if self.kind == "simulated":
                for index in todo:
                    self.step(index)
                    bar.update(1)
                    bar.set_postfix(cited=f"{self.stats.cited / max(self.stats.shown, 1):.3f}", refresh=False)
            else:
                from rmm.training.stream import drive

                asyncio.run(drive(self, todo, bar))
            self.drain()
        except LLMError as error:
            self._stop()
            raise LLMError(f"{str(error).splitlines()[0]} — stopped after {len(self.done)} of {len(self.stream)} "
                           f"questions{self._resume_hint()}") from error
        except BaseException:
            self._stop()
            raise
        finally:
            bar.close()
        self._account()
        if self.output_dir:
            self._checkpoint()
        self._close_llm()
        return build_report(self)

    def generator(self) -> LLM:
        """The real generator, loaded from the citer spec on first use (unless one was given)."""
        if self.llm is None:
            from rmm.llm import load_llm

            options: dict[str, Any] = {}
            if self.kind == "openai":
                options["concurrency"] = self.cfg.concurrency
            elif self.kind == "hf":
                options["batch_size"] = self.cfg.llm_batch
                if self.cfg.llm_threads:
                    options["threads"] = self.cfg.llm_threads
            self.llm, self._owns_llm = load_llm(self.cfg.citer, **options), True
        return self.llm

    def in_flight_limit(self) -> tuple[int, int]:
        """(calls in flight, questions per call): many single requests on a server, one batch in process."""
        return (1, self.cfg.llm_batch) if in_process(self.cfg.citer) else (self.cfg.concurrency, 1)

    def _stop(self) -> None:
        """A failed or interrupted run keeps what it has learned: a checkpoint when one is consistent."""
        self._account()
        if self.output_dir and self._settled:
            self._checkpoint()
        self._close_llm()

    def _resume_hint(self) -> str:
        return f"; checkpoint in {self.output_dir}: run the same command to resume" if self.output_dir else ""

    def _close_llm(self) -> None:
        if self._owns_llm and self.llm is not None:
            self.llm.close()
            self.llm, self._owns_llm = None, False

    def _account(self) -> None:
        """Fold the generator's usage and the stream's wall time since the last call into the stats."""
        now = time.perf_counter()
        self.stats.seconds += now - self._clock
        self._clock = now
        if self.llm is not None:
            usage = self.llm.usage
            self.stats.add_usage(Usage(usage.calls - self._usage_seen.calls,
                                       usage.prompt_tokens - self._usage_seen.prompt_tokens,
                                       usage.completion_tokens - self._usage_seen.completion_tokens))
            self._usage_seen = Usage(usage.calls, usage.prompt_tokens, usage.completion_tokens)

    # -- checkpoints --------------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        """Learners first, then the stream state that names how far each one got."""
        assert self.output_dir is not None
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._account()
        self.learners.save()  # those that learned since the last checkpoint
        state = {"version": STATE_VERSION, "done": self.done.to_json(), "rows": self.rows,
                 "cited_ratio": self.cited_ratio, "mean_reward": self.mean_reward,
                 "rewarded_gold": self.rewarded_gold, "slots": self.slots,
                 "stats": asdict(self.stats), "staleness": self.staleness,
                 "learners": {k: learner_progress(lr) for k, lr in self.learners.items()},
                 "config": self.cfg.resumable_as()}
        atomic_write_json(self.output_dir / "state.json", state)
        self._saved_at = len(self.done)

    def _resume(self) -> None:
        assert self.output_dir is not None
        state = json.loads((self.output_dir / "state.json").read_text())
        if state.get("version") != STATE_VERSION:
            raise CheckpointError(f"{self.output_dir} holds a run written by an older rmm (another checkpoint "
                                  "layout); it cannot be resumed: use another --output directory")
        # runs from before a flag existed ran without what it switches on
        if {"lexical_feature": False, "lexical_init": None, "candidate_features": False, **state["config"]} != self.cfg.resumable_as():
            raise ConfigError(f"{self.output_dir} holds a run with a different configuration; "
                              "use another --output directory or the same settings")
        self.done, self.rows, self.cited_ratio = Done.from_json(state["done"]), state["rows"], state["cited_ratio"]
        # a run checkpointed before these were kept: its reward figures cover what came after
        self.mean_reward, self.rewarded_gold = state.get("mean_reward", []), state.get("rewarded_gold", [])
        self.slots = state.get("slots", self.slots)
        self.stats, self.staleness = GenerationStats(**state["stats"]), state["staleness"]
        self._recorded, self._saved_at = set(state["learners"]), len(self.done)
        for key, progress in state["learners"].items():
            if learner_progress(self.learners.get(key)) != progress:  # loaded from rerankers/
                who = repr(key) if key else "the shared learner"
                raise CheckpointError(f"{self.output_dir}: the reranker checkpoint of {who} does not match "
                                      "state.json (interrupted while saving); use another --output directory")
        log.info("resumed with %d of %d questions rewarded; the rest (in flight ones included) are asked",
                 len(self.done), len(self.stream))


def _seed(seed: int, epoch: int, qid: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}|{epoch}|{qid}".encode()).digest()[:8], "little") >> 1
