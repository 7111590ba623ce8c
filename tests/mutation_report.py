"""Per-module mutation scores from mutmut's results in ``mutants/`` (``make mutate`` runs it).

A module's score is killed / (mutants - equivalent): a timeout or a crash counts as killed (the
tests noticed), a mutant no test reaches counts as a survivor. Equivalent mutants (no test can
tell them from the original) are listed with the reason in ``tests/mutation_equivalents.txt``,
one ``<mutant name>  <reason>`` a line. Survivors are printed with their diff.

Usage: ``python tests/mutation_report.py [engine/sampler.py ...]`` from the repository root;
without arguments, every module of ``[tool.mutmut] source_paths`` in pyproject.toml.
"""

from __future__ import annotations

import json
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "tests" / "mutation_equivalents.txt"

# mutmut's exit codes (mutmut.stats.status_by_exit_code), folded into what the score needs.
KILLED_CODES = {1, 3, 24, -24, 152, 255, 36, -9, -11, 37}  # failed, timed out, crashed, type
SURVIVED_CODES = {0}
NO_TESTS_CODES = {5, 33}
SKIPPED_CODES = {34}


@dataclass
class ModuleScore:
    path: str
    killed: int = 0
    equivalent: int = 0
    not_run: int = 0
    other: int = 0  # suspicious or interrupted: run it again
    survivors: list[str] = field(default_factory=list)  # survived or reached by no test
    skipped: int = 0

    @property
    def total(self) -> int:
        return self.killed + self.equivalent + self.not_run + self.other + len(self.survivors)

    @property
    def scored(self) -> int:
        """Mutants that count: run, not skipped, not equivalent."""
        return self.killed + len(self.survivors) + self.other

    @property
    def score(self) -> float | None:
        return 100.0 * self.killed / self.scored if self.scored else None


def source_paths() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return list(config["source_paths"])


def load_equivalents(path: Path = EQUIVALENTS) -> dict[str, str]:
    """Mutant name -> why no test can kill it."""
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition(" ")
        out[name] = reason.strip()
    return out


def score_module(path: str, equivalents: dict[str, str]) -> ModuleScore | None:
    """The module's counts, or None when mutmut has not generated its mutants yet."""
    if not (ROOT / "mutants" / f"{path}.meta").exists():
        return None
    exit_codes = _exit_codes(path)
    score = ModuleScore(path)
    for name, code in sorted(exit_codes.items()):
        if code is None:
            score.not_run += 1
        elif code in SKIPPED_CODES:
            score.skipped += 1
        elif name in equivalents:
            score.equivalent += 1
        elif code in KILLED_CODES:
            score.killed += 1
        elif code in SURVIVED_CODES or code in NO_TESTS_CODES:
            score.survivors.append(name)
        else:
            score.other += 1
    return score


def _exit_codes(path: str) -> dict[str, int | None]:
    meta = ROOT / "mutants" / f"{path}.meta"
    if not meta.exists():
        return {}
    codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
    return codes


def diff_of(name: str, path: str) -> str:
    """The changed lines of a mutant, from mutmut's own differ (run from the repo root)."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    try:
        diff = get_diff_for_mutant(name, path=path)
    except Exception as e:  # a stale mutants/ tree; the name is still worth printing
        return f"    (no diff: {e})"
    lines = [ln for ln in diff.splitlines()
             if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    return "\n".join(f"    {ln}" for ln in lines)


def main(argv: list[str]) -> int:
    paths = argv or source_paths()
    equivalents = load_equivalents()
    scores: list[ModuleScore] = []
    missing: list[str] = []
    for path in paths:
        s = score_module(path, equivalents)
        if s is None:
            missing.append(path)
        else:
            scores.append(s)

    header = (f"{'module':32} {'mutants':>7} {'killed':>6} {'surv':>5} {'equiv':>5} "
              f"{'not run':>7} {'score':>8}")
    print(header)
    print("-" * len(header))
    for s in scores:
        pct = "-" if s.score is None else f"{s.score:.1f}%"
        print(f"{s.path:32} {s.total:7d} {s.killed:6d} {len(s.survivors):5d} "
              f"{s.equivalent:5d} {s.not_run:7d} {pct:>8}")
    for path in missing:
        print(f"{path:32} {'(no results: not run yet)':>47}")

    survivors = [(s.path, name) for s in scores for name in s.survivors]
    if survivors:
        print(f"\n{len(survivors)} survivors (kill them with a test, or list them in "
              f"{EQUIVALENTS.relative_to(ROOT)} with the reason):")
        for path, name in survivors:
            print(f"  {name}")
            print(diff_of(name, path))
    other = sum(s.other for s in scores)
    if other:
        print(f"\n{other} mutants suspicious or interrupted: run them again")
    # An entry for a mutant that no longer survives (the code or its tests changed) misleads.
    outcomes = {name: code for path in paths for name, code in _exit_codes(path).items()}
    stale = sorted(n for n in equivalents if n in outcomes and outcomes[n] not in SURVIVED_CODES
                   | NO_TESTS_CODES | {None})
    if stale:
        print(f"\nListed as equivalent but killed now (drop them from {EQUIVALENTS.name}):")
        for name in stale:
            print(f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
