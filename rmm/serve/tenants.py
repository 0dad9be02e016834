"""Tenants: who an API key speaks for, and how a tenant's names are kept apart from another's.

Every user id a tenant names is stored as `"<tenant>:<user>"` (tenant names cannot contain `:`),
so two tenants' users can never collide and no code path can reach another tenant's rows by name.
That scoped form is internal: nothing the API answers may show it, so ids made from it (session
and turn ids) are handed out unscoped, and errors raised below the server (whose messages name
scoped ids, files and other users) are retold in the caller's own terms here.
Keys are kept only as digests, so a memory dump of the server does not leak them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rmm.errors import UnknownMemoryError, UnknownUserError
from rmm.memory.store import DuplicateMemoryError
from rmm.serve.config import AuthConfig, key_digest
from rmm.serve.scoping import scoped, unscoped, unscoped_id, unscoped_text  # pure names, torch-free

__all__ = [
    "ApiKeys",
    "callers_error",
    "callers_terms",
    "reranker_key",
    "scoped",
    "unknown_user",
    "unscoped",
    "unscoped_id",
    "unscoped_text",
]


def unknown_user(user: str) -> UnknownUserError:
    """The one 404 for a user: it says nothing about other users or where the bank lives."""
    return UnknownUserError(f"unknown user {user!r} (no memories stored for this user)")


def callers_error(exc: Exception, tenant: str, user: str) -> Exception:
    """`exc` retold for the caller: the store's unknown-user message lists other (possibly other
    tenants') users and the bank's path, and its memory errors name the scoped user id."""
    if isinstance(exc, UnknownUserError):
        return unknown_user(user)
    if isinstance(exc, UnknownMemoryError | DuplicateMemoryError):
        return type(exc)(unscoped_text(tenant, str(exc)))
    return exc


@contextmanager
def callers_terms(tenant: str, user: str) -> Iterator[None]:
    """Re-raise the bank's user and memory errors in the caller's terms (`callers_error`)."""
    try:
        yield
    except (UnknownUserError, UnknownMemoryError, DuplicateMemoryError) as exc:
        raise callers_error(exc, tenant, user) from exc


def reranker_key(per: str, tenant: str, user_id: str) -> str:
    """The learner that serves a user: one for the bank (`""`), one per tenant, or one per user."""
    return "" if per == "bank" else tenant if per == "tenant" else user_id


class ApiKeys:
    """API key → tenant, from every configured source (YAML, environment, key file)."""

    def __init__(self, auth: AuthConfig) -> None:
        self._tenants = {key_digest(key): tenant for key, tenant in auth.resolve().items()}

    def tenant_for(self, key: str | None) -> str | None:
        """The tenant of `key`, or None for a missing or unknown key."""
        return self._tenants.get(key_digest(key)) if key else None

    def tenants(self) -> list[str]:
        """Every configured tenant, sorted."""
        return sorted(set(self._tenants.values()))
