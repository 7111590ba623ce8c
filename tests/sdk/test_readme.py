"""The README's Python blocks run as written, on the real default model, and print real
answers: a plain ``prompt`` reaches the instruct model as a user message, not raw text."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.config import DEFAULT_MODEL

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _block(first_line: str) -> str:
    (block,) = [b for b in _blocks() if b.startswith(first_line)]
    return block


def test_every_python_block_is_run_here() -> None:
    assert len(_blocks()) == 2  # a new block needs a test below


def test_the_sdk_example_prints_real_answers(services: dict[str, str], start_worker,  # type: ignore[no-untyped-def]
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in services.items():
        monkeypatch.setenv(f"KVBATCH_{name.upper()}", value)
    start_worker(model=DEFAULT_MODEL, served_model_name=DEFAULT_MODEL,
                 num_kv_blocks=512)
    exec(_block("from jobs import Client"), {})
    sky, batch_line, place = capsys.readouterr().out.strip().split("\n")[-3:]
    assert len(sky.split()) >= 10, sky  # an answer, not an empty string after one token
    assert batch_line == "q1 succeeded"
    answer = json.loads(place)
    assert set(answer) >= {"city", "country"} and answer["city"].strip()


def test_the_engine_example_prints_real_answers(capsys: pytest.CaptureFixture[str]) -> None:
    names: dict[str, object] = {}
    exec(_block("from engine import"), names)
    chat, raw = names["outs"]  # type: ignore[misc]
    printed = capsys.readouterr().out
    assert len(chat.text.split()) >= 10 and chat.text in printed
    assert chat.metrics.peak_kv_bytes > 0 and f" {chat.metrics.peak_kv_bytes}\n" in printed
    assert raw.text.strip() and raw.text in printed  # the story goes on
