"""Leaving a distributed process: every group destroyed, gloo's threads idle, then exit.

A finished CPU job used to abort now and then at exit (SIGABRT, "terminate
called without an active exception"), after its last iteration and its last
checkpoint, so torchrun reported a failed job. The cause, from the core dumps
(pytorch/pytorch#190489): a gloo worker thread releases each finished
collective *after* the caller's ``wait()`` has returned, and the release drops
tensors, which takes the GIL. If the main thread has meanwhile begun the
interpreter's finalization, Python 3.11 ends the worker by ``pthread_exit``,
and its unwinding through a C++ destructor aborts the process. A loaded
machine widens the window: a 2-rank job that all-reduces and exits without
this teardown aborted in 14 of 30 runs beside a test suite.

:func:`shutdown_distributed` closes the window: it destroys every process
group (a group nothing else references joins its threads), then waits, with
the GIL released, until the gloo worker threads that are left (groups still
referenced by wrapped modules) are idle. :class:`mmfsdp.FSDPRunner` registers
it at exit when it starts the process group; when the caller started it, the
runner registers :func:`settle_gloo_workers` alone: the groups are the
caller's to destroy, but the workers of those its wrapped model holds must be
idle before the interpreter finalizes all the same. mmfsdp's wrappers call
:func:`teardown_at_exit` when they are built, so that a model wrapped by
mmengine's stock ``Runner`` (or by hand) is covered too.
"""
import atexit
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from .compat import gloo_worker_threads

__all__ = ['registered_at_exit', 'settle_at_exit', 'settle_gloo_workers', 'shutdown_at_exit',
           'shutdown_distributed', 'teardown_at_exit']

#: How long a worker must stay blocked, without running, to count as idle.
QUIET_S = 0.005


def _activity(tid: int) -> Optional[Tuple[str, int, int]]:
    """A thread's state and context-switch counts; ``None`` once it has ended."""
    try:
        with open(f'/proc/self/task/{tid}/status') as f:
            fields = dict(line.split(':', 1) for line in f if ':' in line)
    except OSError:
        return None
    return (fields['State'].split()[0], int(fields['voluntary_ctxt_switches']),
            int(fields['nonvoluntary_ctxt_switches']))


def settle_gloo_workers(timeout: float = 5.0) -> bool:
    """Wait until every gloo worker thread of this process is idle; whether they all are.

    Idle: blocked (sleeping), and not switched in even once over
    :data:`QUIET_S` while this thread sleeps without the GIL, so a worker
    that still had a release to finish, and needed the CPU or the GIL for
    it, would have run. Returns at once when no worker is left (every group
    destroyed and unreferenced), and ``False`` when ``timeout`` passes first
    (a collective still in flight).
    """
    deadline = time.monotonic() + timeout
    before: Dict[int, Optional[Tuple[str, int, int]]] = {}
    while True:
        now = {tid: _activity(tid) for tid in gloo_worker_threads()}
        now = {tid: state for tid, state in now.items() if state is not None}
        if all(state[0] == 'S' and before.get(tid) == state for tid, state in now.items()):
            return True
        if time.monotonic() > deadline:
            return False
        before = now
        time.sleep(QUIET_S)


def shutdown_distributed(timeout: float = 5.0) -> bool:
    """Destroy every process group, then :func:`settle_gloo_workers`; whether they settled.

    Call it last in a process that used ``torch.distributed``: after it, no
    collective can run. Safe to call when no group exists.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    return settle_gloo_workers(timeout)


_AT_EXIT: List[Callable[..., bool]] = []


def _once_at_exit(fn: Callable[..., bool]) -> None:
    if fn not in _AT_EXIT:  # one registration per process, however many runners are built
        _AT_EXIT.append(fn)
        atexit.register(fn)


def shutdown_at_exit() -> None:
    """Run :func:`shutdown_distributed` when the interpreter exits (before its finalization)."""
    _once_at_exit(shutdown_distributed)


def settle_at_exit() -> None:
    """Run :func:`settle_gloo_workers` when the interpreter exits, destroying no group."""
    _once_at_exit(settle_gloo_workers)


def registered_at_exit() -> List[str]:
    """The names of the teardown functions this process will run at exit, in registration order."""
    return [fn.__name__ for fn in _AT_EXIT]


def teardown_at_exit() -> None:
    """What a wrapper calls when it is built: its gloo workers idle before the interpreter exits.

    Registers :func:`settle_gloo_workers` unless a teardown is registered
    already (``FSDPRunner``'s :func:`shutdown_distributed`, which settles too,
    or an earlier wrapper's); idempotent. No group is destroyed: the stock
    Runner, or the script that started the group, owns it, and may still use
    it in its own exit handlers. Registered at exit by the wrapper, it runs
    before any exit handler registered earlier (``atexit`` runs in reverse).
    """
    if not _AT_EXIT:
        settle_at_exit()
