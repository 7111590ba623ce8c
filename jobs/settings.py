"""Where the queue and the database are: the one declaration every process shares.

``KVBATCH_REDIS_URL``, ``KVBATCH_DATABASE_URL`` and ``KVBATCH_KEY_PREFIX`` (or the matching
flags and arguments) configure the SDK, the command line, the workers and the control plane
alike, so one environment file serves them all.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobs.constants import DEFAULT_DATABASE_URL, DEFAULT_KEY_PREFIX, DEFAULT_REDIS_URL

ENV_PREFIX = "KVBATCH_"


class ConnectionSettings(BaseSettings):
    """The Redis queue, the SQL database and the key prefix shared with the workers."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")

    redis_url: str = Field(DEFAULT_REDIS_URL, description="the Redis queue")
    database_url: str = Field(DEFAULT_DATABASE_URL, description="the SQL database")
    key_prefix: str = Field(DEFAULT_KEY_PREFIX, description="Redis key prefix shared by the "
                                                            "producers and workers of a "
                                                            "deployment")


class DeploymentModels(BaseSettings):
    """``KVBATCH_MODELS``: the models the deployment serves, a JSON list of served model names
    (``'["smollm2-135m-instruct"]'``). ``kvbatch serve`` accepts batches for them whether or not
    a worker is up at that moment (workers scale from zero), and a worker refuses to serve a
    model outside them. Unset, the API takes the default model and those of live workers, and
    workers serve any."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True)

    models: list[str] = Field(default_factory=list, description="the models the deployment "
                                                                "serves")


def connection_settings(redis_url: str | None = None, database_url: str | None = None,
                        key_prefix: str | None = None) -> ConnectionSettings:
    """Explicit values, else the ``KVBATCH_*`` environment, else the defaults."""
    given = {"redis_url": redis_url, "database_url": database_url, "key_prefix": key_prefix}
    return ConnectionSettings(**{k: v for k, v in given.items() if v is not None})


_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+", re.IGNORECASE)


def mask_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``: for printing and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def redact_urls(text: str) -> str:
    """``text`` with every URL in it replaced by ``<url>``: for errors stored where readers of
    the database (dashboards) see them."""
    return _URL.sub("<url>", text)
