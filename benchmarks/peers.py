"""The peers side by side: ``python -m benchmarks.peers`` (or ``python -m benchmarks.run --peers``).

Trains the same model (a GPT preset), the same per-rank batches and the same
initial weights with every arm of :mod:`benchmarks.peer_arms`: hand-written
torch FSDP1 / FSDP2 / DDP, mmfsdp through ``FSDPRunner``, accelerate's FSDP1
and FSDP2 plugins, Lightning Fabric's ``FSDPStrategy`` and
``ModelParallelStrategy``, and mmengine's ``FlexibleRunner`` with its own
``FSDPStrategy``. Two kinds of torchrun job (``N`` CPU processes, gloo):

- **memory**, one job per arm and repeat (``--memory-repeats``, the arms in
  turn within each repeat), each alone in its processes: a warm-up step of the
  tiny GPT under the same arm, the resident-set baseline, then the arm built and
  trained for a few steps; per step the peak resident set above the baseline and
  the model-state bytes (storages behind parameters, gradients and AdamW state,
  counted right after ``optimizer.step()``), as ``benchmarks.memory`` measures
  them, and the bytes malloc holds live when the step starts
  (:func:`benchmarks.measure.malloc_live_bytes`), which tell memory in use from
  where glibc placed it. Parameter bytes per rank tell whether the arm really
  shards, whatever its configuration says. A failing arm is recorded with its
  exact error, and not run again.
  Repeats exist because a job's resident-set peaks move by a few MiB from one
  process to the next (where glibc and the interpreter happen to place things);
  the report pools the measured steps of all of an arm's jobs.
- **interleaved**, one job holding every arm that ran: ``steps`` rounds, each
  round one step of every arm on the round's batch, the order rotated every
  round, each step timed between two barriers. The step-time ratio of a round
  is ``arm / hand-written torch arm of its family`` (the first ``timed_from``
  rounds are left out); the loss of every step is kept, so all arms can be
  checked to train the same thing. An error there ends the job: it may be one
  rank's alone, and the ranks must not go on into different collectives.

The orchestrator never imports torch; results go to ``benchmarks/results/peers.json``
and ``python -m benchmarks.report benchmarks/results/full.json`` renders them into
``docs/benchmarks.md`` (:mod:`benchmarks.peers_report`).
"""
import argparse
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from .launch import REPO, JobFailed, torchrun

__all__ = ['main', 'plan_cases', 'run_case']

RESULTS = os.path.join(REPO, 'benchmarks', 'results', 'peers.json')
#: Arms in the order of the report (the order of ``peer_arms.ARMS``, without importing it).
ARM_LABELS = ['torch FSDP1', 'torch FSDP2', 'torch DDP', 'mmfsdp FSDP1', 'mmfsdp FSDP2',
              'mmfsdp DDP', 'accelerate FSDP1', 'accelerate FSDP2', 'Fabric FSDPStrategy',
              'Fabric ModelParallelStrategy', 'mmengine FlexibleRunner FSDP',
              'mmengine FlexibleRunner FSDP, device_id=cpu']


def plan_cases(model: str, arms: List[str], steps: int, timed_from: int, batch_size: int,
               seq_len: int, memory_steps: int, cpu_allocator: str = 'glibc',
               memory_repeats: int = 1) -> Dict[str, Any]:
    """The memory cases (one per arm and repeat, every arm once before any twice) and
    the interleaved case of a run.

    ``cpu_allocator``: every arm's malloc, ``'glibc'`` (as the job's environment
    says), or ``'jemalloc'`` / ``'tcmalloc'`` preloaded into every process as the
    launch scripts preload it (:func:`benchmarks.launch.torchrun`).
    """
    unknown = [a for a in arms if a not in ARM_LABELS]
    if unknown:
        raise ValueError(f'--arms: {unknown} not among {ARM_LABELS}')
    if memory_repeats < 1:
        raise ValueError(f'--memory-repeats: {memory_repeats} is not a positive number of jobs')
    common = dict(kind='peers', model=model, batch_size=batch_size, seq_len=seq_len,
                  cpu_allocator=cpu_allocator)
    memory = [dict(common, mode='memory', arms=[arm], steps=memory_steps, warm_up=True,
                   repeat=repeat, name=f'peers/memory/{model}/{arm}'
                   + (f' #{repeat + 1}' if memory_repeats > 1 else ''))
              for repeat in range(memory_repeats) for arm in arms]
    interleaved = dict(common, mode='interleaved', name=f'peers/interleaved/{model}',
                       arms=list(arms), steps=steps, timed_from=timed_from)
    return dict(memory=memory, interleaved=interleaved)


