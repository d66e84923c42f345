"""CPU allocator: peak per rank and step time through the documented launch.

``python -m benchmarks.allocator [--world-sizes 2 4] [--rounds 2] [--append] [--out JSON]``

Every job is started exactly as the README tells a user to:
``bash tools/dist_train.sh CONFIG N --work-dir DIR``, from the repository root,
with the caller's environment minus every allocator variable (``LD_PRELOAD``,
``MALLOC_*``, ``GLIBC_TUNABLES``, ``MMFSDP_CPU_ALLOCATOR``) plus the arm's own:
the launch script chooses the allocator (``tools/cpu_allocator.sh``).
``CONFIG`` is written per job: it inherits
``configs/gpt-nano_{fsdp,ddp}_2xcpu.py``, sizes the model as gpt-100m (as in
:mod:`benchmarks.workload`), turns checkpoints and validation off, and imports
:mod:`benchmarks.alloc_probe`, whose hook records each rank's peak resident
set per training iteration above the resident set when the config was loaded,
and which allocator the rank runs on.

Arms: DDP and FSDP1 FULL_SHARD under each setting: **launch default** (no
variable: jemalloc where installed, else tcmalloc), **tcmalloc**
(``MMFSDP_CPU_ALLOCATOR=tcmalloc``) and **glibc (opt-out)**
(``MMFSDP_CPU_ALLOCATOR=glibc``: glibc's own defaults). One round runs every
arm once per world size, the order reversed every other round (ABAB), so that
the load of a shared machine falls on the arms alike; step-time ratios are
taken within a round. ``--append`` adds rounds to an earlier run's file, so a
long measurement can be split into runs of a few minutes each.
"""
import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from .launch import REPO
from .record import machine, save_results, utc_now
from .workload import MODELS

__all__ = ['ARMS', 'RESULTS', 'SETTINGS', 'load', 'main', 'report', 'run_job', 'section_lines',
           'summarize']

#: Strategy label -> the documented config it inherits.
CONFIGS = {'DDP': 'configs/gpt-nano_ddp_2xcpu.py',
           'FSDP1 FULL_SHARD': 'configs/gpt-nano_fsdp_2xcpu.py'}
#: Setting label -> the variables the arm adds to the launch's environment.
SETTINGS: Dict[str, Dict[str, str]] = {
    'launch default': {},
    'tcmalloc': {'MMFSDP_CPU_ALLOCATOR': 'tcmalloc'},
    'glibc (opt-out)': {'MMFSDP_CPU_ALLOCATOR': 'glibc'},
}
GLIBC = 'glibc (opt-out)'
DEFAULT = 'launch default'
ARMS = [(strategy, setting) for strategy in CONFIGS for setting in SETTINGS]
MiB = 1 << 20
#: Where ``main`` writes by default and :mod:`benchmarks.report` reads the section from.
RESULTS = os.path.join(REPO, 'benchmarks', 'results', 'allocator.json')
#: Runs of FSDP1 arms under allocator settings beyond the launch's (``--setting``), for the
#: section's "what else was tried" table.
SETTINGS_RESULTS = os.path.join(REPO, 'benchmarks', 'results', 'allocator_settings.json')
#: The model of the floor jobs: what a job's peak holds whatever the model (~0.1M parameters).
FLOOR_MODEL = 'gpt-tiny'
#: Variables that choose or tune a process's allocator: none leaks in from the caller.
ALLOCATOR_VARIABLES = ('LD_PRELOAD', 'GLIBC_TUNABLES', 'MMFSDP_CPU_ALLOCATOR')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _config_text(strategy: str, model: str, batch: int, seq: int, iters: int,
                 out_dir: str) -> str:
    dims = MODELS[model]
    lines = [
        f"_base_ = [{os.path.join(REPO, CONFIGS[strategy])!r}]",
        f"model = dict(n_layer={dims['n_layer']}, n_embd={dims['n_embd']}, "
        f"n_head={dims['n_head']}, block_size=128)",
        f"train_dataloader = dict(batch_size={batch}, "
        f"dataset=dict(block_size={seq}, max_chars=200_000))",
        f"train_cfg = dict(by_epoch=False, max_iters={iters}, val_interval={iters + 1})",
        'val_dataloader = None',
        'val_cfg = None',
        'val_evaluator = None',
        'param_scheduler = []',
        "default_hooks = dict(checkpoint=None, logger=dict(type='LoggerHook', interval=1000))",
        "custom_imports = dict(imports=['benchmarks.alloc_probe'], allow_failed_imports=False)",
        f"custom_hooks = [dict(type='AllocProbeHook', out_dir={out_dir!r})]",
    ]
    return '\n'.join(lines) + '\n'


