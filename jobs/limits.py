"""Per-job limits: what one job may ask of a shared engine, and what it may store.

Checked at submission (``JobClient.submit``, so nothing is stored when a job is over a limit)
and again by the worker before the engine sees the job (a job that bypassed the SDK fails alone,
with the same message, off the engine thread). Each is a ``KVBATCH_*`` setting.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobs.schemas import JobSpec

# A stored logprob entry ({"token", "token_id", "logprob", "bytes"} in JSON) takes about this
# many bytes (measured on English text with SmolLM2's tokenizer: 111 with no top tokens, 95
# with 5).
LOGPROB_ENTRY_BYTES = 112


class JobLimits(BaseSettings):
    """Limits of one job (``KVBATCH_<FIELD>``)."""

    model_config = SettingsConfigDict(env_prefix="KVBATCH_", frozen=True, extra="forbid")

    max_prompt_bytes: int = Field(
        512 * 1024, ge=1, description="prompt or messages (an embedding job's texts), UTF-8 "
                                      "bytes; checked before the prompt is tokenized")
    max_job_tokens: int = Field(
        65536, ge=1, description="n x max_tokens: the most tokens one job may generate")
    max_stop_strings: int = Field(16, ge=0, description="stop strings per job")
    max_stop_string_chars: int = Field(256, ge=1, description="characters per stop string")
    max_result_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="stored result (texts, token ids, logprobs) of "
                                              "one job; estimated at submission, enforced by "
                                              "the worker")

    def check(self, spec: JobSpec) -> None:
        """Raise ``ValueError`` naming the field and the limit when ``spec`` is over one."""
        s = spec.sampling
        text = spec.prompt if spec.prompt is not None else spec.raw_prompt
        parts = (spec.embed.input if spec.embed is not None
                 else [m.content for m in spec.messages or []])
        prompt = text if text is not None else "".join(parts)
        size = len(prompt.encode("utf-8", "surrogatepass"))
        if size > self.max_prompt_bytes:
            raise ValueError(f"prompt is {size} bytes, over the limit of {self.max_prompt_bytes} "
                             "(KVBATCH_MAX_PROMPT_BYTES)")
        if s.n * s.max_tokens > self.max_job_tokens:
            raise ValueError(f"n x max_tokens is {s.n * s.max_tokens}, over the limit of "
                             f"{self.max_job_tokens} (KVBATCH_MAX_JOB_TOKENS)")
        if len(s.stop) > self.max_stop_strings:
            raise ValueError(f"stop has {len(s.stop)} strings, over the limit of "
                             f"{self.max_stop_strings} (KVBATCH_MAX_STOP_STRINGS)")
        longest = max((len(x) for x in s.stop), default=0)
        if longest > self.max_stop_string_chars:
            raise ValueError(f"a stop string has {longest} characters, over the limit of "
                             f"{self.max_stop_string_chars} (KVBATCH_MAX_STOP_STRING_CHARS)")
        estimate = s.n * s.max_tokens * (1 + (s.logprobs or 0)) * LOGPROB_ENTRY_BYTES
        if s.logprobs is not None and estimate > self.max_result_bytes:
            raise ValueError(
                f"n x max_tokens x (logprobs + 1) could store about {estimate} bytes, over the "
                f"result limit of {self.max_result_bytes} (KVBATCH_MAX_RESULT_BYTES): lower n, "
                "max_tokens or logprobs")
