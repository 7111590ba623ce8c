"""The real services every test directory talks to (override with the environment)."""

from __future__ import annotations

import os

REDIS_URL = os.environ.get("KVBATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_URL = os.environ.get(
    "KVBATCH_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
# Full-size reliability runs (10,000 jobs, soak, more kills and inputs).
SOAK = os.environ.get("KVBATCH_SOAK") == "1"
