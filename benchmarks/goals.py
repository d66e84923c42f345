"""The goals of issue 6 and their verdicts, from a results file of :mod:`benchmarks.run`.

Shared by :mod:`benchmarks.report` (the table) and :mod:`benchmarks.notes`
(why a goal fails), so neither imports the other.
"""
from typing import Any, Dict, List, Optional, Tuple

from .workload import MODELS, STRATEGIES

__all__ = ['COMM_LIMIT', 'Goal', 'MIB', 'OVERHEAD_LIMIT', 'PEAK_LIMITS', 'PEAK_MODEL', 'Results',
           'STATE_LIMIT', 'goals', 'mib', 'spread']

MIB = 2**20
#: Goal limits of issue 6.
STATE_LIMIT = 1.05
PEAK_LIMITS = {2: 0.60, 4: 0.35}
PEAK_MODEL = 'gpt-100m'
COMM_LIMIT = 1.05
OVERHEAD_LIMIT = 1.03


def mib(n: float) -> str:
    return f'{n / MIB:,.1f}'


def spread(summary: Dict[str, float], scale: float = 1.0, fmt: str = '{:.2f}') -> str:
    """``median (min–max)``, or just the median when every repeat agreed."""
    med, lo, hi = (summary[k] * scale for k in ('median', 'min', 'max'))
    if fmt.format(lo) == fmt.format(hi):
        return fmt.format(med)
    return f'{fmt.format(med)} ({fmt.format(lo)}–{fmt.format(hi)})'


class Results:
    """Index over the results of one run."""

    def __init__(self, data: Dict[str, Any]) -> None:
        self.data = data
        self.all = data['results']

    def of(self, kind: str, **match: Any) -> List[Dict[str, Any]]:
        return [r for r in self.all if r['kind'] == kind
                and all(r.get(k) == v for k, v in match.items())]

    def one(self, kind: str, **match: Any) -> Optional[Dict[str, Any]]:
        found = self.of(kind, **match)
        return found[0] if found else None

    def models(self) -> List[str]:
        seen = {r['model'] for r in self.of('memory')}
        return [m for m in MODELS if m in seen]

    def world_sizes(self) -> List[int]:
        return sorted({r['world_size'] for r in self.of('memory')})


# ---------------------------------------------------------------------------- goals

Goal = Tuple[str, str, str, Optional[bool]]  # (goal, target, measured, pass)


def goals(res: Results) -> List[Goal]:
    """Every goal of issue 6 with its measurement and verdict (``None``: not measured)."""
    out: List[Goal] = []
    for label in ('FSDP1 FULL_SHARD', 'FSDP2 reshard'):
        rows = [r for r in res.of('memory', strategy=label) if r['world_size'] in (2, 4)]
        ratios = [(r['model_state_bytes']['max'] / r['theory']['model_state_bytes'], r)
                  for r in rows]
        worst = max(ratios, key=lambda x: x[0], default=None)
        measured = (f'max {worst[0]:.4f}× ({worst[1]["model"]}, N={worst[1]["world_size"]}; '
                    f'{len(rows)} case{"s" if len(rows) > 1 else ""})' if worst else '—')
        out.append((f'{label}: model-state bytes per rank at N = 2, 4',
                    f'≤ {STATE_LIMIT} × 16P/N', measured,
                    None if not worst else worst[0] <= STATE_LIMIT))
    for n, limit in PEAK_LIMITS.items():
        fsdp = res.one('memory', model=PEAK_MODEL, strategy='FSDP1 FULL_SHARD', world_size=n)
        ddp = res.one('memory', model=PEAK_MODEL, strategy='DDP', world_size=n)
        ratio = fsdp['peak_bytes']['median'] / ddp['peak_bytes']['median'] if fsdp and ddp \
            else None
        out.append((f'Peak per rank, FSDP1 FULL_SHARD / DDP, {PEAK_MODEL}, N = {n}',
                    f'≤ {limit:.2f}',
                    f'{ratio:.3f} ({mib(fsdp["peak_bytes"]["median"])} / '
                    f'{mib(ddp["peak_bytes"]["median"])} MiB)' if ratio else '—',
                    None if ratio is None else ratio <= limit))
    for label in STRATEGIES:
        rows = [r for r in res.of('memory', strategy=label) if r['world_size'] > 1]
        ratios = [(r['comm_send_bytes']['max'] / r['theory']['comm_bytes'], r) for r in rows]
        worst = max(ratios, key=lambda x: x[0], default=None)
        out.append((f'{label}: communication bytes per rank per step',
                    f'≤ {COMM_LIMIT} × {STRATEGIES[label].comm_formula}',
                    f'max {worst[0]:.4f}× ({worst[1]["model"]}, N={worst[1]["world_size"]})'
                    if worst else '—', None if not worst else worst[0] <= COMM_LIMIT))
    for wrapper, label in (('fsdp1', 'FSDP1'), ('fsdp2', 'FSDP2'), ('ddp', 'DDP')):
        r = res.one('overhead', wrapper=wrapper)
        out.append((f'Wrapper overhead, {label} (FSDPRunner + mmfsdp / hand-written torch)',
                    f'median ≤ {OVERHEAD_LIMIT}',
                    f'{spread(r["ratio"], fmt="{:.3f}")} over {r["steps"]} rounds' if r else '—',
                    None if not r else r['ratio']['median'] <= OVERHEAD_LIMIT))
    for n in sorted({r['world_size'] for r in res.of('construction', init='meta')}):
        rows = [r for r in res.of('construction', init='meta', world_size=n)
                if r.get('wrapper', 'fsdp2') == 'fsdp2']
        worst = max(r['peak_bytes'] for r in rows)
        bound = rows[0]['goal_bytes']
        out.append((f"Construction peak per rank, FSDP2 init_device='meta', {rows[0]['model']}, "
                    f'N = {n}', f'≤ shard + 2 × largest unit = {mib(bound)} MiB',
                    f"{mib(worst)} MiB (worst of {len(rows)} "
                    f"process{'es' if len(rows) > 1 else ''} × {n} ranks)",
                    worst <= bound))
    return out
