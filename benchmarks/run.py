"""The benchmark suite of mmfsdp: ``python -m benchmarks.run --quick|--full``.

Every measurement is one torchrun job (:mod:`benchmarks.worker`) of 1, 2 or 4
CPU processes talking gloo; this process only schedules them, collects their
results (``benchmarks/results/<mode>.json``, written after every job, so
``--resume`` continues an interrupted run) and writes the report.

- ``--full``: GPT 25M and 100M at world sizes 1, 2, 4 (the report's numbers;
  under 30 minutes on 2 cores); rewrites ``docs/benchmarks.md`` and ``docs/img/``.
- ``--quick``: a 7M GPT at world size 2 (and DDP at 1), fewer steps; under
  5 minutes; prints the report (``--report PATH`` writes it, with plots).
- ``--peers``: the same model trained by hand-written torch, mmfsdp, accelerate,
  Lightning Fabric and mmengine's FlexibleRunner side by side (:mod:`benchmarks.peers`).
- ``--smoke``: the tiny GPT at world sizes 1-2, 2 steps, cases packed into one job
  per world size: checks the harness, not the machine (the test suite runs it).
"""
import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .checkpoint_cost import TYPES as CHECKPOINT_TYPES
from .checkpoint_cost import case as checkpoint_case
from .launch import REPO, torchrun
from .record import machine, utc_now
from .record import save_results as _save
from .workload import STRATEGIES

__all__ = ['SUITES', 'Suite', 'main', 'plan_jobs']


@dataclass(frozen=True)
class Suite:
    """What one mode measures, and how long."""

    models: List[str]
    world_sizes: List[int]
    #: Per model, the world sizes at which every strategy runs; elsewhere only DDP
    #: (at N = 1 FSDP does not shard: FSDP1 falls back to NO_SHARD; they only cost time).
    all_strategies_at: Dict[str, List[int]]
    memory_batch: int = 2
    memory_seq: int = 64
    memory_warmup: int = 1
    memory_steps: int = 3
    overhead_model: str = 'gpt-25m'
    overhead_world_size: int = 2
    overhead_batch: int = 2
    overhead_seq: int = 64
    overhead_warmup: int = 2
    overhead_steps: int = 20
    construction_model: str = 'gpt-100m'
    construction_world_sizes: List[int] = field(default_factory=lambda: [2, 4])
    construction_repeats: int = 2
    checkpoint_model: str = 'gpt-100m'
    checkpoint_repeats: int = 3
    #: Pack all cases of one world size into one job (smoke test only).
    pack: bool = False
    #: Warm-up step of the tiny GPT before each memory baseline (see ``workload.warm_up``).
    memory_warm_up: bool = True


SUITES: Dict[str, Suite] = dict(
    full=Suite(models=['gpt-25m', 'gpt-100m'], world_sizes=[1, 2, 4],
               all_strategies_at={'gpt-25m': [2, 4], 'gpt-100m': [2, 4]},
               checkpoint_model='gpt-25m'),
    quick=Suite(models=['gpt-7m'], world_sizes=[1, 2], all_strategies_at={'gpt-7m': [2]},
                memory_steps=2, overhead_model='gpt-7m', overhead_warmup=2, overhead_steps=10,
                construction_model='gpt-7m', construction_world_sizes=[2],
                construction_repeats=1, checkpoint_model='gpt-7m', checkpoint_repeats=2),
    smoke=Suite(models=['gpt-tiny'], world_sizes=[1, 2], all_strategies_at={'gpt-tiny': [2]},
                memory_seq=32, memory_steps=2, overhead_model='gpt-tiny', overhead_seq=32,
                overhead_warmup=1, overhead_steps=2, construction_model='gpt-tiny',
                construction_world_sizes=[2], construction_repeats=1,
                checkpoint_model='gpt-tiny', checkpoint_repeats=1, pack=True,
                memory_warm_up=False),
)


def plan_jobs(suite: Suite) -> List[Dict[str, Any]]:
    """The jobs of a suite: ``dict(nproc=N, cases=[...])``, cheapest first."""
    jobs = []
    for model in suite.models:
        for n in suite.world_sizes:
            labels = STRATEGIES if n in suite.all_strategies_at.get(model, []) else ['DDP']
            for label in labels:
                jobs.append(dict(nproc=n, cases=[dict(
                    kind='memory', model=model, strategy=label,
                    name=f'memory/{model}/N{n}/{label}', batch_size=suite.memory_batch,
                    seq_len=suite.memory_seq, warmup=suite.memory_warmup,
                    steps=suite.memory_steps, warm_up=suite.memory_warm_up)]))
    for wrapper in ('fsdp1', 'fsdp2', 'ddp'):
        jobs.append(dict(nproc=suite.overhead_world_size, cases=[dict(
            kind='overhead', model=suite.overhead_model, wrapper=wrapper,
            also=['fsdp1'] if wrapper == 'fsdp2' else [],
            name=f'overhead/{suite.overhead_model}/N{suite.overhead_world_size}/{wrapper}',
            batch_size=suite.overhead_batch, seq_len=suite.overhead_seq,
            warmup=suite.overhead_warmup, steps=suite.overhead_steps)]))
    for n in suite.construction_world_sizes:
        for wrapper in ('fsdp2', 'fsdp1'):
            for init in ('eager', 'meta'):
                for repeat in range(suite.construction_repeats):
                    jobs.append(dict(nproc=n, cases=[dict(
                        kind='construction', model=suite.construction_model, init=init,
                        wrapper=wrapper, name=f'construction/{suite.construction_model}/N{n}/'
                        f'{wrapper}/{init}/{repeat}')]))
    for kind in CHECKPOINT_TYPES:
        jobs.append(dict(nproc=2, cases=[checkpoint_case(kind, suite.checkpoint_model,
                                                         suite.checkpoint_repeats)]))
    if suite.pack:
        packed: Dict[int, List[Dict[str, Any]]] = {}
        for job in jobs:
            packed.setdefault(job['nproc'], []).extend(job['cases'])
        jobs = [dict(nproc=n, cases=cases) for n, cases in sorted(packed.items())]
    return jobs


