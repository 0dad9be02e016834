"""Device and dtype choice: `"auto"` means CUDA when present, else CPU."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

import torch

from rmm.errors import DeviceUnavailableError


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """The torch device a setting names; a missing GPU is a user error (one line), not a crash."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise DeviceUnavailableError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(f"device {device!r} requested but CUDA is not available on this machine")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise DeviceUnavailableError(f"device {device!r} requested but this machine has "
                                     f"{torch.cuda.device_count()} CUDA device(s)")
    return resolved


def default_dtype(device: torch.device, dtype: str | torch.dtype | None = "auto") -> torch.dtype:
    """float32 on CPU; bf16 on CUDA where supported (else fp16) — the encoders' inference dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if dtype not in names:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)} or 'auto'")
        return names[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def cpu_fingerprint() -> dict[str, Any]:
    """What a timing of a CPU fast path depends on besides its inputs: the CPU model and flags, the
    thread count, the libraries (`rmm.encoders.query.choice`, `rmm.memory.scan_choice` key their
    caches by it)."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and not model:
                model = value
            elif key in ("flags", "Features") and not flags:
                flags = value
    except OSError:  # not Linux: the platform's word for the processor
        pass
    try:
        onnxruntime = importlib.metadata.version("onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        onnxruntime = None
    return {"cpu": model or platform.processor() or platform.machine(),
            "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "onnxruntime": onnxruntime, "threads": torch.get_num_threads(), "cores": os.cpu_count()}
