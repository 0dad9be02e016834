"""Reaching a PostgreSQL bank: URL parsing, schema migrations on start, the connection pool.

A bank is one PostgreSQL *schema* (default ``rmm``; ``?schema=NAME`` in the URL picks another),
so one database can hold several banks — e.g. one per benchmark and encoder — each with its own
embedding dimension. Every connection gets ``search_path = <bank schema>, <server default>``, so
the bank's tables resolve first and pgvector's ``vector`` type (installed once per database in
``public``) still resolves.

Migrations are SQL files in ``rmm/memory/migrations/postgresql`` applied with yoyo-migrations:
plain versioned SQL, one transaction per migration, a record of what ran in the bank's schema, and
no ORM to carry (alembic would bring SQLAlchemy for a schema we write by hand anyway). Processes
that start together take a PostgreSQL advisory lock around schema creation and migration, so each
migration runs exactly once. A schema migrated by a newer rmm is refused rather than written to.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from rmm.errors import RmmError

if TYPE_CHECKING:
    import psycopg
    from psycopg_pool import ConnectionPool

__all__ = [
    "DEFAULT_SCHEMA",
    "DatabasePoolExhaustedError",
    "DatabaseSetupError",
    "DatabaseUnavailableError",
    "PostgresLocation",
    "RECONNECT_MAX_DELAY_S",
    "database_errors",
    "migrate",
    "open_pool",
    "parse_location",
    "pool_exhausted",
    "schema_name",
    "with_schema",
]

log = logging.getLogger(__name__)

DEFAULT_SCHEMA = "rmm"
MIGRATIONS = Path(__file__).resolve().parent / "migrations" / "postgresql"
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_SETUP_LOCK_KEY = 0x726D6D5F7365  # "rmm_se": serialises schema set-up across processes, database-wide
_CONNECT_TIMEOUT_S = 10
# The learner lease's keepalives (rmm/serve/learner_lease.py): a dead peer is noticed in ~11 s.
_POOL_KEEPALIVE = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3}
# psycopg_pool retries a lost connection after 1, 2, 4, 8 … s (doubling until `reconnect_timeout`,
# 300 s): after a 150 s outage `rmm serve` answered 503 for 110 s more (rmm/bench/pg_outage.py), until
# its next try. Capped, a returning server is reached within this many seconds (0.3 s measured).
RECONNECT_MAX_DELAY_S = 2.0
_MIGRATION_TABLE = "_yoyo_migration"
_INSTALL_HINT = "install the PostgreSQL extras: pip install 'rmm[postgres]'"


class DatabaseUnavailableError(RmmError, ConnectionError):
    """The PostgreSQL server cannot be reached (down, wrong host, refused login); nothing was written."""


class DatabasePoolExhaustedError(DatabaseUnavailableError):
    """Every connection of this process's pool stayed lent out for the pool timeout: the server is
    there, this process asked for more connections at once than `pool_max` allows."""


class DatabaseSetupError(RmmError):
    """The database is reachable but cannot hold a bank (no pgvector, no rights, a newer schema)."""


@dataclass(frozen=True)
class PostgresLocation:
    """A parsed ``postgresql://`` URL: what psycopg connects with, the bank schema, a safe display."""

    conninfo: str  # the URL without rmm's own `schema` parameter
    schema: str
    display: str  # the URL with its password masked, for messages and logs
    params: dict[str, str]


def parse_location(url: str) -> PostgresLocation:
    """Split rmm's ``schema`` parameter off a PostgreSQL URL and validate the rest with libpq's rules."""
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError as exc:
        raise RmmError(f"a postgresql:// store needs psycopg: {_INSTALL_HINT}") from exc
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schemas = [value for key, value in query if key == "schema"]
    schema = schemas[-1] if schemas else DEFAULT_SCHEMA
    if not _SCHEMA_NAME.match(schema):
        raise RmmError(f"bank schema {schema!r} in the store URL must be lower-case letters, digits and _ "
                       "(at most 63, not starting with a digit)")
    rest = [(key, value) for key, value in query if key != "schema"]
    conninfo = urlunsplit(parts._replace(query=urlencode(rest, quote_via=quote)))
    try:
        params = {k: str(v) for k, v in conninfo_to_dict(conninfo).items()}
    except Exception as exc:  # psycopg.ProgrammingError: libpq's own reason
        raise RmmError(f"bad PostgreSQL URL {_mask(parts)}: {exc}") from exc
    return PostgresLocation(conninfo, schema, _display(params, schema), params)


