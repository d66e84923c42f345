"""Bytes each rank reads from disk when resuming (issue 27 §4): ``python -m benchmarks.load_bytes``.

Per strategy, one torchrun job of 4 CPU ranks trains the GPT a step under
``FSDPRunner``, saves a full and a sharded checkpoint, and for each builds a fresh
runner with ``resume=True`` whose ``load_or_resume()`` it measures per rank, cold:
rank 0 first ``fsync``s every checkpoint file and drops it from the page cache
(``posix_fadvise(DONTNEED)``, checked with ``mincore``). ``read``: ``read_bytes`` of
``/proc/self/io``, what the rank made the kernel fetch from storage (readahead
included; a page another rank brought in is not charged again, so the sum over the
ranks is what the host read). ``rchar``: bytes through read syscalls, cached or not
(``mmap``'d pages are not in it). ``mapped``: the resident size of the rank's
mappings of checkpoint files (``/proc/self/smaps``) as ``load_checkpoint`` returns,
i.e. the pages of an ``mmap``'d full file it touched. ``shard``: the rank's model +
optimizer storages (:func:`benchmarks.measure.model_state_bytes`).
Results: ``benchmarks/results/load_bytes.json`` and the ``load-bytes`` block of
``docs/benchmarks.md`` (not with ``--quick``).
"""
import argparse
import ctypes
import gc
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List

from .launch import ALLOCATOR_VARIABLES, REPO

RESULTS = os.path.join(REPO, 'benchmarks', 'results', 'load_bytes.json')
REPORT = os.path.join(REPO, 'docs', 'benchmarks.md')
BEGIN, END = '<!-- load-bytes:begin -->', '<!-- load-bytes:end -->'
NPROC = 4
STRATEGIES = ('FSDP1 FULL_SHARD', 'FSDP2 reshard')
KINDS = ('sharded', 'full')
GOAL = 1.1
MIB = 2**20


