"""Dataset rows: the two input shapes a batch accepts, and the output line of each.

* Plain: ``{"custom_id": …, "prompt": … | "raw_prompt": … | "messages": […], <sampling
  fields>, "priority": …, "metadata": {…}}``; every key but the prompt is optional
  (``custom_id`` defaults to the row's index). A ``prompt`` is the user's request (one user
  message on a chat model), a ``raw_prompt`` goes to the model as it is.
* OpenAI Batch API: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
  "/v1/completions" | "/v1/embeddings", "body": {…}}``. The body's ``model`` is not used: a
  batch runs on one served model, chosen by the caller. A completions ``prompt`` is raw text,
  as OpenAI's is. Besides OpenAI's sampling fields, a body may set any ``SamplingParams`` field
  by name (as vLLM's server accepts ``top_k``, ``min_p``, …). An embeddings body is OpenAI's
  ``{"model", "input", "encoding_format", "dimensions"}``, ``input`` a string or a list of
  strings: one job (``JobSpec.embed``) whose output holds a vector per string.

Output lines are keyed by ``custom_id`` and take the shape of the input: the OpenAI batch
output shape for OpenAI rows (``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``: a request kvbatch refused or could not run has status 400
and an error body; an expired or cancelled one ``response: null`` and ``error: {code,
message}``), a flat object for plain rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from jobs.echo import quote, quote_all
from jobs.schemas import Choice, JobInfo, JobStatus, TokenLogprob

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
PLAIN_FIELDS = frozenset({"custom_id", "prompt", "raw_prompt", "messages", "priority",
                          "metadata"}) | SAMPLING_FIELDS
# OpenAI body fields mapped below rather than taken by name.
OPENAI_MAPPED = frozenset({"max_completion_tokens", "logprobs", "top_logprobs"})
# Accepted and not used: they change nothing in what is generated.
OPENAI_IGNORED = frozenset({"model", "user", "store", "stream"})
EMBEDDINGS_FIELDS = frozenset({"model", "user", "input", "encoding_format", "dimensions"})
ROW_ERROR = "invalid_request_error"
# How the engine words a step that failed under a request (engine.LLMEngine._fail).
ENGINE_FAULT = "failed in the engine step"


class RowKind(StrEnum):
    PLAIN = "plain"
    CHAT = CHAT_URL
    COMPLETION = COMPLETIONS_URL
    EMBEDDINGS = EMBEDDINGS_URL


@dataclass(slots=True)  # not frozen: its __init__ took 3x as long, and a submit makes two a row
class Row:
    """One validated input row, before it becomes a job (not changed once made: use
    ``dataclasses.replace``)."""

    custom_id: str
    kind: RowKind
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    raw_prompt: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    embed: dict[str, Any] | None = None  # an embedding row's ``EmbeddingInput`` fields
    priority: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the row cannot run (it is reported, not submitted)


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
    if not PLAIN_FIELDS.issuperset(obj):
        unknown = sorted(set(obj) - PLAIN_FIELDS)
        raise ValueError(f"unknown field(s) {quote_all(unknown)}")
    return Row(
        custom_id=str(obj.get("custom_id", index)),
        kind=RowKind.PLAIN,
        prompt=obj.get("prompt"),
        raw_prompt=obj.get("raw_prompt"),
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
        raise ValueError(f"unknown field(s) {quote_all(unknown)}")
    if not obj.get("custom_id"):
        raise ValueError("an OpenAI batch row needs a 'custom_id'")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"method {quote(obj.get('method'))} is not supported (POST only)")
    try:
        kind = RowKind(str(obj.get("url")))
    except ValueError:
        raise ValueError(f"url {quote(obj.get('url'))} is not supported "
                         f"({CHAT_URL}, {COMPLETIONS_URL} or {EMBEDDINGS_URL})") from None
    if kind is RowKind.PLAIN:
        raise ValueError("an OpenAI batch row needs a 'url'")
    body = obj.get("body")
    if not isinstance(body, Mapping):
        raise ValueError("'body' must be an object")
    if kind is RowKind.EMBEDDINGS:
        return Row(custom_id=str(obj["custom_id"]), kind=kind, embed=_embed_fields(body))
    prompt_key = "messages" if kind is RowKind.CHAT else "prompt"
    known = SAMPLING_FIELDS | OPENAI_MAPPED | OPENAI_IGNORED | {prompt_key, "metadata"}
    unsupported = sorted(set(body) - known)
    if unsupported:
        raise ValueError(f"body field(s) {quote_all(unsupported)} not supported")
    sampling = {k: v for k, v in body.items() if k in SAMPLING_FIELDS and k != "logprobs"}
    if "max_completion_tokens" in body:
        sampling["max_tokens"] = body["max_completion_tokens"]
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    logprobs = body.get("logprobs")
    if kind is RowKind.CHAT and logprobs:
        sampling["logprobs"] = body.get("top_logprobs") or 0
    elif kind is RowKind.COMPLETION and logprobs is not None:
        sampling["logprobs"] = logprobs
    metadata = _object(body.get("metadata"), "metadata")
    if kind is RowKind.CHAT:
        messages = body.get("messages") or []
        if not isinstance(messages, list):
            raise ValueError(f"'messages' must be a list, not {type(messages).__name__}")
        return Row(custom_id=str(obj["custom_id"]), kind=kind,
                   messages=[_openai_message(m) for m in messages], sampling=sampling,
                   metadata=metadata)
    return Row(custom_id=str(obj["custom_id"]), kind=kind, raw_prompt=body.get("prompt"),
               sampling=sampling, metadata=metadata)


def _embed_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """``EmbeddingInput``'s fields from OpenAI's embeddings request body."""
    unsupported = sorted(set(body) - EMBEDDINGS_FIELDS)
    if unsupported:
        raise ValueError(f"body field(s) {quote_all(unsupported)} not supported")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ValueError("'input' must be a string or a list of strings")
    fields: dict[str, Any] = {"input": texts}
    if body.get("dimensions") is not None:
        fields["pooling"] = {"dimensions": body["dimensions"]}
    if body.get("encoding_format") is not None:
        fields["encoding_format"] = body["encoding_format"]
    return fields


def rejected_row(obj: Any, index: int, error: str) -> Row:
    """The row of a line that cannot run, kept to be reported under its ``custom_id``.

    Raises:
        ValueError: the line has no ``custom_id`` to report it under (an OpenAI row, or a
            line that is not an object).
    """
    if not isinstance(obj, Mapping):
        raise ValueError(error)
    is_openai = "body" in obj or "url" in obj
    if is_openai and not obj.get("custom_id"):
        raise ValueError(error)
    kind = RowKind.PLAIN
    if is_openai:
        url = obj.get("url")
        kind = RowKind(url) if url in (COMPLETIONS_URL, EMBEDDINGS_URL) else RowKind.CHAT
    custom_id = obj.get("custom_id", index)
    if not isinstance(custom_id, str | int) or isinstance(custom_id, bool):
        raise ValueError(error)
    return Row(custom_id=str(custom_id), kind=kind, error=error)


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
    if info.status is JobStatus.SUCCEEDED:
        body = _embeddings_body(info) if kind is RowKind.EMBEDDINGS else _openai_body(kind, info)
        return {"id": f"batch_req_{info.id}", "custom_id": info.custom_id,
                "response": {"status_code": 200, "request_id": info.id, "body": body},
                "error": None}
    if info.status is JobStatus.FAILED:  # the request could not run
        return _openai_request_error(info.custom_id, info.error or "failed", info.id)
    code = "batch_expired" if info.status is JobStatus.EXPIRED else "batch_cancelled"
    return {"id": f"batch_req_{info.id}", "custom_id": info.custom_id, "response": None,
            "error": {"code": code, "message": info.error or info.status.value}}


def rejected_line(row: Row) -> dict[str, Any]:
    """The output line of a row refused before it became a job (``row.error``)."""
    assert row.error is not None
    if row.kind is RowKind.PLAIN:
        return {"custom_id": row.custom_id, "job_id": None, "status": JobStatus.FAILED.value,
                "text": None, "finish_reason": None, "usage": None, "error": row.error}
    return _openai_request_error(row.custom_id, row.error, None)


def _openai_request_error(custom_id: str | None, message: str,
                          job_id: str | None) -> dict[str, Any]:
    """A request error (400); a fault of the engine that ran it is a server error (500)."""
    server = message.startswith(ENGINE_FAULT)
    return {"id": f"batch_req_{job_id or custom_id}", "custom_id": custom_id,
            "response": {"status_code": 500 if server else 400, "request_id": job_id,
                         "body": {"error": {"message": message,
                                            "type": "server_error" if server else ROW_ERROR,
                                            "param": None, "code": None}}},
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
    if result and result.logprobs is not None:
        line["logprobs"] = [lp.model_dump() for lp in result.logprobs]
        if result.choices:
            line["choices_logprobs"] = [[lp.model_dump() for lp in c.logprobs or []]
                                        for c in result.choices]
    if result and result.embeddings is not None:
        line["embeddings"] = result.embeddings
    if stats is not None:
        line["e2e_s"] = stats.e2e_s
    return line


def _embeddings_body(info: JobInfo) -> dict[str, Any]:
    """OpenAI's embeddings response: a vector per input, floats or base64 as asked."""
    assert info.result is not None and info.result.embeddings is not None
    tokens = info.result.usage.prompt_tokens
    return {"object": "list", "model": info.model,
            "data": [{"object": "embedding", "index": i, "embedding": v}
                     for i, v in enumerate(info.result.embeddings)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _openai_body(kind: RowKind, info: JobInfo) -> dict[str, Any]:
    assert info.result is not None  # a succeeded job has a result
    result = info.result
    samples: list[Choice | None] = list(result.choices) or [None]
    choices = []
    for i, c in enumerate(samples):
        text = c.text if c else result.text
        reason = _openai_finish_reason(c.finish_reason if c else result.finish_reason)
        logprobs = c.logprobs if c else result.logprobs
        if kind is RowKind.CHAT:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "finish_reason": reason, "logprobs": _chat_logprobs(logprobs)})
        else:
            choices.append({"index": i, "text": text, "finish_reason": reason,
                            "logprobs": _completion_logprobs(logprobs)})
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


def _chat_logprobs(steps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if steps is None:
        return None
    return {"content": [
        {"token": s.token, "logprob": s.logprob, "bytes": s.bytes,
         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes}
                          for t in s.top_logprobs]}
        for s in steps], "refusal": None}


def _completion_logprobs(steps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI completions logprobs: parallel lists, ``top_logprobs`` as {token: logprob}
    per step, ``text_offset`` where each token starts in the text."""
    if steps is None:
        return None
    offsets, at = [], 0
    for s in steps:
        offsets.append(at)
        at += len(s.token)
    return {"tokens": [s.token for s in steps],
            "token_logprobs": [s.logprob for s in steps],
            "top_logprobs": [{t.token: t.logprob for t in s.top_logprobs} for s in steps],
            "text_offset": offsets}


def _openai_finish_reason(reason: FinishReason | None) -> FinishReason | None:
    """OpenAI has no ``abort``: a cancelled or expired sample ended early, as at a stop."""
    return FinishReason.STOP if reason == FinishReason.ABORT else reason
