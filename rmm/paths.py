"""Where rmm keeps data and caches: one place, so the CLI, loaders and tests agree."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

DATA_DIR_ENV = "RMM_DATA_DIR"
CACHE_DIR_ENV = "RMM_CACHE_DIR"


def data_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Benchmark data: the explicit flag, else `$RMM_DATA_DIR`, else the user data directory."""
    if override:
        return Path(override).expanduser()
    if env := os.environ.get(DATA_DIR_ENV):
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("rmm")) / "data"


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Derived artefacts (embedding caches, scratch banks): flag, `$RMM_CACHE_DIR`, user cache."""
    if override:
        return Path(override).expanduser()
    if env := os.environ.get(CACHE_DIR_ENV):
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("rmm"))