def with_schema(url: str, schema: str) -> str:
    """`url` pointing at bank schema `schema` (e.g. one bank per benchmark in a shared database)."""
    parts = urlsplit(url)
    query = [(key, value) for key, value in parse_qsl(parts.query, keep_blank_values=True) if key != "schema"]
    return urlunsplit(parts._replace(query=urlencode([*query, ("schema", schema)], quote_via=quote)))


def schema_name(key: str) -> str:
    """A valid bank schema name for any key (e.g. a cached benchmark bank's folder name)."""
    import hashlib

    name = re.sub(r"[^a-z0-9_]+", "_", key.lower()).strip("_") or "bank"
    if name[0].isdigit():
        name = f"b_{name}"
    if len(name) > 63:
        name = f"{name[:50]}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return name


def _mask(parts: Any) -> str:
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc, query=""))


def _display(params: dict[str, str], schema: str) -> str:
    user = params.get("user", "")
    host = params.get("host", params.get("hostaddr", "localhost"))
    port = f":{params['port']}" if params.get("port") else ""
    return f"postgresql://{user + '@' if user else ''}{host}{port}/{params.get('dbname', '')}?schema={schema}"


@contextmanager
def database_errors(where: str) -> Iterator[None]:
    """Map a lost or refused connection to `DatabaseUnavailableError` naming the server."""
    import psycopg
    from psycopg_pool import PoolTimeout

    try:
        yield
    except PoolTimeout as exc:  # a full pool is told apart by its owner (`pool_exhausted`) before this
        raise DatabaseUnavailableError(f"PostgreSQL at {where} is unreachable (no new connection could be made "
                                       f"within the pool timeout): {_one_line(exc)}") from exc
    except psycopg.OperationalError as exc:
        if not _lost_connection(exc):
            raise  # a deadlock, a cancelled query: the server is there and said why
        raise DatabaseUnavailableError(f"PostgreSQL at {where} is unreachable: {_one_line(exc)}") from exc


def pool_exhausted(where: str, pool_max: int, exc: BaseException) -> DatabasePoolExhaustedError:
    """The error for a pool timeout while the pool was at its full `pool_max` size (not a lost server)."""
    return DatabasePoolExhaustedError(
        f"no free PostgreSQL connection for {where}: all {pool_max} connections in use (slow queries or an "
        f"unresponsive server) for the pool timeout ({_one_line(exc)}); raise database.pool_max if it is load")


def _lost_connection(exc: BaseException) -> bool:
    """No SQLSTATE (libpq failed to connect / lost the socket), a connection exception (class 08),
    a server shutting down or starting (57P01-57P03), or no free connection slot (53300)."""
    state = getattr(exc, "sqlstate", None)
    return state is None or state.startswith("08") or state in {"57P01", "57P02", "57P03", "53300"}


def _one_line(exc: BaseException) -> str:
    """The driver's message on one line (libpq spreads a refused connection over several)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text or type(exc).__name__


def _connect(location: PostgresLocation, **kwargs: Any) -> psycopg.Connection[Any]:
    import psycopg

    options = {"connect_timeout": _CONNECT_TIMEOUT_S} if "connect_timeout" not in location.params else {}
    with database_errors(location.display):
        return psycopg.connect(location.conninfo, autocommit=True, **options, **kwargs)


def _search_path_option(location: PostgresLocation, default_path: str) -> str:
    """libpq `options` that put the bank schema first; keeps the user's own options."""
    path = ",".join([location.schema, *(p.strip() for p in default_path.split(",") if p.strip())])
    ours = "-c search_path=" + path.replace("\\", "\\\\").replace(" ", "\\ ")
    own = location.params.get("options", "")
    return f"{own} {ours}".strip()


