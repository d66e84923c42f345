"""Asynchronous saves (issue 27 §1): seconds training is blocked per save, sync vs async.

Usage::

    python -m benchmarks.async_save [--model gpt-100m --world-sizes 2 4 --repeats 2
                                     --strategies 'FSDP1 FULL_SHARD' 'FSDP2 reshard']

One torchrun job per (strategy, world size, format): the demo GPT sharded per
``TransformerBlock`` with AdamW state after one step saves
``repeats`` times synchronously, then ``repeats`` times with
``async_save=True``. Per save and rank:

- **blocked**: from the call of ``save_checkpoint`` until it returns (what
  training waits for); the slowest rank counts;
- **total**: until the checkpoint is written and published
  (``wait_for_checkpoint()`` called at once, so the write does not compete
  with training here);
- **peak**: the increase of the resident set over its value just before the
  save, until published (the kernel's high-water mark, reset there); the
  staging copy is the difference between the two modes.

The jobs run under glibc with ``MALLOC_MMAP_THRESHOLD_`` set (see
:data:`benchmarks.launch.MMAP_THRESHOLD`), so freed copies leave the resident set.
"""
import argparse
import json
import shutil
import tempfile
import time
from typing import Any, Dict, List

from .measure import peak_rss_bytes, reset_peak_rss, summary
from .workload import STRATEGIES, make_runner, runner_cfg

__all__ = ['case', 'run_case', 'table']

FORMATS = ('full', 'sharded')


def case(kind: str, model: str, repeats: int,
         strategy: str = 'FSDP1 FULL_SHARD') -> Dict[str, Any]:
    """The case of one checkpoint format; both modes run in its job."""
    return dict(kind='async_save', type=kind, model=model, repeats=repeats, strategy=strategy,
                name=f'async-save-{kind}-{model}-{strategy.replace(" ", "-")}')


def _save(runner: Any, work_dir: str, name: str, kind: str, background: bool) -> tuple:
    import torch.distributed as dist
    dist.barrier()
    before = reset_peak_rss()
    start = time.perf_counter()
    runner.save_checkpoint(work_dir, name, by_epoch=False, state_dict_type=kind,
                           async_save=background)
    blocked = time.perf_counter() - start
    runner.wait_for_checkpoint()
    total = time.perf_counter() - start
    return blocked, total, peak_rss_bytes() - before


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """One torchrun rank: build, step once, then save synchronously and asynchronously."""
    import torch.distributed as dist
    kind, repeats = case['type'], case['repeats']
    work_dir = tempfile.mkdtemp(prefix=f'mmfsdp-async-{kind}-') if dist.get_rank() == 0 else None
    holder = [work_dir]
    dist.broadcast_object_list(holder, src=0)
    work_dir = holder[0]
    measured: Dict[str, List[tuple]] = {'sync': [], 'async': []}
    try:
        cfg = runner_cfg(case['model'], STRATEGIES[case['strategy']].wrapper_cfg, work_dir,
                         case['name'], 2, 64, 1)
        runner = make_runner(cfg)
        runner.train()
        for mode in ('sync', 'async'):
            for i in range(repeats):
                measured[mode].append(_save(runner, work_dir, f'{mode}_{i}.pth', kind,
                                            mode == 'async'))
        del runner
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(work_dir, ignore_errors=True)
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, measured)
    if dist.get_rank() != 0:
        return {}
    out: Dict[str, Any] = dict(kind='async_save', name=case['name'], type=kind,
                               model=case['model'], strategy=case['strategy'],
                               world_size=dist.get_world_size())
    for mode in ('sync', 'async'):
        per_save = list(zip(*(rank[mode] for rank in everyone)))  # one tuple of ranks per save
        out[mode] = dict(blocked_s=summary(max(r[0] for r in save) for save in per_save),
                         total_s=summary(max(r[1] for r in save) for save in per_save),
                         rank0_peak_bytes=max(save[0][2] for save in per_save),
                         max_peak_bytes=max(r[2] for save in per_save for r in save))
    return out


def table(results: List[Dict[str, Any]]) -> str:
    """The Markdown table of ``results``."""
    mib = 1 << 20
    lines = ['| wrapper | format | N | blocked sync (s) | blocked async (s) | async / sync | '
             'written + published, async (s) | peak sync, rank 0 (MiB) | '
             'peak async, rank 0 (MiB) | staging extra, rank 0 (MiB) |',
             '|---|---|---|---|---|---|---|---|---|---|']
    for r in results:
        sync, background = r['sync'], r['async']
        ratio = background['blocked_s']['median'] / sync['blocked_s']['median']
        lines.append(
            f"| {r.get('strategy', 'FSDP1 FULL_SHARD')} | {r['type']} | {r['world_size']} | "
            f"{sync['blocked_s']['median']:.2f} | "
            f"{background['blocked_s']['median']:.2f} | {ratio:.2f} | "
            f"{background['total_s']['median']:.2f} | {sync['rank0_peak_bytes'] / mib:.0f} | "
            f"{background['rank0_peak_bytes'] / mib:.0f} | "
            f"{(background['rank0_peak_bytes'] - sync['rank0_peak_bytes']) / mib:+.0f} |")
    return '\n'.join(lines)


def main() -> None:
    """Command-line entry point: one torchrun job per (world size, format); JSON, then a table."""
    from .launch import torchrun
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-100m')
    parser.add_argument('--world-sizes', type=int, nargs='+', default=[2, 4])
    parser.add_argument('--repeats', type=int, default=2)
    parser.add_argument('--strategies', nargs='+', default=['FSDP1 FULL_SHARD', 'FSDP2 reshard'],
                        help='labels of benchmarks.workload.STRATEGIES')
    parser.add_argument('--out', help='also write the results (JSON lines) here')
    args = parser.parse_args()
    results = []
    for strategy in args.strategies:
        for world_size in args.world_sizes:
            for kind in FORMATS:
                result, = torchrun([case(kind, args.model, args.repeats, strategy)], world_size,
                                   exact_allocator=True)
                print(json.dumps(result), flush=True)
                results.append(result)
                if args.out:
                    with open(args.out, 'a') as f:
                        f.write(json.dumps(result) + '\n')
    print(table(results))


if __name__ == '__main__':
    main()
