"""pytest plugin for ``make mutate`` (loaded by ``[tool.mutmut] pytest_add_cli_args``): run a
mutant's test modules fastest first, by the durations mutmut recorded while collecting stats,
so that ``-x`` stops a killed mutant after the model-free tests instead of the engine ones.
Within a module the order stays, and its fixtures are set up once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

STATS = Path("mutmut-stats.json")  # pytest runs in mutants/ under mutmut


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not STATS.exists():
        return
    durations: dict[str, float] = json.loads(STATS.read_text())["duration_by_test"]
    module_s: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        module_s[module] = module_s.get(module, 0.0) + durations.get(item.nodeid, 0.0)
    # sort is stable: items keep their order within a module
    items.sort(key=lambda item: module_s[item.nodeid.split("::")[0]])
