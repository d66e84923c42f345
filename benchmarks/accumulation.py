"""Gradient accumulation, sharded or unsharded: peak and communication per optimizer step.

``python -m benchmarks.accumulation``: one torchrun job per case (a process's
memory belongs to one case): the GPT under FSDP1 FULL_SHARD or FSDP2
``reshard_after_forward=True``, ``optim_wrapper.accumulative_counts = k`` and
``accumulation='sharded' | 'unsharded'`` (at k = 1 the modes do the same thing:
one case). Per optimizer step (k micro-steps and the update): the resident set's
high-water mark over the step minus the resident set before the model was built,
and the ring send volume of every collective of the step; the first ``--warmup``
steps are dropped, figures are the maximum over ranks.

Theory for ZeRO-3 (P parameters, b = 4 bytes, N ranks), per step: each micro-step
all-gathers the parameters twice (forward, backward); ``'sharded'`` reduce-scatters
every micro-step, ``3k(N-1)/N·P·b``; ``'unsharded'`` once, ``(2k+1)(N-1)/N·P·b``.
``--resume`` keeps the cases already in ``--out``, so runs with and without
``--activation-checkpointing`` add up to one table. Block: ``accumulation``.
"""
import argparse
import tempfile
from typing import Any, Dict, List, Optional

from .core import records
from .core.launch import torchrun
from .core.measure import CollectiveCounter, peak_rss_bytes, reset_peak_rss, rss_bytes, summary
from .core.records import mib
from .core.workload import (
    BYTES_PER_ELEMENT,
    CHECKPOINT_BLOCKS,
    fsdp1_cfg,
    fsdp2_cfg,
    make_runner,
    parameter_count,
    runner_cfg,
    warm_up,
)

WRAPPERS = {'fsdp1': fsdp1_cfg, 'fsdp2': fsdp2_cfg}


def comm_factor(mode: str, counts: int, world_size: int) -> float:
    """Communication bytes per rank per optimizer step, as a multiple of P·b (ZeRO-3)."""
    ring = (world_size - 1) / world_size
    return ring * (3 * counts if mode == 'sharded' else 2 * counts + 1)