def migrate(location: PostgresLocation) -> str:
    """Create the bank schema and apply pending migrations; return the libpq `options` for its connections."""
    import psycopg
    from psycopg import sql

    with _connect(location) as conn:
        default_path = str(conn.execute("SHOW search_path").fetchone()[0])  # type: ignore[index]
        options = _search_path_option(location, default_path)
        with database_errors(location.display):
            if _up_to_date(conn, location):
                return options  # the common start: nothing to apply, no lock, no migration tool
            conn.execute("SELECT pg_advisory_lock(%s)", (_SETUP_LOCK_KEY,))
            try:
                try:
                    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(location.schema)))
                except psycopg.errors.InsufficientPrivilege as exc:
                    raise DatabaseSetupError(
                        f"role {location.params.get('user') or '(default)'} may not create schema {location.schema!r} "
                        f"in {location.display}: {_one_line(exc)}. Ask an administrator to run "
                        f"`CREATE SCHEMA {location.schema} AUTHORIZATION <your role>;`, or pick an existing schema "
                        "with ?schema=NAME"
                    ) from exc
                _apply_migrations(location, options)
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (_SETUP_LOCK_KEY,))
    return options


def _migrations() -> Any:
    try:
        from yoyo import read_migrations
    except ImportError as exc:
        raise RmmError(f"a postgresql:// store needs yoyo-migrations: {_INSTALL_HINT}") from exc
    return read_migrations(str(MIGRATIONS))


@functools.cache
def _known_hashes() -> frozenset[str]:
    return frozenset(m.hash for m in _migrations())


def _up_to_date(conn: psycopg.Connection[Any], location: PostgresLocation) -> bool:
    """Whether yoyo's record in the bank schema lists exactly this rmm's migrations (one query)."""
    import psycopg
    from psycopg import sql

    table = sql.Identifier(location.schema, _MIGRATION_TABLE)
    try:
        applied = {r[0] for r in conn.execute(sql.SQL("SELECT migration_hash FROM {}").format(table))}
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn, psycopg.errors.InvalidSchemaName):
        return False
    return applied == _known_hashes()


def _apply_migrations(location: PostgresLocation, options: str) -> None:
    import psycopg

    try:
        from yoyo.backends import get_backend_class
        from yoyo.connections import DatabaseURI
    except ImportError as exc:
        raise RmmError(f"a postgresql:// store needs yoyo-migrations: {_INSTALL_HINT}") from exc
    args = {k: v for k, v in location.params.items() if k != "dbname"}
    args["options"] = options
    args.setdefault("connect_timeout", str(_CONNECT_TIMEOUT_S))
    uri = DatabaseURI("postgresql+psycopg", None, None, None, None, location.params.get("dbname"), args)
    migrations = _migrations()
    with database_errors(location.display):
        backend = get_backend_class("postgresql+psycopg")(uri, _MIGRATION_TABLE)
        try:
            backend.init_database()
            known = {m.hash for m in migrations}
            unknown = [h for h in backend.get_applied_migration_hashes() if h not in known]
            if unknown:
                raise DatabaseSetupError(
                    f"bank schema {location.schema!r} in {location.display} was migrated by a newer rmm "
                    f"({len(unknown)} migration(s) this version does not know); upgrade rmm to open it"
                )
            with backend.lock():
                pending = backend.to_apply(migrations)
                if pending:
                    log.info("applying %d migration(s) to %s: %s", len(pending), location.display,
                             ", ".join(m.id for m in pending))
                backend.apply_migrations(pending)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise DatabaseSetupError(_privilege_message(location, exc)) from exc
        except (psycopg.errors.UndefinedFile, psycopg.errors.FeatureNotSupported) as exc:
            raise DatabaseSetupError(
                f"the PostgreSQL server at {location.display} has no pgvector extension to install "
                f"({_one_line(exc)}); install pgvector on the server (e.g. the postgresql-NN-pgvector package, "
                "or the pgvector/pgvector Docker image), then run `CREATE EXTENSION vector;` in the database"
            ) from exc
        finally:
            backend.connection.close()


