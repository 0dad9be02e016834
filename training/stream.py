"""Many training questions in flight to a real generator, rewards taken as they come.

A vLLM server on one GPU is only busy with dozens of requests at once, and an in-process engine
only with a batch: so the trainer asks ahead. On an `openai:` server each question is its own
request, `concurrency` of them in flight (the backend's async client bounds them and retries);
an in-process generator (`hf:`, `vllm:`) gets one `generate` call of `llm_batch` questions at a
time, in a worker thread. Whichever reply arrives first is read and its rewards go to the learner
at once, while the others are still being generated: each Selection carries the behaviour
log-probability it was sampled with, so the learner can weigh a reward that comes back after
other updates moved the weights.

Everything but the generation itself runs on this one event loop — sampling, reading replies,
learner updates, checkpoints — so none of it needs a lock. When a call fails (after the client's
retries) or the run is interrupted, the calls still in flight are cancelled; their questions are
not marked done, so a resumed run asks them again.
"""

from __future__ import annotations

import asyncio
import time
from itertools import islice
from typing import TYPE_CHECKING, Any

from rmm.training.generation import ask, llm_answer_prompt, read_llm_reply

if TYPE_CHECKING:
    from rmm.training.online import Asked, OnlineTrainer

__all__ = ["drive"]


async def drive(trainer: OnlineTrainer, todo: list[int], bar: Any) -> None:
    """Ask every stream item of `todo` (in order), keeping the generator busy; see the module docstring."""
    cfg = trainer.cfg
    llm = trainer.generator()
    calls, per_call = trainer.in_flight_limit()
    pending = iter(todo)
    flight: dict[asyncio.Future[list[str]], list[Asked]] = {}
    started, tokens_before = time.perf_counter(), llm.usage.completion_tokens
    try:
        while True:
            while len(flight) < calls:
                batch = [trainer.ask(index) for index in islice(pending, per_call)]
                if not batch:
                    break
                prompts = [llm_answer_prompt(a.question.text, a.shown, cfg.structured) for a in batch]
                call = ask(llm, prompts, [a.shown for a in batch], structured=cfg.structured,
                           max_tokens=cfg.max_tokens)
                flight[asyncio.ensure_future(call)] = batch
            if not flight:
                return
            finished, _ = await asyncio.wait(flight, return_when=asyncio.FIRST_COMPLETED)
            for future in finished:
                batch = flight.pop(future)
                for asked, raw in zip(batch, future.result(), strict=True):
                    trainer.answer(asked, read_llm_reply(raw, asked.selection, cfg.structured))
                bar.update(len(batch))
            _postfix(trainer, bar, llm.usage.completion_tokens - tokens_before, time.perf_counter() - started)
    finally:
        for future in flight:
            future.cancel()
        await asyncio.gather(*flight, return_exceptions=True)


def _postfix(trainer: OnlineTrainer, bar: Any, tokens: int, seconds: float) -> None:
    """Completion tokens/s of this session, the cited ratio and the share of unusable replies so far."""
    stats = trainer.stats
    bar.set_postfix({"tok/s": f"{tokens / seconds:.0f}" if seconds > 0 else "-",
                     "cited": f"{stats.cited / max(stats.shown, 1):.3f}",
                     "unusable": f"{stats.unusable / max(stats.replies, 1):.1%}"}, refresh=False)
