"""The differential tier's settings and its summary line.

Settings are environment variables, so that the README's ``pytest -q`` runs the tier as it is
and one command reruns any draw (docs/contributing.md, "The differential tier"):

- ``MMFSDP_DIFF_SEED``: the first case's seed; case ``i`` of a run draws from ``seed + i``.
  Default: the commit under test (the first 7 hex digits of ``git rev-parse HEAD``), so every
  change draws new cases and a CI run of one commit is the same run again (printed); outside a
  git checkout, the current UTC time in minutes.
- ``MMFSDP_DIFF_CASES``: stop after this many cases (default: as many as the budget allows).
- ``MMFSDP_DIFF_SEEDS``: run exactly the cases of these seeds (comma-separated), no budget.
- ``MMFSDP_DIFF_BUDGET_S``: seconds of cases (default 180); a case started runs to its end.
- ``MMFSDP_DIFF_SHRINK_S``: seconds spent shrinking the failures found (default 240).
- ``MMFSDP_DIFF_OUT``: where a failing case's config is written (default
  ``differential-failures/`` in the repository, ignored by git).
"""
import os
import subprocess
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


def _commit_seed() -> int:
    """The commit under test as a seed (the current UTC minute outside a git checkout)."""
    try:
        head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        return int(head[:7], 16)
    except (OSError, ValueError, subprocess.SubprocessError):
        return int(time.time() // 60)


def settings() -> Settings:
    env = os.environ.get
    seed = env('MMFSDP_DIFF_SEED')
    cases = env('MMFSDP_DIFF_CASES')
    return Settings(seed=int(seed) if seed else _commit_seed(),
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
