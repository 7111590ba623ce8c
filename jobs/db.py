"""Database connections and schema migrations (Alembic, driven programmatically).

``kvbatch db upgrade`` runs :func:`upgrade`. The migration scripts live in the repository's
top-level ``migrations/`` directory; :func:`migrations_dir` finds them in a source checkout,
an editable install, or as the importable ``migrations`` package of a wheel.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, make_url

from jobs.constants import DEFAULT_DATABASE_URL

MIGRATIONS_ENV = "KVBATCH_MIGRATIONS_DIR"


def make_engine(url: str = DEFAULT_DATABASE_URL, *, connect_timeout_s: float | None = None,
                statement_timeout_s: float | None = None, **kwargs: object) -> Engine:
    """A SQLAlchemy engine for ``url``; ``postgresql://`` URLs use psycopg 3.

    Args:
        url: the database URL.
        connect_timeout_s: PostgreSQL only: give up connecting after this long (whole
            seconds, at least 2, as libpq counts them).
        statement_timeout_s: PostgreSQL only: the server cancels statements that run longer.
        kwargs: passed to ``sqlalchemy.create_engine``.

    Error messages never carry bound parameters (``hide_parameters``): they end up in logs and
    in job rows, and parameters hold prompts and results.
    """
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    kwargs.setdefault("hide_parameters", True)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30}, **kwargs)  # type: ignore[arg-type]
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    if connect_timeout_s is not None:
        connect_args = dict(kwargs.pop("connect_args", None) or {})  # type: ignore[call-overload]
        connect_args.setdefault("connect_timeout", max(2, round(connect_timeout_s)))
        kwargs["connect_args"] = connect_args
    engine = create_engine(url, **kwargs)  # type: ignore[arg-type]
    if statement_timeout_s is not None:
        timeout_ms = max(1, int(statement_timeout_s * 1000))

        @event.listens_for(engine, "connect")
        def _statement_timeout(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            # SET, not the startup "options": the URL may carry its own options (search_path).
            autocommit = dbapi_conn.autocommit
            dbapi_conn.autocommit = True
            with dbapi_conn.cursor() as cur:
                cur.execute(f"SET statement_timeout = {timeout_ms}")
            dbapi_conn.autocommit = autocommit

    return engine


def as_engine(url_or_engine: str | Engine) -> Engine:
    """``url_or_engine`` itself, or a new engine for it when it is a URL."""
    return make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine


def _sqlite_pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    if cur.execute("PRAGMA database_list").fetchone()[2]:  # a file, not :memory:
        cur.execute("PRAGMA journal_mode=WAL")
    cur.close()


def migrations_dir() -> Path:
    """Where the Alembic environment (``env.py``, ``versions/``) is."""
    if os.environ.get(MIGRATIONS_ENV):
        return Path(os.environ[MIGRATIONS_ENV])
    checkout = Path(__file__).resolve().parent.parent / "migrations"
    if (checkout / "env.py").is_file():
        return checkout
    spec = importlib.util.find_spec("migrations")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise RuntimeError(f"cannot find the kvbatch migrations; set {MIGRATIONS_ENV}")


def _alembic_config(engine: Engine | None):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Migrate the database up to ``revision`` (creating the schema in an empty database)."""
    from alembic import command

    engine = as_engine(url_or_engine)
    command.upgrade(_alembic_config(engine), revision)


def downgrade(url_or_engine: str | Engine, revision: str = "base") -> None:
    """Migrate the database down to ``revision`` (``base`` drops everything kvbatch created)."""
    from alembic import command

    engine = as_engine(url_or_engine)
    command.downgrade(_alembic_config(engine), revision)


class SchemaNotReady(RuntimeError):
    """The database is missing, unmigrated or at another revision than this code's."""


def head_revision() -> str | None:
    """The newest migration's revision: what this code expects the database to be at."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config(None)).get_current_head()


def check_schema(url_or_engine: str | Engine) -> None:
    """Raise :class:`SchemaNotReady` (its message names the fix) unless the database is at
    :func:`head_revision`. A SQLite file that does not exist is reported without being
    created."""
    engine = as_engine(url_or_engine)
    require_database(engine.url.render_as_string(hide_password=False))
    current, head = current_revision(engine), head_revision()
    if current != head:
        state = "is not migrated" if current is None else f"is at revision {current}"
        raise SchemaNotReady(f"database {engine.url!r} {state}, this kvbatch needs {head}; "
                             f"{_FIX}")


# The password stays out of messages (and so out of shells' history): the command takes the
# URL from KVBATCH_DATABASE_URL as the failing one did.
_FIX = "run: kvbatch db upgrade (with --database-url or KVBATCH_DATABASE_URL naming it)"


def require_database(url: str) -> None:
    """Raise :class:`SchemaNotReady` for a SQLite file that does not exist, without creating
    it (connecting would)."""
    if not database_exists(url):
        raise SchemaNotReady(f"database {make_url(url).database} does not exist; {_FIX}")


def database_exists(url: str) -> bool:
    """False only for a SQLite file that does not exist (checking creates nothing)."""
    path = _sqlite_file(url)
    return path is None or path.exists()


def _sqlite_file(url: str) -> Path | None:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def current_revision(url_or_engine: str | Engine) -> str | None:
    """The revision the database is at, or None for an unmigrated database."""
    from alembic.runtime.migration import MigrationContext

    engine = as_engine(url_or_engine)
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