def launch_env(setting: Dict[str, str]) -> Dict[str, str]:
    """The caller's environment without allocator variables, plus ``setting``'s."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(('MALLOC_', 'JE_MALLOC_', 'TCMALLOC_'))
           and k not in ALLOCATOR_VARIABLES}
    env.update(PYTHON=sys.executable, PORT=str(_free_port()), **setting)
    return env


def run_job(strategy: str, setting: str, nproc: int, model: str, batch: int, seq: int,
            warmup: int, steps: int, timeout: float = 1800,
            settings: Optional[Dict[str, Dict[str, str]]] = None) -> Dict[str, Any]:
    """One documented-launch job; per measured step, the worst rank's peak and time.

    ``setting`` is the arm's label in ``settings`` (default :data:`SETTINGS`).
    """
    env_vars = (settings or SETTINGS)[setting]
    with tempfile.TemporaryDirectory(prefix='mmfsdp-alloc-') as tmp:
        out_dir = os.path.join(tmp, 'probe')
        config = os.path.join(tmp, f"alloc_{strategy.split()[0].lower()}.py")
        with open(config, 'w') as f:
            f.write(_config_text(strategy, model, batch, seq, warmup + steps, out_dir))
        cmd = ['bash', 'tools/dist_train.sh', config, str(nproc), '--work-dir',
               os.path.join(tmp, 'work')]
        load = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=launch_env(env_vars), capture_output=True,
                              text=True, timeout=timeout)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(f'{" ".join(cmd)} failed ({proc.returncode}):\n'
                               f'{proc.stderr[-3000:]}')
        ranks = []
        for r in range(nproc):
            with open(os.path.join(out_dir, f'rank{r}.json')) as f:
                ranks.append(json.load(f))
    announced = re.search(r'^mmfsdp: CPU allocator: .*$', proc.stderr, re.M)
    measured = range(warmup, warmup + steps)

    def worst(fn: Any) -> List[float]:
        return [max(fn(r, r['records'][i]) for r in ranks) for i in measured]

    return dict(
        strategy=strategy, setting=setting, env=env_vars, world_size=nproc, model=model,
        batch_size=batch, seq_len=seq, warmup=warmup, steps=steps, wall_s=round(wall, 1),
        load_before=load, load_after=os.getloadavg()[0],
        launch_line=announced.group(0) if announced else None,
        allocator=sorted({r['allocator'] for r in ranks}),
        peak_bytes=worst(lambda r, rec: rec['peak_bytes'] - r['baseline_bytes']),
        peak_rss_bytes=worst(lambda r, rec: rec['peak_bytes']),
        end_rss_bytes=worst(lambda r, rec: rec['end_bytes']),
        baseline_bytes=[r['baseline_bytes'] for r in ranks],
        step_time_s=worst(lambda r, rec: rec['time_s']),
        step_cpu_s=worst(lambda r, rec: rec['cpu_s']))


def _median(values: List[float]) -> float:
    return statistics.median(values)


def _fmt(values: List[float], scale: float = MiB, digits: int = 1) -> str:
    med = _median(values) / scale
    lo, hi = min(values) / scale, max(values) / scale
    return f'{med:,.{digits}f} ({lo:,.{digits}f}–{hi:,.{digits}f})'


def _pooled(results: List[Dict[str, Any]], key: str, **match: Any) -> List[float]:
    return [v for r in results if all(r[k] == m for k, m in match.items()) for v in r[key]]


#: Goals of issue 25 section 4: FSDP FULL_SHARD peak / DDP peak per world size, step-time ratio.
PEAK_GOALS = {2: 0.60, 4: 0.35}
TIME_GOAL = 1.15


def _time_ratios(results: List[Dict[str, Any]], n: int, strategy: str, setting: str,
                 key: str = 'step_time_s') -> List[float]:
    """Per round: the arm's median ``key`` / the glibc arm's, same strategy and N."""
    ratios = []
    for rnd in sorted({r['round'] for r in results if r['round'] != 'floor'}):
        pair = {r['setting']: _median(r[key]) for r in results
                if r['round'] == rnd and r['world_size'] == n and r['strategy'] == strategy}
        if setting in pair and GLIBC in pair:
            ratios.append(pair[setting] / pair[GLIBC])
    return ratios


def summarize(data: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per world size and allocator setting: peaks, ratios and goals (the report's rows)."""
    measured = [r for r in data['results'] if r['round'] != 'floor']
    floors = [r for r in data['results'] if r['round'] == 'floor']
    rows = []
    for n in sorted({r['world_size'] for r in measured}):
        for setting in dict.fromkeys(r['setting'] for r in measured):
            row: Dict[str, Any] = dict(world_size=n, setting=setting)
            for strategy in CONFIGS:
                m = dict(world_size=n, strategy=strategy, setting=setting)
                peaks = _pooled(measured, 'peak_bytes', **m)
                if not peaks:
                    continue
                floor = _pooled(floors, 'peak_bytes', **m)
                row[strategy] = dict(
                    peak_bytes=_median(peaks), peak_range=(min(peaks), max(peaks)),
                    floor_bytes=_median(floor) if floor else None,
                    net_peak_bytes=_median(peaks) - (_median(floor) if floor else 0),
                    peak_rss_bytes=_median(_pooled(measured, 'peak_rss_bytes', **m)),
                    end_rss_bytes=_median(_pooled(measured, 'end_rss_bytes', **m)),
                    step_time_s=_pooled(measured, 'step_time_s', **m),
                    step_cpu_s=_pooled(measured, 'step_cpu_s', **m),
                    time_ratios=_time_ratios(measured, n, strategy, setting),
                    cpu_ratios=_time_ratios(measured, n, strategy, setting, 'step_cpu_s'))
            fsdp, ddp = row.get('FSDP1 FULL_SHARD'), row.get('DDP')
            if fsdp and ddp:
                row['peak_ratio'] = fsdp['peak_bytes'] / ddp['peak_bytes']
                row['net_peak_ratio'] = fsdp['net_peak_bytes'] / ddp['net_peak_bytes']
            rows.append(row)
    return rows


