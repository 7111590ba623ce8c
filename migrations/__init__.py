"""Alembic migrations of the kvbatch SQL schema; run them with ``kvbatch db upgrade``."""
