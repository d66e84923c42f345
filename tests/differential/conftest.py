"""The differential tier's settings and its two long-lived pools.

Settings are environment variables, so that the README's ``pytest -q`` runs the tier as it is
and one command reruns any draw (docs/contributing.md, "The differential tier"):

- ``MMFSDP_DIFF_SEED``: the first case's seed; case ``i`` of a run draws from ``seed + i``.
  Default: the current UTC time in minutes, so each CI run draws new cases (printed).
- ``MMFSDP_DIFF_CASES``: stop after this many cases (default: as many as the budget allows).
- ``MMFSDP_DIFF_SEEDS``: run exactly the cases of these seeds (comma-separated), no budget.
- ``MMFSDP_DIFF_BUDGET_S``: seconds of cases (default 180); a case started runs to its end.
- ``MMFSDP_DIFF_SHRINK_S``: seconds spent shrinking the failures found (default 240).
- ``MMFSDP_DIFF_OUT``: where a failing case's config is written (default
  ``differential-failures/`` in the repository, ignored by git).
"""
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from harness import REPO


@dataclass(frozen=True)
class Settings:
    seed: int
    cases: Optional[int]
    seeds: Tuple[int, ...]
    budget_s: float
    shrink_s: float
    out: Path


def settings() -> Settings:
    env = os.environ.get
    seed = env('MMFSDP_DIFF_SEED')
    cases = env('MMFSDP_DIFF_CASES')
    return Settings(seed=int(seed) if seed else int(time.time() // 60),
                    cases=int(cases) if cases else None,
                    seeds=tuple(int(x) for x in env('MMFSDP_DIFF_SEEDS', '').split(',') if x),
                    budget_s=float(env('MMFSDP_DIFF_BUDGET_S', '180')),
                    shrink_s=float(env('MMFSDP_DIFF_SHRINK_S', '240')),
                    out=Path(env('MMFSDP_DIFF_OUT', str(REPO / 'differential-failures'))))


#: Lines the tier adds to pytest's terminal summary (the seed, the cases run): shown without
#: ``-s`` and whether the test passed or failed, so every CI log says how to rerun its draw.
SUMMARY: List[str] = []


def pytest_terminal_summary(terminalreporter) -> None:
    for line in SUMMARY:
        terminalreporter.write_line(line)
