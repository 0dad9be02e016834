"""The reranker checkpoint folder: what is in it, how it is written safely, how it is read back.

A checkpoint is a folder —

- `reranker.safetensors`: the reranker's weights (safetensors: no pickle, loads anywhere);
- `optimizer.pt`: the optimizer state plus the records still waiting in the learner's batch
  buffer, so a resumed learner continues exactly where the saved one stood;
- `meta.json`: dim, encoder, step, stats, config, format version and the SHA-256 of both files,
  so a truncated or bit-flipped file is refused instead of silently loaded.

Format 2 added to each buffered record the τ, behaviour log-probability μ, weights version and
mask it was sampled with (the off-policy correction needs them) and to the config the credit and
importance options; format 3 `lexical_feature` in the meta (our extension of Eq. 1: the weights
then hold `lexical_weight`; a checkpoint without the key is a plain Eq. 1 reranker); format 4
`lexical_definition` beside a true `lexical_feature`: which lexical feature the weights were
trained on (`rmm.memory.hybrid.LEXICAL_DEFINITION`, BM25's score scaled over its top list). Formats
1–3 are still read, and `Learner.load` upgrades them. A format-3 reranker with the lexical weight was
trained on the feature before it (`LEGACY_LEXICAL_DEFINITION`: a hybrid's fused score over its
largest value; for a `bm25:DENSE` first stage already today's): it loads as it is, with a warning —
its w and residual are where learning resumes, and its pending selections keep the features they
were sampled with, so every update stays correct — and the first save after an update records
today's definition (a save with no update since loading, e.g. `rmm chat --no-learn` closing, keeps
the old one, so the warning repeats until the weights have learned on today's feature).
A definition this rmm does not know is refused. Format 5 adds `feature_names` to the meta: the
candidate features (`rmm.memory.features`) the reranker weighs, in the order of its
`feature_weight` (empty: none); formats 1–4 predate them.

A checkpoint without the lexical weight or without feature weights, loaded by a run that asks for
them, gains them at 0 (`rmm.policy.growth`: its ranking is unchanged, and the next save records
them, so the next start loads it as saved); likewise one whose feature names are the leading ones the
run asks for gains the rest (`LearnerConfig.extra_features`). A checkpoint *with* them, loaded by a run
that asks for none or for other feature names (fewer included), is refused with a one-line error: dropping learned weights
would silently change the ranking.

It is written to a temporary sibling and swapped in with two renames: a crash mid-write never
leaves a half-written folder where the old one was, and a crash between the renames leaves the
old checkpoint at `.<name>.old`, which `read_checkpoint` falls back to. This module knows the
format only; `rmm.policy.learner.Learner.save/load` turn a learner into these pieces and back.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import tarfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from rmm.errors import CheckpointError, DimensionMismatchError, EncoderMismatchError
from rmm.memory.hybrid import LEXICAL_DEFINITION

__all__ = [
    "FORMAT_VERSION",
    "KIND",
    "LEGACY_LEXICAL_DEFINITION",
    "READABLE_VERSIONS",
    "Checkpoint",
    "backup_of",
    "checkpoint_exists",
    "finish_interrupted_swap",
    "pack_checkpoint",
    "read_checkpoint",
    "saved_feature_names",
    "saved_lexical_feature",
    "unpack_checkpoint",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

# 2: records carry τ, μ, version, mask; config credit/importance. 3: lexical_feature. 4: lexical_definition.
# 5: feature_names (and records' candidate features)
FORMAT_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)  # older ones the learner upgrades on load
LEGACY_LEXICAL_DEFINITION = "fused-over-max"  # what a format-3 reranker's lexical weight was trained on
_LEXICAL_DEFINITIONS = (LEGACY_LEXICAL_DEFINITION, LEXICAL_DEFINITION)
KIND = "rmm-reranker"
WEIGHTS, TRAINING, META = "reranker.safetensors", "optimizer.pt", "meta.json"
_REQUIRED_META = ("dim", "encoder_name", "config", "stats")


@dataclass
class Checkpoint:
    """What a checkpoint folder holds, read and verified (checksums, format, dim, encoder)."""

    folder: Path
    meta: dict[str, Any]
    weights: dict[str, Tensor]
    training: dict[str, Any]  # {"optimizer": state_dict, "pending": [buffered records' states]}


def backup_of(target: Path) -> Path:
    """Where the previous checkpoint waits while a new one is swapped in."""
    return target.parent / f".{target.name}.old"


def checkpoint_exists(path: Path) -> bool:
    """A saved checkpoint, or the backup a crash mid-swap leaves (which `read_checkpoint` recovers)."""
    return (path / META).exists() or backup_of(path).is_dir()


def write_checkpoint(target: str | Path, *, weights: dict[str, Tensor], training: dict[str, Any],
                     meta: dict[str, Any]) -> Path:
    """Write the folder atomically (temp sibling, then swap); returns its path.

    `meta` carries the learner's fields (dim, encoder_name, step, stats, config, lexical_feature and,
    for a reranker loaded and not updated since, the `lexical_definition` it was loaded with); the
    format version, kind, checksums and otherwise today's lexical definition are added here.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
        torch.save(training, tmp / TRAINING)
        full_meta = {"format_version": FORMAT_VERSION, "kind": KIND, **meta,
                     "sha256": {name: _sha256(tmp / name) for name in (WEIGHTS, TRAINING)}}
        if meta.get("lexical_feature"):  # the learner's kept definition, else today's (module docstring)
            full_meta["lexical_definition"] = meta.get("lexical_definition") or LEXICAL_DEFINITION
        (tmp / META).write_text(json.dumps(full_meta, indent=2))
        for name in (WEIGHTS, TRAINING, META):
            _fsync(tmp / name)
        _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def read_checkpoint(path: str | Path, *, encoder_name: str | None = None, dim: int | None = None) -> Checkpoint:
    """Read and verify `write_checkpoint`'s folder (or the backup an interrupted swap left).

    Refuses another dimension or encoder than expected; a checkpoint that names no encoder adopts
    `encoder_name` (with a warning). Every failure to read is a `CheckpointError`.
    """
    folder = _recover(Path(path))
    meta = _read_meta(folder)
    if dim is not None and meta["dim"] != dim:
        raise DimensionMismatchError(f"checkpoint {folder} is for dimension {meta['dim']}, expected {dim}")
    if encoder_name is not None and meta["encoder_name"] == "" and encoder_name:
        log.warning("checkpoint %s does not name its encoder; assuming %r", folder, encoder_name)
        meta["encoder_name"] = encoder_name
    elif encoder_name is not None and meta["encoder_name"] != encoder_name:
        raise EncoderMismatchError(
            f"checkpoint {folder} was trained on encoder {meta['encoder_name']!r}, not {encoder_name!r}"
        )
    for name, digest in meta.get("sha256", {}).items():
        if not (folder / name).is_file():
            raise CheckpointError(f"checkpoint {folder} lacks {name}")
        if _sha256(folder / name) != digest:
            raise CheckpointError(f"checkpoint file {folder / name} is corrupt (checksum mismatch)")
    try:
        weights = load_file(str(folder / WEIGHTS))
        training = torch.load(folder / TRAINING, map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors / pickle errors and missing files all mean the same to a user
        raise CheckpointError(f"cannot load reranker checkpoint {folder}: {exc}") from exc
    if not isinstance(training, dict) or not {"optimizer", "pending"} <= set(training):
        raise CheckpointError(f"{folder / TRAINING} does not hold an optimizer state and pending records")
    return Checkpoint(folder, meta, weights, training)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def finish_interrupted_swap(target: Path) -> None:
    """Complete a swap a crash cut short: the backup becomes `target` again when `target` is
    missing, else only what it held besides the checkpoint moves over, and it goes.

    Until then the folders nested in the backup (other keys' checkpoints) are out of sight, so a
    registry calls this before it looks for any of them.
    """
    backup = backup_of(target)
    if not backup.is_dir():
        return
    if target.is_dir():
        _carry_over(backup, target)
        shutil.rmtree(backup)
    elif not target.exists():
        os.replace(backup, target)
        log.warning("restored checkpoint %s from the backup an interrupted save left", target)


def _swap_in(tmp: Path, target: Path) -> None:
    """Replace `target` by `tmp`, keeping whatever else `target` holds (nested checkpoints of
    other keys, see `rmm.policy.registry`). A crash between the two renames leaves the old
    checkpoint at `.<name>.old`, which `read_checkpoint` falls back to and the next save finishes."""
    finish_interrupted_swap(target)
    backup = backup_of(target)
    if target.exists():
        if not target.is_dir():
            raise CheckpointError(f"{target} exists and is not a checkpoint folder")
        os.replace(target, backup)
    os.replace(tmp, target)
    _carry_over(backup, target)
    shutil.rmtree(backup, ignore_errors=True)
    try:  # make the renames durable
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _carry_over(old: Path, new: Path, files: tuple[str, ...] = (WEIGHTS, TRAINING, META)) -> None:
    """Move what `old` holds besides its own checkpoint `files` into `new`; where both hold a
    folder of the same name, merge it (what `new` already has wins: it was written later)."""
    if not old.is_dir():
        return
    for entry in old.iterdir():
        if entry.name in files:
            continue
        there = new / entry.name
        if not there.exists():
            os.replace(entry, there)
        elif entry.is_dir() and there.is_dir():
            _carry_over(entry, there, files=())


def _recover(folder: Path) -> Path:
    if folder.is_dir():
        return folder
    backup = backup_of(folder)
    if backup.is_dir():
        log.warning("checkpoint %s missing; using the previous one left by an interrupted save", folder)
        return backup
    raise CheckpointError(f"no reranker checkpoint at {folder}")


def _read_meta(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{folder} is not a reranker checkpoint (no {META})") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{folder / META} is corrupt: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("kind") != KIND:
        raise CheckpointError(f"{folder / META} does not describe a reranker checkpoint")
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint {folder} has format version {version}; this rmm reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    for key in _REQUIRED_META:
        if key not in meta:
            raise CheckpointError(f"{folder / META} lacks {key!r}")
    if meta.get("lexical_feature"):
        meta["lexical_definition"] = _lexical_definition(folder, meta, version)
    return meta


def _lexical_definition(folder: Path, meta: dict[str, Any], version: int) -> str:
    """Which lexical feature a reranker with the lexical weight was trained on (module docstring)."""
    stated = meta.get("lexical_definition", LEGACY_LEXICAL_DEFINITION if version < 4 else None)
    if stated is None:
        raise CheckpointError(f"{folder / META} has a lexical weight but no 'lexical_definition' (which lexical "
                              "feature it was trained on)")
    if stated not in _LEXICAL_DEFINITIONS:
        raise CheckpointError(f"checkpoint {folder} was trained on lexical feature {stated!r}; this rmm knows "
                              f"{', '.join(map(repr, _LEXICAL_DEFINITIONS))}")
    if stated != LEXICAL_DEFINITION:
        log.warning("reranker checkpoint %s was trained on the lexical feature %r (format %s); this rmm computes "
                    "%r (BM25's score scaled over its top list; the same for a bm25:DENSE first stage): its "
                    "weights are where learning resumes, and the first save after an update records %r",
                    folder, stated, version, LEXICAL_DEFINITION, LEXICAL_DEFINITION)
    return str(stated)


def pack_checkpoint(folder: str | Path) -> bytes:
    """A checkpoint folder as one uncompressed tar (what a database row holds); the checksums in
    `meta.json` still guard every file when it is unpacked and read."""
    folder = Path(folder)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in (WEIGHTS, TRAINING, META):
            tar.add(folder / name, arcname=name)
    return buffer.getvalue()


def unpack_checkpoint(data: bytes, folder: str | Path) -> Path:
    """Write `pack_checkpoint`'s bytes back as a checkpoint folder (only its three known files)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            for name in (WEIGHTS, TRAINING, META):
                member = tar.getmember(name)
                source = tar.extractfile(member)
                if source is None:
                    raise CheckpointError(f"packed checkpoint entry {name} is not a file")
                (folder / name).write_bytes(source.read())
    except (tarfile.TarError, KeyError) as exc:
        raise CheckpointError(f"packed checkpoint is unreadable: {exc}") from exc
    return folder


def saved_lexical_feature(folder: Path, meta: dict[str, Any], expected: bool | None) -> bool:
    """Whether a checkpoint's reranker has the lexical weight (checkpoints older than the feature state
    none: plain Eq. 1). A clear error when it has one and `expected` is False: dropping a learned weight
    would change the ranking. One without it is no error whatever is expected (`rmm.policy.growth`)."""
    stated = meta.get("lexical_feature")
    if stated and expected is not None and not expected:
        raise CheckpointError(f"reranker checkpoint {folder} was trained with the lexical feature, but this run "
                              "asks for a reranker without it; match the setting (--no-lexical-feature / "
                              "lexical_feature) or use another checkpoint folder")
    return bool(stated)


def saved_feature_names(folder: Path, meta: dict[str, Any], expected: Sequence[str] | None) -> tuple[str, ...]:
    """The candidate features a checkpoint's reranker weighs, in order (formats 1–4 predate them: none).
    A one-line error when it weighs some and `expected` names others or none: a learned weight must never
    be dropped or meet another feature. One that weighs none, or the leading ones of `expected` (a run
    that asks for `extra_features` too), is no error: it gains the rest (`rmm.policy.growth`)."""
    stated = meta.get("feature_names")
    if stated is None:
        return ()
    if not isinstance(stated, list) or not all(isinstance(n, str) for n in stated):
        raise CheckpointError(f"{folder / META} has feature_names {stated!r}; expected a list of names")
    names = tuple(stated)
    if names and expected is not None and names != tuple(expected)[:len(names)]:
        raise CheckpointError(f"reranker checkpoint {folder} weighs candidate features {list(names)}, but "
                              f"this run asks for {list(expected) or 'none'}; match the setting "
                              "(--no-candidate-features / candidate_features) or use another checkpoint folder")
    return names
