"""Tensor bytes per step, counted exactly: ``python -m benchmarks.tensor_peaks [--arms ...]``.

The peers' memory jobs (:mod:`benchmarks.peers`) measure the resident set,
which also holds what is not a tensor: the interpreter's objects, malloc's heap
and its fragments. To tell tensors from the rest, each job records every
allocation and free of torch's CPU allocator from just before the arm is built
(``torch.profiler`` with ``profile_memory=True``) and sums those of 4 KiB and
more: per step the live tensor bytes when the step starts, the most live at
once during it, and at its end, all above the live bytes before the arm was
built. One torchrun job per arm (gloo, CPU), the same model, batches and
initial weights as the peers run.

Beside the tensors, each job counts the Python objects the arm holds after its
last step (``tracemalloc``, started before the arm is built, by the package
whose code allocated them): what a runner keeps that a plain loop does not.
As in the peers' memory jobs, a step of the tiny GPT under the same arm comes
first, so imports and first-use caches are paid before either count starts.

Results: ``benchmarks/results/tensor_peaks.json``.
"""
import argparse
import gc
import json
import os
import sys
import sysconfig
import time
import tracemalloc
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from .launch import REPO, torchrun

__all__ = ['main', 'run_case']

RESULTS = os.path.join(REPO, 'benchmarks', 'results', 'tensor_peaks.json')
#: Tensors this small or larger are counted.
MIN_BYTES = 4096
MiB = 1 << 20


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """Build one arm in this torchrun job, train ``steps`` steps; rank 0 returns the counts."""
    from .peers import gathered_in_shared_dir
    gathered = gathered_in_shared_dir(lambda work_dir: _count(case, work_dir))
    return {} if gathered is None else dict(case, ranks=gathered)


def allocation_events(prof: Any) -> List[Tuple[int, int]]:
    """``(time ns, bytes)`` of every CPU allocation (bytes > 0) and free (< 0) a profile
    recorded, in time order.

    Why private: the public ``torch.profiler`` API aggregates memory per operator; the
    event tree of its results holds each allocation with its time and size (torch's own
    ``torch.profiler._memory_profiler`` reads it so).
    """
    from torch._C._profiler import _EventType
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == 'cpu':
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    return sorted(events)


def tensor_steps(events: List[Tuple[int, int]], steps: List[Tuple[int, int]],
                 min_bytes: int = MIN_BYTES) -> List[Dict[str, int]]:
    """Per ``(start ns, end ns)`` step: the live bytes of blocks of ``min_bytes`` and more
    (above those at the first event) at its start, the most during it, and at its end."""
    out, live, i = [], 0, 0
    for start, end in steps:
        while i < len(events) and events[i][0] < start:
            live += events[i][1] if abs(events[i][1]) >= min_bytes else 0
            i += 1
        at_start = peak = live
        while i < len(events) and events[i][0] <= end:
            live += events[i][1] if abs(events[i][1]) >= min_bytes else 0
            peak = max(peak, live)
            i += 1
        out.append(dict(start=at_start, peak=peak, end=live))
    return out


def _count(case: Dict[str, Any], work_dir: str) -> Dict[str, Any]:
    """This rank's counts: tensor bytes per step, Python objects held after the last."""
    import torch.distributed as dist
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    from . import peer_arms
    from .peers import _batches, _init_file, _warm_up
    label = case['arm']
    _warm_up(label, case['seq_len'], work_dir)
    init = _init_file(work_dir, case['model'])
    batches = _batches(case['seq_len'], case['batch_size'], case['steps'])
    dist.barrier()
    gc.collect()
    tracemalloc.start()
    python_before = tracemalloc.take_snapshot()
    marks = []
    trainer = None
    try:
        # every thread: a tensor freed on a gloo or autograd thread must count as freed
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                     experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
            trainer = peer_arms.build(label, case['model'], init, os.path.join(work_dir, 'arm'))
            for batch in batches:
                gc.collect()
                start = time.time_ns()
                trainer.step(batch)
                marks.append((start, time.time_ns()))
        gc.collect()
        python_held = held_by_package(python_before, tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
        peer_arms.release(trainer)
    return dict(steps=tensor_steps(allocation_events(prof), marks), python_held=python_held)


def package_of(filename: str) -> str:
    """The package whose code is at ``filename``: its top-level import name,
    ``'stdlib'`` for the standard library, the file name for anything else."""
    for root in (sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib'], REPO):
        if filename.startswith(root + os.sep):
            return filename[len(root) + 1:].split(os.sep)[0].split('.')[0]
    if filename.startswith(sysconfig.get_paths()['stdlib'] + os.sep):
        return 'stdlib'
    return filename


def held_by_package(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> Dict[str, int]:
    """Bytes of Python objects allocated between the snapshots and still alive, by package."""
    held: Counter = Counter()
    for diff in after.compare_to(before, 'filename'):
        held[package_of(diff.traceback[0].filename)] += diff.size_diff
    return dict(held)


def most_held(ranks: List[Dict[str, Any]]) -> Dict[str, int]:
    """The Python objects held by the rank of ``ranks`` holding most, by package."""
    return max((rank['python_held'] for rank in ranks), key=lambda held: sum(held.values()))


def describe_held(held: Dict[str, int]) -> str:
    """``'<total> (<package> <MiB>, ...)'``, MiB, the four packages holding most."""
    top = ', '.join(f'{name} {size / MiB:.2f}' for name, size in
                    sorted(held.items(), key=lambda kv: -kv[1])[:4] if size > 0)
    return f'{sum(held.values()) / MiB:.2f} ({top})'


def report(results: List[Dict[str, Any]]) -> str:
    """Per arm: the worst rank's start / peak / end per step, MiB, and the Python
    objects held after the last step (worst rank) with the packages holding most."""
    lines = ['| arm | tensors per step: start / peak / end, MiB (worst rank) '
             '| Python objects held, MiB (largest packages) |', '|---|---|---|']
    for r in results:
        steps = zip(*(rank['steps'] for rank in r['ranks']))
        cells = [' / '.join(f'{max(s[k] for s in step) / MiB:.2f}'
                            for k in ('start', 'peak', 'end')) for step in steps]
        held = describe_held(most_held(r['ranks']))
        lines.append(f"| {r['arm']} | {'; '.join(cells)} | {held} |")
    return '\n'.join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    """Command-line entry point."""
    from .peers import ARM_LABELS
    parser = argparse.ArgumentParser(prog='python -m benchmarks.tensor_peaks',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-25m')
    parser.add_argument('--nproc', type=int, default=2)
    parser.add_argument('--steps', type=int, default=10)
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
        json.dump(dict(command=command, date_utc=utc_now(), machine=machine(),
                       counter='torch.profiler', results=results),
                  f, indent=1)
    print(report(results))


if __name__ == '__main__':
    main()
