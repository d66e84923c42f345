"""One harness for every multi-process test: real processes, real gloo collectives.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh
interpreters (spawn) with torchrun's environment variables on a free local
port, calls ``fn(*args)`` in each, and returns their results by rank. A rank
that raises fails the test with that rank's traceback; a run that outlives its
deadline is killed and fails the test, so a collective that never completes
cannot hang the suite. Process groups are started with :data:`COLLECTIVE_TIMEOUT_S`
so that each collective also times out on its own.

Tests batch several checks into one call: starting interpreters is the cost. So the
ranks are kept: a run's interpreters serve the next run of the same world size (a
fresh process group on a fresh port each time, the process's global state put back
between runs, see :func:`_serve`). A run in which a rank raised, hung or died ends
its interpreters, and so does ``fresh=True``, for a test about the process itself
(what it registers at exit); ``MMFSDP_TEST_FRESH_RANKS=1`` starts new interpreters
for every run.

``start_distributed`` starts such a run and returns at once (its ``result()``
waits), so that a caller can work beside the ranks: the differential tier
(tests/differential) runs the stock one-process reference while its 2 ranks
train. A rank that raised gives the others a few seconds more, not the whole
deadline (they may wait in a collective it left).

``run_job(cmd, env=job_env(...))`` runs a whole job the way a user starts it
(``tools/dist_train.sh``, ``torchrun``, a third-party ``train.py``) in its own
session under a deadline; a job past it is killed with all its processes.

The small comparisons the checks share (:func:`max_abs_diff`,
:func:`scalar_history`, :func:`raised`) live here too, so that every test
measures "equal to one process" the same way.
"""
import atexit
import multiprocessing
import multiprocessing.connection
import os
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
           'free_port', 'job_env', 'max_abs_diff', 'raised', 'run_distributed',
           'run_job', 'scalar_history', 'start_distributed']

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


#: ``MMFSDP_TEST_FRESH_RANKS=1``: every run starts its own interpreters (no reuse).
FRESH_RANKS = os.environ.get('MMFSDP_TEST_FRESH_RANKS') == '1'


def _reset_process_state(environ: Dict[str, str], cwd: str, path: List[str]) -> None:
    """Put back what a run may leave in a rank's interpreter, as a new one would have it."""
    import torch._dynamo
    from mmengine.logging import MessageHub, MMLogger
    from mmengine.registry import DefaultScope
    from mmengine.visualization import Visualizer
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    # mmengine's named global instances (a runner's logger, message hub, visualizer and
    # default scope, named by the experiment and its start second): a new runner of the
    # next run must not find the last one's.
    for manager in (MessageHub, MMLogger, Visualizer, DefaultScope):
        manager._instance_dict.clear()
    torch._dynamo.reset()  # compiled graphs and recompile counts
    torch.set_default_dtype(torch.float32)
    torch.seed()  # a new interpreter's generator is seeded at random too


def _serve(rank: int, world_size: int, conn) -> None:
    """A rank's interpreter: run each ``(port, out_dir, fn, args)`` it is sent, until EOF.

    Each run gets torchrun's variables with its own port, one thread, and the
    teardown at its end; its result or traceback goes to ``out_dir`` as
    ``{rank}.pt`` / ``{rank}.err``, then ``'done'`` goes back on the pipe.
    """
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR='127.0.0.1')
    torch.set_num_threads(1)
    environ, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    while True:
        try:
            port, out_dir, fn, args = conn.recv()
        except EOFError:
            return
        os.environ['MASTER_PORT'] = str(port)
        try:
            result = fn(*args)
        except BaseException:
            with open(os.path.join(out_dir, f'{rank}.err'), 'w') as f:
                f.write(traceback.format_exc())
        else:
            torch.save(result, os.path.join(out_dir, f'{rank}.pt'))
        finally:
            shutdown_distributed()  # as FSDPRunner does at exit (mmfsdp/dist.py)
            _reset_process_state(environ, cwd, path)
        conn.send('done')


