"""Per-request sampling parameters, validated at construction.

The one definition of a job's sampling fields: the engine takes it as is, and the job schema
(``jobs.schemas.JobSpec.sampling``) uses it as a pydantic field type, so a value is checked
where the job is submitted, with the same rules and messages. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal

MAX_LOGPROBS = 20
# Integer fields are 32-bit (token ids, counts); seeds are 63-bit, so that ``seed + i`` of
# sample i of a request still fits the generator's seed.
MAX_INT32 = 2**31 - 1
MAX_N = 2**16
MAX_SEED = 2**63 - 1 - MAX_N
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CHOICES = 1024
# Objects and arrays in a json_schema, nested (a property of an object is two levels down):
# real schemas nest a few dozen; a deeper one only exhausts the stacks that walk it.
MAX_SCHEMA_DEPTH = 64
# Cheap bounds on what a worker's grammar compiler is given, checked at submission: the
# compile time grows with the properties of a schema and the size of its patterns (a
# 17-character nested repeat takes ~0.6 s), so a request of thousands of them is refused
# before it is stored rather than failed by the worker's compile budget.
MAX_SCHEMA_PROPERTIES = 1000  # in all, across every object of a json_schema
MAX_PATTERN_CHARS = 1000  # a regex response format, a schema's pattern or patternProperties key
MAX_GRAMMAR_BYTES = 64 * 1024  # a grammar response format, UTF-8
# Read by pydantic where these dataclasses are field types (the job schema): unknown fields
# are refused and inf/NaN are not JSON. Plain dict: no pydantic import here.
_PYDANTIC_CONFIG: dict[str, Any] = {"extra": "forbid", "allow_inf_nan": False}

ResponseFormatType = Literal["text", "json_object", "json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class JsonSchema:
    """OpenAI's ``response_format.json_schema``: ``schema`` is a JSON Schema (an object).
    The output is held to it whatever ``strict`` says (kvbatch always enforces)."""

    __pydantic_config__: ClassVar[dict[str, Any]] = _PYDANTIC_CONFIG

    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.name):
            raise ValueError("json_schema.name must be 1-64 letters, digits, '_' or '-'")
        if not isinstance(self.schema, Mapping):
            raise ValueError("json_schema.schema must be a JSON Schema object")
        # Checked without recursion before anything recursive (the schema check here, the
        # grammar compiler on the worker) walks it.
        _check_schema_size(self.schema)
        from jsonschema.exceptions import SchemaError
        from jsonschema.validators import validator_for

        try:
            validator_for(self.schema).check_schema(self.schema)
        except SchemaError as exc:
            where = "/".join(map(str, exc.path)) or "(root)"
            raise ValueError(f"json_schema.schema is not a valid JSON Schema at {where}: "
                             f"{exc.message}") from None


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must be, enforced token by token (grammar-constrained decoding).

    OpenAI's shapes: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
    JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
    kvbatch's additions: ``{"type": "regex", "regex": …}``, ``{"type": "choice", "choice":
    [...]}`` (exactly one of the strings) and ``{"type": "grammar", "grammar": …}`` (EBNF, the
    GBNF dialect of llama.cpp, with a ``root`` rule). JSON is generated compact (no free
    whitespace). A regex or grammar the engine's grammar library cannot parse fails its
    request when it reaches a worker, with the parser's message.
    """

    __pydantic_config__: ClassVar[dict[str, Any]] = _PYDANTIC_CONFIG

    type: ResponseFormatType = "text"
    json_schema: JsonSchema | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, Mapping):
            object.__setattr__(self, "json_schema", _build(JsonSchema, self.json_schema,
                                                           "json_schema"))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = ("text", "json_object", "json_schema", "regex", "choice", "grammar")
        if self.type not in kinds:
            raise ValueError(f"response_format.type must be one of {', '.join(kinds)}; "
                             f"got {self.type!r}")
        payload = {"json_schema": self.json_schema, "regex": self.regex,
                   "choice": self.choice, "grammar": self.grammar}
        needed = self.type if self.type in payload else None
        extra = sorted(k for k, v in payload.items() if v is not None and k != needed)
        if extra:
            raise ValueError(f"response_format of type {self.type!r} takes no "
                             f"{', '.join(extra)}")
        if needed is not None and payload[needed] is None:
            raise ValueError(f"response_format of type {self.type!r} needs {needed!r}")
        if self.type in ("regex", "grammar"):
            text = payload[self.type]
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"response_format.{self.type} must be a non-empty string")
        if self.type == "regex":
            _check_pattern(str(self.regex), "response_format.regex")
        if self.type == "grammar" and len(str(self.grammar).encode()) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"response_format.grammar is over {MAX_GRAMMAR_BYTES} bytes "
                             "(MAX_GRAMMAR_BYTES)")
        if self.type == "choice":
            choice = self.choice or ()
            if not choice or len(choice) > MAX_CHOICES or not all(
                    isinstance(c, str) and c for c in choice):
                raise ValueError(f"response_format.choice must be 1 to {MAX_CHOICES} "
                                 "non-empty strings")

    @property
    def constrained(self) -> bool:
        return self.type != "text"

    @property
    def key(self) -> str:
        """A hash of what the output is held to: requests with the same key share one
        compiled grammar."""
        held = asdict(self)
        if self.json_schema is not None:  # its name, description and strict change nothing
            held["json_schema"] = self.json_schema.schema
        canonical = json.dumps(held, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    Args:
        n: parallel samples of the same prompt; they share the prompt's KV blocks.
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1 = off).
        top_k: keep the ``top_k`` most likely tokens (0 = off).
        min_p: drop tokens less likely than ``min_p`` times the most likely one (0 = off).
        seed: per-request seed; the same request with the same seed gives the same tokens.
        max_tokens: most tokens to generate.
        min_tokens: EOS, stop tokens and stop strings are ignored before this many tokens.
        stop: strings that end generation (not included in the text).
        stop_token_ids: token ids that end generation, besides EOS.
        ignore_eos: keep generating past EOS.
        repetition_penalty: > 1 discourages tokens already in the prompt or output (1 = off).
        presence_penalty: subtracted from logits of tokens already generated.
        frequency_penalty: subtracted per occurrence from logits of generated tokens.
        logprobs: return the log-probabilities of the sampled token and of the top ``logprobs``
            tokens at each step (None = off).
        logit_bias: token id -> value in [-100, 100] added to its logit before sampling
            (OpenAI's ``logit_bias``; -100 bans the token, 100 all but forces it).
        response_format: what the output must be (JSON schema, regex, choice, grammar; see
            :class:`ResponseFormat`); a dict in its shape is accepted. Under a constraint,
            ``min_tokens`` does not hold back EOS once the grammar is complete, and the sample
            ends when the grammar does.

    ``n > 1`` at temperature 0 gives ``n`` equal samples, as OpenAI does.
    """

    __pydantic_config__: ClassVar[dict[str, Any]] = _PYDANTIC_CONFIG

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        # Lists become tuples and dicts their dataclasses, so that params stay immutable.
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.response_format, Mapping):
            object.__setattr__(self, "response_format", _build(
                ResponseFormat, self.response_format, "response_format"))
        if self.response_format is not None and not isinstance(self.response_format,
                                                               ResponseFormat):
            raise ValueError("response_format must be an object with a 'type'")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        _check_int(self, "n", lo=1, hi=MAX_N)
        _check_float(self, "temperature", lo=0.0)
        _check_float(self, "top_p", lo=0.0, lo_open=True, hi=1.0)
        _check_int(self, "top_k", lo=0, hi=MAX_INT32)
        _check_float(self, "min_p", lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int(self, "seed", lo=0, hi=MAX_SEED)
        _check_int(self, "max_tokens", lo=1, hi=MAX_INT32)
        _check_int(self, "min_tokens", lo=0, hi=MAX_INT32)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32
                   for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers in [0, 2**31 - 1]")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_float(self, "repetition_penalty", lo=0.0, lo_open=True)
        _check_float(self, "presence_penalty", lo=-2.0, hi=2.0)
        _check_float(self, "frequency_penalty", lo=-2.0, hi=2.0)
        if self.logprobs is not None:
            _check_int(self, "logprobs", lo=0, hi=MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        """The output is held to a grammar (a ``response_format`` other than text)."""
        return self.response_format is not None and self.response_format.constrained

    @property
    def edits_logits(self) -> bool:
        """Penalties, a logit bias or a grammar change the logits before sampling."""
        return self.has_penalties or bool(self.logit_bias) or self.constrained

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check_schema_size(schema: Mapping[str, Any]) -> None:
    """Refuse a json_schema over a structural limit (objects and arrays nested past
    :data:`MAX_SCHEMA_DEPTH`, more than :data:`MAX_SCHEMA_PROPERTIES` properties in all, a
    pattern over :data:`MAX_PATTERN_CHARS`), walking it once without recursion."""
    properties, todo = 0, [(schema, 1)]
    while todo:
        item, level = todo.pop()
        children = (item.values() if isinstance(item, Mapping)
                    else item if isinstance(item, list | tuple) else None)
        if children is None:
            continue
        if level > MAX_SCHEMA_DEPTH:
            raise ValueError(f"json_schema.schema is nested more than {MAX_SCHEMA_DEPTH} "
                             "levels deep (MAX_SCHEMA_DEPTH)")
        if isinstance(item, Mapping):
            named = item.get("properties")
            properties += len(named) if isinstance(named, Mapping) else 0
            if properties > MAX_SCHEMA_PROPERTIES:
                raise ValueError(f"json_schema.schema has more than {MAX_SCHEMA_PROPERTIES} "
                                 "properties (MAX_SCHEMA_PROPERTIES)")
            patterns = item.get("patternProperties")
            for pattern in [item.get("pattern"), *(patterns if isinstance(patterns, Mapping)
                                                   else ())]:
                if isinstance(pattern, str):
                    _check_pattern(pattern, "a pattern of json_schema.schema")
        todo.extend((child, level + 1) for child in children)


def _check_pattern(pattern: str, what: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"{what} is over {MAX_PATTERN_CHARS} characters (MAX_PATTERN_CHARS)")


def _build(cls: type[Any], value: Mapping[str, Any], name: str) -> Any:
    """``cls(**value)``, with a ``ValueError`` naming unknown keys (as pydantic does)."""
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {', '.join(map(repr, unknown))}")
    return cls(**value)


def _logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise ValueError("logit_bias must be an object of token id -> bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias has {len(value)} entries, over {MAX_LOGIT_BIAS_ENTRIES}")
    bias: dict[int, float] = {}
    for key, item in value.items():
        try:
            token = int(key)  # JSON keys are strings
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias key {key!r} is not a token id") from None
        if isinstance(key, bool) or not 0 <= token <= MAX_INT32:
            raise ValueError(f"logit_bias key {key!r} is not a token id")
        if (isinstance(item, bool) or not isinstance(item, int | float)
                or not math.isfinite(item) or not -100 <= item <= 100):
            raise ValueError(f"logit_bias[{token}] must be a number in [-100, 100], got {item!r}")
        bias[token] = float(item)
    return bias


def _check_int(p: SamplingParams, name: str, lo: int, hi: int | None = None) -> None:
    value = getattr(p, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_float(
    p: SamplingParams, name: str, lo: float, hi: float | None = None, lo_open: bool = False
) -> None:
    value = getattr(p, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = value <= lo if lo_open else value < lo
    if too_low or (hi is not None and value > hi):
        left = "(" if lo_open else "["
        bound = f"> {lo}" if hi is None and lo_open else (
            f">= {lo}" if hi is None else f"in {left}{lo}, {hi}]"
        )
        raise ValueError(f"{name} must be {bound}, got {value}")
