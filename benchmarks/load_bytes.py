"""Bytes each rank reads from disk when resuming: ``python -m benchmarks.load_bytes``.

Per strategy, one torchrun job of ``--nproc`` CPU ranks trains the GPT a step under
``FSDPRunner``, saves a full and a sharded checkpoint, and for each builds a fresh
runner with ``resume=True`` whose ``load_or_resume()`` it measures per rank, cold:
rank 0 first ``fsync``s every checkpoint file and drops it from the page cache
(``posix_fadvise(DONTNEED)``, checked with ``mincore``).

- ``read``: ``read_bytes`` of ``/proc/self/io``, what the rank made the kernel fetch
  from storage (readahead included; a page another rank brought in is not charged
  again, so the sum over the ranks is what the host read);
- ``rchar``: bytes through read syscalls, cached or not (``mmap``'d pages are not in it);
- ``mapped``: the resident size of the rank's mappings of checkpoint files as
  ``load_checkpoint`` returns (the pages of an ``mmap``'d full file it touched);
- ``shard``: the rank's model + optimizer storages.

Block: ``load-bytes``.
"""
import argparse
import ctypes
import gc
import mmap
import os
import shutil
from typing import Any, Dict, List, Optional

from .core import records
from .core.launch import torchrun
from .core.measure import model_state_bytes
from .core.workload import STRATEGIES, make_runner, runner_cfg, shared_tmpdir

KINDS = ('sharded', 'full')
GOAL = 1.1
MIB = records.MIB


def files(path: str) -> List[str]:
    """``path`` if it is a file, else every file under it."""
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def drop_from_cache(path: str) -> None:
    """Flush every file of ``path`` and drop its pages from the page cache (no root needed)."""
    for file in files(path):
        with open(file, 'rb') as f:
            os.fsync(f.fileno())  # dirty pages are not dropped
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def cached_bytes(path: str) -> int:
    """Bytes of the files of ``path`` now in the page cache (``mincore`` of a fresh mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page, total = mmap.PAGESIZE, 0
    for file in files(path):
        size = os.path.getsize(file)
        if not size:
            continue
        with open(file, 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            view = ctypes.c_char.from_buffer(mapped)  # untouched private pages: the cache's
            failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(view)),
                                  ctypes.c_size_t(size), vec)
            del view
            if failed:
                raise OSError(ctypes.get_errno(), f'mincore of {file} failed')
        total += min(size, sum(v & 1 for v in vec) * page)
    return total


def io_counters(who: str = 'self') -> Dict[str, int]:
    """I/O counters of this process (``'self'``) or of the calling thread (``'thread-self'``)."""
    with open(f'/proc/{who}/io') as f:
        return {k: int(v) for k, v in (line.split(':') for line in f)}


def mapped_bytes(prefix: str) -> int:
    """Resident bytes of this process's mappings of files under ``prefix``."""
    total, inside = 0, False
    with open('/proc/self/smaps') as f:
        for line in f:
            head = line.split(None, 1)[0]
            if '-' in head and not head.endswith(':'):  # a mapping's header line
                inside = line.rstrip('\n').split(None, 5)[-1].startswith(prefix)
            elif inside and head == 'Rss:':
                total += int(line.split()[1]) * 1024
    return total