def _privilege_message(location: PostgresLocation, exc: BaseException) -> str:
    reason = _one_line(exc)
    database = location.params.get("dbname") or "<database>"
    if "extension" in reason:
        return (f"role {location.params.get('user') or '(default)'} may not create the pgvector extension in "
                f"{location.display} ({reason}); ask a superuser to run `CREATE EXTENSION IF NOT EXISTS vector;` "
                f"in database {database} once, then start again")
    return (f"role {location.params.get('user') or '(default)'} lacks a privilege to set up bank schema "
            f"{location.schema!r} in {location.display}: {reason}")


@functools.cache
def _capped_pool_class() -> type[ConnectionPool]:
    """`ConnectionPool` whose reconnection back-off stops growing at `reconnect_max_delay_s`.

    psycopg_pool has no setting for it: each lost connection is re-made by an `AddConnection`
    task that the pool re-schedules (`schedule_task`) after its attempt's delay, doubled on every
    failure. Capping that delay (and the attempt's own, so it doubles from the cap) keeps the
    tries every few seconds however long the server was away; `reconnect_timeout` still ends them.
    """
    import random

    from psycopg_pool import ConnectionPool

    class CappedBackoffPool(ConnectionPool):  # type: ignore[type-arg]
        def __init__(self, *args: Any, reconnect_max_delay_s: float, **kwargs: Any) -> None:
            self.reconnect_max_delay_s = reconnect_max_delay_s
            super().__init__(*args, **kwargs)

        def schedule_task(self, task: Any, delay: float) -> None:
            attempt = getattr(task, "attempt", None)  # only AddConnection carries a back-off
            if attempt is not None and delay > self.reconnect_max_delay_s:
                # jittered, so the pools of several replicas do not knock in step
                delay = attempt.delay = self.reconnect_max_delay_s * random.uniform(0.8, 1.0)
            super().schedule_task(task, delay)

    return CappedBackoffPool


def open_pool(location: PostgresLocation, options: str, *, min_size: int, max_size: int,
              timeout_s: float, reconnect_max_delay_s: float = RECONNECT_MAX_DELAY_S) -> ConnectionPool:
    """A psycopg pool whose connections know pgvector's types and are checked before each use, and
    that retries a lost server at least every `reconnect_max_delay_s` (see `RECONNECT_MAX_DELAY_S`)."""
    try:
        from pgvector.psycopg import register_vector
        from psycopg_pool import ConnectionPool
    except ImportError as exc:
        raise RmmError(f"a postgresql:// store needs psycopg_pool and pgvector: {_INSTALL_HINT}") from exc

    def configure(conn: psycopg.Connection[Any]) -> None:
        register_vector(conn)

    # TCP keepalives (as the learner lease's connection has): a pooled connection whose server or
    # network died fails within seconds instead of hanging a request until the OS gives up.
    # A URL's own keepalive settings win.
    kwargs: dict[str, Any] = {"autocommit": True, "options": options,
                              **{k: v for k, v in _POOL_KEEPALIVE.items() if k not in location.params}}
    if "connect_timeout" not in location.params:
        kwargs["connect_timeout"] = _CONNECT_TIMEOUT_S
    pool = _capped_pool_class()(location.conninfo, min_size=min_size, max_size=max_size, kwargs=kwargs,
                                configure=configure, check=ConnectionPool.check_connection, timeout=timeout_s,
                                name=f"rmm:{location.schema}", open=False,
                                reconnect_max_delay_s=reconnect_max_delay_s)
    with database_errors(location.display):
        pool.open(wait=True, timeout=timeout_s)
    return pool
