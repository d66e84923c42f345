"""One harness for every multi-process test: real processes, real gloo collectives.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh
interpreters (spawn) with torchrun's environment variables on a free local
port, calls ``fn(*args)`` in each, and returns their results by rank. A rank
that raises fails the test with that rank's traceback; a run that outlives its
deadline is killed and fails the test, so a collective that never completes
cannot hang the suite. Process groups are started with :data:`COLLECTIVE_TIMEOUT_S`
so that each collective also times out on its own.

Tests batch several checks into one call: starting interpreters is the cost.

``RankPool(world_size)`` keeps such ranks alive between calls, for tiers that
run many short cases (tests/differential): the process group is started once,
each ``pool.run(fn, *args)`` runs ``fn`` on every rank under the same deadline
and rules, and a call that fails, hangs or ends the process group restarts the
pool for the next one. ``RankPool(1, process_group=False)`` is one plain
process (a stock single-process reference).

``run_job(cmd, env=job_env(...))`` runs a whole job the way a user starts it
(``tools/dist_train.sh``, ``torchrun``, a third-party ``train.py``) in its own
session under a deadline; a job past it is killed with all its processes.

The small comparisons the checks share (:func:`max_abs_diff`,
:func:`scalar_history`, :func:`raised`) live here too, so that every test
measures "equal to one process" the same way.
"""
import io
import multiprocessing
import os
import queue
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import pytest
import torch

from job import Job
from mmfsdp.dist import shutdown_distributed

__all__ = ['COLLECTIVE_TIMEOUT_S', 'DIST_CFG', 'JOB_TIMEOUT_S', 'LAUNCHER_VARS', 'REPO', 'SUPPORT',
           'RankPool', 'free_port', 'job_env', 'max_abs_diff', 'raised', 'run_distributed',
           'run_job', 'scalar_history']

#: The repository root: the working directory of the documented launch commands.
REPO = Path(__file__).resolve().parents[2]
#: This folder: what a job started by a test puts on its ``PYTHONPATH`` to import ``toy``.
SUPPORT = Path(__file__).resolve().parent

