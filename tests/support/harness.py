"""One harness for every multi-process test: real processes, real gloo collectives.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh
interpreters (spawn) with torchrun's environment variables on a free local
port, calls ``fn(*args)`` in each, and returns their results by rank. A rank
that raises fails the test with that rank's traceback; a run that outlives its
deadline is killed and fails the test, so a collective that never completes
cannot hang the suite. Process groups are started with :data:`COLLECTIVE_TIMEOUT_S`
so that each collective also times out on its own.

Tests batch several checks into one call: starting interpreters is the cost.

``run_job(cmd, env=job_env(...))`` runs a whole job the way a user starts it
(``tools/dist_train.sh``, ``torchrun``, a third-party ``train.py``) in its own
session under a deadline; a job past it is killed with all its processes.

The small comparisons the checks share (:func:`max_abs_diff`,
:func:`scalar_history`, :func:`raised`) live here too, so that every test
measures "equal to one process" the same way.
"""
import multiprocessing
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
           'free_port', 'job_env', 'max_abs_diff', 'raised', 'run_distributed', 'run_job',
           'scalar_history']

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
