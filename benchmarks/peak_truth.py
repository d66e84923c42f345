"""Does the plan predict the peak? ``python -m benchmarks.peak_truth [--quick] [--resume]``.

Each case trains one model under one strategy, world size, activation
checkpointing setting and batch size through ``FSDPRunner`` (measured as
:mod:`benchmarks.memory` measures it: the resident set's high-water mark of a
training iteration above the process's resident set before the model was
built, with ``MALLOC_MMAP_THRESHOLD_`` set so freed tensors leave the resident
set; the maximum over ranks, median over iterations), and compares it with
``python -m mmfsdp.plan``'s prediction for the same config: model state +
gathered units + traced activations + the largest transient.

Results go to ``benchmarks/results/peak_truth.json`` after every case; the
table between the ``peak-truth`` markers of ``docs/benchmarks.md`` is rewritten.
Goal: |predicted - measured| <= 10 % of measured on every case.
"""
import argparse
import glob
import json
import os
import sys
from typing import Any, Dict, List, Optional

from .launch import REPO, JobFailed, torchrun

GOAL = 0.10
RESULTS_DIR = os.path.join(REPO, 'benchmarks', 'results')
AC = dict(layer_cls=['TransformerBlock'])
STRATEGY_NAMES = ['DDP', 'FSDP1 FULL_SHARD', 'FSDP2 reshard']
BEGIN, END = '<!-- peak-truth:begin -->', '<!-- peak-truth:end -->'
#: The allocator of the docs' table: glibc with the benchmarks' 1 MiB mmap threshold
#: (:data:`benchmarks.launch.MMAP_THRESHOLD`); the others are preloaded as the launch does.
MEASURED_ALLOCATOR = 'glibc'
CPU_ALLOCATORS = ('glibc', 'jemalloc', 'tcmalloc')


def predict(case: Dict[str, Any]) -> Dict[str, Any]:
    """The plan's step peak for a case, from its runner config (model built on meta)."""
    from mmfsdp.plan import heap_threshold, plan_for, step_peak, trace_for
    from mmfsdp.plan.batch import config_batch
    from mmfsdp.registry import MODEL_WRAPPERS

    from .workload import STRATEGIES, build_model, runner_cfg
    wrapper_cfg = dict(STRATEGIES[case['strategy']].wrapper_cfg, **case.get('wrapper_options', {}))
    cfg = runner_cfg(case['model'], wrapper_cfg, '/nonexistent', case['name'],
                     case['batch_size'], case['seq_len'], 1)
    batch, size = config_batch(cfg.train_dataloader, 'mmengine')
    wrapper_cls = MODEL_WRAPPERS.get(wrapper_cfg['type'].split('.', 1)[-1])
    model = build_model(case['model'], 'meta')
    plan = plan_for(wrapper_cls, wrapper_cfg, model, case['world_size'], dict(type='AdamW'))
    # under glibc the job's MALLOC_MMAP_THRESHOLD_ (the benchmarks' 1 MiB) fixes the threshold
    heap = heap_threshold('cpu', case.get('cpu_allocator', MEASURED_ALLOCATOR))
    return step_peak(plan, trace_for(wrapper_cls, wrapper_cfg, model, batch), size,
                     heap).to_dict()


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """Measure a case in this torchrun job (:func:`benchmarks.memory.run_case`), then predict."""
    import torch.distributed as dist

    from . import memory
    result = memory.run_case(case)
    if dist.get_rank() == 0:
        result['kind'] = 'peak'
        result['wrapper_options'] = case.get('wrapper_options', {})
        result['activation_checkpointing'] = bool(result['wrapper_options'])
        result['cpu_allocator'] = case.get('cpu_allocator', MEASURED_ALLOCATOR)
        result['predicted'] = predict(dict(case, world_size=dist.get_world_size()))
    return result


