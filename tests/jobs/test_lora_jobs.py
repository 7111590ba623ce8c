"""LoRA adapters through the queue: a worker started with ``--lora`` runs jobs naming
``<model>:<adapter>`` with that adapter, beside base-model jobs; a job naming an adapter it does
not serve fails alone with the reason; live workers announce their adapters (what
``GET /v1/models`` lists)."""

from __future__ import annotations

from pathlib import Path

import redis
import sqlalchemy as sa

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.testing import make_random_adapter
from jobs.client import JobClient
from jobs.constants import Keys
from jobs.schemas import JobSpec, JobStatus, queue_model

MODEL = "tiny"
SAMPLING = {"temperature": 0.0, "max_tokens": 8, "min_tokens": 8}


def test_adapter_jobs_run_with_their_adapter(redis_client: redis.Redis, keys: Keys,
                                             pg_engine: sa.Engine, tiny_model: str,
                                             tmp_path: Path, start_worker) -> None:  # type: ignore[no-untyped-def]
    sql = make_random_adapter(Path(tiny_model), tmp_path / "sql", rank=8, seed=1,
                              targets=("q_proj", "v_proj", "down_proj"))
    chat = make_random_adapter(Path(tiny_model), tmp_path / "chat", rank=16, seed=2)
    lora = (f"sql={sql}", f"chat={chat}")
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    prompts = [f"row {i} of the dataset" for i in range(6)]
    models = [MODEL, f"{MODEL}:sql", f"{MODEL}:chat"] * 2
    specs = [JobSpec(model=m, raw_prompt=p, sampling=SAMPLING)
             for m, p in zip(models, prompts, strict=True)]
    specs.append(JobSpec(model=f"{MODEL}:sql", embed={"input": ["x"]}))
    specs.append(JobSpec(model=f"{MODEL}:nope", raw_prompt="x", sampling=SAMPLING))
    ids = client.submit(specs)
    running = start_worker(lora=lora)
    by_id = {info.id: info for info in client.wait(ids, timeout_s=120)}
    infos = [by_id[i] for i in ids]

    # The same prompts on an engine of the same weights and adapters.
    engine = LLMEngine(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=128,
                                    lora=lora))
    adapters = [None if m == MODEL else m.split(":")[1] for m in models]
    want = engine.generate(prompts, SamplingParams(**SAMPLING), lora=adapters)
    for info, out, model in zip(infos[:-2], want, models, strict=True):
        assert info.status is JobStatus.SUCCEEDED, (model, info.error)
        assert info.result.token_ids == out.outputs[0].token_ids, model
        assert info.model == model  # as the job named it (its queue is the base model's)
    assert infos[0].result.token_ids != infos[1].result.token_ids  # the adapter changed it
    embed = infos[-2]
    assert embed.status is JobStatus.FAILED
    assert embed.error == ("embedding jobs run on the base model ('tiny'), not a LoRA adapter "
                           "('tiny:sql')")
    bad = infos[-1]
    assert bad.status is JobStatus.FAILED
    assert bad.error == ("unknown model 'tiny:nope': this queue is served by 'tiny' and its "
                         "LoRA adapters sql, chat")
    assert client.served_models() == {MODEL, f"{MODEL}:sql", f"{MODEL}:chat", "sql", "chat"}
    # By the adapter's name alone (as vLLM's --lora-modules): the live model serving it.
    (bare,) = client.wait(client.submit([JobSpec(model="sql", raw_prompt=prompts[1],
                                                 sampling=SAMPLING)]), timeout_s=60)
    assert bare.status is JobStatus.SUCCEEDED and bare.model == f"{MODEL}:sql"
    assert bare.result.token_ids == infos[1].result.token_ids
    assert running.stop() == 0


def test_queue_model() -> None:
    assert queue_model("tiny:sql") == "tiny"
    assert queue_model("tiny") == "tiny"
    assert queue_model("org/model") == "org/model"
