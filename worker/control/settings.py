"""Control-plane settings: flags of ``kvbatch control`` or ``KVBATCH_*`` environment variables.

Names shared with the worker (``redis_url``, ``database_url``, ``key_prefix``,
``max_deliveries``) read the same variables, so one environment file serves both.
"""

from __future__ import annotations

import argparse
import ipaddress

from pydantic import Field, field_validator

from jobs.constants import DEFAULT_MAX_DELIVERIES
from jobs.settings import ConnectionSettings
from worker.settings import add_flag


class ControlSettings(ConnectionSettings):
    """Where the queue and database are (``ConnectionSettings``), how often each task runs, and
    what finalizing a batch does (export, webhook)."""

    broker_url: str | None = Field(None, description="Celery broker (default: --redis-url)")
    max_deliveries: int = Field(DEFAULT_MAX_DELIVERIES, ge=1,
                                description="the workers' limit, for the reaper")
    # Schedules.
    expire_interval_s: float = Field(30.0, gt=0)
    finalize_interval_s: float = Field(10.0, gt=0)
    reap_interval_s: float = Field(60.0, gt=0)
    purge_interval_s: float = Field(3600.0, gt=0)
    task_lock_ttl_s: float = Field(
        60.0, gt=0, description="a task's lock expires this long after its process died "
                               "(renewed while the task runs)")
    page_size: int = Field(1000, ge=1, description="jobs per transaction when expiring and "
                                                   "reaping")
    # Deadlines and batches.
    running_deadline_grace_s: float = Field(
        60.0, ge=0, description="expire a running job this long after its deadline")
    batch_settle_s: float = Field(
        30.0, ge=0, description="finalize a batch once no job was added to it for this long")
    # Finalization.
    export_dir: str | None = Field(None, description="write <batch>.jsonl results files here")
    webhook_url: str | None = Field(None, description="POST batch events here (a batch's "
                                                      "own webhook_url wins)")
    webhook_secret: str | None = Field(None, description="HMAC-SHA256 key signing webhooks "
                                                         "(with a timestamp: t=…,v1=…)")
    webhook_allow_unsigned: bool = Field(
        False, description="send webhooks without a secret (unsigned): off by default")
    webhook_allow_networks: str = Field(
        "", description="comma-separated networks webhooks may reach although not global "
                        "(e.g. 10.0.0.0/8); loopback, private, link-local are refused otherwise")
    webhook_timeout_s: float = Field(10.0, gt=0, description="the whole of one attempt")
    webhook_concurrency: int = Field(
        2, ge=1, description="webhook POSTs at once; the other control threads stay free")
    webhook_max_attempts: int = Field(8, ge=1)
    webhook_backoff_s: float = Field(30.0, gt=0, description="first retry delay; doubles, "
                                                             "capped at one hour")
    # Retention.
    results_retention_days: float | None = Field(
        30.0, gt=0, description="drop result payloads of jobs finished longer ago")
    jobs_retention_days: float | None = Field(
        None, gt=0, description="delete job rows (and their stats) finished longer ago")
    purge_chunk: int = Field(1000, ge=1, description="rows per purge transaction")

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def webhook_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """The parsed ``webhook_allow_networks``."""
        return tuple(ipaddress.ip_network(n.strip(), strict=False)
                     for n in self.webhook_allow_networks.split(",") if n.strip())

    @field_validator("webhook_allow_networks")
    @classmethod
    def _networks(cls, value: str) -> str:
        for n in value.split(","):
            if n.strip():
                ipaddress.ip_network(n.strip(), strict=False)  # ValueError names it
        return value


def add_control_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per settings field; unset flags fall back to environment and defaults."""
    for name, field in ControlSettings.model_fields.items():
        add_flag(parser, name, field)


def control_settings_from_args(args: argparse.Namespace) -> ControlSettings:
    given = {k: v for k, v in vars(args).items() if k in ControlSettings.model_fields}
    return ControlSettings(**given)