def _load(path: str) -> Dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def run_suite(mode: str, out: str, resume: bool = False,
              log: Any = sys.stderr, only: Optional[str] = None,
              repeats: Optional[int] = None) -> Dict[str, Any]:
    """Run every job of ``mode`` (``only``: of that kind); save the results to ``out`` after each.

    ``repeats`` overrides the suite's construction repeats.
    """
    suite = SUITES[mode]
    if repeats is not None:
        suite = dataclasses.replace(suite, construction_repeats=repeats)
    jobs = [job for job in plan_jobs(suite)
            if only is None or all(c['kind'] == only for c in job['cases'])]
    data = _load(out) if resume and os.path.exists(out) else None
    if data is None or data.get('mode') != mode:
        data = dict(mode=mode, machine=machine(), results=[], jobs=[],
                    started=utc_now())
    data['out'] = os.path.relpath(out, REPO) if os.path.abspath(out).startswith(REPO) else out
    done = {r['name'] for r in data['results']}
    todo = [(i, job) for i, job in enumerate(jobs, 1)
            if not all(c['name'] in done for c in job['cases'])]
    start = time.perf_counter()

    def run_job(job: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], float, float]:
        with open('/proc/loadavg') as f:
            load = float(f.read().split()[0])
        t0 = time.perf_counter()
        results = torchrun(job['cases'], job['nproc'])
        return results, time.perf_counter() - t0, load

    def record(i: int, job: Dict[str, Any], outcome: Tuple[List[Dict[str, Any]], float, float]
               ) -> None:
        results, wall, load = outcome
        names = [c['name'] for c in job['cases']]
        for result in results:
            result['job_wall_s'] = wall
        data['results'].extend(results)
        data['jobs'].append(dict(names=names, nproc=job['nproc'], wall_s=wall,
                                 load_before=load))
        _save(out, data)
        print(f'[{i}/{len(jobs)}] {", ".join(names)} (N={job["nproc"]}): {wall:.1f} s, '
              f'{time.perf_counter() - start:.0f} s so far', file=log, flush=True)

    if suite.pack:  # the smoke test: its few packed jobs run side by side
        with ThreadPoolExecutor(max_workers=len(todo) or 1) as pool:
            futures = [(i, job, pool.submit(run_job, job)) for i, job in todo]
            for i, job, future in futures:
                record(i, job, future.result())
    else:
        for i, job in todo:
            record(i, job, run_job(job))
    data['elapsed_s'] = data.get('elapsed_s', 0) + time.perf_counter() - start
    _save(out, data)
    return data


def main(argv: Optional[List[str]] = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    modes = parser.add_mutually_exclusive_group(required=True)
    for mode in SUITES:
        modes.add_argument(f'--{mode}', dest='mode', action='store_const', const=mode)
    modes.add_argument('--peers', dest='mode', action='store_const', const='peers',
                       help='the peers side by side (python -m benchmarks.peers --help; the '
                       'arguments after --peers go to it)')
    parser.add_argument('--out', help='results JSON (default: benchmarks/results/<mode>.json)')
    parser.add_argument('--resume', action='store_true',
                        help='keep the results already in --out and run only the missing jobs')
    parser.add_argument('--report', help='write the Markdown report here (default for --full: '
                        'docs/benchmarks.md)')
    parser.add_argument('--img-dir', help='directory of the plots (default: docs/img next to '
                        'the report)')
    parser.add_argument('--only', choices=['memory', 'overhead', 'construction', 'checkpoint'],
                        help='run only the jobs of this kind (use with --out)')
    parser.add_argument('--repeats', type=int, help='separate processes per construction case')
    args, rest = parser.parse_known_args(argv)
    if args.mode == 'peers':
        from . import peers
        return peers.main(rest + (['--out', args.out] if args.out else []))
    if rest:
        parser.error(f'unrecognized arguments: {" ".join(rest)}')
    out = args.out or os.path.join(REPO, 'benchmarks', 'results', f'{args.mode}.json')
    data = run_suite(args.mode, out, args.resume, only=args.only, repeats=args.repeats)
    from .report import render, write_report
    report = args.report or (os.path.join(REPO, 'docs', 'benchmarks.md')
                             if args.mode == 'full' else None)
    if report:
        write_report(data, report, args.img_dir)
        print(f'report: {report}', file=sys.stderr)
    else:
        print(render(data, img_dir=None))


if __name__ == '__main__':
    main()
