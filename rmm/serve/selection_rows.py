"""A pending selection, its row codec and the checks on it, shared by both selection stores.

`PendingSelection` is a `Selection` as it was sampled, plus who asked for it and until when.
`selection_row` / `selection_from_row` write and read it in `SELECTION_COLUMNS` order for the
SQLite store (`rmm.serve.pending`) and, with JSONB and BOOLEAN, for the PostgreSQL one
(`rmm.serve.pg_pending`), so a new field is added here once. Tensors are float32 bytes (the mask
uint8), row-major; times are floats.

A row is decoded only when its feedback arrives (or the learner reads it), so a blob whose size
does not match the shape its row states — K candidates × d, or K × F candidate features — is
refused for that selection alone (`CorruptSelectionError`, in the transaction that claimed it:
the row stays as it was) rather than surfacing as a reshape failure deep in an update.

Both stores also refuse alike: a selection written without its candidate embeddings
(`require_embeddings`), an id never issued or already purged (`unknown_selection`), and one already
rewarded, expired or legacy at claim time (`refuse_unusable`). They live here, below both stores,
so that `pending` (which opens either store) and `pg_pending` import them without a circle.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rmm.serve.errors import (
    CorruptSelectionError,
    SelectionExpiredError,
    SelectionUsedError,
    UnknownSelectionError,
)

__all__ = [
    "SELECTION_COLUMNS",
    "SQLITE_FORMAT",
    "EmbeddingsOf",
    "PendingSelection",
    "RowFormat",
    "check_features",
    "refuse_unusable",
    "require_embeddings",
    "selection_from_row",
    "selection_row",
    "tensor_blob",
    "unknown_selection",
]

EmbeddingsOf = Callable[[str, list[str]], torch.Tensor]  # (user_id, memory ids) -> [K, d]

# A selection row's columns, in the order `selection_row` writes and `selection_from_row` reads
# them — for both stores (SQLite in `pending`, PostgreSQL in `pg_pending`): a new field is added here once.
SELECTION_COLUMNS = ("id", "tenant", "user_id", "reranker_key", "query", "memory_ids", "chosen", "explore",
                     "query_emb", "scores", "logp", "noise", "created_at", "expires_at", "consumed_at",
                     "embeddings", "tau", "version", "mask", "lexical", "features", "feature_names")


@dataclass
class PendingSelection:
    """A `Selection` as it was at sampling time, plus who asked for it and until when."""

    id: str
    tenant: str
    user_id: str  # the tenant-scoped user id
    reranker_key: str
    query: str
    memory_ids: list[str]  # the K candidates, in retrieval order
    chosen: list[int]  # indices into memory_ids, in shown order
    explore: bool
    query_embedding: torch.Tensor  # [d]
    scores: torch.Tensor  # [K]
    logp: torch.Tensor | None
    noise: torch.Tensor | None
    created_at: float
    expires_at: float
    consumed_at: float | None = None
    embeddings: torch.Tensor | None = None  # [K, d] as scored; None only in a legacy row not yet upgraded
    tau: float | None = None
    version: int | None = None
    mask: torch.Tensor | None = None  # [K] bool
    lexical: torch.Tensor | None = None  # [K] the candidates' lexical feature as scored; None = none
    features: torch.Tensor | None = None  # [K, F] the candidates' features as scored; None = none
    feature_names: tuple[str, ...] = ()  # the F column names of `features`; () when there are none


@dataclass(frozen=True)
class RowFormat:
    """How a database spells a selection row's JSON lists and its explore flag; tensors are float32
    bytes (the mask uint8) and times are floats in both, so the rest of the codec is shared."""

    dump_json: Callable[[list[Any]], Any]
    load_json: Callable[[Any], list[Any]]
    dump_bool: Callable[[bool], Any]


SQLITE_FORMAT = RowFormat(dump_json=json.dumps, load_json=json.loads, dump_bool=int)  # TEXT, INTEGER 0/1


def tensor_blob(tensor: torch.Tensor | None) -> bytes | None:
    """float32 bytes, row-major (None stays NULL)."""
    if tensor is None:
        return None
    return np.ascontiguousarray(tensor.detach().float().cpu().numpy(), dtype=np.float32).tobytes()


def _tensor(blob: bytes | memoryview | None) -> torch.Tensor | None:
    if blob is None:
        return None
    return torch.from_numpy(np.frombuffer(blob, dtype=np.float32).copy())


def _mask_blob(mask: torch.Tensor | None) -> bytes | None:
    return None if mask is None else mask.detach().cpu().to(torch.uint8).numpy().tobytes()


def check_features(s: PendingSelection) -> None:
    """Refuse to store candidate features that do not match their names and the K candidates: a
    row must describe itself, since it is read back in another process after the code moved on."""
    if s.features is None:
        if s.feature_names:
            raise ValueError(f"selection {s.id!r} names candidate features {list(s.feature_names)} but has none")
        return
    want = (len(s.memory_ids), len(s.feature_names))
    if tuple(s.features.shape) != want:
        raise ValueError(f"selection {s.id!r}: candidate features of shape {tuple(s.features.shape)}, expected "
                         f"[K={want[0]}, F={want[1]}] (K candidates × the {want[1]} feature names)")


def selection_row(s: PendingSelection, fmt: RowFormat = SQLITE_FORMAT) -> tuple[Any, ...]:
    """A new (not yet rewarded) selection's values in `SELECTION_COLUMNS` order."""
    check_features(s)
    blob = tensor_blob
    return (s.id, s.tenant, s.user_id, s.reranker_key, s.query, fmt.dump_json(list(s.memory_ids)),
            fmt.dump_json(list(s.chosen)), fmt.dump_bool(bool(s.explore)), blob(s.query_embedding), blob(s.scores),
            blob(s.logp), blob(s.noise), float(s.created_at), float(s.expires_at), None, blob(s.embeddings),
            None if s.tau is None else float(s.tau), None if s.version is None else int(s.version),
            _mask_blob(s.mask), blob(s.lexical), blob(s.features),
            None if s.features is None else fmt.dump_json(list(s.feature_names)))