def cases(quick: bool = False, cpu_allocator: str = MEASURED_ALLOCATOR) -> List[Dict[str, Any]]:
    """The grid: model x N x strategy x AC x batch (DDP has no checkpointing option).

    Most informative first (sharded world sizes, the larger batch), so that a
    run cut short still covers every strategy and model. ``cpu_allocator`` is
    the jobs' malloc (named in the case unless the measured one).
    """
    suffix = '' if cpu_allocator == MEASURED_ALLOCATOR else f'/{cpu_allocator}'
    models = ['gpt-7m'] if quick else ['gpt-25m', 'gpt-100m']
    out = []
    for model in models:
        for n in (1, 2) if quick else (1, 2, 4):
            for strategy in STRATEGY_NAMES:
                for ac in (False, True) if strategy != 'DDP' else (False, ):
                    for batch in (2, 8):
                        out.append(dict(
                            kind='peak', model=model, strategy=strategy, nproc=n,
                            name=f'peak/{model}/N{n}/{strategy}/{"AC" if ac else "no-AC"}/b{batch}'
                                 f'{suffix}',
                            wrapper_options=dict(activation_checkpointing=AC) if ac else {},
                            batch_size=batch, seq_len=64, warmup=1, steps=2, warm_up=True,
                            cpu_allocator=cpu_allocator))
    world_order = {2: 0, 4: 1, 1: 2}
    return sorted(out, key=lambda c: (world_order[c['nproc']], c['batch_size'] != 8,
                                      c['model'] != models[0], c['name']))


def _error(r: Dict[str, Any]) -> float:
    measured = r['peak_bytes']['median']
    return (r['predicted']['peak_bytes'] - measured) / measured


INTRO = """## 12. The plan's step peak against the measured peak

`python -m benchmarks.peak_truth` (results: `benchmarks/results/peak_truth.json`) trains each case
through `FSDPRunner` and measures it as section 2 does: the resident set's high-water mark of a
training iteration above the resident set before the model was built (after the tiny-GPT warm-up,
with glibc's malloc under `MALLOC_MMAP_THRESHOLD_=1048576`, the threshold of
`env_cfg.cpu_allocator='release'` under which these cases ran), the maximum
over ranks, the median over the measured iterations (1 warm-up + 2 measured). "predicted" is
`python -m mmfsdp.plan --device cpu`'s step peak for the same config, computed on the
meta-device model without running it:

    peak = model states (exact) - freed gradients
         + gathered units (2 x the largest unit's parameters + its unsharded gradient;
                           every unit when they stay gathered)
         + heap + max(activations - heap, freed gradients) + max(traced transient, staging)

Activations are what is alive when a `FakeTensorMode` trace of one step (on a batch built from
the config's dataset and collate function) ends its forward; the traced transient is how far its
backward rises above them. FSDP1's and FSDP2's gradients are freed between steps (DDP's buckets
stay; with gradient accumulation none are freed), so backward's gradients take the place of the
activations it frees: the larger of the two counts. Two terms are the CPU host's
(`mmfsdp/plan/host.py`, `StepPeak.staging_bytes`):
**heap** = the activations in blocks below the 1 MiB mmap threshold, which glibc serves from its
heap and which stay resident after backward frees them, so they make no room for the gradients;
**staging** = one largest unit, the copy gloo makes of every all-gather output and reduce-scatter
input while the call lasts (FSDP issues those calls between the units' computations, so it counts
against the traced transient, not on top of it; 0 for DDP and at N = 1). The parts column shows
states + gathered + activations (heap part) + max(traced transient, staging).
Activation checkpointing (AC) is `activation_checkpointing=dict(layer_cls=['TransformerBlock'])`;
sequence length 64; fp32. Goal: |predicted - measured| <= 10 % of measured on every case."""