def resume_measured(cfg: Any, directory: str) -> Dict[str, int]:
    """``load_or_resume()`` of a fresh runner of ``cfg``, cold; what this rank read."""
    import torch.distributed as dist
    runner = make_runner(cfg)
    dist.barrier()
    if dist.get_rank() == 0:
        drop_from_cache(directory)
        cold = cached_bytes(directory)
    dist.barrier()
    original, mapped = runner.load_checkpoint, {}

    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:  # Runner.resume calls it
        checkpoint = original(*args, **kwargs)  # whatever it mmap'd is still mapped here
        start = io_counters()
        mapped.update(bytes=mapped_bytes(directory), probe=io_counters()['rchar'] - start['rchar'])
        return checkpoint

    runner.load_checkpoint = load_checkpoint
    before = io_counters()
    runner.load_or_resume()
    after = io_counters()
    if not runner.train_loop.iter or not runner.optim_wrapper.optimizer.state:
        raise RuntimeError('the resume restored no iteration count or no optimizer state')
    shard = model_state_bytes(runner.model, runner.optim_wrapper.optimizer)
    out = dict(read=after['read_bytes'] - before['read_bytes'], mapped=mapped['bytes'],
               rchar=after['rchar'] - before['rchar'] - mapped['probe'],
               shard=shard['params'] + shard['optimizer'])
    dist.barrier()
    if dist.get_rank() == 0:
        out.update(cold_cached=cold, host_cached=cached_bytes(directory),
                   size=sum(os.path.getsize(f) for f in files(directory)))
    del runner
    gc.collect()
    return out


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: train a step, save both kinds, resume from each."""
    import torch.distributed as dist
    root, ranks = shared_tmpdir('mmfsdp-load-bytes-'), {}

    def cfg(work_dir: str, **extra: Any) -> Any:
        config = runner_cfg(case['model'], STRATEGIES[case['strategy']].wrapper_cfg,
                            os.path.join(root, work_dir), 'load-bytes', 1, 32, 1)
        config.merge_from_dict(extra)
        return config
    try:
        runner = make_runner(cfg('train'))
        runner.train()
        for kind in KINDS:
            runner.save_checkpoint(os.path.join(root, kind), 'iter_1.pth', by_epoch=False,
                                   state_dict_type=kind)
            if dist.get_rank() == 0:  # what CheckpointHook writes for auto-resume
                with open(os.path.join(root, kind, 'last_checkpoint'), 'w') as f:
                    f.write(os.path.join(root, kind, 'iter_1.pth'))
        del runner
        gc.collect()
        for kind in KINDS:
            ranks[kind] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks[kind], resume_measured(
                cfg(kind, resume=True), os.path.join(root, kind, 'iter_1.pth')))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return dict(case, world_size=dist.get_world_size(), ranks=ranks)


def table(cases: List[Dict[str, Any]]) -> str:
    """Per strategy and checkpoint type, each rank, then the host."""
    rows = []
    for case in cases:
        for kind in KINDS:
            ranks = case['ranks'][kind]
            rows += [[case['strategy'], kind, rank, f"{r['read'] / MIB:.1f}",
                      f"{r['rchar'] / MIB:.1f}", f"{r['mapped'] / MIB:.1f}",
                      f"{r['shard'] / MIB:.1f}", f"{r['read'] / r['shard']:.2f}"]
                     for rank, r in enumerate(ranks)]
            host, total = ranks[0], sum(r['read'] for r in ranks)
            rows.append([case['strategy'], kind, 'all', f'{total / MIB:.1f}', '', '',
                         f"files {host['size'] / MIB:.1f}; in the page cache before / after "
                         f"{host['cold_cached'] / MIB:.1f} / {host['host_cached'] / MIB:.1f}",
                         f"read / files {total / host['size']:.2f}"])
    return records.table(['strategy', 'checkpoint', 'rank', 'read from disk', 'rchar',
                          'mapped (touched)', 'shard (model + optimizer)', 'read / shard'],
                         rows, align='--:').replace('|--:|--:|', '|---|---|', 1)


def verdicts(cases: List[Dict[str, Any]]) -> Dict[str, bool]:
    """Each goal, by strategy: whether it holds."""
    out = {}
    for case in cases:
        sharded, full = case['ranks']['sharded'], case['ranks']['full']
        out[f"{case['strategy']}: sharded resume reads <= {GOAL} x its shard on every rank"] = \
            all(r['read'] <= GOAL * r['shard'] for r in sharded)
        out[f"{case['strategy']}: the full file is read once per host (all ranks <= {GOAL} x "
            'file)'] = sum(r['read'] for r in full) <= GOAL * full[0]['size']
    return out


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.load_bytes',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-100m')
    parser.add_argument('--nproc', type=int, default=4, help='world size N')
    parser.add_argument('--strategies', nargs='+', default=['FSDP1 FULL_SHARD', 'FSDP2 reshard'],
                        choices=list(STRATEGIES), metavar='STRATEGY',
                        help=f'labels of {list(STRATEGIES)}')
    records.add_output_options(parser, 'load_bytes')
    args = parser.parse_args(argv)
    cases = []
    for strategy in args.strategies:
        cases += torchrun('load_bytes', [dict(model=args.model, strategy=strategy)], args.nproc,
                          memory=False)
        records.save_results(args.out, cases)
    goals = '\n'.join(f"- {'holds' if ok else '**missed**'}: {name}"
                      for name, ok in verdicts(cases).items())
    records.finish(args, {'load-bytes': records.header('python -m benchmarks.load_bytes')
                          + f' {args.model}, N = {args.nproc}, load average '
                          f"{cases[0]['load_before']}–{cases[-1]['load_after']}. MiB per rank."
                          f'\n\n{table(cases)}\n\n{goals}'})


if __name__ == '__main__':
    main()
