"""The server's own typed errors; the HTTP layer maps each to one status code.

Unknown and foreign ids are the same error on purpose: a tenant asking for another tenant's user
or selection learns nothing about whether it exists.
"""

from __future__ import annotations

from rmm.errors import RmmError

__all__ = [
    "BadRequestError",
    "CorruptSelectionError",
    "ForbiddenError",
    "InvalidApiKeyError",
    "MissingApiKeyError",
    "NoOpenSessionError",
    "NoShadowError",
    "SelectionExpiredError",
    "SelectionUsedError",
    "UnknownJobError",
    "UnknownSelectionError",
]


class UnknownSelectionError(RmmError, KeyError):
    """No pending selection with that id for this tenant (never made, purged, or another tenant's)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown selection"


class SelectionExpiredError(RmmError):
    """The selection waited longer than `selection_ttl_s` for its feedback."""


class CorruptSelectionError(RmmError, ValueError):
    """A stored selection whose row cannot be decoded as what it states (a blob of the wrong size):
    that selection cannot be learned from; every other one still can."""


class SelectionUsedError(RmmError):
    """Feedback for this selection was already given; a selection is rewarded once."""


class UnknownJobError(RmmError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown job"


class NoOpenSessionError(RmmError, KeyError):
    """End-session for a user with no turns posted since their last session ended."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "no open session"


class BadRequestError(RmmError, ValueError):
    """Well-formed JSON that asks for something impossible (e.g. citing index 7 of 5 shown)."""


class MissingApiKeyError(RmmError):
    """A `/v1` request with neither `Authorization: Bearer KEY` nor `X-API-Key: KEY`."""


class InvalidApiKeyError(RmmError):
    """A key that names no tenant (the answer never hints at which keys exist)."""



class ForbiddenError(RmmError):
    """A valid key whose tenant may not do this (an admin route: `shadow.admin_tenants`)."""


class NoShadowError(RmmError, KeyError):
    """Shadow scoring or promotion asked of a server configured without `shadow.checkpoint`."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "no shadow reranker configured"
