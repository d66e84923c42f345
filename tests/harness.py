"""One harness for every multi-process test: real processes, real gloo collectives.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh
interpreters (spawn) with torchrun's environment variables on a free local
port, calls ``fn(*args)`` in each, and returns their results by rank. A rank
that raises fails the test with that rank's traceback; a run that outlives its
deadline is killed and fails the test, so a collective that never completes
cannot hang the suite. Process groups are started with :data:`COLLECTIVE_TIMEOUT_S`
so that each collective also times out on its own.

Tests batch several checks into one call: starting interpreters is the cost.
"""
import multiprocessing
import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch

__all__ = ['COLLECTIVE_TIMEOUT_S', 'DIST_CFG', 'free_port', 'run_distributed']

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
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f'{rank}.pt'))


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the results, rank 0 first.

    ``fn`` must be a module-level function (it is pickled by reference) and
    return tensors, numbers, strings, or lists / dicts of them.
    """
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
