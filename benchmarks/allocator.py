"""CPU allocator: peak per rank and step time through the documented launch.

``python -m benchmarks.allocator [--world-sizes 2 4] [--rounds 2] [--out JSON]``

Every job is started exactly as the README tells a user to:
``bash tools/dist_train.sh CONFIG N --work-dir DIR``, from the repository root,
with the caller's environment minus every glibc malloc variable
(``MALLOC_*``, ``GLIBC_TUNABLES``): whatever the allocator does, mmfsdp must do
it itself. ``CONFIG`` is written per job: it inherits
``configs/gpt-nano_{fsdp,ddp}_2xcpu.py``, sizes the model as gpt-100m (as in
:mod:`benchmarks.workload`), turns checkpoints and validation off, and imports
:mod:`benchmarks.alloc_probe`, whose hook records each rank's peak resident
set per training iteration above the resident set when the config was loaded.

Arms: DDP and FSDP1 FULL_SHARD, each with mmfsdp's default allocator setting
(no key in the config) and with ``env_cfg.cpu_allocator='glibc'`` (glibc's own
defaults, the opt-out). One round runs every arm once per world size, the
order reversed every other round, so that the load of a shared machine falls
on the arms alike; step-time ratios are taken within a round.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from .launch import REPO
from .record import machine, utc_now
from .workload import MODELS

__all__ = ['ARMS', 'RESULTS', 'load', 'main', 'report', 'run_job', 'section_lines', 'summarize']

#: Strategy label -> the documented config it inherits.
CONFIGS = {'DDP': 'configs/gpt-nano_ddp_2xcpu.py',
           'FSDP1 FULL_SHARD': 'configs/gpt-nano_fsdp_2xcpu.py'}
#: Setting label -> the value of env_cfg.cpu_allocator (None: key absent, the default).
SETTINGS: Dict[str, Any] = {'mmfsdp default': None, 'glibc (opt-out)': 'glibc'}
GLIBC = 'glibc (opt-out)'
ARMS = [(strategy, setting) for strategy in CONFIGS for setting in SETTINGS]
MiB = 1 << 20
#: Where ``main`` writes by default and :mod:`benchmarks.report` reads the section from.
RESULTS = os.path.join(REPO, 'benchmarks', 'results', 'allocator.json')
#: Earlier runs with other settings (``--setting``), kept for the section's "what else" table.
EXPLORATION = os.path.join(REPO, 'benchmarks', 'results', 'allocator_explore.json')
#: What each exploration setting was, in words.
EXPLORED = {
    'glibc (opt-out)': "glibc's defaults",
    'mmfsdp default': 'then the default',
    'mmap128k': 'mmap_threshold=128 KiB (MALLOC_MMAP_THRESHOLD_=131072 in-process)',
    'mmap4m': 'mmap_threshold=4 MiB, no huge pages',
    'mmap1m-nothp': 'mmap_threshold=1 MiB, no huge pages',
    'trim1': "glibc's defaults + malloc_trim(0) after every iteration",
    'arena1': "glibc's defaults, one arena (arena_max=1)",
    'mmap 2 MiB': 'mmap_threshold=2 MiB, huge pages',
    'release+trim1': 'the default + malloc_trim(0) after every iteration (trim_interval=1)',
    'release+trim50': 'the default + malloc_trim(0) every 50 iterations (trim_interval=50)',
    'cache v1 1m': 'caching allocator, first version (unmapped cached blocks on every miss), '
                   'tensors of 1 MiB and more',
    'cache v1 64k': 'caching allocator, first version, tensors of 64 KiB and more',
    'cache64k': "caching allocator, tensors of 64 KiB and more ('cache' before its per-iteration "
                'bound)',
}
#: The model of the floor jobs: what a job's peak holds whatever the model (~0.1M parameters).
FLOOR_MODEL = 'gpt-tiny'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _config_text(strategy: str, allocator: Any, model: str, batch: int, seq: int,
                 iters: int, out_dir: str) -> str:
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
    if allocator is not None:
        lines.append(f'env_cfg = dict(cpu_allocator={allocator!r})')
    return '\n'.join(lines) + '\n'


def _clean_env() -> Dict[str, str]:
    """The caller's environment without glibc malloc settings, for the launcher script."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith('MALLOC_') and k != 'GLIBC_TUNABLES'}
    env.update(PYTHON=sys.executable, PORT=str(_free_port()))
    return env