def _files(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def drop_from_cache(path: str) -> None:
    """Flush every file of ``path`` and drop its pages from the page cache (no root needed)."""
    for file in _files(path):
        with open(file, 'rb') as f:
            os.fsync(f.fileno())  # dirty pages are not dropped
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def cached_bytes(path: str) -> int:
    """Bytes of the files of ``path`` now in the page cache (``mincore`` of a fresh mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page, total = mmap.PAGESIZE, 0
    for file in _files(path):
        size = os.path.getsize(file)
        if not size:
            continue
        with open(file, 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            view = ctypes.c_char.from_buffer(mapped)  # untouched private pages: the cache's
            found = libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size),
                                 vec)
            del view
            if found:
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

    from .measure import model_state_bytes
    from .workload import make_runner
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
                   size=sum(os.path.getsize(f) for f in _files(directory)))
    del runner
    gc.collect()
    return out


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: train a step, save both kinds, resume from each; rank 0 returns all."""
    import torch.distributed as dist

    from .workload import STRATEGIES as WRAPPERS
    from .workload import make_runner, runner_cfg
    box = [tempfile.mkdtemp(prefix='mmfsdp-load-bytes-') if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root, rows = box[0], {}

    def cfg(work_dir: str, **extra: Any) -> Any:
        config = runner_cfg(case['model'], WRAPPERS[case['strategy']].wrapper_cfg,
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
            rows[kind] = [None] * dist.get_world_size()
            dist.all_gather_object(rows[kind], resume_measured(
                cfg(kind, resume=True), os.path.join(root, kind, 'iter_1.pth')))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return dict(case, world_size=dist.get_world_size(), results=rows)


def worker(case: Dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from mmfsdp.dist import init_distributed, shutdown_distributed

    from .workload import threads_per_rank
    init_distributed('pytorch', dict(timeout=1800))
    torch.set_num_threads(threads_per_rank(dist.get_world_size()))
    try:
        result = run_case(case)
        if dist.get_rank() == 0:
            print('RESULT ' + json.dumps(result), flush=True)
    finally:
        shutdown_distributed()


def launch(case: Dict[str, Any], timeout: float = 1800) -> Dict[str, Any]:
    """One torchrun job of ``case``; the load average around it."""
    from .job import Job
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
    env['PYTHONPATH'] = REPO
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node',
           str(NPROC), '-m', 'benchmarks.load_bytes', '--worker', json.dumps(case)]
    load, start = os.getloadavg(), time.perf_counter()
    with Job([cmd], env, REPO, merge_stderr=False) as job:
        finished = job.wait(timeout)
        out, err, code = job.stdout(), job.stderr(), job.returncodes[0]
    results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith('RESULT ')]
    if not finished or code or not results:
        raise RuntimeError(f'{case} failed (exit {code}, finished {finished}):\n{err[-4000:]}')
    return dict(results[0], load_before=[round(x, 2) for x in load],
                load_after=[round(x, 2) for x in os.getloadavg()],
                wall_s=round(time.perf_counter() - start, 1))


def table(cases: List[Dict[str, Any]]) -> str:
    """The Markdown table: per strategy and checkpoint type, each rank, then the host."""
    lines = ['| strategy | checkpoint | rank | read from disk | rchar | mapped (touched) | '
             'shard (model + optimizer) | read / shard |', '|---|---|--:|--:|--:|--:|--:|--:|']
    for case in cases:
        for kind in KINDS:
            ranks = case['results'][kind]
            for rank, r in enumerate(ranks):
                lines.append(f"| {case['strategy']} | {kind} | {rank} | {r['read'] / MIB:.1f} | "
                             f"{r['rchar'] / MIB:.1f} | {r['mapped'] / MIB:.1f} | "
                             f"{r['shard'] / MIB:.1f} | {r['read'] / r['shard']:.2f} |")
            host, total = ranks[0], sum(r['read'] for r in ranks)
            lines.append(f"| {case['strategy']} | {kind} | all | {total / MIB:.1f} | | | "
                         f"files {host['size'] / MIB:.1f}; in the page cache before / after "
                         f"{host['cold_cached'] / MIB:.1f} / {host['host_cached'] / MIB:.1f} | "
                         f"read / files {total / host['size']:.2f} |")
    return '\n'.join(lines)


def verdicts(cases: List[Dict[str, Any]]) -> Dict[str, bool]:
    """Each goal, by strategy: whether it holds."""
    out = {}
    for case in cases:
        sharded, full = case['results']['sharded'], case['results']['full']
        out[f"{case['strategy']}: sharded resume reads <= {GOAL} x its shard on every rank"] = \
            all(r['read'] <= GOAL * r['shard'] for r in sharded)
        out[f"{case['strategy']}: the full file is read once per host (all ranks <= {GOAL} x "
            'file)'] = sum(r['read'] for r in full) <= GOAL * full[0]['size']
    return out


def write_block(text: str, path: str = REPORT) -> None:
    """Replace what is between the ``load-bytes`` markers of ``path`` with ``text``."""
    with open(path) as f:
        head, rest = f.read().split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, 'w') as f:
        f.write(f'{head}{BEGIN}\n{text}\n{END}{tail}')


def main() -> None:
    from .record import machine, save_results, utc_now
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true', help='gpt-7m, FSDP1 only, no files')
    parser.add_argument('--worker', help=argparse.SUPPRESS)  # a case, inside torchrun
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    model = 'gpt-7m' if args.quick else 'gpt-100m'
    cases = [launch(dict(model=model, strategy=s))
             for s in (STRATEGIES[:1] if args.quick else STRATEGIES)]
    text, checks = table(cases), verdicts(cases)
    goals = '\n'.join(f"- {'holds' if ok else '**missed**'}: {name}" for name, ok in checks.items())
    print(f'{text}\n\n{goals}')
    if args.quick:
        return None
    host = machine()
    save_results(RESULTS, dict(
        date=utc_now(), command='python -m benchmarks.load_bytes', machine=host,
        world_size=NPROC, model=model, goals=checks,
        cases=[dict({k: v for k, v in c.items() if k != 'results'}, ranks=c['results'])
               for c in cases]))
    write_block(f"Measured {utc_now()} on {host['cpu']} ({host['cores']} cores, torch "
                f"{host['versions']['torch']}, commit {host['commit']}), {model}, N = {NPROC}, "
                f"load average {cases[0]['load_before'][0]}–{cases[-1]['load_after'][0]}: "
                f'`python -m benchmarks.load_bytes`. MiB per rank.\n\n{text}\n\n{goals}')
    return None


if __name__ == '__main__':
    sys.exit(main())
