"""A tenant's user ids as the store keeps them (`"<tenant>:<user>"`) and as the tenant names them.

Pure string functions with no import of rmm, so the HTTP schemas (which the torch-free client
shares) can answer in the tenant's own terms; `rmm.serve.tenants` builds the rest of tenancy
(keys, error retelling) on them.
"""

from __future__ import annotations

__all__ = ["scoped", "unscoped", "unscoped_id", "unscoped_text"]


def scoped(tenant: str, user: str) -> str:
    """The store's user id for a tenant's user (tenant names never contain ':')."""
    return f"{tenant}:{user}"


def unscoped(user_id: str) -> str:
    """The user id as its tenant named it."""
    return user_id.split(":", 1)[1]


def unscoped_id(tenant: str, name: str) -> str:
    """An id built from a scoped user id (`alpha:ana:live-…`) as the tenant sees it (`ana:live-…`)."""
    prefix = scoped(tenant, "")
    return name.removeprefix(prefix)


def unscoped_text(tenant: str, text: str) -> str:
    """A message with every scoped name of the tenant's written as the tenant's own."""
    return text.replace(scoped(tenant, ""), "")
