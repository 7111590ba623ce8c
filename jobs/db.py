"""Database connections and schema migrations (Alembic, driven programmatically).

``kvbatch db upgrade`` runs :func:`upgrade`. The migration scripts live in the repository's
top-level ``migrations/`` directory; :func:`migrations_dir` finds them in a source checkout,
an editable install, or as the importable ``migrations`` package of a wheel.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event

DEFAULT_DATABASE_URL = "sqlite:///kvbatch.db"
MIGRATIONS_ENV = "KVBATCH_MIGRATIONS_DIR"


def make_engine(url: str = DEFAULT_DATABASE_URL, **kwargs: object) -> Engine:
    """A SQLAlchemy engine for ``url``; ``postgresql://`` URLs use psycopg 3."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30}, **kwargs)  # type: ignore[arg-type]
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **kwargs)  # type: ignore[arg-type]


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


def _alembic_config(engine: Engine):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Migrate the database up to ``revision`` (creating the schema in an empty database)."""
    from alembic import command

    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    command.upgrade(_alembic_config(engine), revision)


def downgrade(url_or_engine: str | Engine, revision: str = "base") -> None:
    """Migrate the database down to ``revision`` (``base`` drops everything kvbatch created)."""
    from alembic import command

    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    command.downgrade(_alembic_config(engine), revision)


def current_revision(url_or_engine: str | Engine) -> str | None:
    """The revision the database is at, or None for an unmigrated database."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
