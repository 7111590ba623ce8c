"""Process entry: build the engine, serve metrics, run the loop, stop on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def build_engine(s: WorkerSettings) -> Any:
    """An ``engine.LLMEngine`` configured from the worker settings."""
    from engine import EngineConfig, LLMEngine

    config = EngineConfig(
        model=s.model, dtype=s.dtype, device=s.device, block_size=s.block_size,
        num_kv_blocks=s.num_kv_blocks, kv_cache_memory_bytes=s.kv_cache_memory_bytes,
        max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.max_model_len, enable_prefix_caching=s.enable_prefix_caching,
        seed=s.seed,
    )
    return LLMEngine(config)


def run_worker(settings: WorkerSettings) -> int:
    """Run a worker in this process until SIGTERM/SIGINT (a second signal skips the drain)."""
    from prometheus_client import start_http_server

    from worker.loop import Worker

    worker = Worker(settings, build_engine(settings))
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port, registry=worker.metrics.registry)
    signals = 0

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal signals
        signals += 1
        log.info("signal %d: %s", signum, "stopping" if signals == 1 else "no drain")
        worker.stop(drain=signals == 1)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return worker.run()


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from worker.settings import add_settings_arguments, settings_from_args

    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    add_settings_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    return run_worker(settings_from_args(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
