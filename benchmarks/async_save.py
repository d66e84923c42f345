"""Seconds training is blocked per save, sync vs async: ``python -m benchmarks.async_save``.

One torchrun job per (strategy, world size, format): the demo GPT sharded per
``TransformerBlock`` with AdamW state after one step saves ``--repeats`` times
synchronously, then ``--repeats`` times with ``async_save=True``. Per save:

- **blocked**: from the call of ``save_checkpoint`` until it returns (the slowest rank); the
  first asynchronous save apart (it allocates the staged copy, which later saves reuse);
- **total**: until ``wait_for_checkpoint()``, called at once, returns (written and published);
- **peak**: rank 0's resident-set increase over the save, until published.

Glibc with the 1 MiB mmap threshold, so freed copies leave the resident set.
Block: ``async-save``.
"""
import argparse
import shutil
import time
from typing import Any, Dict, List, Optional

from .core import records
from .core.launch import torchrun
from .core.measure import peak_rss_bytes, reset_peak_rss, summary
from .core.workload import STRATEGIES, make_runner, runner_cfg, shared_tmpdir

FORMATS = ('full', 'sharded')
MODES = ('sync', 'async')


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: step once, then save synchronously and asynchronously."""
    import torch.distributed as dist
    work_dir = shared_tmpdir('mmfsdp-async-')
    measured: Dict[str, List[tuple]] = {mode: [] for mode in MODES}
    try:
        runner = make_runner(runner_cfg(case['model'], STRATEGIES[case['strategy']].wrapper_cfg,
                                        work_dir, case['name'], 2, 64, 1))
        runner.train()
        for mode in MODES:
            for i in range(case['repeats']):
                dist.barrier()
                before = reset_peak_rss()
                start = time.perf_counter()
                runner.save_checkpoint(work_dir, f'{mode}_{i}.pth', by_epoch=False,
                                       state_dict_type=case['type'], async_save=mode == 'async')
                blocked = time.perf_counter() - start
                runner.wait_for_checkpoint()
                measured[mode].append((blocked, time.perf_counter() - start,
                                       peak_rss_bytes() - before))
        del runner
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(work_dir, ignore_errors=True)
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, measured)
    if dist.get_rank():
        return {}
    out = dict(case, world_size=len(everyone))
    for mode in MODES:
        saves = list(zip(*(rank[mode] for rank in everyone)))  # per save, one tuple per rank
        out[mode] = dict(blocked_s=summary(max(r[0] for r in save) for save in saves),
                         total_s=summary(max(r[1] for r in save) for save in saves),
                         first_blocked_s=max(r[0] for r in saves[0]),
                         rank0_peak_bytes=max(save[0][2] for save in saves))
    return out


def table(results: List[Dict[str, Any]]) -> str:
    """One row per (strategy, format, N)."""
    rows = []
    for r in results:
        sync, background = r['sync'], r['async']
        s, a = sync['rank0_peak_bytes'], background['rank0_peak_bytes']
        blocked = sync['blocked_s']['median'], background['blocked_s']['median']
        rows.append([r['strategy'], r['type'], r['world_size'], f'{blocked[0]:.2f}',
                     f"{background['first_blocked_s']:.2f}", f'{blocked[1]:.2f}',
                     f'{blocked[1] / blocked[0]:.2f}',
                     f"{background['total_s']['median']:.2f}", records.mib(s, 0),
                     records.mib(a, 0), f'{(a - s) / records.MIB:+.0f}'])
    return records.table(
        ['wrapper', 'format', 'N', 'blocked sync (s)', 'blocked async, first save (s)',
         'blocked async (s)', 'async / sync',
         'written + published, async (s)', 'peak sync, rank 0 (MiB)',
         'peak async, rank 0 (MiB)', 'staging extra, rank 0 (MiB)'], rows)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.async_save',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-100m')
    parser.add_argument('--world-sizes', type=int, nargs='+', default=[2, 4])
    parser.add_argument('--repeats', type=int, default=3, help='saves per mode (medians)')
    parser.add_argument('--strategies', nargs='+', default=['FSDP1 FULL_SHARD', 'FSDP2 reshard'],
                        choices=list(STRATEGIES), metavar='STRATEGY',
                        help=f'labels of {list(STRATEGIES)}')
    parser.add_argument('--formats', nargs='+', default=list(FORMATS), choices=FORMATS)
    records.add_output_options(parser, 'async_save')
    args = parser.parse_args(argv)
    results = []
    for strategy in args.strategies:
        for n in args.world_sizes:
            for kind in args.formats:
                case = dict(type=kind, model=args.model, repeats=args.repeats, strategy=strategy,
                            name=f"async-save-{kind}-{strategy.replace(' ', '-')}")
                results += torchrun('async_save', [case], n)
                records.save_results(args.out, results)
    records.finish(args, {'async-save': records.header('python -m benchmarks.async_save')
                          + '\n\n' + table(results)})


if __name__ == '__main__':
    main()