#: Every collective of a test process group fails after this many seconds.
COLLECTIVE_TIMEOUT_S = 60
#: ``env_cfg.dist_cfg`` for runners in tests: no backend, so the device picks it.
DIST_CFG = dict(timeout=COLLECTIVE_TIMEOUT_S)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable,
           args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        result = fn(*args)
    except BaseException:
        with open(os.path.join(out_dir, f'{rank}.err'), 'w') as f:
            f.write(traceback.format_exc())
        raise
    finally:
        shutdown_distributed()  # as FSDPRunner does at exit (mmfsdp/dist.py)
    torch.save(result, os.path.join(out_dir, f'{rank}.pt'))


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the results, rank 0 first.

    ``fn`` must be a module-level function (it is pickled by reference) and
    return tensors, numbers, strings, or lists / dicts of them.
    """
    sys.audit('harness.run_distributed', world_size)  # tests/unit refuses it
    ctx = multiprocessing.get_context('spawn')
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, out_dir, fn, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = {r: open(os.path.join(out_dir, f'{r}.err')).read()
                  for r in range(world_size) if os.path.exists(os.path.join(out_dir, f'{r}.err'))}
        if errors:
            raise AssertionError('\n'.join(f'--- rank {r} raised:\n{e}' for r, e in errors.items()))
        if hung:
            raise TimeoutError(f'ranks {hung} still running after {timeout} s (a hung collective?)')
        failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        if failed:
            raise AssertionError(f'ranks exited with codes {failed}')
        return [torch.load(os.path.join(out_dir, f'{r}.pt')) for r in range(world_size)]


def _pool_entry(rank: int, world_size: int, port: Optional[int], inbox: Any, outbox: Any) -> None:
    """A pool rank: start the process group once, then run what the driver sends until ``None``."""
    import datetime

    import torch.distributed as dist
    torch.set_num_threads(1)
    if port is not None:
        os.environ.update(
            MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        for job in iter(inbox.get, None):
            fn, args = job
            try:
                reply = ('ok', fn(*args))
            except BaseException:  # noqa: BLE001 - the driver reports whatever a rank raised
                reply = ('raised', traceback.format_exc())
            buffer = io.BytesIO()
            torch.save(reply, buffer)  # tensors by value: no shared-memory handles per call
            ended = port is not None and not dist.is_initialized()
            outbox.put((rank, buffer.getvalue(), ended))
            if ended:
                break  # the call ended the process group: leave (atexit work runs), restart
    finally:
        shutdown_distributed()


class RankPool:
    """``world_size`` ranks kept alive between calls (see the module docstring).

    ``run`` returns the results by rank, or raises as :func:`run_distributed`
    does (a rank's traceback, a deadline passed); after any failure, and after a
    call that destroyed the process group, the ranks are stopped and the next
    ``run`` starts fresh ones. ``restarts`` counts the starts.
    """

    def __init__(self, world_size: int, process_group: bool = True) -> None:
        self.world_size, self.process_group = world_size, process_group
        self.procs: List[Any] = []
        self.restarts = 0

    def _start(self) -> None:
        sys.audit('harness.run_distributed', self.world_size)  # tests/unit refuses it
        ctx = multiprocessing.get_context('spawn')
        port = free_port() if self.process_group else None
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self.procs = [ctx.Process(target=_pool_entry, daemon=True,
                                  args=(r, self.world_size, port, self.inboxes[r], self.outbox))
                      for r in range(self.world_size)]
        for p in self.procs:
            p.start()
        self.restarts += 1

    def close(self, grace: float = 10.0) -> bool:
        """Stop the ranks (``None`` to each, then kill the rest); True if all left themselves."""
        for inbox, p in zip(getattr(self, 'inboxes', []), self.procs):
            if p.is_alive():
                inbox.put(None)
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        clean = not any(p.is_alive() for p in self.procs)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []
        return clean

    def run(self, fn: Callable, *args: Any, timeout: float = 120) -> List[Any]:
        """Run ``fn(*args)`` on every rank; return the results, rank 0 first."""
        self.submit(fn, *args)
        return self.collect(timeout)

    def submit(self, fn: Callable, *args: Any) -> None:
        """Start ``fn(*args)`` on every rank and return at once (:meth:`collect` waits)."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close(grace=0)
            self._start()
        for inbox in self.inboxes:
            inbox.put((fn, args))

    def collect(self, timeout: float = 120) -> List[Any]:
        """The results of the call :meth:`submit` started, as :meth:`run` returns them."""
        deadline = time.monotonic() + timeout
        replies: Dict[int, Tuple[str, Any]] = {}
        ended = False
        while len(replies) < self.world_size:
            wait = deadline - time.monotonic()
            if replies and any(kind == 'raised' for kind, _ in replies.values()):
                wait = min(wait, 5.0)  # the others are likely stuck in a collective it left
            try:
                rank, payload, group_ended = self.outbox.get(timeout=max(0.0, wait))
            except queue.Empty:
                break
            replies[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            ended = ended or group_ended
        errors = {r: v for r, (kind, v) in sorted(replies.items()) if kind == 'raised'}
        if errors or len(replies) < self.world_size:
            self.close(grace=0)
        elif ended:
            self.close()  # the call ended the process group: let them exit and publish
        if errors:
            silent = sorted(set(range(self.world_size)) - set(replies))
            raise AssertionError('\n'.join(f'--- rank {r} raised:\n{e}' for r, e in errors.items())
                                 + (f'\n--- ranks {silent} did not return' if silent else ''))
        if len(replies) < self.world_size:
            hung = sorted(set(range(self.world_size)) - set(replies))
            raise TimeoutError(f'ranks {hung} still running after {timeout} s (a hung collective?)')
        return [replies[r][1] for r in range(self.world_size)]


#: A job's deadline: starting the interpreters dominates, each job trains a few seconds.
JOB_TIMEOUT_S = 240
#: Variables a launcher sets; a job a test starts must not inherit them from the test run
#: (under torchrun or Slurm the job would take the test's rank and port).
LAUNCHER_VARS = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR',
                 'MASTER_PORT', 'PORT')
#: How much of a failed job's output the failure shows.
OUTPUT_TAIL = 6000


def job_env(*pythonpath: Union[str, Path], unset: Iterable[str] = (),
            **variables: str) -> Dict[str, str]:
    """The environment of a job a test starts: the test run's, made launch-neutral.

    :data:`LAUNCHER_VARS` and the names in ``unset`` (a name ending in ``*`` is
    a prefix: ``'SLURM_*'``) are removed; ``OMP_NUM_THREADS=1``, as torchrun
    gives its workers (the suite shares the cores, and oversubscribed OpenMP
    threads slowed a step 10x here); ``pythonpath`` goes before the inherited
    ``PYTHONPATH``; ``variables`` are set last.
    """
    names = set(LAUNCHER_VARS) | {n for n in unset if not n.endswith('*')}
    prefixes = tuple(n[:-1] for n in unset if n.endswith('*'))
    env = {k: v for k, v in os.environ.items()
           if k not in names and not (prefixes and k.startswith(prefixes))}
    env['OMP_NUM_THREADS'] = '1'
    paths = [str(p) for p in pythonpath] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else [])
    if paths:
        env['PYTHONPATH'] = os.pathsep.join(paths)
    env.update(variables)
    return env