# ----------------------------------------------------------------- in the torchrun job

def _error(e: BaseException, stage: str) -> Dict[str, str]:
    import torch.distributed as dist
    print(f'[rank{dist.get_rank()}] {stage} failed:\n' + ''.join(traceback.format_exception(e)),
          file=sys.stderr, flush=True)
    lines = traceback.format_exception_only(type(e), e)
    frames = [f"{f.filename.split('site-packages/')[-1].replace(REPO + os.sep, '')}:"
              f'{f.lineno} {f.name}' for f in traceback.extract_tb(e.__traceback__)[-3:]]
    return dict(stage=stage, error=''.join(lines).strip()[:1500], where=frames)


def _batches(preset_seq: int, batch_size: int, steps: int) -> List[Dict[str, Any]]:
    """This rank's batches: windows of the stdlib corpus drawn with a per-rank seed."""
    import torch
    import torch.distributed as dist
    from mmengine.dataset import default_collate

    from mmfsdp.demo import StdlibCharDataset
    dataset = StdlibCharDataset(block_size=preset_seq, max_chars=200_000)
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    return [default_collate([dataset[int(i)] for i in
                             torch.randint(len(dataset), (batch_size, ), generator=generator)])
            for _ in range(steps)]


def _shared_dir() -> str:
    import torch.distributed as dist
    box = [tempfile.mkdtemp(prefix='mmfsdp-peers-') if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _init_file(work_dir: str, preset: str) -> str:
    import torch.distributed as dist

    from .peer_arms import write_init_file
    path = os.path.join(work_dir, f'init-{preset}.pt')
    if dist.get_rank() == 0:
        write_init_file(preset, path)
    dist.barrier()
    return path


class _StateProbe:
    """Counts an arm's model state right after every ``optimizer.step()``."""

    def __init__(self, trainer: Any) -> None:
        from .measure import model_state_bytes
        self.records: List[Dict[str, int]] = []
        self._handle = trainer.optimizer.register_step_post_hook(
            lambda opt, args, kwargs: self.records.append(model_state_bytes(trainer.module, opt)))

    def remove(self) -> None:
        self._handle.remove()


def _timed_step(trainer: Any, batch: Dict[str, Any]) -> tuple:
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    loss = trainer.step(batch)
    dist.barrier()
    return time.perf_counter() - start, loss


def _warm_up(label: str, seq_len: int, work_dir: str) -> None:
    """One step of the tiny GPT under arm ``label``, released: pays, before a
    baseline, what does not depend on the model (imports, first-use caches)."""
    from . import peer_arms
    tiny = peer_arms.build(label, 'gpt-tiny', _init_file(work_dir, 'gpt-tiny'),
                           os.path.join(work_dir, 'warm-up'))
    tiny.step(_batches(seq_len, 1, 1)[0])
    peer_arms.release(tiny)


def _memory_case(case: Dict[str, Any], work_dir: str) -> Dict[str, Any]:
    from . import peer_arms
    from .measure import malloc_live_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes
    label = case['arms'][0]
    import torch.distributed as dist
    out: Dict[str, Any] = dict(ok=True)
    trainer, stage = None, 'warm-up (gpt-tiny)'
    try:
        if case['warm_up']:
            _warm_up(label, case['seq_len'], work_dir)
        batches = _batches(case['seq_len'], case['batch_size'], case['steps'])
        init = _init_file(work_dir, case['model'])
        stage = 'build'
        baseline, live_baseline = rss_bytes(), malloc_live_bytes()
        trainer = peer_arms.build(label, case['model'], init, os.path.join(work_dir, 'arm'))
        probe = _StateProbe(trainer)
        stage = 'train'
        peaks, starts, lives, losses = [], [], [], []
        for batch in batches:
            dist.barrier()
            live = malloc_live_bytes()
            lives.append(None if live is None else live - live_baseline)
            starts.append(reset_peak_rss() - baseline)
            losses.append(trainer.step(batch))
            peaks.append(peak_rss_bytes() - baseline)
        probe.remove()
        out.update(peaks=peaks, starts=starts, lives=lives, losses=losses, states=probe.records,
                   wrapper=peer_arms.wrapper_name(trainer.module), notes=trainer.notes,
                   baseline=baseline)
    except Exception as e:  # noqa: BLE001 - the error is the result
        out = dict(ok=False, **_error(e, stage))
    peer_arms.release(trainer)
    return out


def _interleaved_case(case: Dict[str, Any], work_dir: str) -> Dict[str, Any]:
    """Every arm built, then trained round by round; an error ends the job.

    Only arms whose memory job trained on every rank are here, so an error is
    unexpected, and it may be one rank's alone: going on without the arm on
    that rank would send the ranks into different collectives. Raising lets
    torchrun stop the job, and the run reports the error.
    """
    from . import peer_arms
    batches = _batches(case['seq_len'], case['batch_size'], case['steps'])
    init = _init_file(work_dir, case['model'])
    trainers, probes = {}, {}
    for label in case['arms']:
        trainers[label] = peer_arms.build(label, case['model'], init,
                                          os.path.join(work_dir, label.replace(' ', '-')))
        probes[label] = _StateProbe(trainers[label])
    times: Dict[str, List[float]] = {label: [] for label in trainers}
    losses: Dict[str, List[float]] = {label: [] for label in trainers}
    order = list(trainers)
    for i, batch in enumerate(batches):
        k = i % len(order) if order else 0
        for label in order[k:] + order[:k]:
            elapsed, loss = _timed_step(trainers[label], batch)
            times[label].append(elapsed)
            losses[label].append(loss)
    out = dict(times=times, losses=losses, order=order,
               states={label: p.records[-1] if p.records else None
                       for label, p in probes.items()},
               wrappers={label: peer_arms.wrapper_name(t.module)
                         for label, t in trainers.items()},
               notes={label: t.notes for label, t in trainers.items()})
    for probe in probes.values():
        probe.remove()
    del trainers
    peer_arms.release(None)
    return out


def gathered_in_shared_dir(work: Callable[[str], Any]) -> Optional[List[Any]]:
    """Run ``work(work_dir)`` on every rank in one directory the ranks share, and gather
    what each returns: rank 0 gets the list, the other ranks ``None``.

    Rank 0 removes the directory once every rank is done with it; after an error, at
    once and with no collective (the other ranks may be in another one).
    """
    import shutil

    import torch.distributed as dist
    work_dir = _shared_dir()
    try:
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, work(work_dir))
        dist.barrier()  # every rank is done with the files
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(work_dir, ignore_errors=True)
    return gathered if dist.get_rank() == 0 else None


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """Run one peers case in this torchrun job; rank 0 returns the result."""
    import torch.distributed as dist
    measure = _memory_case if case['mode'] == 'memory' else _interleaved_case
    gathered = gathered_in_shared_dir(lambda work_dir: measure(case, work_dir))
    if gathered is None:
        return {}
    return dict(case, world_size=dist.get_world_size(), ranks=gathered,
                params=_params(case['model']))