CAVEAT = """Measured on 2026-11-23 on the shared 2-core machine (memory does not depend on its
load): 26 cases before 08:00 UTC (1-minute load average 12-28), 34 between 11:09 and 11:51 UTC
(load 4-23), among them the two earlier misses, gpt-25m N = 2 batch 2 without AC (now 262.6 and
266.6 MiB, then 264.4 and 262.9). Predictions: the current code for all 60 (`--repredict`).

**How the two CPU terms were found** (gpt-25m, batch 2, `benchmarks`' workload, a probe
hook reading the high-water mark between phases of the iteration, and torch's profiler with
`profile_memory=True` for the live tensors):

- *Heap*: at batch 2 every activation of gpt-25m is a 256 KiB block except the MLP's 1 MiB
  hidden state; the trace puts 16.7 of its 32.7 MiB below 1 MiB. FSDP2 at N = 2 peaked at
  264 MiB with the 1 MiB threshold and at 244 MiB with a 64 KiB one (nothing then on the heap),
  and the resident set at the start of an iteration was 29 MiB above the model state with 1 MiB
  and 5 MiB with 64 KiB: what backward freed stayed resident. At batch 8 the blocks are 1 MiB
  and more, mapped on their own, and the term is under 1 MiB.
- *Staging*: on 4 ranks, a 48 MiB gloo reduce-scatter raised the resident set by 49.7 MiB during
  the call and a 48 MiB all-gather by 47.8 MiB; an all-reduce by 1.8 MiB. At the FSDP2 peak the
  profiler showed four unit-sized buffers alive where the plan had counted three. With the 64 KiB
  threshold, the resident peak (161.9 MiB at N = 4) was within 1.4 MiB of the live tensors.

With neither term, gpt-25m at batch 2 sharded over N = 2 missed by -11.1 % and -10.6 % and
gpt-7m showed a fixed 8-12 MiB; with the heap term alone, gpt-25m at batch 2 over N = 4 missed by
-10.6 % and -11.8 %. With both, gpt-7m (`--quick`, 4 of its cases re-run, not in the table):
FSDP1 N = 2 batch 2 +0.6 %, FSDP2 N = 2 batch 2 -2.8 %, FSDP2 N = 2 batch 8 -8.4 % (11 MiB
still unexplained), FSDP1 N = 1 batch 2 -5.9 %.

What is still left out: the rest of the allocator. A resident-set peak counts pages, not
tensors; glibc serves a request from free heap space left by earlier iterations before it maps new
memory, so DDP at batch 8 peaks by up to 100 MiB differently in consecutive iterations of one
process (435 and 533 MiB), which is why its median sits 9 % below the prediction. FSDP2 keeps each
unit's reduce-scatter input (a flat copy of its gradient) alive until the next unit reduces
(`reduce_scatter_max_input_buffers=1` in torch's `_fsdp_param_group.py`), which the plan counts
only as that unit's unsharded gradient; a likely part of why FSDP2 at N = 4, batch 2 sits 8 %
above the prediction (not profiled further). On an accelerator (`--device cuda`)
neither CPU term applies and the prediction is compared with `max_memory_allocated` (not measured
here)."""


def table(results: List[Dict[str, Any]]) -> str:
    """The Markdown section: what was run, one row per case, and the goal's verdict."""
    mib = 2 ** 20
    rows = [INTRO, '', '| model | strategy | N | AC | batch | measured MiB | predicted MiB | '
            'states + gathered + activations (heap) + max(traced transient, staging) MiB | '
            'error | within 10 % |',
            '|---|---|---|---|---|---|---|---|---|---|']
    for r in sorted(results, key=lambda r: (r['model'] != 'gpt-25m', r['world_size'],
                                            r['strategy'], r['activation_checkpointing'],
                                            r['batch_size'])):
        p = r['predicted']
        err = _error(r)
        rows.append(
            f"| {r['model']} | {r['strategy']} | {r['world_size']} | "
            f"{'on' if r['activation_checkpointing'] else 'off'} | {r['batch_size']} | "
            f"{r['peak_bytes']['median'] / mib:,.1f} "
            f"({r['peak_bytes']['min'] / mib:,.0f}–{r['peak_bytes']['max'] / mib:,.0f}) | "
            f"{p['peak_bytes'] / mib:,.1f} | "
            f"{p['model_state_bytes'] / mib:,.1f} + {p['gathered_bytes'] / mib:,.1f} + "
            f"{p['activation_bytes'] / mib:,.1f} ({p.get('heap_activation_bytes', 0) / mib:,.1f})"
            f" + max({p.get('traced_transient_bytes', p['transient_bytes']) / mib:,.1f}, "
            f"{p.get('staging_bytes', 0) / mib:,.1f}) | "
            f"{err:+.1%} | {'yes' if abs(err) <= GOAL else '**no**'} |")
    worst = max((abs(_error(r)) for r in results), default=0.0)
    passed = sum(abs(_error(r)) <= GOAL for r in results)
    grid = len(cases())
    run = {r['name'] for r in results}
    missing = [c['name'].split('/', 1)[1] for c in cases() if c['name'] not in run]
    rows += ['', f'**{passed} of {len(results)} cases within 10 %** (largest error {worst:.1%}); '
             f'{len(results)} of the {grid} cases of the full grid (gpt-25m / gpt-100m x N = 1, 2, '
             f'4 x DDP / FSDP1 FULL_SHARD / FSDP2 x AC off / on x batch 2, 8) were run'
             + (f"; not run: {', '.join(missing)}." if missing else '.'),
             '', CAVEAT]
    return '\n'.join(rows)


