"""Where rmm keeps data and caches: one place, so the CLI, loaders and tests agree."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

DATA_DIR_ENV = "RMM_DATA_DIR"
CACHE_DIR_ENV = "RMM_CACHE_DIR"


# A source checkout that sits beside a `shared/data` folder (the team's layout) reads the benchmark
# data from there, so the quickstart needs no download on the team's offline machines.
_CHECKOUT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def data_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Benchmark data: the explicit flag, else `$RMM_DATA_DIR`, else the user data directory
    (or, when that is empty and this is a source checkout beside `shared/data`, that folder)."""
    if override:
        return Path(override).expanduser()
    if env := os.environ.get(DATA_DIR_ENV):
        return Path(env).expanduser()
    user = Path(platformdirs.user_data_dir("rmm")) / "data"
    if not (user.exists() and any(user.iterdir())) and _CHECKOUT_DATA.is_dir():
        return _CHECKOUT_DATA
    return user


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Derived artefacts (embedding caches, scratch banks): flag, `$RMM_CACHE_DIR`, user cache."""
    if override:
        return Path(override).expanduser()
    if env := os.environ.get(CACHE_DIR_ENV):
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("rmm"))