def run_job(cmd: Sequence[str], *, env: Optional[Dict[str, str]] = None,
            cwd: Union[str, Path] = REPO, timeout: float = JOB_TIMEOUT_S,
            merge_stderr: bool = True) -> str:
    """Run ``cmd`` in ``cwd`` in its own session; return its output, or fail with its tail.

    ``env`` defaults to :func:`job_env` ``()``. A job past ``timeout`` is
    killed with every process it started (torchrun's workers included, see
    :class:`job.Job`) and the test fails with the output it had
    written; so does a job whose launcher exits leaving processes running.
    With ``merge_stderr=False`` only stdout is returned (for a command whose
    stdout is parsed) and stderr is shown on failure.
    """
    with Job([cmd], job_env() if env is None else env, str(cwd), merge_stderr) as job:
        finished = job.wait(timeout)
        out, code = job.stdout(), job.returncodes[0]
        output = out + job.stderr()
    if not finished:
        pytest.fail(f'{cmd} still running after {timeout} s (every process killed); output:\n'
                    f'{output[-OUTPUT_TAIL:]}')
    assert code == 0 and not job.left_behind, (
        f'{cmd} exited with {code}'
        + (f', leaving {len(job.left_behind)} processes running (killed)' if job.left_behind
           else '') + f'; output:\n{output[-OUTPUT_TAIL:]}')
    return out


def max_abs_diff(a: Dict[str, Any], b: Dict[str, Any]) -> float:
    """The largest absolute difference between two state dicts with the same keys.

    Nested dicts (optimizer state) are compared recursively; tensors are
    compared in float64 (so the difference itself is not rounded), empty ones
    count as equal; any other value counts 0 when equal and 1 when not. Keys
    that differ fail the test, naming them.
    """
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    diffs = [max_abs_diff(a[k], b[k]) if isinstance(a[k], dict)
             else ((a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0)
             if isinstance(a[k], torch.Tensor) else float(a[k] != b[k]) for k in a]
    return max(diffs, default=0.0)


def scalar_history(runner, key: str) -> List[float]:
    """Every value a runner's message hub logged under ``key`` (``'train/loss'``), oldest first."""
    if not runner.message_hub.log_scalars.get(key):
        return []
    return [float(v) for v in runner.message_hub.get_scalar(key).data[0]]


def raised(fn: Callable[[], Any]) -> Tuple[Optional[str], Optional[str]]:
    """``(type name, message)`` of what ``fn()`` raised, ``(None, None)`` if nothing.

    For checks that run on every rank and compare the errors afterwards.
    """
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares whatever was raised
        return type(e).__name__, str(e)
    return None, None
