#!/usr/bin/env python
"""Run one `rmm` command in this process and report its wall time and peak GPU memory.

Peak memory is torch's allocator high-water mark (`torch.cuda.max_memory_allocated`, and the
reserved pool beside it), so it counts exactly what the command's tensors needed on the device.

    python -m rmm.bench.cuda_peak [--json FILE] -- train --retriever minilm --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write {command, exit, seconds, peak_gib} here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the rmm command and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the rmm command after --")

    import torch

    from rmm.cli import main as rmm_main

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    try:
        status = rmm_main(command)
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
    print(f"`rmm {' '.join(command)}`: exit {status}, wall {seconds:.1f} s, peak GPU memory {peak:.2f} GiB "
          f"allocated ({reserved:.2f} GiB reserved){'' if cuda else ' (no CUDA device)'}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": command, "exit": status, "seconds": seconds, "peak_gib": peak,
                       "reserved_gib": reserved}, handle, indent=2)
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