def results_path(cpu_allocator: str = MEASURED_ALLOCATOR) -> str:
    """``peak_truth.json`` for the measured allocator, ``peak_truth_<name>.json`` for another."""
    name = '' if cpu_allocator == MEASURED_ALLOCATOR else f'_{cpu_allocator}'
    return os.path.join(RESULTS_DIR, f'peak_truth{name}.json')


def other_allocator_lines(paths: List[str]) -> List[str]:
    """One line per run under another ``--cpu-allocator``: how many cases are within 10 %."""
    lines = []
    for path in paths:
        with open(path) as f:
            results = json.load(f)
        if not results:
            continue
        allocator = os.path.basename(path)[len('peak_truth_'):-len('.json')]  # results_path
        errors = sorted(_error(r) for r in results)
        passed = sum(abs(e) <= GOAL for e in errors)
        models = sorted({r['model'] for r in results})
        lines.append(f'Under {allocator} preloaded (`--cpu-allocator {allocator}`, '
                     f'`benchmarks/results/{os.path.basename(path)}`, {", ".join(models)}): '
                     f'**{passed} of {len(results)} cases within 10 %**, errors '
                     f'{errors[0]:+.1%} to {errors[-1]:+.1%}.')
    return lines


def write_section(results: List[Dict[str, Any]], path: str,
                  others: Optional[List[str]] = None) -> None:
    """Replace the text between the markers of ``path`` with the table.

    ``others``: results files of runs under other allocators (default: every
    ``peak_truth_<allocator>.json`` beside ``peak_truth.json``), one line each.
    """
    if others is None:
        others = sorted(glob.glob(results_path('*')))
    with open(path) as f:
        text = f.read()
    if BEGIN not in text:
        raise ValueError(f'{path} has no {BEGIN} marker')
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    extra = other_allocator_lines(others)
    body = table(results) + ('\n\n' + '\n'.join(extra) if extra else '')
    with open(path, 'w') as f:
        f.write(f'{head}{BEGIN}\n{body}\n{END}{tail}')


def _save(results: List[Dict[str, Any]], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(results, f, indent=1)


def _commit() -> str:
    import subprocess
    return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, text=True,
                          capture_output=True).stdout.strip()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true', help='gpt-7m at N = 1, 2 only')
    parser.add_argument('--resume', action='store_true', help='keep results already in --out')
    parser.add_argument('--only', help='run only cases whose name contains this')
    parser.add_argument('--shard', default='0/1', help='I/K: run every K-th case from the I-th '
                        '(K runs side by side, each with its own --out)')
    parser.add_argument('--repredict', action='store_true', help='measure nothing: recompute '
                        'the predictions of the results in --out with the current code')
    parser.add_argument('--cpu-allocator', default=MEASURED_ALLOCATOR, choices=CPU_ALLOCATORS,
                        help="the jobs' malloc; the docs' table is glibc's (1 MiB mmap "
                             'threshold), another goes to peak_truth_<name>.json and no section '
                             'is written')
    parser.add_argument('--out', default=None,
                        help='default: benchmarks/results/peak_truth[_<allocator>].json')
    parser.add_argument('--report', default=os.path.join(REPO, 'docs', 'benchmarks.md'))
    args = parser.parse_args(argv)
    measured = args.cpu_allocator == MEASURED_ALLOCATOR
    if args.out is None:
        args.out = results_path(args.cpu_allocator)
    results: List[Dict[str, Any]] = []
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    if args.repredict:
        for r in results:
            r['predicted'], r['predicted_by'] = predict(r), _commit()
        _save(results, args.out)
    done = {r['name'] for r in results}
    index, count = map(int, args.shard.split('/'))
    todo = cases(args.quick, args.cpu_allocator)[index::count]
    for case in todo if not args.repredict else []:
        if case['name'] in done or (args.only and args.only not in case['name']):
            continue
        try:
            results.extend(torchrun([case], case['nproc'],
                                    cpu_allocator=case['cpu_allocator']))
        except JobFailed as e:
            print(f'{case["name"]}: {e}', file=sys.stderr, flush=True)
            continue
        r = results[-1]
        r['predicted_by'] = _commit()
        print(f"{case['name']}: measured {r['peak_bytes']['median'] / 2**20:.1f} MiB, "
              f"predicted {r['predicted']['peak_bytes'] / 2**20:.1f} MiB ({_error(r):+.1%})",
              file=sys.stderr, flush=True)
        _save(results, args.out)
    if not args.quick and measured:
        write_section(results, args.report)
    print(table(results))


if __name__ == '__main__':
    main()
