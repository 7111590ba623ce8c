"""The question → answer → judge pipeline the pipeline tests run (in the test process and in
``kvbatch pipeline run``: the stages' functions must have one source for both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, Field

from jobs import Pipeline
from jobs.pipeline import RowDict

KEEP_AT_LEAST = 5  # judge scores kept


class Questions(BaseModel):
    items: list[Literal["why", "how", "when"]] = Field(min_length=1, max_length=3)


class Score(BaseModel):
    score: int = Field(ge=0, le=9)


def topics(n: int) -> list[RowDict]:
    """``width``: how many answers rows each question becomes (0: the row ends there)."""
    return [{"topic": f"topic {i}", "width": (i + 1) % 3} for i in range(n)]


def judge_prompt(row: RowDict) -> str:
    return f"Rate 0-9: {row['question']} -> {row['answers']}"


def build(name: str, n: int, judge: Callable[[RowDict], str] = judge_prompt) -> Pipeline:
    p = Pipeline(name)
    q = p.stage("questions", source=topics(n), prompt=lambda r: f"Ask about {r['topic']}",
                response_format=Questions, max_tokens=60, temperature=0.0)
    a = p.stage("answers", source=q,
                explode=lambda r: ({"topic": r["topic"], "question": f"{x} #{k}"}
                                   for x in r["questions"].items for k in range(r["width"])),
                prompt=lambda r: [{"role": "system", "content": "Answer briefly."},
                                  {"role": "user", "content": r["question"]}],
                max_tokens=6, temperature=0.0)
    p.stage("judge", source=a, prompt=judge, response_format=Score, max_tokens=20,
            temperature=0.0, keep=lambda r: r["judge"].score >= KEEP_AT_LEAST
            and not r["question"].endswith("#1"))
    return p