def _params(preset: str) -> int:
    from .workload import build_model
    return sum(p.numel() for p in build_model(preset, 'meta').parameters())


# ----------------------------------------------------------------- the orchestrator

def _load_average() -> float:
    with open('/proc/loadavg') as f:
        return float(f.read().split()[0])


def _run_job(case: Dict[str, Any], nproc: int, exact_allocator: bool, timeout: float,
             log: Any) -> Dict[str, Any]:
    load, start = _load_average(), time.perf_counter()
    try:
        result = torchrun([case], nproc, timeout=timeout, exact_allocator=exact_allocator,
                          cpu_allocator=case.get('cpu_allocator', 'glibc'))[0]
    except JobFailed as e:
        result = dict(case, job_failed=str(e)[-3000:])
    result.update(load_before=load, load_after=_load_average(),
                  job_wall_s=time.perf_counter() - start)
    print(f"{case['name']} (N={nproc}): {result['job_wall_s']:.0f} s, load "
          f"{load:.1f} -> {result['load_after']:.1f}"
          + (' FAILED' if 'job_failed' in result else ''), file=log, flush=True)
    return result


def memory_ok(result: Dict[str, Any]) -> bool:
    """Whether an arm's memory job trained on every rank."""
    return 'job_failed' not in result and all(r['ok'] for r in result['ranks'])


