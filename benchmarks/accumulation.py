"""Gradient accumulation: peak and communication per optimizer step, ``accumulation`` modes.

``python -m benchmarks.accumulation [--world-sizes 2 4] [--wrappers fsdp1 fsdp2]
[--counts 1 2 4] [--out benchmarks/results/accumulation.json] [--resume]``

One torchrun job per case (a process's memory belongs to one case): the GPT of
``--model`` (gpt-100m) under FSDP1 FULL_SHARD or FSDP2 ``reshard_after_forward=True``,
``optim_wrapper.accumulative_counts = k`` and ``accumulation='sharded' |
'unsharded'`` (at k = 1 the modes do the same thing: one case). Per optimizer
step (k micro-steps and the update) a hook measures, as :mod:`benchmarks.memory`
does per iteration:

- **peak**: the resident set's high-water mark over the step (reset at its
  first micro-step) minus the resident set before the model was built;
- **communication**: the ring send volume of every collective of the step.

The first ``--warmup`` steps (AdamW allocates its state in the first) are
dropped; figures are the maximum over ranks. Theory for ZeRO-3 (P parameters,
b = 4 bytes, N ranks), per step: each micro-step all-gathers the parameters
twice (forward, backward); ``'sharded'`` reduce-scatters every micro-step,
``3k(N-1)/N·P·b``; ``'unsharded'`` once, ``(2k+1)(N-1)/N·P·b``: the
difference is the k-1 extra reduce-scatters.
"""
import argparse
import json
import os
import tempfile
from typing import Any, Dict, List, Optional

__all__ = ['WRAPPERS', 'comm_factor', 'load', 'main', 'plan_cases', 'run_case', 'section_lines',
           'table']

