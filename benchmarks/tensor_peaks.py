"""Tensor bytes per step, counted exactly: ``python -m benchmarks.tensor_peaks [--arms ...]``.

The peers' memory jobs (:mod:`benchmarks.peers`) measure the resident set,
which also holds what is not a tensor: the interpreter's objects, glibc's heap
and its fragments. To tell tensors from the rest, each job here installs
mmfsdp's caching CPU allocator (:mod:`mmfsdp.cpu_cache`) for every tensor of
4 KiB and more before the arm is built, and reads its counters: per step the
live tensor bytes when the step starts, the most live at once during it (the
cache's bound, reset by ``release()`` before the step), and at its end, all
above the live bytes before the arm was built. One torchrun job per arm (gloo,
CPU), the same model, batches and initial weights as the peers run.

Results: ``benchmarks/results/tensor_peaks.json``.
"""
import argparse
import gc
import json
import os
import sys
from typing import Any, Dict, List, Optional

from .launch import REPO, torchrun

__all__ = ['main', 'run_case']

RESULTS = os.path.join(REPO, 'benchmarks', 'results', 'tensor_peaks.json')
#: Tensors this small or larger are counted (smaller ones keep torch's allocator).
MIN_BYTES = 4096
MiB = 1 << 20


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """Build one arm in this torchrun job, train ``steps`` steps; rank 0 returns the counts."""
    from mmfsdp import cpu_cache
    installed = cpu_cache.install(MIN_BYTES, huge_pages=False)
    if not installed.installed:
        raise RuntimeError(f'mmfsdp.cpu_cache {installed.reason}')
    import shutil

    import torch.distributed as dist

    from . import peer_arms
    from .peers import _batches, _init_file, _shared_dir
    work_dir = _shared_dir()
    label = case['arm']
    init = _init_file(work_dir, case['model'])
    dist.barrier()
    base = cpu_cache.stats().live_bytes
    trainer = peer_arms.build(label, case['model'], init, os.path.join(work_dir, 'arm'))
    steps = []
    try:
        for batch in _batches(case['seq_len'], case['batch_size'], case['steps']):
            gc.collect()
            cpu_cache.release()  # the bound restarts at the live bytes
            start = cpu_cache.stats().live_bytes
            trainer.step(batch)
            end = cpu_cache.stats()
            steps.append(dict(start=start - base, peak=end.bound - base, end=end.live_bytes - base))
    finally:
        peer_arms.release(trainer)
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, steps)
    dist.barrier()  # every rank is done with the files
    if dist.get_rank() != 0:
        return {}
    shutil.rmtree(work_dir, ignore_errors=True)
    return dict(case, ranks=gathered)


def report(results: List[Dict[str, Any]]) -> str:
    """Per arm: the worst rank's start / peak / end per step, MiB."""
    lines = ['| arm | per step: start / peak / end, MiB (worst rank) |', '|---|---|']
    for r in results:
        steps = zip(*r['ranks'])
        cells = [' / '.join(f'{max(s[k] for s in step) / MiB:.2f}'
                            for k in ('start', 'peak', 'end')) for step in steps]
        lines.append(f"| {r['arm']} | {'; '.join(cells)} |")
    return '\n'.join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    """Command-line entry point."""
    from .peers import ARM_LABELS
    parser = argparse.ArgumentParser(prog='python -m benchmarks.tensor_peaks',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-25m')
    parser.add_argument('--nproc', type=int, default=2)
    parser.add_argument('--steps', type=int, default=4)
    parser.add_argument('--batch-size', type=int, default=2)
    parser.add_argument('--seq-len', type=int, default=64)
    parser.add_argument('--arms', nargs='+', default=['torch FSDP1', 'mmfsdp FSDP1',
                                                      'torch FSDP2', 'mmfsdp FSDP2',
                                                      'torch DDP', 'mmfsdp DDP'],
                        choices=ARM_LABELS, metavar='ARM')
    parser.add_argument('--out', default=RESULTS)
    args = parser.parse_args(argv)
    results = []
    for arm in args.arms:
        case = dict(kind='tensor_peak', arm=arm, model=args.model, steps=args.steps,
                    batch_size=args.batch_size, seq_len=args.seq_len)
        results.extend(torchrun([case], args.nproc, exact_allocator=True))
        print(report(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    from .record import machine, utc_now
    given = sys.argv[1:] if argv is None else argv
    command = ' '.join(['python -m benchmarks.tensor_peaks', *given])
    with open(args.out, 'w') as f:
        json.dump(dict(command=command, date_utc=utc_now(), machine=machine(), results=results),
                  f, indent=1)
    print(report(results))


if __name__ == '__main__':
    main()