def run(args: argparse.Namespace, log: Any = sys.stderr) -> Dict[str, Any]:
    """Every job of a peers run; the results file is written after each job."""
    from .record import machine, utc_now
    from .record import save_results as _save
    cases = plan_cases(args.model, args.arms, args.steps, args.timed_from, args.batch_size,
                       args.seq_len, args.memory_steps, args.cpu_allocator,
                       args.memory_repeats)
    data: Dict[str, Any] = dict(mode='peers', machine=machine(), nproc=args.nproc, results=[],
                                started=utc_now(),
                                options={k: v for k, v in vars(args).items() if k != 'out'})
    interleaved = dict(cases['interleaved'])
    if not args.skip_memory:
        failed = set()  # an arm that failed once is not run again
        for case in cases['memory']:
            if case['arms'][0] in failed:
                continue
            data['results'].append(_run_job(case, args.nproc, True, args.timeout, log))
            _save(args.out, data)
            if not memory_ok(data['results'][-1]):
                failed.add(case['arms'][0])
        interleaved['arms'] = [arm for arm in args.arms if arm not in failed]
    if not args.skip_interleaved:
        data['results'].append(_run_job(interleaved, args.nproc, False, 3 * args.timeout, log))
    data['elapsed_s'] = sum(r['job_wall_s'] for r in data['results'])
    _save(args.out, data)
    return data


def parser() -> argparse.ArgumentParser:
    """The command line of a peers run."""
    p = argparse.ArgumentParser(prog='python -m benchmarks.peers',
                                description=__doc__.split('\n\n')[0])
    p.add_argument('--model', default='gpt-25m', help='GPT preset (benchmarks.workload.MODELS)')
    p.add_argument('--nproc', type=int, default=2, help='world size N')
    p.add_argument('--steps', type=int, default=20, help='training steps of every arm')
    p.add_argument('--timed-from', type=int, default=2,
                   help='rounds left out of the step-time ratios (warm-up)')
    p.add_argument('--batch-size', type=int, default=2, help='sequences per rank per step')
    p.add_argument('--seq-len', type=int, default=64, help='tokens per sequence')
    p.add_argument('--memory-steps', type=int, default=3,
                   help='steps of each memory job (the first is left out)')
    p.add_argument('--memory-repeats', type=int, default=1,
                   help='memory jobs per arm; the report pools their measured steps')
    p.add_argument('--arms', nargs='+', default=ARM_LABELS, metavar='ARM',
                   help=f'subset of {ARM_LABELS}')
    p.add_argument('--skip-memory', action='store_true', help='only the interleaved job')
    p.add_argument('--skip-interleaved', action='store_true', help='only the memory jobs')
    p.add_argument('--cpu-allocator', choices=['glibc', 'jemalloc', 'tcmalloc'],
                   default='glibc', help="every arm's malloc: glibc as the job's environment "
                   'says, or one preloaded into every process as the launch scripts do')
    p.add_argument('--timeout', type=float, default=600, help='seconds per memory job')
    p.add_argument('--out', default=RESULTS, help='results JSON')
    return p


def main(argv: Optional[List[str]] = None) -> None:
    """Command-line entry point: run, then print the report section."""
    args = parser().parse_args(argv)
    data = run(args)
    from .peers_report import peers_lines
    print('\n'.join(peers_lines(data, img_dir=None)))
    print(f'results: {args.out}', file=sys.stderr)


if __name__ == '__main__':
    main()
