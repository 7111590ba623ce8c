"""docs/api.md's example runs as written (the address, key and poll interval aside) against a
real server and worker, and prints OpenAI-shaped output lines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from api_server import ApiServer
from openai.types.chat import ChatCompletion

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_the_api_doc_example_runs(server: ApiServer, make_key, start_worker,  # type: ignore[no-untyped-def]
                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(block.strip().splitlines()) <= 10
    code = (block.replace("http://127.0.0.1:8000/v1", f"{server.url}/v1")
            .replace("kvb-…", make_key("docs")).replace("time.sleep(10)", "time.sleep(0.2)"))
    rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "max_tokens": 5,
                      "messages": [{"role": "user", "content": f"Hi {i}"}]}} for i in range(3)]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    start_worker()
    exec(code, {})
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == ["q0", "q1", "q2"]
    for line in lines:
        ChatCompletion.model_validate(line["response"]["body"])