class _Ranks:
    """``world_size`` interpreters (spawned) that each run one function at a time."""

    def __init__(self, world_size: int) -> None:
        ctx = multiprocessing.get_context('spawn')
        self.procs, self.pipes = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world_size, child))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.pipes.append(parent)

    def usable(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def send(self, fn: Callable, args: tuple, out_dir: str) -> None:
        """Start ``fn(*args)`` on every rank, on a fresh port."""
        port = free_port()
        for pipe in self.pipes:
            pipe.send((port, out_dir, fn, args))

    def wait(self, out_dir: str, deadline: float) -> List[int]:
        """Wait for the run :meth:`send` started; return the ranks still running at the end.

        Once a rank has raised, the others get :data:`AFTER_A_RAISE_S` more.
        """
        waiting = dict(zip(self.pipes, range(len(self.pipes))))
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while waiting:
            ready = multiprocessing.connection.wait(
                list(waiting) + list(sentinels), max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for ready_one in ready:
                if ready_one in sentinels:  # the rank died: its pipe will never answer
                    waiting = {p: r for p, r in waiting.items() if r != sentinels[ready_one]}
                    del sentinels[ready_one]
                elif ready_one in waiting:
                    try:
                        ready_one.recv()
                    except EOFError:  # the rank died: its sentinel tells the rest
                        del waiting[ready_one]
                        continue
                    if os.path.exists(os.path.join(out_dir, f'{waiting[ready_one]}.err')):
                        deadline = min(deadline, time.monotonic() + AFTER_A_RAISE_S)
                    del waiting[ready_one]
        return sorted(r for r in waiting.values() if self.procs[r].is_alive())

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()  # an idle rank sees EOF and returns
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


#: The kept interpreters, by world size.
_KEPT: Dict[int, _Ranks] = {}
#: Once a rank has raised, the seconds the others get to finish.
AFTER_A_RAISE_S = 5.0


@atexit.register
def _close_kept_ranks() -> None:
    while _KEPT:
        _KEPT.popitem()[1].close()


class Run:
    """A run started by :func:`start_distributed`; :meth:`result` waits for it."""

    def __init__(self, fn: Callable, world_size: int, args: tuple, timeout: float,
                 fresh: bool) -> None:
        sys.audit('harness.run_distributed', world_size)  # tests/unit refuses it
        self.world_size, self.fresh = world_size, fresh or FRESH_RANKS
        self.deadline, self.timeout = time.monotonic() + timeout, timeout
        ranks = _KEPT.pop(world_size, None)
        if ranks is None or not ranks.usable():
            if ranks is not None:
                ranks.close()
            ranks = _Ranks(world_size)
        self.ranks, self.out = ranks, tempfile.TemporaryDirectory()
        ranks.send(fn, args, self.out.name)

    def result(self) -> List[Any]:
        """The results by rank, rank 0 first; or the failure, as :func:`run_distributed`."""
        ranks, out_dir = self.ranks, self.out.name
        with self.out:
            hung = ranks.wait(out_dir, self.deadline)
            errors = {r: open(os.path.join(out_dir, f'{r}.err')).read()
                      for r in range(self.world_size)
                      if os.path.exists(os.path.join(out_dir, f'{r}.err'))}
            died = {r: p.exitcode for r, p in enumerate(ranks.procs) if not p.is_alive()}
            if self.fresh or hung or errors or died:
                ranks.close()  # kills the hung ones
            else:
                _KEPT.setdefault(self.world_size, ranks)
            if errors:
                raise AssertionError('\n'.join(f'--- rank {r} raised:\n{e}'
                                                for r, e in errors.items()))
            if hung:
                raise TimeoutError(f'ranks {hung} still running after {self.timeout} s '
                                   '(a hung collective?)')
            if died:
                raise AssertionError(f'ranks exited with codes {died}')
            return [torch.load(os.path.join(out_dir, f'{r}.pt')) for r in range(self.world_size)]


def start_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240,
                      fresh: bool = False) -> Run:
    """Start ``fn(*args)`` on ``world_size`` ranks; return at once (:func:`run_distributed`)."""
    return Run(fn, world_size, args, timeout, fresh)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240,
                    fresh: bool = False) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the results, rank 0 first.

    ``fn`` must be a module-level function (it is pickled by reference) and
    return tensors, numbers, strings, or lists / dicts of them. The ranks'
    interpreters are reused across runs unless ``fresh`` (module docstring).
    """
    return start_distributed(fn, world_size, *args, timeout=timeout, fresh=fresh).result()


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
