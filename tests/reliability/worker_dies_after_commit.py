"""A worker process that dies (exit status 137) right after its first transaction of results
is stored, before any of them is acknowledged: the narrowest window of at-least-once delivery
(``test_faults.py``). Takes ``kvbatch worker``'s flags; the crash goes in through the result
writer's ``after_commit`` hook."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from worker.loop import Worker
from worker.main import preflight, start_engine
from worker.settings import LOG_FORMAT, add_settings_arguments, settings_from_args

KILLED = 137  # what a SIGKILLed process reports


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    settings = settings_from_args(parser.parse_args(argv))
    preflight(settings)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    worker = Worker(settings, start_engine(settings), after_commit=lambda: os._exit(KILLED))
    return worker.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
