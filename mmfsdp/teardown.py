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
it at exit when it starts the process group.
"""
import atexit
import time
from typing import Dict, Optional, Tuple

import torch.distributed as dist

from .compat import gloo_worker_threads

__all__ = ['settle_gloo_workers', 'shutdown_at_exit', 'shutdown_distributed']

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


def shutdown_at_exit() -> None:
    """Run :func:`shutdown_distributed` when the interpreter exits (before its finalization)."""
    atexit.register(shutdown_distributed)
