"""Item 6: checkpoint cost, full vs sharded: save / load time, size, rank-0 peak memory.

Usage (standalone; the suite runs the same cases)::

    python -m benchmarks.checkpoint_cost [--model gpt-100m --world-size 2 --repeats 3]

Each checkpoint type is measured in its own torchrun job, so that a process's
memory belongs to one type. The model is the demo GPT with FSDP1 FULL_SHARD
per ``TransformerBlock`` and AdamW state after one step. A job saves
``repeats`` times and resumes ``repeats`` times (model + optimizer +
schedulers); the peaks are the increase of the resident set over its value
just before the first save (resp. resume), from the kernel's high-water mark,
reset at that moment.
"""
import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List

from .measure import peak_rss_bytes, reset_peak_rss, summary
from .workload import STRATEGIES, make_runner, runner_cfg

__all__ = ['TYPES', 'case', 'run_case']

TYPES = ('full', 'sharded')


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def case(kind: str, model: str, repeats: int) -> Dict[str, Any]:
    """The case of one checkpoint type."""
    return dict(kind='checkpoint', type=kind, model=model, repeats=repeats,
                name=f'ckpt-{kind}-{model}')


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """One torchrun rank: build, step once, then save and resume ``repeats`` times."""
    import torch
    import torch.distributed as dist
    kind, repeats = case['type'], case['repeats']
    work_dir = tempfile.mkdtemp(prefix=f'mmfsdp-ckpt-{kind}-') if dist.get_rank() == 0 else None
    holder = [work_dir]
    dist.broadcast_object_list(holder, src=0)
    work_dir = holder[0]
    try:
        cfg = runner_cfg(case['model'], STRATEGIES['FSDP1 FULL_SHARD'].wrapper_cfg, work_dir,
                         case['name'], 2, 64, 1)
        runner = make_runner(cfg)
        runner.train()
        params = torch.tensor(sum(p.numel() for p in runner.model.parameters()))
        dist.all_reduce(params)  # the local shards add up to the model
        path = os.path.join(work_dir, 'iter_1.pth')
        saves: List[float] = []
        loads: List[float] = []
        before_save = reset_peak_rss()
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            runner.save_checkpoint(work_dir, 'iter_1.pth', by_epoch=False, state_dict_type=kind)
            dist.barrier()
            saves.append(time.perf_counter() - start)
        peak_save = peak_rss_bytes() - before_save
        before_load = reset_peak_rss()
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            runner.resume(path)
            dist.barrier()
            loads.append(time.perf_counter() - start)
        peak_load = peak_rss_bytes() - before_load
        size = _size(path) if dist.get_rank() == 0 else 0
        del runner
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(work_dir, ignore_errors=True)
    peaks: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (peak_save, peak_load))
    if dist.get_rank() != 0:
        return {}
    return dict(kind='checkpoint', name=case['name'], type=kind, model=case['model'],
                params=int(params), world_size=dist.get_world_size(),
                save_s=summary(saves), load_s=summary(loads), bytes=size,
                rank0_peak_save_bytes=peak_save, rank0_peak_load_bytes=peak_load,
                max_peak_save_bytes=max(p[0] for p in peaks),
                max_peak_load_bytes=max(p[1] for p in peaks))


def main() -> None:
    """Command-line entry point: one torchrun job per type, one JSON line per result."""
    from .launch import torchrun
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-100m')
    parser.add_argument('--world-size', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=3)
    args = parser.parse_args()
    for kind in TYPES:
        result, = torchrun([case(kind, args.model, args.repeats)], args.world_size)
        print(json.dumps(result), flush=True)


if __name__ == '__main__':
    main()