def _ratio_cell(ratios: List[float]) -> str:
    if not ratios:
        return '—'
    return f'{_median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})'


def report(data: Dict[str, Any]) -> str:
    """Markdown tables of a run: every arm, then ratios and goals per world size."""
    rows = summarize(data)
    lines = ['| N | allocator | strategy | peak above baseline MiB | floor MiB | net peak MiB | '
             'peak RSS MiB | RSS after last step MiB | step s | CPU s per step |',
             '|---|---|---|---|---|---|---|---|---|---|']
    for row in rows:
        for strategy in CONFIGS:
            arm = row.get(strategy)
            if arm is None:
                continue
            floor = arm['floor_bytes']
            lines.append(
                f"| {row['world_size']} | {row['setting']} | {strategy} | "
                f"{arm['peak_bytes'] / MiB:,.1f} ({arm['peak_range'][0] / MiB:,.1f}–"
                f"{arm['peak_range'][1] / MiB:,.1f}) | "
                f"{'—' if floor is None else f'{floor / MiB:,.1f}'} | "
                f"{arm['net_peak_bytes'] / MiB:,.1f} | {arm['peak_rss_bytes'] / MiB:,.1f} | "
                f"{arm['end_rss_bytes'] / MiB:,.1f} | {_fmt(arm['step_time_s'], 1, 2)} | "
                f"{_fmt(arm['step_cpu_s'], 1, 2)} |")
    lines += ['', '| N | allocator | FSDP / DDP, net peak (goal) | FSDP / DDP, peak above '
              'baseline | FSDP step time / glibc\'s: wall (goal ≤ 1.15) | FSDP: CPU | '
              'DDP step time / glibc\'s: wall | DDP: CPU |', '|---|---|---|---|---|---|---|---|']
    for row in rows:
        goal = PEAK_GOALS.get(row['world_size'])
        net = row.get('net_peak_ratio')
        verdict = ('—' if net is None else f'{net:.3f}' + (
            f" (≤ {goal}: **{'pass' if net <= goal else 'fail'}**)" if goal else ''))
        fsdp, ddp = row.get('FSDP1 FULL_SHARD', {}), row.get('DDP', {})
        glibc_row = row['setting'] == GLIBC
        cells = [_ratio_cell([] if glibc_row else arm.get(key, []))
                 for arm in (fsdp, ddp) for key in ('time_ratios', 'cpu_ratios')]
        if not glibc_row and fsdp.get('time_ratios'):
            ok = _median(fsdp['time_ratios']) <= TIME_GOAL
            cells[0] += f" **{'pass' if ok else 'fail'}**"
        raw = row.get('peak_ratio')
        lines.append(f"| {row['world_size']} | {row['setting']} | {verdict} | "
                     f"{'—' if raw is None else f'{raw:.3f}'} | " + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def load(path: str = RESULTS) -> Dict[str, Any]:
    """The recorded run (empty when the file is absent)."""
    if not os.path.exists(path):
        return dict(results=[])
    with open(path) as f:
        return json.load(f)


def section_lines(data: Dict[str, Any]) -> List[str]:
    """Section 9, "CPU allocator", of ``docs/benchmarks.md`` (nothing without results)."""
    results = data.get('results', [])
    if not results:
        return []
    measured = [r for r in results if r['round'] != 'floor']
    r0, m = measured[0], data['machine']
    loads = [r['load_before'] for r in results] + [r.get('load_after', 0) for r in results]
    per_arm: Dict[tuple, int] = {}
    for r in measured:
        key = (r['world_size'], r['strategy'], r['setting'])
        per_arm[key] = per_arm.get(key, 0) + 1
    jobs = {n: sorted({k for (m, *_), k in per_arm.items() if m == n})
            for n in sorted({r['world_size'] for r in measured})}
    launched = sorted({line for r in results if r['setting'] == DEFAULT
                       for line in [r.get('launch_line')] if line})
    commands = data.get('commands') or [data['command']]
    lines = [
        '## 9. CPU allocator: the saving with the documented launch', '',
        ' and '.join(f'`{c}`' for c in commands)
        + f" ({data['date_utc']} – {data.get('date_end_utc', 'unfinished')}, "
        f"commit {m['commit']}, {m['cpu']}, {m['cores']} cores). Every job is started as the "
        'README says, `bash tools/dist_train.sh CONFIG N --work-dir DIR`, with no allocator '
        'variable of the caller (`LD_PRELOAD`, `MALLOC_*`, `GLIBC_TUNABLES`, '
        '`MMFSDP_CPU_ALLOCATOR`) in its environment; CONFIG inherits '
        '`configs/gpt-nano_{fsdp,ddp}_2xcpu.py` and only resizes the model '
        f"({r0['model']}: 14 layers, width 768; batch {r0['batch_size']} × {r0['seq_len']} "
        'tokens per rank, AdamW), turns checkpoints and validation off, and imports a probe hook '
        '(`benchmarks/alloc_probe.py`, which also reads which malloc each rank has loaded). The '
        'settings: **launch default** (nothing set: the script preloads jemalloc where '
        'installed, else tcmalloc'
        + (f"; here it printed `{launched[0]}`" if len(launched) == 1 else '')
        + '), **tcmalloc** (`MMFSDP_CPU_ALLOCATOR=tcmalloc`: tcmalloc-minimal preloaded) and '
        "**glibc (opt-out)** (`MMFSDP_CPU_ALLOCATOR=glibc`: glibc's own defaults, nothing "
        'preloaded).', '',
        f"Peak: the kernel's high-water mark of each rank's resident set during one training "
        f"iteration (reset at its start) minus the resident set when the config was loaded "
        f"(imports done, nothing built); the worst rank; {r0['steps']} measured iterations after "
        f"{r0['warmup']} warm-up, in "
        + ', '.join(f"{'–'.join(map(str, sorted({k[0], k[-1]})))} job(s) per arm at N = {n}"
                    for n, k in jobs.items())
        + '. That baseline leaves in '
        'what every job holds whatever its model (runner scaffolding, lazily imported modules, '
        'gloo buffers): **floor** is the same measurement with the 0.1M-parameter gpt-tiny, '
        'same launch, arm and N, and **net peak** = peak − floor, the quantity of section 2 '
        '(whose suite pays the same costs in a warm-up step before its baseline). '
        'CPU s: user + system CPU time of the rank process (all threads) per iteration.', '',
        'Arms ran round-robin (order reversed every round, ABAB); step-time ratios are per '
        'round, same N and strategy. **Load**: the 1-minute load average before and after the '
        f"jobs was {min(loads):.1f}–{max(loads):.1f} on {m['cores']} cores"
        + (f" ({data['machine_use']})" if data.get('machine_use') else '') + '.', '']
    lines += report(data).split('\n') + ['']
    lines += _reading(data)
    tried = settings_lines()
    if tried:
        lines += ['**What else was tried** (`benchmarks/results/allocator_settings.json`: runs '
                  'of the FSDP1 FULL_SHARD arm only, N = 2, no floor, beside the glibc arm of the '
                  "same round; the settings' variables go to the launch's environment with "
                  '`--setting`; medians over the measured iterations, worst rank):', ''] + tried
        lines.append('')
    return lines


def settings_lines(path: str = SETTINGS_RESULTS) -> List[str]:
    """Per run and setting: FSDP1's peak above baseline, CPU and wall time per step, and the
    ratios of those times to the glibc arm's of the same round."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        runs = json.load(f)['runs']
    lines = ['| run | round | load | setting | variables | FSDP1 peak MiB | CPU s per step | '
             "CPU / glibc's | wall s per step | wall / glibc's |",
             '|---|---|---|---|---|---|---|---|---|---|']
    for run in runs:
        for r in run['results']:
            glibc = next((g for g in run['results'] if g['round'] == r['round']
                          and g['setting'] == GLIBC), None)
            ratio = {key: (f"{_median(r[key]) / _median(glibc[key]):.2f}"
                           if glibc and r is not glibc else '—')
                     for key in ('step_cpu_s', 'step_time_s')}
            variables = ', '.join(f'`{k}={v}`' for k, v in r.get('env', {}).items()) or '—'
            lines.append(
                f"| {run['run']} | {r['round']} | {r['load_before']:.1f} | {r['setting']} | "
                f"{variables} | {_median(r['peak_bytes']) / MiB:,.0f} | "
                f"{_median(r['step_cpu_s']):.2f} | {ratio['step_cpu_s']} | "
                f"{_median(r['step_time_s']):.2f} | {ratio['step_time_s']} |")
    return lines


def _reading(data: Dict[str, Any]) -> List[str]:
    """What the tables say, in numbers taken from them."""
    rows = {(r['world_size'], r['setting']): r for r in summarize(data)}
    out = []
    for (n, setting), row in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] == GLIBC)):
        glibc_row = rows.get((n, GLIBC))
        if setting == GLIBC or not (glibc_row and 'net_peak_ratio' in row
                                    and 'net_peak_ratio' in glibc_row):
            continue
        f_m, f_g = row['FSDP1 FULL_SHARD'], glibc_row['FSDP1 FULL_SHARD']
        d_m, d_g = row['DDP'], glibc_row['DDP']
        times, cpu = f_m['time_ratios'], f_m['cpu_ratios']
        out.append(
            f"- N = {n}, {setting}: FSDP1 FULL_SHARD's net peak "
            f"{f_m['net_peak_bytes'] / MiB:,.0f} MiB against DDP's "
            f"{d_m['net_peak_bytes'] / MiB:,.0f} ({row['net_peak_ratio']:.3f}×; with glibc's "
            f"defaults {f_g['net_peak_bytes'] / MiB:,.0f} against "
            f"{d_g['net_peak_bytes'] / MiB:,.0f}, {glibc_row['net_peak_ratio']:.3f}×). "
            "FSDP's step against glibc's: "
            + (f'{_median(times):.2f}× wall' if times else '—')
            + (f', {_median(cpu):.2f}× CPU' if cpu else '')
            + (f" (goal ≤ {TIME_GOAL:.2f}: {'met' if _median(times) <= TIME_GOAL else 'not met'})"
               if times else '') + '.')
    out += [
        "- Why: FSDP allocates and frees every gathered unit, unsharded gradient and "
        "reduce-scatter buffer every step (some GiB per step at this size). glibc's heap reuses "
        'freed memory without the kernel but keeps it resident and fragmented (it raises its '
        'mmap threshold to the largest block freed, up to 32 MiB, so those blocks come from the '
        "heap too), and FSDP's peak stays near DDP's. jemalloc and tcmalloc keep freed blocks "
        'by size and reuse them for the next request of that size, which a training loop makes '
        'every step, and return whole free pages to the kernel (jemalloc after a decay time).',
        '']
    return out


def _next_round(results: List[Dict[str, Any]], n: int) -> int:
    rounds = [r['round'] for r in results if r['world_size'] == n and r['round'] != 'floor']
    return max(rounds) + 1 if rounds else 0


def main(argv: Optional[List[str]] = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog='python -m benchmarks.allocator',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-100m', choices=sorted(MODELS))
    parser.add_argument('--world-sizes', type=int, nargs='+', default=[2, 4])
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--warmup', type=int, default=1)
    parser.add_argument('--steps', type=int, default=4)
    parser.add_argument('--batch-size', type=int, default=2)
    parser.add_argument('--seq-len', type=int, default=64)
    parser.add_argument('--arms', nargs='+', default=None,
                        help='subset of arms as STRATEGY/SETTING, e.g. "DDP/glibc (opt-out)"')
    parser.add_argument('--setting', action='append', default=[], metavar='LABEL=JSON',
                        help='an extra arm: LABEL={"VARIABLE": "value", ...} added to the '
                             "launch's environment, e.g. 'jemalloc bg={\"MALLOC_CONF\": "
                             "\"background_thread:true\"}'")
    parser.add_argument('--no-floor', action='store_true',
                        help='skip the gpt-tiny floor jobs (by default each arm and N gets one, '
                             'unless the results already have it)')
    parser.add_argument('--append', action='store_true',
                        help='add rounds to the results already in --out')
    parser.add_argument('--out', default=RESULTS)
    parser.add_argument('--machine-use', default=None, metavar='TEXT',
                        help='what else ran on the machine meanwhile, in words, for the report')
    args = parser.parse_args(argv)
    settings = dict(SETTINGS)
    for item in args.setting:
        label, value = item.split('=', 1)
        settings[label] = json.loads(value)
    arms = [(strategy, label) for strategy in CONFIGS for label in settings]
    if args.arms is not None:
        arms = [tuple(a.split('/', 1)) for a in args.arms]
    command = 'python -m benchmarks.allocator ' + ' '.join(argv or sys.argv[1:])
    if args.append and os.path.exists(args.out):
        data = load(args.out)
        data.setdefault('commands', [data.get('command')]).append(command)
    else:
        data = dict(command=command, commands=[command], date_utc=utc_now(), machine=machine(),
                    machine_use=args.machine_use, results=[])
    if args.machine_use:
        data['machine_use'] = args.machine_use
    for _ in range(args.rounds):
        for n in args.world_sizes:
            floored = {(r['strategy'], r['setting']) for r in data['results']
                       if r['round'] == 'floor' and r['world_size'] == n}
            if not args.no_floor and args.model != FLOOR_MODEL:
                for strategy, setting in [a for a in arms if a not in floored]:
                    # the floor: what no model adds, once per arm and N
                    print(f'floor N={n} {strategy} / {setting}', file=sys.stderr, flush=True)
                    result = run_job(strategy, setting, n, FLOOR_MODEL, args.batch_size,
                                     args.seq_len, args.warmup, args.steps, settings=settings)
                    result['round'] = 'floor'
                    data['results'].append(result)
            label = _next_round(data['results'], n)
            order = arms if label % 2 == 0 else arms[::-1]
            for strategy, setting in order:
                print(f'round {label} N={n} {strategy} / {setting}', file=sys.stderr,
                      flush=True)
                result = run_job(strategy, setting, n, args.model, args.batch_size,
                                 args.seq_len, args.warmup, args.steps, settings=settings)
                result['round'] = label
                data['results'].append(result)
                print(f"  {result['allocator']}: peak {_fmt(result['peak_bytes'])} MiB, step "
                      f"{_fmt(result['step_time_s'], 1, 2)} s, job {result['wall_s']} s, "
                      f"load {result['load_before']:.2f}", file=sys.stderr, flush=True)
                save_results(args.out, data)
    data['date_end_utc'] = utc_now()
    save_results(args.out, data)
    print(report(data))


if __name__ == '__main__':
    main()