#: label -> ``model_wrapper_cfg`` (without ``accumulation``)
WRAPPERS: Dict[str, Dict[str, Any]] = {
    'fsdp1': dict(type='mmfsdp.MMFullyShardedDataParallel', sharding_strategy='FULL_SHARD',
                  auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock'])),
    'fsdp2': dict(type='mmfsdp.MMFullyShard', reshard_after_forward=True,
                  auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock'])),
}
#: ``model_wrapper_cfg.activation_checkpointing`` of the ``--activation-checkpointing`` cases.
AC = dict(layer_cls=['TransformerBlock'])
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results',
                           'accumulation.json')


def comm_factor(mode: str, counts: int, world_size: int) -> float:
    """Communication bytes per rank per optimizer step, as a multiple of P·b (ZeRO-3)."""
    ring = (world_size - 1) / world_size
    return ring * (3 * counts if mode == 'sharded' else 2 * counts + 1)


def _probe(counter: Any, counts: int) -> Any:
    from mmengine.hooks import Hook

    from .measure import peak_rss_bytes, reset_peak_rss

    class _OptimizerStepProbe(Hook):
        """Peak and communication of every optimizer step (``counts`` iterations)."""

        def __init__(self) -> None:
            self.records: List[Dict[str, Any]] = []

        def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
            if runner.iter % counts == 0:
                counter.reset()
                reset_peak_rss()

        def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                             outputs: Any = None) -> None:
            if (runner.iter + 1) % counts == 0:
                comm = counter.snapshot()
                self.records.append(dict(peak_bytes=peak_rss_bytes(),
                                         send_bytes=comm['send_bytes'], by_op=comm['by_op']))

    return _OptimizerStepProbe()


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``warmup + steps`` optimizer steps of one case; return the result (rank 0)."""
    import torch.distributed as dist

    from .comm import CollectiveCounter
    from .measure import rss_bytes, summary
    from .workload import BYTES_PER_ELEMENT, build_model, make_runner, runner_cfg, warm_up
    counts, mode = case['counts'], case['mode']
    wrapper = dict(WRAPPERS[case['wrapper']], accumulation=mode)
    if case.get('ac'):
        wrapper['activation_checkpointing'] = AC
    warm_up(wrapper, case['name'])
    baseline = rss_bytes()  # before the model is built
    counter = CollectiveCounter()
    with tempfile.TemporaryDirectory(prefix='mmfsdp-bench-') as work_dir, counter:
        cfg = runner_cfg(case['model'], wrapper, work_dir, case['name'].replace('/', '-'),
                         case['batch_size'], case['seq_len'],
                         counts * (case['warmup'] + case['steps']))
        cfg.optim_wrapper['accumulative_counts'] = counts
        runner = make_runner(cfg)
        probe = _probe(counter, counts)
        runner.register_hook(probe, priority='VERY_LOW')
        runner.train()
        del runner
    records = probe.records[case['warmup']:]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(baseline=baseline, records=records))
    if dist.get_rank() != 0:
        return {}
    world = dist.get_world_size()
    params = sum(p.numel() for p in build_model(case['model'], 'meta').parameters())
    peak = [max(g['records'][i]['peak_bytes'] - g['baseline'] for g in gathered)
            for i in range(len(records))]
    comm = [max(g['records'][i]['send_bytes'] for g in gathered) for i in range(len(records))]
    return dict(kind='accumulation', name=case['name'], model=case['model'],
                wrapper=case['wrapper'], ac=bool(case.get('ac')), mode=mode, counts=counts,
                world_size=world,
                params=params, batch_size=case['batch_size'], seq_len=case['seq_len'],
                warmup=case['warmup'], steps=len(records), peak_bytes=summary(peak),
                comm_send_bytes=summary(comm),
                comm_by_op=records[-1]['by_op'],
                theory_comm_bytes=comm_factor(mode, counts, world) * params * BYTES_PER_ELEMENT)


def plan_cases(model: str, wrappers: List[str], world_sizes: List[int], counts: List[int],
               batch_size: int, seq_len: int, warmup: int, steps: int,
               ac: bool = False) -> List[Dict[str, Any]]:
    """One case per (world size, wrapper, k, mode); k = 1 once (no micro-steps to differ).

    ``ac``: every block under activation checkpointing (:data:`AC`).
    """
    cases = []
    tag = '/ac' if ac else ''
    for n in world_sizes:
        for wrapper in wrappers:
            for k in counts:
                for mode in (['sharded'] if k == 1 else ['sharded', 'unsharded']):
                    cases.append(dict(
                        kind='accumulation', nproc=n, model=model, wrapper=wrapper, counts=k,
                        mode=mode, batch_size=batch_size, seq_len=seq_len, warmup=warmup,
                        steps=steps, ac=ac,
                        name=f'accumulation/{model}/N{n}/{wrapper}{tag}/k{k}/{mode}'))
    return cases


def _mib(b: float) -> str:
    return f'{b / 2**20:,.1f}'


def _step(warmup: int, steps: int = 1) -> str:
    if warmup == 0:
        return 'step 1 (AdamW state made at its end)'
    return f'step {warmup + 1}' if steps == 1 else f'steps {warmup + 1}–{warmup + steps}'


def table(results: List[Dict[str, Any]]) -> str:
    """The markdown table: peak vs k = 1, communication vs theory, the extra reduce-scatters."""
    from .workload import BYTES_PER_ELEMENT
    def key(r: Dict[str, Any]) -> tuple:
        return r.get('ac', False), r['wrapper'], r['world_size'], r.get('warmup', 1)

    base = {key(r): r['peak_bytes']['median'] for r in results if r['counts'] == 1}
    worst = {key(r): r['peak_bytes']['max'] for r in results if r['counts'] == 1}
    comm = {(key(r), r['counts'], r['mode']): r['comm_send_bytes']['median'] for r in results}
    lines = ['| wrapper | N | measured step | k | accumulation | peak MiB | peak / peak at k=1 '
             '| peak / k=1\'s highest step | comm MiB / step | theory MiB | comm / theory '
             '| (sharded − unsharded) / (k−1)(N−1)/N·P·b | (peak − peak at k=1) / P·b/N |',
             '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
    for r in sorted(results, key=lambda r: (*key(r), r['counts'], r['mode'])):
        n, k = r['world_size'], r['counts']
        ref = base.get(key(r))
        if not ref:
            continue
        peak, sent = r['peak_bytes']['median'], r['comm_send_bytes']['median']
        if k == 1:
            spread = (f"{_mib(r['peak_bytes']['min'])}–{_mib(r['peak_bytes']['max'])} "
                      f"over {r['peak_bytes']['n']} steps" if r['peak_bytes']['n'] > 1 else '')
        else:
            spread = f'{peak / worst[key(r)]:.3f}'
        extra, over = '', ''
        if k > 1:  # what accumulation adds, against the gradient shard it has to keep
            over = f"{(peak - ref) / (r['params'] * BYTES_PER_ELEMENT / n):.2f}"
        other = comm.get((key(r), k, 'unsharded'))
        if r['mode'] == 'sharded' and k > 1 and other is not None:
            theory = (k - 1) * (n - 1) / n * r['params'] * BYTES_PER_ELEMENT
            extra = f'{(sent - other) / theory:.4f}'
        lines.append(
            f"| {r['wrapper']}{' + AC' if r.get('ac') else ''} | {n} | "
            f"{_step(r.get('warmup', 1), r['steps'])} | {k} | "
            f"{r['mode'] if k > 1 else '(either)'} | "
            f"{_mib(peak)} | {peak / ref:.3f} | {spread} | {_mib(sent)} | "
            f"{_mib(r['theory_comm_bytes'])} | "
            f"{sent / r['theory_comm_bytes']:.4f} | {extra} | {over} |")
    return '\n'.join(lines)


def load(path: str = DEFAULT_OUT) -> Dict[str, Any]:
    """The recorded results and notes (empty when the file is absent)."""
    if not os.path.exists(path):
        return dict(results=[], notes=[])
    with open(path) as f:
        return json.load(f)


def section_lines(data: Dict[str, Any]) -> List[str]:
    """The section of ``docs/benchmarks.md`` (nothing without results)."""
    results = data.get('results', [])
    if not results:
        return []
    r0 = results[0]
    return [
        '## 8. Gradient accumulation: sharded or unsharded', '',
        f"`python -m benchmarks.accumulation` ({r0['model']}, batch {r0['batch_size']} × "
        f"{r0['seq_len']} tokens per rank and micro-step, fp32 AdamW; FSDP1 FULL_SHARD and FSDP2 "
        '`reshard_after_forward=True`, one unit per block). Per **optimizer step** of k '
        'micro-steps: the peak resident set over the step minus the resident set before the '
        'model was built (maximum over ranks), and the ring send volume of every collective '
        'of the step. Theory (ZeRO-3, P·b parameter bytes): `\'sharded\'` 3k(N−1)/N·P·b, '
        '`\'unsharded\'` (2k+1)(N−1)/N·P·b: the difference is the k−1 extra '
        'reduce-scatters. Goals: `\'sharded\'` peak ≤ 1.05 × the peak at k = 1; '
        'communication within 5 % of theory. The last column is what accumulation adds to '
        'the peak in units of one gradient shard (P·b/N), the memory any accumulation has '
        'to keep between micro-steps: ≤ 1 is the bound `\'sharded\'` can reach.', '',
        table(results), ''] + [f'- {note}' for note in data.get('notes', [])] + ['']


def main(argv: Optional[List[str]] = None) -> None:
    from .launch import torchrun
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-100m')
    parser.add_argument('--wrappers', nargs='+', default=list(WRAPPERS), choices=list(WRAPPERS))
    parser.add_argument('--world-sizes', type=int, nargs='+', default=[2, 4])
    parser.add_argument('--counts', type=int, nargs='+', default=[1, 2, 4])
    parser.add_argument('--batch-size', type=int, default=2)
    parser.add_argument('--seq-len', type=int, default=64)
    parser.add_argument('--warmup', type=int, default=1, help='optimizer steps not measured')
    parser.add_argument('--steps', type=int, default=1, help='optimizer steps measured')
    parser.add_argument('--activation-checkpointing', action='store_true',
                        help='every block under activation checkpointing')
    parser.add_argument('--out', default=DEFAULT_OUT)
    parser.add_argument('--resume', action='store_true', help='skip the cases in --out')
    parser.add_argument('--pack', action='store_true',
                        help='one job per world size and wrapper (saves the start-ups; each '
                        'case still takes its own baseline before building its model, but '
                        'what the heap kept from earlier cases is in it, so later cases read '
                        'low: gpt-100m N=4 FSDP1 k=4 sharded, 460 MiB packed, 596 alone)')
    args = parser.parse_args(argv)
    cases = plan_cases(args.model, args.wrappers, args.world_sizes, args.counts,
                       args.batch_size, args.seq_len, args.warmup, args.steps,
                       args.activation_checkpointing)
    done: List[Dict[str, Any]] = []
    kept: Dict[str, Any] = {}  # what a resumed file holds besides results (its notes)
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            kept = json.load(f)
        done = kept.pop('results')
    names = {r['name'] for r in done}
    jobs: Dict[Any, List[Dict[str, Any]]] = {}
    for case in cases:
        if case['name'] not in names:
            key = (case['nproc'], case['wrapper']) if args.pack else case['name']
            jobs.setdefault(key, []).append(case)
    for job in jobs.values():
        nproc = job[0]['nproc']
        job = [{k: v for k, v in case.items() if k != 'nproc'} for case in job]
        print(f"running {', '.join(case['name'] for case in job)}", flush=True)
        done.extend(torchrun(job, nproc, timeout=3600))
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, 'w') as f:
            json.dump(dict(kept, results=done, packed=args.pack), f, indent=1)
    print(table(done))


if __name__ == '__main__':
    main()
