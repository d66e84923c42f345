"""Random draws from the product of the axes users combine hold every oracle.

Each case (:mod:`differential.cases`) is drawn from its seed, run at 2 ranks on a pool of
long-lived ranks (a fresh ``FSDPRunner`` per variant), and judged by relations that need no
hand-written expectation: fp32 equals mmengine's stock ``Runner`` on one process; inserting an
evaluation changes no trained state (where the stock run is unchanged by it); a resumed run
ends bit-equal to the uninterrupted one; a FlexibleRunner strategy trains equal to its native
keys; every published checkpoint loads into a plain model and equals the live weights at its
step; a refused combination fails on every rank with the same error naming the key; no case
hangs (a deadline on every case, a timeout on every collective).

A failing case is shrunk (each drawn axis reset while it still fails the same way) and written
as a config for ``tools/train.py``; the test fails listing each distinct failure, its seed and
that file.
"""
import dataclasses
import itertools
import re
import time
from typing import Dict, List, Optional, Tuple

import pytest
from mmengine.config import Config

from differential.cases import (
    WORLD_SIZE,
    Case,
    canonical,
    case_config,
    draw,
    judge,
    run_case,
    run_stock,
    stock_key,
)
from differential.conftest import SUMMARY, settings
from harness import run_distributed, start_distributed

pytestmark = pytest.mark.differential

#: A case's deadline (a few seconds each on a quiet machine; the suite shares two cores).
CASE_TIMEOUT_S = 150
SETTINGS = settings()
_TAGS = itertools.count()


class Runs:
    """Runs cases on the harness's kept ranks, caching the stock runs (many cases share one)."""

    def __init__(self, root) -> None:
        self.root = root
        self.stock: Dict[Case, Optional[dict]] = {}

    def failures(self, case: Case) -> List[str]:
        """What ``case`` fails (oracle messages; ``raised: ...`` when a rank raised or hung)."""
        tag = f'case{next(_TAGS)}-{case.seed}'
        root = str(self.root / tag)
        key = stock_key(case)
        pending = case.refusal == 'none' and key not in self.stock
        if pending:  # the stock reference trains beside the ranks, in a plain process
            stock = start_distributed(run_stock, 1, key, f'{root}/stock', tag,
                                      timeout=CASE_TIMEOUT_S)
        try:
            by_rank = run_distributed(run_case, WORLD_SIZE, case, root, tag,
                                      timeout=CASE_TIMEOUT_S)
        except (AssertionError, TimeoutError) as e:
            by_rank = None
            error = str(e)
        stock_failed = []
        if pending:
            try:
                self.stock[key] = stock.result()[0]
            except (AssertionError, TimeoutError) as e:
                # the reference itself failed: the tier's own fault, or mmengine's; reported
                # so that no oracle is skipped in silence
                self.stock[key] = None
                stock_failed = [f'stock run raised: {_summary(str(e))}\n{e}']
        if by_rank is None:
            return [f'raised: {_summary(error)}\n{error}'] + stock_failed
        ranks = dict(by_rank[0] or {}, by_rank=by_rank)
        return judge(case, ranks, self.stock.get(key)) + stock_failed


def _summary(error: str) -> str:
    """The last line of the first traceback (the exception), or the timeout."""
    for block in error.split('--- rank')[1:]:
        lines = [line for line in block.strip().splitlines() if line.strip()]
        return f'rank{lines[-1]}' if len(lines) == 1 else lines[-1].strip()
    return error.splitlines()[0]


def signature(failures: List[str]) -> Tuple[str, ...]:
    """What makes two failures the same: each oracle that failed, numbers removed."""
    return tuple(sorted({re.sub(r'[-+]?\d[\d.e+-]*', 'N', f.splitlines()[0]) for f in failures}))


def shrink(runs: Runs, case: Case, failing: Tuple[str, ...], deadline: float) -> Case:
    """Reset each drawn axis to its default while the case still fails the same way."""
    default = Case(seed=case.seed)
    for axis in list(case.axes()):
        if time.monotonic() > deadline:
            break
        candidate = canonical(dataclasses.replace(case, **{axis: getattr(default, axis)}))
        if candidate == case:
            continue
        # A failure may not happen every run (an async write racing the exit): a candidate
        # counts as passing only when it passes twice.
        same = any(signature(runs.failures(candidate)) == failing for _ in range(2))
        print(f'  shrink {axis}: {"still fails" if same else "passes twice"}')
        if same:
            case = candidate
    return case