def plan_cases(model: str, wrappers: List[str], world_sizes: List[int], counts: List[int],
               batch_size: int, seq_len: int, warmup: int, steps: int,
               ac: bool = False) -> List[Dict[str, Any]]:
    """One case per (N, wrapper, k, mode); k = 1 once (no micro-steps to differ)."""
    tag = '/ac' if ac else ''
    return [dict(world_size=n, model=model, wrapper=wrapper, counts=k, mode=mode,
                 batch_size=batch_size, seq_len=seq_len, warmup=warmup, steps=steps, ac=ac,
                 name=f'accumulation/{model}/N{n}/{wrapper}{tag}/k{k}/{mode}')
            for n in world_sizes for wrapper in wrappers for k in counts
            for mode in (['sharded'] if k == 1 else ['sharded', 'unsharded'])]


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: train ``warmup + steps`` optimizer steps of one case."""
    import torch.distributed as dist
    from mmengine.hooks import Hook
    counts = case['counts']
    wrapper = dict(WRAPPERS[case['wrapper']](), accumulation=case['mode'])
    if case['ac']:
        wrapper['activation_checkpointing'] = CHECKPOINT_BLOCKS
    counter = CollectiveCounter()

    class OptimizerStepProbe(Hook):
        def __init__(self) -> None:
            self.records: List[Dict[str, Any]] = []

        def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
            if runner.iter % counts == 0:
                counter.reset()
                reset_peak_rss()

        def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                             outputs: Any = None) -> None:
            if (runner.iter + 1) % counts == 0:
                self.records.append(dict(peak=peak_rss_bytes(), **counter.snapshot()))

    warm_up(wrapper, case['name'])
    baseline = rss_bytes()  # before the model is built
    with tempfile.TemporaryDirectory(prefix='mmfsdp-bench-') as work_dir, counter:
        cfg = runner_cfg(case['model'], wrapper, work_dir, case['name'], case['batch_size'],
                         case['seq_len'], counts * (case['warmup'] + case['steps']))
        cfg.optim_wrapper['accumulative_counts'] = counts
        runner = make_runner(cfg)
        probe = OptimizerStepProbe()
        runner.register_hook(probe, priority='VERY_LOW')
        runner.train()
        del runner
    measured = probe.records[case['warmup']:]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(baseline=baseline, records=measured))
    if dist.get_rank():
        return {}
    params = parameter_count(case['model'])
    steps = range(len(measured))
    return dict(case, params=params, world_size=len(gathered),
                peak_bytes=summary(max(g['records'][i]['peak'] - g['baseline'] for g in gathered)
                                   for i in steps),
                comm_send_bytes=summary(max(g['records'][i]['send_bytes'] for g in gathered)
                                        for i in steps),
                comm_by_op=measured[-1]['by_op'],
                theory_comm_bytes=comm_factor(case['mode'], counts, len(gathered)) * params
                * BYTES_PER_ELEMENT)


def _step(warmup: int, steps: int) -> str:
    if warmup == 0:
        return 'step 1 (AdamW state made at its end)'
    return f'step {warmup + 1}' if steps == 1 else f'steps {warmup + 1}–{warmup + steps}'


def table(results: List[Dict[str, Any]]) -> str:
    """Peak against k = 1 of the same wrapper, N and checkpointing; communication
    against theory; the extra reduce-scatters; what accumulation adds in gradient shards."""
    def key(r: Dict[str, Any]) -> tuple:
        return r.get('ac', False), r['wrapper'], r['world_size'], r.get('warmup', 1)

    base = {key(r): r['peak_bytes'] for r in results if r['counts'] == 1}
    comm = {(key(r), r['counts'], r['mode']): r['comm_send_bytes']['median'] for r in results}
    rows = []
    for r in sorted(results, key=lambda r: (*key(r), r['counts'], r['mode'])):
        n, k, ref = r['world_size'], r['counts'], base.get(key(r))
        if ref is None:
            continue
        peak, sent = r['peak_bytes']['median'], r['comm_send_bytes']['median']
        pb = r['params'] * BYTES_PER_ELEMENT
        if k == 1:
            highest = (f"{mib(r['peak_bytes']['min'])}–{mib(r['peak_bytes']['max'])} over "
                       f"{r['peak_bytes']['n']} steps" if r['peak_bytes']['n'] > 1 else '')
        else:
            highest = f"{peak / ref['max']:.3f}"
        unsharded = comm.get((key(r), k, 'unsharded'))
        extra = (f'{(sent - unsharded) / ((k - 1) * (n - 1) / n * pb):.4f}'
                 if r['mode'] == 'sharded' and k > 1 and unsharded is not None else '')
        rows.append([f"{r['wrapper']}{' + AC' if r.get('ac') else ''}", n,
                     _step(r.get('warmup', 1), r['steps']), k,
                     r['mode'] if k > 1 else '(either)', mib(peak),
                     f"{peak / ref['median']:.3f}", highest, mib(sent),
                     mib(r['theory_comm_bytes']), f"{sent / r['theory_comm_bytes']:.4f}", extra,
                     f"{(peak - ref['median']) / (pb / n):.2f}" if k > 1 else ''])
    return records.table(
        ['wrapper', 'N', 'measured step', 'k', 'accumulation', 'peak MiB', 'peak / peak at k=1',
         "peak / k=1's highest step", 'comm MiB / step', 'theory MiB', 'comm / theory',
         '(sharded − unsharded) / (k−1)(N−1)/N·P·b', '(peak − peak at k=1) / P·b/N'], rows)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.accumulation',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-100m')
    parser.add_argument('--wrappers', nargs='+', default=list(WRAPPERS), choices=list(WRAPPERS))
    parser.add_argument('--world-sizes', type=int, nargs='+', default=[2, 4])
    parser.add_argument('--counts', type=int, nargs='+', default=[1, 2, 4],
                        help='accumulative_counts k')
    parser.add_argument('--batch-size', type=int, default=2)
    parser.add_argument('--seq-len', type=int, default=64)
    parser.add_argument('--warmup', type=int, default=1, help='optimizer steps not measured')
    parser.add_argument('--steps', type=int, default=1, help='optimizer steps measured')
    parser.add_argument('--activation-checkpointing', action='store_true',
                        help='every block under activation checkpointing')
    parser.add_argument('--resume', action='store_true', help='keep the cases already in --out')
    records.add_output_options(parser, 'accumulation')
    args = parser.parse_args(argv)
    results = records.load_results(args.out) if args.resume else []
    done = {r['name'] for r in results}
    for case in plan_cases(args.model, args.wrappers, args.world_sizes, args.counts,
                           args.batch_size, args.seq_len, args.warmup, args.steps,
                           args.activation_checkpointing):
        if case['name'] not in done:
            results += torchrun('accumulation', [case], case['world_size'], timeout=3600)
            records.save_results(args.out, results)
    records.finish(args, {'accumulation': records.header('python -m benchmarks.accumulation')
                          + '\n\n' + table(results)})


if __name__ == '__main__':
    main()