def run_job(strategy: str, setting: str, allocator: Any, nproc: int, model: str, batch: int,
            seq: int, warmup: int, steps: int, timeout: float = 1800) -> Dict[str, Any]:
    """One documented-launch job; per measured step, the worst rank's peak and time.

    ``allocator`` is the value of ``env_cfg.cpu_allocator`` (``None``: no key),
    ``setting`` its label in the results.
    """
    with tempfile.TemporaryDirectory(prefix='mmfsdp-alloc-') as tmp:
        out_dir = os.path.join(tmp, 'probe')
        config = os.path.join(tmp, f"alloc_{strategy.split()[0].lower()}.py")
        with open(config, 'w') as f:
            f.write(_config_text(strategy, allocator, model, batch, seq, warmup + steps,
                                 out_dir))
        cmd = ['bash', 'tools/dist_train.sh', config, str(nproc), '--work-dir',
               os.path.join(tmp, 'work')]
        load = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True,
                              timeout=timeout)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(f'{" ".join(cmd)} failed ({proc.returncode}):\n'
                               f'{proc.stderr[-3000:]}')
        ranks = []
        for r in range(nproc):
            with open(os.path.join(out_dir, f'rank{r}.json')) as f:
                ranks.append(json.load(f))
    measured = range(warmup, warmup + steps)

    def worst(fn: Any) -> List[float]:
        return [max(fn(r, r['records'][i]) for r in ranks) for i in measured]

    return dict(
        strategy=strategy, setting=setting, world_size=nproc, model=model, batch_size=batch,
        seq_len=seq, warmup=warmup, steps=steps, wall_s=round(wall, 1), load_before=load,
        policy=ranks[0]['policy'],
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


#: Goals of issue 16 part 4: FSDP FULL_SHARD peak / DDP peak per world size, step-time ratio.
PEAK_GOALS = {2: 0.60, 4: 0.35}
TIME_GOAL = 1.10


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
              'baseline | FSDP step time / glibc\'s: wall (goal ≤ 1.10) | FSDP: CPU | '
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


def exploration_lines(path: str = EXPLORATION) -> List[str]:
    """The settings tried before the default was chosen: FSDP1 peak and step time per run."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        explored = json.load(f)
    lines = ['| run | N | steps | load average | setting | FSDP1 FULL_SHARD peak above baseline '
             'MiB, median of steps | at the last step | '
             "FSDP step s | FSDP step / glibc's, same run | DDP peak MiB |",
             '|---|---|---|---|---|---|---|---|---|---|']
    fsdp = 'FSDP1 FULL_SHARD'
    for run, n in dict.fromkeys((r['run'], r['world_size']) for r in explored['results']):
        rows = [r for r in explored['results']
                if r['run'] == run and r['world_size'] == n and r['round'] != 'floor']
        loads = [r['load_before'] for r in rows]
        glibc_time = _pooled(rows, 'step_time_s', setting=GLIBC, strategy=fsdp)
        name = run if rows[0]['model'] == 'gpt-100m' else f"{run} ({rows[0]['model']})"
        for setting in dict.fromkeys(r['setting'] for r in rows):
            peak = _pooled(rows, 'peak_bytes', setting=setting, strategy=fsdp)
            if not peak:  # a DDP-only setting
                continue
            last = [r['peak_bytes'][-1] for r in rows
                    if r['setting'] == setting and r['strategy'] == fsdp]
            step = _pooled(rows, 'step_time_s', setting=setting, strategy=fsdp)
            ddp = _pooled(rows, 'peak_bytes', setting=setting, strategy='DDP')
            policy = next((r['policy'] for r in rows if r['setting'] == setting), None)
            label = EXPLORED.get(setting, setting)
            if setting == 'mmfsdp default':
                label = ("'release': mmap_threshold=1 MiB, huge pages (then the default)"
                         if policy.get('huge_pages') else
                         'mmap_threshold=1 MiB (then the default; no huge pages yet)')
            ratio = f'{_median(step) / _median(glibc_time):.2f}' if glibc_time else '—'
            lines.append(
                f"| {name} | {n} | {rows[0]['steps']} | {min(loads):.1f}–{max(loads):.1f} | "
                f'{label} | {_median(peak) / MiB:,.0f} | {_median(last) / MiB:,.0f} | '
                f'{_median(step):.2f} | {ratio} | '
                f"{f'{_median(ddp) / MiB:,.0f}' if ddp else '—'} |")
    return lines + (['', explored['note']] if explored.get('note') else [])


def section_lines(data: Dict[str, Any]) -> List[str]:
    """Section 9, "CPU allocator", of ``docs/benchmarks.md`` (nothing without results)."""
    results = data.get('results', [])
    if not results:
        return []
    measured = [r for r in results if r['round'] != 'floor']
    r0, m = measured[0], data['machine']
    loads = [r['load_before'] for r in results]
    rounds = len({r['round'] for r in measured})
    lines = [
        '## 9. CPU allocator: the saving with the documented launch', '',
        f"`{data['command']}` ({data['date_utc']} – {data.get('date_end_utc', 'unfinished')}, "
        f"commit {m['commit']}, {m['cpu']}, {m['cores']} cores). Every job is started as the "
        'README says, `bash tools/dist_train.sh CONFIG N --work-dir DIR`, with no `MALLOC_*` / '
        '`GLIBC_TUNABLES` variable in its environment; CONFIG inherits '
        '`configs/gpt-nano_{fsdp,ddp}_2xcpu.py` and only resizes the model '
        f"({r0['model']}: 14 layers, width 768; batch {r0['batch_size']} × {r0['seq_len']} "
        'tokens per rank, AdamW), turns checkpoints and validation off, and imports a probe hook '
        '(`benchmarks/alloc_probe.py`). The two settings: **mmfsdp default** (no key: '
        "`env_cfg.cpu_allocator='cache'`, mmfsdp's caching CPU allocator for tensors of 64 KiB "
        "and more) and **glibc (opt-out)** (`env_cfg.cpu_allocator='glibc'`: glibc's own "
        'defaults, what every run got before mmfsdp set the allocator).',
        '',
        f"Peak: the kernel's high-water mark of each rank's resident set during one training "
        f"iteration (reset at its start) minus the resident set when the config was loaded "
        f"(imports done, nothing built); the worst rank; {r0['steps']} measured iterations after "
        f"{r0['warmup']} warm-up, in {rounds} separate job(s) per arm. That baseline leaves in "
        'what every job holds whatever its model (runner scaffolding, lazily imported modules, '
        'gloo buffers): **floor** is the same measurement with the 0.1M-parameter gpt-tiny, '
        'same launch, arm and N, and **net peak** = peak − floor, the quantity of section 2 '
        '(whose suite pays the same costs in a warm-up step before its baseline). '
        'CPU s: user + system CPU time of the rank process (all threads) per iteration.', '',
        f'Arms ran round-robin (order reversed every round); step-time ratios are per round, '
        f'same N and strategy. **Load**: the 1-minute load average before the jobs was '
        f"{min(loads):.1f}–{max(loads):.1f} on {m['cores']} cores"
        + (f" ({data['machine_use']})" if data.get('machine_use') else '') + '.', '']
    lines += report(data).split('\n') + ['']
    lines += _reading(data)
    explored = exploration_lines()
    if explored:
        lines += ['**What else was tried** (same benchmark, gpt-100m unless the run names '
                  'another model, `--setting` arms and earlier runs, '
                  '`benchmarks/results/allocator_explore.json`; wall-clock steps, medians over '
                  'the run\'s rounds):', ''] + explored + ['']
    return lines


def _reading(data: Dict[str, Any]) -> List[str]:
    """What the tables say, in numbers taken from them."""
    rows = {(r['world_size'], r['setting']): r for r in summarize(data)}
    out = []
    for n in sorted({n for n, _ in rows}):
        mine, glibc_row = rows.get((n, 'mmfsdp default')), rows.get((n, GLIBC))
        if not (mine and glibc_row and 'net_peak_ratio' in mine and 'net_peak_ratio' in glibc_row):
            continue
        f_m, f_g = mine['FSDP1 FULL_SHARD'], glibc_row['FSDP1 FULL_SHARD']
        d_m, d_g = mine['DDP'], glibc_row['DDP']
        cpu = f_m['cpu_ratios']
        out.append(
            f"- N = {n}: with glibc's defaults FSDP1 FULL_SHARD's net peak is "
            f"{f_g['net_peak_bytes'] / MiB:,.0f} MiB against DDP's "
            f"{d_g['net_peak_bytes'] / MiB:,.0f}"
            f" ({glibc_row['net_peak_ratio']:.3f}×); with mmfsdp's default "
            f"{f_m['net_peak_bytes'] / MiB:,.0f} against {d_m['net_peak_bytes'] / MiB:,.0f} "
            f"({mine['net_peak_ratio']:.3f}×). FSDP's CPU time per step: "
            f"{_median(f_m['step_cpu_s']):.2f} s against {_median(f_g['step_cpu_s']):.2f} s"
            + (f' ({_median(cpu):.2f}×)' if cpu else '') + '; DDP\'s: '
            f"{_median(d_m['step_cpu_s']):.2f} s against {_median(d_g['step_cpu_s']):.2f} s.")
    times = {n: _median(r['FSDP1 FULL_SHARD']['time_ratios']) for (n, setting), r in rows.items()
             if setting == 'mmfsdp default' and r.get('FSDP1 FULL_SHARD', {}).get('time_ratios')}
    met = [n for n, t in sorted(times.items()) if t <= TIME_GOAL]
    missed = [n for n, t in sorted(times.items()) if t > TIME_GOAL]
    out += [
        "- Why: FSDP allocates and frees every gathered unit, unsharded gradient and "
        'reduce-scatter buffer every step (some GiB per step at this size). glibc\'s heap reuses '
        'freed memory without the kernel but keeps it resident and fragmented, so the peak '
        "stays near DDP's. A block mapped on its own and unmapped when freed ('release', the "
        'default before, and what the default falls back to where no compiler can build the '
        'cache) keeps the peak at the live tensors but is zero-filled and page-faulted in '
        'afresh every time. The default keeps each freed block of 64 KiB and more mapped in '
        "mmfsdp's caching CPU allocator (`mmfsdp/cpu_cache.py`) for the next request of its "
        'size, and maps new memory only while live + cached bytes stay within the most live at '
        "once in this iteration or the one before: the peak of 'release', from warm pages."]
    if met:
        out.append(f'- Step-time goal (≤ {TIME_GOAL:.2f} × the glibc-default step time, median '
                   f'of the per-round ratios) met at N = {", ".join(map(str, met))}.')
    if missed:
        out.append(
            f'- Step-time goal not met at N = {", ".join(map(str, missed))} '
            f'({", ".join(f"{times[n]:.2f}×" for n in missed)}).')
    out.append('')
    return out


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
                        help='an extra allocator setting: LABEL=value of env_cfg.cpu_allocator')
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
    data: Dict[str, Any] = dict(
        command='python -m benchmarks.allocator ' + ' '.join(argv or sys.argv[1:]),
        date_utc=utc_now(), machine=machine(),
        machine_use=args.machine_use, results=[])
    for rnd in range(args.rounds):
        for n in args.world_sizes:
            if rnd == 0 and args.model != FLOOR_MODEL:
                for strategy, setting in arms:  # the floor: what no model adds
                    print(f'floor N={n} {strategy} / {setting}', file=sys.stderr, flush=True)
                    result = run_job(strategy, setting, settings[setting], n, FLOOR_MODEL,
                                     args.batch_size, args.seq_len, args.warmup, args.steps)
                    result['round'] = 'floor'
                    data['results'].append(result)
            order = arms if rnd % 2 == 0 else arms[::-1]
            for strategy, setting in order:
                print(f'round {rnd} N={n} {strategy} / {setting}', file=sys.stderr, flush=True)
                result = run_job(strategy, setting, settings[setting], n, args.model,
                                 args.batch_size, args.seq_len, args.warmup, args.steps)
                result['round'] = rnd
                data['results'].append(result)
                print(f"  peak {_fmt(result['peak_bytes'])} MiB, step "
                      f"{_fmt(result['step_time_s'], 1, 2)} s, job {result['wall_s']} s",
                      file=sys.stderr, flush=True)
                os.makedirs(os.path.dirname(args.out), exist_ok=True)
                with open(args.out, 'w') as f:
                    json.dump(data, f, indent=1)
    data['date_end_utc'] = utc_now()
    with open(args.out, 'w') as f:
        json.dump(data, f, indent=1)
    print(report(data))


if __name__ == '__main__':
    main()