def write_config(case: Case, failures: List[str], out) -> str:
    """The failing case as a config ``tools/train.py`` runs at 2 ranks; return its path."""
    variant = 'eval' if any(f.startswith('evaluation') for f in failures) else 'base'
    name = f'diff_{case.seed}'
    cfg = case_config(case, variant, f'work_dirs/{name}', name)
    cfg['launcher'] = 'pytorch'
    notes = []
    if variant == 'eval' and case.evaluation == 'val-first':
        notes.append('# the case calls runner.val() before runner.train() on the same runner')
    if case.checkpoint == 'resume':
        notes.append(f'# then resume: --resume work_dirs/{name}/iter_{case.ckpt_interval}.pth '
                     'and compare with the uninterrupted run')
    if case.checkpoint == 'async-exit':
        notes.append(f"# after train(): runner.save_checkpoint(work_dir, 'outside_train.pth', "
                     f"state_dict_type={case.ckpt_format!r}, async_save={case.ckpt_async}), then "
                     'mmfsdp.dist.shutdown_distributed()')
    if case.refusal != 'none':
        notes.append('# expected: refused at start-up on every rank, naming the key')
    out.mkdir(parents=True, exist_ok=True)
    path = out / f'{name}.py'
    header = [f'# differential tier: {case}', f'# rerun the case: MMFSDP_DIFF_SEED={case.seed} '
              'MMFSDP_DIFF_CASES=1 pytest -q tests/differential',
              '# run it: PYTHONPATH=tests/support torchrun --nproc-per-node 2 tools/train.py '
              f'{path} --launcher pytorch', *notes, '# failed:',
              *(f'#   {f.splitlines()[0]}' for f in failures)]
    path.write_text('\n'.join(header) + '\n' + Config(cfg).pretty_text)
    return str(path)


@pytest.mark.timeout(SETTINGS.budget_s + SETTINGS.shrink_s + 600)
def test_random_draws_hold_every_oracle(tmp_path):
    s = SETTINGS
    print(f'\ndifferential tier: MMFSDP_DIFF_SEED={s.seed} budget {s.budget_s:.0f} s'
          + (f', {s.cases} cases' if s.cases else ''))
    runs = Runs(tmp_path)
    found: Dict[Tuple[str, ...], Tuple[Case, List[str]]] = {}
    start, n = time.monotonic(), 0
    if s.seeds:
        print(f'the cases of MMFSDP_DIFF_SEEDS={",".join(map(str, s.seeds))}')
    seeds = iter(s.seeds) if s.seeds else (s.seed + i for i in itertools.count())
    for seed in seeds:
        if not s.seeds and ((s.cases is not None and n >= s.cases) or (
                s.cases is None and time.monotonic() - start > s.budget_s)):
            break
        n += 1
        case = draw(seed)
        t0 = time.monotonic()
        got = runs.failures(case)
        print(f'{case}: {time.monotonic() - t0:.1f} s, '
              + ('ok' if not got else 'FAILED: ' + '; '.join(f.splitlines()[0] for f in got)))
        if got:
            found.setdefault(signature(got), (case, got))
    elapsed = time.monotonic() - start
    done = (f'{n} cases in {elapsed:.0f} s ({elapsed / max(n, 1):.1f} s per case); '
            f'{len(found)} distinct failures')
    print(done)
    rerun = (f'MMFSDP_DIFF_SEEDS={",".join(map(str, s.seeds))}' if s.seeds else
             f'MMFSDP_DIFF_SEED={s.seed} MMFSDP_DIFF_CASES={n}')
    SUMMARY.append(f'differential tier: {done}; rerun: {rerun} pytest -q tests/differential')
    report = []
    shrink_deadline = time.monotonic() + s.shrink_s
    for failing, (case, got) in found.items():
        small = shrink(runs, case, failing, shrink_deadline)
        small_got = runs.failures(small) if small != case else got
        path = write_config(small, small_got or got, s.out)
        report.append(f'seed {case.seed}: {case}\n  shrunk: {small}\n  config: {path}\n'
                      + '\n'.join(f'  {f}' for f in (small_got or got)))
    assert not found, (f'{len(found)} distinct failures (rerun one: MMFSDP_DIFF_SEED=<seed> '
                       'MMFSDP_DIFF_CASES=1 pytest -q tests/differential):\n'
                       + '\n'.join(report))
