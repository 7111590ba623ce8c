"""Settings of ``kvbatch serve``: flags, else ``KVBATCH_API_*`` variables, else defaults."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobs.settings import ENV_PREFIX

API_ENV_PREFIX = f"{ENV_PREFIX}API_"
DEFAULT_FILES_DIR = Path.home() / ".cache" / "kvbatch" / "files"


class ApiSettings(BaseSettings):
    """The HTTP API's own settings (the queue and the database are ``ConnectionSettings``)."""

    model_config = SettingsConfigDict(env_prefix=API_ENV_PREFIX, frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    files_dir: Path = Field(DEFAULT_FILES_DIR, description="where uploaded files are stored "
                                                           "(shared by every API replica)")
    max_upload_bytes: int = Field(512 * 2**20, gt=0, description="largest upload (413 past "
                                                                 "it)")
    max_requests_per_batch: int = Field(1_000_000, gt=0, description="most lines in a batch's "
                                                                     "input file")
    poll_interval_s: float = Field(1.0, gt=0, description="how often batches in progress are "
                                                          "looked at")
    max_files_per_key: int = Field(1000, gt=0, description="files a key may hold (its uploads "
                                                          "and its batches' output files)")
    max_stored_bytes_per_key: int = Field(10 * 2**30, gt=0, description="bytes of the files a "
                                                                        "key may hold")
    max_active_batches_per_key: int = Field(100, gt=0, description="a key's batches not ended "
                                                                   "(validating, in progress, "
                                                                   "finalizing)")
    max_queued_rows_per_key: int = Field(2_000_000, gt=0, description="requests of a key's "
                                                                      "batches queued or "
                                                                      "running")
    file_retention_s: int = Field(30 * 86400, gt=0, description="how long a file is kept when "
                                                               "its upload gives no "
                                                               "expires_after (and every "
                                                               "output file)")
    max_attempts: int = Field(5, ge=1, description="tries at validating a batch, and at "
                                                   "writing its files, before it ends without "
                                                   "(failed, or without its files)")
    body_read_timeout_s: float = Field(30.0, gt=0, description="longest wait for the next "
                                                               "chunk of a request's body "
                                                               "(408 past it)")
    lease_s: float = Field(30.0, gt=0, description="how long a batch being validated or "
                                                   "finalized stays with the process doing it "
                                                   "if that process dies")
