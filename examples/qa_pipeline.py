"""Questions -> answers -> judge: the answers the judge scores 4 or 5, as a dataset.

    kvbatch pipeline run examples/qa_pipeline.py -o qa.parquet
    python examples/qa_pipeline.py     # the same, through Client() (KVBATCH_* settings)
"""

from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints

from jobs import Client, Pipeline


class Questions(BaseModel):
    items: list[Annotated[str, StringConstraints(max_length=60)]] = Field(min_length=3,
                                                                          max_length=3)


class Score(BaseModel):
    score: int = Field(ge=1, le=5)


SYS = "You are a careful teacher. Answer in two sentences."
topics = [{"topic": t} for t in ("tides", "rainbows", "volcanoes")]

pipeline = Pipeline("qa-v1")
questions = pipeline.stage(
    "questions", source=topics,
    prompt=lambda r: f"Write 3 short questions about {r['topic']}.",
    response_format=Questions, temperature=0.8, seed=0, max_tokens=256)
answers = pipeline.stage(
    "answers", source=questions,
    explode=lambda r: ({"topic": r["topic"], "question": x} for x in r["questions"].items),
    prompt=lambda r: [{"role": "system", "content": SYS},
                      {"role": "user", "content": r["question"]}],
    max_tokens=80, temperature=0.0)
judge = pipeline.stage(
    "judge", source=answers, response_format=Score, max_tokens=20, temperature=0.0,
    prompt=lambda r: f"Question: {r['question']}\nAnswer: {r['answers']}\n\nHow good is this "
                     "answer, from 1 (wrong) to 5 (correct and clear)?",
    keep=lambda r: r["judge"].score >= 4)

if __name__ == "__main__":
    with Client() as client:
        result = pipeline.run(client, output="qa.parquet")
    print(result.table())
