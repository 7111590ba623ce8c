"""Dataset pipelines: stages of generation over rows, streamed, durable and resumable.

```python
from jobs import Client, Pipeline

p = Pipeline("qa-v1")
q = p.stage("questions", source=topics, prompt=lambda r: f"Questions about {r['topic']}",
            response_format=Questions, temperature=0.8)
a = p.stage("answers", source=q, explode=lambda r: ({"question": x} for x in r["questions"].items),
            prompt=lambda r: r["question"])
p.run(Client(), output="qa.jsonl")
```

A stage's output row is its input row plus a field named after the stage: the parsed record
(a pydantic model's instance, or a dict for a JSON Schema) or the text (a list of them when
``n > 1``). Each stage is a batch whose id derives from the pipeline's name and the stage's
fingerprint (its name, the source of its functions, its format, model and sampling, and its
source stage's fingerprint); each row's job is keyed (``custom_id``) by a hash of the stage's
fingerprint, its parent row's key and the row. Running the same pipeline again therefore
finds what already ran and submits only what is missing; changing a stage re-runs it and the
stages after it. The run itself is :mod:`jobs.pipeline_run`.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import to_jsonable_python

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jobs.pipeline_client import PipelineClient
    from jobs.pipeline_run import PipelineResult

RowDict = dict[str, Any]
Prompt = str | list[dict[str, Any]]  # a user message's text, or chat messages
Format = type[BaseModel] | Mapping[str, Any]  # a pydantic model or a JSON Schema

NAME_PATTERN = r"[A-Za-z0-9_-]{1,40}"
# A stage's name is a field of its rows: never one of the output's lineage columns (``_key``…)
STAGE_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}"
KEY_CHARS = 32  # hex digits of a row key (128 bits)


def canonical(value: Any) -> str:
    """``value`` as JSON with sorted keys: equal rows, equal text (pydantic records as dicts)."""
    return json.dumps(to_jsonable_python(value), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _source(fn: Callable[..., Any] | None) -> str:
    """What a function's fingerprint holds: its source, or (defined where no file has it, as
    in ``exec``) its bytecode and constants, or (a builtin such as ``str``) its name."""
    if fn is None:
        return ""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        if code is None:
            return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
        return code.co_code.hex() + repr(code.co_consts)


@dataclass(frozen=True, eq=False)
class Stage:
    """One stage of a :class:`Pipeline` (made by :meth:`Pipeline.stage`): a job per input
    row, its output parsed into the field ``name`` of the row.

    ``fingerprint`` is a hash of everything that decides the stage's outputs (its source
    stage's fingerprint included); ``batch_id`` derives from it and the pipeline's name."""

    name: str
    source: Stage | None  # None: the rows given to Pipeline.stage
    prompt: Callable[[RowDict], Prompt]
    response_format: Format | None
    explode: Callable[[RowDict], Iterable[RowDict]] | None
    keep: Callable[[RowDict], bool] | None
    parse: Callable[[RowDict, str], Any] | None
    model: str | None
    retries: int
    sampling: Mapping[str, Any]
    fingerprint: str
    batch_id: str

    def wire_format(self) -> dict[str, Any] | None:
        """The jobs' ``response_format`` (OpenAI's json_schema shape)."""
        if self.response_format is None:
            return None
        if isinstance(self.response_format, type):
            name, schema = self.response_format.__name__, self.response_format.model_json_schema()
        else:
            name, schema = "response", dict(self.response_format)
        return {"type": "json_schema",
                "json_schema": {"name": re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64],
                                "schema": schema, "strict": True}}

    def job_sampling(self, attempt: int) -> dict[str, Any]:
        """Sampling fields of the job of try ``attempt`` (0 first): a retry draws with
        another seed."""
        fields = dict(self.sampling)
        if attempt:
            fields["seed"] = (fields.get("seed") or 0) + attempt
        fmt = self.wire_format()
        return fields if fmt is None else {**fields, "response_format": fmt}

    def value(self, row: RowDict, text: str) -> Any:
        """One output's value: ``parse(row, text)``, else the format's record, else the text.
        Raises when it does not parse.

        A record's JSON is read with its strings' raw control characters (a tab, U+0018)
        taken as they are: JSON wants them escaped, but the grammar of a string with a
        ``maxLength`` (xgrammar 0.2.9) lets them through, and the record is still checked
        against the format."""
        if self.parse is not None:
            return self.parse(row, text)
        if isinstance(self.response_format, type):
            try:
                return self.response_format.model_validate_json(text)
            except ValidationError as exc:
                if [e["type"] for e in exc.errors()] != ["json_invalid"]:
                    raise
                try:
                    record = json.loads(text, strict=False)
                except ValueError:
                    raise exc from None
                return self.response_format.model_validate(record)
        if self.response_format is not None:
            from jsonschema import validate

            record = json.loads(text, strict=False)
            validate(record, dict(self.response_format))
            return record
        return text

    def row_key(self, parent_key: str, row: RowDict, occurrence: int) -> str:
        """The key (and first job's ``custom_id``) of an input row: a hash of the stage, the
        parent row's key and the row; ``occurrence`` tells equal rows of one parent apart."""
        return _digest(self.fingerprint, parent_key, canonical(row), str(occurrence))[:KEY_CHARS]


@dataclass
class Pipeline:
    """Stages of generation over rows: each output row flows into the stages fed by its
    stage as soon as it is done (no barrier between stages), and every row's job is durable
    and keyed by its content, so running the pipeline again runs only what is missing.

    Args:
        name: names the stages' batches (letters, digits, ``_``, ``-``).
    """

    name: str
    stages: list[Stage] = field(default_factory=list)
    rows: dict[str, Iterable[RowDict]] = field(default_factory=dict)  # a first stage's rows

    def __post_init__(self) -> None:
        if not re.fullmatch(NAME_PATTERN, self.name):
            raise ValueError(f"pipeline name {self.name!r} must match {NAME_PATTERN}")

    def stage(self, name: str, *, source: Stage | Iterable[RowDict],
              prompt: Callable[[RowDict], Prompt], response_format: Format | None = None,
              explode: Callable[[RowDict], Iterable[RowDict]] | None = None,
              keep: Callable[[RowDict], bool] | None = None,
              parse: Callable[[RowDict, str], Any] | None = None, model: str | None = None,
              retries: int = 2, **sampling: Any) -> Stage:
        """Add a stage.

        Args:
            name: the stage, and the field its output takes in each row.
            source: a stage of this pipeline (its output rows, those ``keep`` let through),
                or an iterable of dict rows (read when the pipeline runs).
            prompt: ``prompt(row)``: a user message's text or a list of chat messages.
            response_format: a pydantic model (the field holds its instance) or a JSON Schema
                (the field holds the dict); the output is held to it while it is generated.
            explode: ``explode(row)``: the rows that enter this stage for one source row
                (default: the row itself).
            keep: ``keep(row)`` of each output row: False drops it (counted as filtered).
            parse: ``parse(row, text)`` replaces the default parser; raising means the output
                did not parse.
            model: served model name (default: the client's).
            retries: tries with another seed for an output that does not parse; then the row
                is recorded as failed and the run goes on.
            **sampling: sampling fields of the stage's jobs (``max_tokens``, ``temperature``,
                ``n``, ``seed``, ``stop``, …).

        Raises:
            ValueError: a bad or repeated name, a source stage of another pipeline, or
                ``retries`` below 0.
            pydantic.ValidationError: a sampling field that does not exist or is out of range
                (the message names it), or a format that is not a valid JSON Schema.
        """
        if not re.fullmatch(STAGE_NAME_PATTERN, name) or any(s.name == name
                                                             for s in self.stages):
            raise ValueError(f"stage name {name!r} must match {STAGE_NAME_PATTERN} and be new "
                             "in the pipeline")
        if isinstance(source, Stage) and source not in self.stages:
            raise ValueError(f"stage {name!r}: its source {source.name!r} is not a stage of "
                             f"pipeline {self.name!r}")
        if retries < 0:
            raise ValueError(f"stage {name!r}: retries must be >= 0, got {retries}")
        parent = source if isinstance(source, Stage) else None
        fmt = (response_format.model_json_schema() if isinstance(response_format, type)
               else response_format)
        fingerprint = _digest(name, *map(_source, (prompt, explode, keep, parse)),
                              canonical(fmt), model or "", canonical(sampling),
                              parent.fingerprint if parent else "")
        stage = Stage(name=name, source=parent, prompt=prompt, response_format=response_format,
                      explode=explode, keep=keep, parse=parse, model=model, retries=retries,
                      sampling=dict(sampling), fingerprint=fingerprint,
                      batch_id=f"{self.name}.{name}.{fingerprint[:16]}")
        TypeAdapter(SamplingParams).validate_python(stage.job_sampling(0))  # fail here, once
        self.stages.append(stage)
        if parent is None:
            self.rows[name] = source  # type: ignore[assignment]  # not a Stage: rows
        return stage

    def run(self, client: PipelineClient, output: str | Path | None = None, *,
            errors: str | Path | None = None, progress: bool | None = None,
            timeout_s: float | None = None) -> PipelineResult:
        """Run every stage to its end, submitting only the jobs not already stored.

        Args:
            client: what the jobs go through: the SDK's ``Client`` (Redis and SQL), or a
                ``jobs.RemoteClient`` (the HTTP API with an API key, the rows that key's).
            output: a file of the rows out of the last stages (those no stage reads), each
                with its lineage columns (``_stage``, ``_key``, ``_parent``, ``_lineage``):
                Parquet when the name ends in ``.parquet`` (written when the run ends), else
                JSONL (written as rows are done). :meth:`PipelineResult.dataset` gives the
                same as a ``datasets.Dataset``.
            errors: a file of the rows that failed (stage, key, lineage, error, input row),
                Parquet or JSONL as ``output``.
            progress: per-stage progress bars on stderr (default: when it is a terminal).
            timeout_s: raise ``TimeoutError`` if the stages are not done by then.

        Returns:
            The output rows, the failed rows and a summary per stage.

        Raises:
            TimeoutError: ``timeout_s`` passed.
            ValueError: a Parquet file asked for rows with a field whose values have no one
                type (the stage's jobs are stored: run again with a JSONL output).
        """
        from jobs.pipeline_run import PipelineRun

        return PipelineRun(self, client, progress=progress).run(output, errors, timeout_s)