def _corrupt(selection_id: str, what: str) -> CorruptSelectionError:
    """The typed error for a row that cannot be decoded, naming the selection and what is wrong."""
    return CorruptSelectionError(f"selection {selection_id!r} is stored corrupt: {what}; it cannot be learned from "
                                 "— retrieve again")


def _matrix(selection_id: str, what: str, blob: bytes | memoryview | None, rows: int, cols: int) -> torch.Tensor | None:
    """A [rows, cols] float32 blob, or the typed error naming the selection when its size is not that."""
    flat = _tensor(blob)
    if flat is None:
        return None
    if flat.numel() != rows * cols:
        raise _corrupt(selection_id, f"its {what} hold {flat.numel()} floats, not {rows} × {cols}")
    return flat.reshape(rows, cols)


def _feature_names(selection_id: str, raw: Any, fmt: RowFormat) -> tuple[str, ...] | None:
    """The stored feature names (None when NULL), or the typed error when they are not a list of strings."""
    if raw is None:
        return None
    try:
        names = fmt.load_json(raw)
    except (TypeError, ValueError) as exc:
        raise _corrupt(selection_id, f"its feature names are not JSON ({exc})") from exc
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _corrupt(selection_id, "its feature names are not a list of strings")
    return tuple(names)


def selection_from_row(row: tuple[Any, ...], fmt: RowFormat = SQLITE_FORMAT) -> PendingSelection:
    """A selection from its values in `SELECTION_COLUMNS` order (NULL in columns an older rmm did not
    write); `CorruptSelectionError` when a blob's size does not match the shape the row states."""
    sid = str(row[0])
    query_embedding = _tensor(row[8])
    scores = _tensor(row[9])
    assert query_embedding is not None and scores is not None
    memory_ids = [str(m) for m in fmt.load_json(row[5])]
    k = len(memory_ids)
    embeddings = _matrix(sid, "candidate embeddings", row[15], k, query_embedding.numel())
    names = _feature_names(sid, row[21], fmt)
    if (row[20] is None) != (names is None):
        raise _corrupt(sid, "it has candidate features without their names or names without features")
    features = _matrix(sid, "candidate features", row[20], k, len(names or ()))
    mask = None if row[18] is None else torch.from_numpy(np.frombuffer(row[18], dtype=np.uint8).copy()).bool()
    return PendingSelection(
        id=row[0], tenant=row[1], user_id=row[2], reranker_key=row[3], query=row[4],
        memory_ids=memory_ids, chosen=[int(c) for c in fmt.load_json(row[6])], explore=bool(row[7]),
        query_embedding=query_embedding, scores=scores, logp=_tensor(row[10]), noise=_tensor(row[11]),
        created_at=float(row[12]), expires_at=float(row[13]), consumed_at=None if row[14] is None else float(row[14]),
        embeddings=embeddings, tau=None if row[16] is None else float(row[16]),
        version=None if row[17] is None else int(row[17]), mask=mask, lexical=_tensor(row[19]),
        features=features, feature_names=names or (),
    )


def require_embeddings(selections: list[PendingSelection]) -> None:
    """Refuse a selection stored without the candidate embeddings it was scored with: its update
    would have to re-read them from the store, which may have changed since."""
    for s in selections:
        if s.embeddings is None:
            raise ValueError(f"selection {s.id!r} has no candidate embeddings; its update would have to "
                             "re-read them from the store")


def unknown_selection(selection_id: str) -> UnknownSelectionError:
    return UnknownSelectionError(
        f"unknown selection id {selection_id!r}: never issued to this API key's tenant, or "
        "purged (expired or rewarded more than one TTL ago, or its user was deleted)"
    )


def refuse_unusable(selection: PendingSelection, now: float, ttl_s: float) -> None:
    """Raise when a selection can no longer be rewarded (already rewarded, expired, legacy row)."""
    if selection.consumed_at is not None:
        raise SelectionUsedError(
            f"selection {selection.id!r} already received feedback at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(selection.consumed_at))}; "
            "each selection is rewarded once"
        )
    if selection.expires_at < now:
        raise SelectionExpiredError(
            f"selection {selection.id!r} expired {now - selection.expires_at:.1f} s ago (selections "
            f"wait {ttl_s:g} s for feedback; raise selection_ttl_s to allow slower feedback)"
        )
    if selection.embeddings is None:  # written by an older rmm after this store was opened
        raise SelectionExpiredError(
            f"selection {selection.id!r} was written without its candidate embeddings (an older rmm); "
            "it cannot be learned from faithfully — retrieve again"
        )
