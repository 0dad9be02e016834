"""Tenants: who an API key speaks for, and how a tenant's names are kept apart from another's.

Every user id a tenant names is stored as `"<tenant>:<user>"` (tenant names cannot contain `:`),
so two tenants' users can never collide and no code path can reach another tenant's rows by name.
Keys are kept only as digests, so a memory dump of the server does not leak them.
"""

from __future__ import annotations

from rmm.serve.config import AuthConfig, key_digest

__all__ = ["ApiKeys", "reranker_key", "scoped", "unscoped"]


def scoped(tenant: str, user: str) -> str:
    """The store's user id for a tenant's user (tenant names never contain ':')."""
    return f"{tenant}:{user}"


def unscoped(user_id: str) -> str:
    """The user id as its tenant named it."""
    return user_id.split(":", 1)[1]


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
