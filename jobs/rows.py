"""Dataset rows: the two input shapes a batch accepts, and the output line of each.

* Plain: ``{"custom_id": …, "prompt": … | "messages": […], <sampling fields>, "priority": …,
  "metadata": {…}}``; every key but the prompt is optional (``custom_id`` defaults to the
  row's index).
* OpenAI Batch API: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
  "/v1/completions", "body": {…}}``. The body's ``model`` is not used: a batch runs on one
  served model, chosen by the caller.

Output lines are keyed by ``custom_id`` and take the shape of the input: the OpenAI batch
output shape (``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``) for OpenAI rows, a flat object for plain rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from engine.sampling_params import SamplingParams
from jobs.schemas import Choice, JobInfo, JobStatus

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
# OpenAI body fields with the same meaning here; "logprobs"/"top_logprobs" are mapped below.
OPENAI_SAMPLING = frozenset({"temperature", "top_p", "n", "seed", "stop", "presence_penalty",
                             "frequency_penalty", "max_tokens"})
# Accepted and not used: they change nothing in what is generated.
OPENAI_IGNORED = frozenset({"model", "user", "store", "stream"})


class RowKind(StrEnum):
    PLAIN = "plain"
    CHAT = CHAT_URL
    COMPLETION = COMPLETIONS_URL


@dataclass(frozen=True)
class Row:
    """One validated input row, before it becomes a job."""

    custom_id: str
    kind: RowKind
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def parse_row(obj: Any, index: int) -> Row:
    """Read one input row (plain or OpenAI Batch API); ``ValueError`` names what is wrong.

    Args:
        obj: the decoded JSON object.
        index: the row's position, the ``custom_id`` of a plain row that has none.
    """
    if not isinstance(obj, Mapping):
        raise ValueError("a row must be a JSON object")
    if "body" in obj or "url" in obj:
        return _openai_row(obj)
    return _plain_row(obj, index)


def _plain_row(obj: Mapping[str, Any], index: int) -> Row:
    known = {"custom_id", "prompt", "messages", "priority", "metadata"} | SAMPLING_FIELDS
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}")
    return Row(
        custom_id=str(obj.get("custom_id", index)),
        kind=RowKind.PLAIN,
        prompt=obj.get("prompt"),
        messages=obj.get("messages"),
        sampling={k: v for k, v in obj.items() if k in SAMPLING_FIELDS},
        priority=obj.get("priority"),
        metadata=_object(obj.get("metadata"), "metadata"),
    )


def _object(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{name!r} must be a JSON object, not {type(value).__name__}")
    return dict(value)


def _openai_row(obj: Mapping[str, Any]) -> Row:
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}")
    if not obj.get("custom_id"):
        raise ValueError("an OpenAI batch row needs a 'custom_id'")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"method {obj.get('method')!r} is not supported (POST only)")
    try:
        kind = RowKind(str(obj.get("url")))
    except ValueError:
        raise ValueError(f"url {obj.get('url')!r} is not supported "
                         f"({CHAT_URL} or {COMPLETIONS_URL})") from None
    if kind is RowKind.PLAIN:
        raise ValueError("an OpenAI batch row needs a 'url'")
    body = obj.get("body")
    if not isinstance(body, Mapping):
        raise ValueError("'body' must be an object")
    prompt_key = "messages" if kind is RowKind.CHAT else "prompt"
    known = OPENAI_SAMPLING | OPENAI_IGNORED | {prompt_key, "max_completion_tokens",
                                                "logprobs", "top_logprobs", "metadata"}
    unsupported = sorted(set(body) - known)
    if unsupported:
        raise ValueError(f"body field(s) {', '.join(map(repr, unsupported))} not supported")
    sampling = {k: v for k, v in body.items() if k in OPENAI_SAMPLING}
    if "max_completion_tokens" in body:
        sampling["max_tokens"] = body["max_completion_tokens"]
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    logprobs = body.get("logprobs")
    if kind is RowKind.CHAT and logprobs:
        sampling["logprobs"] = body.get("top_logprobs") or 0
    elif kind is RowKind.COMPLETION and logprobs is not None:
        sampling["logprobs"] = logprobs
    messages = None
    if kind is RowKind.CHAT:
        messages = [_openai_message(m) for m in body.get("messages") or []]
    return Row(custom_id=str(obj["custom_id"]), kind=kind, prompt=body.get("prompt"),
               messages=messages, sampling=sampling, metadata=dict(body.get("metadata") or {}))


def _openai_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError("each message must be an object")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if any(not isinstance(p, Mapping) or p.get("type") != "text" for p in content):
            raise ValueError("only text content parts are supported")
        content = "".join(p.get("text", "") for p in content)
    return {"role": message.get("role"), "content": content}


def output_line(kind: RowKind, info: JobInfo) -> dict[str, Any]:
    """The output line of a finished job in the shape of its input row."""
    if kind is RowKind.PLAIN:
        return _plain_output(info)
    if info.status is not JobStatus.SUCCEEDED:
        return {"id": f"batch_req_{info.id}", "custom_id": info.custom_id, "response": None,
                "error": {"code": f"job_{info.status.value}", "message": info.error or ""}}
    return {"id": f"batch_req_{info.id}", "custom_id": info.custom_id,
            "response": {"status_code": 200, "request_id": info.id,
                         "body": _openai_body(kind, info)},
            "error": None}


def _plain_output(info: JobInfo) -> dict[str, Any]:
    result, stats = info.result, info.stats
    line: dict[str, Any] = {
        "custom_id": info.custom_id, "job_id": info.id, "status": info.status.value,
        "text": result.text if result else None,
        "finish_reason": result.finish_reason if result else None,
        "usage": result.usage.model_dump() if result else None,
        "error": info.error if info.status is not JobStatus.SUCCEEDED else None,
    }
    if result and result.choices:
        line["choices"] = [c.text for c in result.choices]
    if stats is not None:
        line["e2e_s"] = stats.e2e_s
    return line


def _openai_body(kind: RowKind, info: JobInfo) -> dict[str, Any]:
    assert info.result is not None  # a succeeded job has a result
    result = info.result
    samples: list[Choice | None] = list(result.choices) or [None]
    choices = []
    for i, c in enumerate(samples):
        text = c.text if c else result.text
        reason = _openai_finish_reason(c.finish_reason if c else result.finish_reason)
        if kind is RowKind.CHAT:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "finish_reason": reason, "logprobs": None})
        else:
            choices.append({"index": i, "text": text, "finish_reason": reason,
                            "logprobs": None})
    usage = result.usage
    return {
        "id": ("chatcmpl-" if kind is RowKind.CHAT else "cmpl-") + info.id,
        "object": "chat.completion" if kind is RowKind.CHAT else "text_completion",
        "created": int(info.finished_at.timestamp()) if info.finished_at else 0,
        "model": info.model,
        "choices": choices,
        "usage": {"prompt_tokens": usage.prompt_tokens,
                  "completion_tokens": usage.completion_tokens,
                  "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}},
    }


def _openai_finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason
