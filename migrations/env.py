"""Alembic environment. :mod:`jobs.db` passes the SQLAlchemy engine in ``config.attributes``;
plain ``alembic`` runs may instead set ``sqlalchemy.url`` (or ``KVBATCH_DATABASE_URL``)."""

from __future__ import annotations

import os

from alembic import context

from jobs.db import DEFAULT_DATABASE_URL, make_engine
from jobs.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        url = config.get_main_option("sqlalchemy.url") or os.environ.get(
            "KVBATCH_DATABASE_URL", DEFAULT_DATABASE_URL
        )
        engine = make_engine(url)
    with engine.begin() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; run them online")
run_migrations_online()
