"""Checkpoint cost, full vs sharded: ``python -m benchmarks.checkpoint_cost``.

One torchrun job per checkpoint type (a process's memory belongs to one type):
the demo GPT under FSDP1 FULL_SHARD per ``TransformerBlock`` with AdamW state
after one step saves ``--repeats`` times and resumes ``--repeats`` times (model +
optimizer + schedulers). Times are medians over the repeats; the peaks are rank 0's
resident-set increase over its value just before the first save (resp. resume),
from the kernel's high-water mark reset there. Block: ``checkpoint-cost``.
"""
import argparse
import os
import shutil
import time
from functools import partial
from typing import Any, Dict, List, Optional

from .core import records
from .core.launch import torchrun
from .core.measure import peak_rss_bytes, reset_peak_rss, summary
from .core.records import mib, spread
from .core.workload import STRATEGIES, make_runner, runner_cfg, shared_tmpdir

TYPES = ('full', 'sharded')


def directory_bytes(path: str) -> int:
    """Bytes of a file, or of every file under a directory."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def timed_barriers(fn: Any) -> float:
    """Seconds of ``fn()`` between two barriers."""
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: step once, then save and resume ``repeats`` times."""
    import torch.distributed as dist
    kind, repeats = case['type'], case['repeats']
    work_dir = shared_tmpdir(f'mmfsdp-ckpt-{kind}-')
    try:
        runner = make_runner(runner_cfg(case['model'], STRATEGIES['FSDP1 FULL_SHARD'].wrapper_cfg,
                                        work_dir, case['name'], 2, 64, 1))
        runner.train()
        path = os.path.join(work_dir, 'iter_1.pth')
        save = partial(runner.save_checkpoint, work_dir, 'iter_1.pth', by_epoch=False,
                       state_dict_type=kind)
        before = reset_peak_rss()
        saves = [timed_barriers(save) for _ in range(repeats)]
        peak_save = peak_rss_bytes() - before
        before = reset_peak_rss()
        loads = [timed_barriers(partial(runner.resume, path)) for _ in range(repeats)]
        peak_load = peak_rss_bytes() - before
        size = directory_bytes(path) if dist.get_rank() == 0 else 0
        del runner, save
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(work_dir, ignore_errors=True)
    if dist.get_rank():
        return {}
    return dict(case, world_size=dist.get_world_size(), save_s=summary(saves),
                load_s=summary(loads), bytes=size, rank0_peak_save_bytes=peak_save,
                rank0_peak_load_bytes=peak_load)


def table(results: List[Dict[str, Any]]) -> str:
    """One row per checkpoint type."""
    rows = [[r['type'], spread(r['save_s']), spread(r['load_s']), f"{r['bytes'] / 1e6:.0f}",
             f"+{mib(r['rank0_peak_save_bytes'])} MiB", f"+{mib(r['rank0_peak_load_bytes'])} MiB"]
            for r in results]
    return records.table(['type', 'save s', 'resume s', 'size MB', 'rank-0 peak during save',
                          'rank-0 peak during resume'], rows)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.checkpoint_cost',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-25m')
    parser.add_argument('--world-size', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=3)
    records.add_output_options(parser, 'checkpoint_cost')
    args = parser.parse_args(argv)
    results = []
    for kind in TYPES:
        case = dict(type=kind, model=args.model, repeats=args.repeats, name=f'ckpt-{kind}')
        results += torchrun('checkpoint_cost', [case], args.world_size)
        records.save_results(args.out, results)
    records.finish(args, {'checkpoint-cost': records.header('python -m benchmarks.checkpoint_cost')
                          + '\n\n' + table(results)})


if __name__ == '__main__':
    main()
