"""Work that one rank does while the others wait: its failure becomes every rank's error.

Rank 0 logs the sharding plan, runs ``before_save_checkpoint`` hooks and
writes checkpoint files while the other ranks go on to the next collective.
If rank 0 raises there, the others would block in that collective until the
process-group timeout (then the watchdog kills the job, saying nothing about
the cause). :func:`fail_together` closes such a section with one exchange of
a success flag: every rank leaves it together, and if any rank failed, every
rank raises, the failing one its own exception, the others
:class:`PeerFailure` naming the section, the rank and its error::

    with fail_together('saving checkpoint iter_4.pth', wait_s=7200):
        if rank == 0:
            torch.save(checkpoint, path)

``wait_s`` bounds how long the others wait for a slow but healthy rank (the
exchange then runs in a gloo group with that timeout); it is separate from the
process group's timeout, which is sized for collectives, not for writing a
multi-GB file. A rank that dies meanwhile fails the others at once (its
connections close), whatever ``wait_s`` is.
"""
import contextlib
import datetime
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ['PeerFailure', 'control_group', 'fail_together']

#: The longest error text sent to the other ranks.
_MAX_MESSAGE = 2000


class PeerFailure(RuntimeError):
    """Another rank failed in a section that every rank leaves together."""


_GROUPS: Dict[Tuple[Any, Optional[float]], Optional[dist.ProcessGroup]] = {}


def control_group(timeout_s: Optional[float] = None) -> Optional[dist.ProcessGroup]:
    """A gloo group over all ranks for small CPU messages; ``None`` means the default group.

    With ``timeout_s``, a gloo group whose collectives wait that long (the
    default group's timeout is sized for collectives, not for a slow save).
    Groups are created at the first call, which every rank makes at the same
    point, and reused.
    """
    if not dist.is_initialized():
        raise ValueError('control_group needs the default process group: call '
                         'init_process_group first')
    default = dist.group.WORLD  # one side group per default group
    key = (default, timeout_s)
    if key not in _GROUPS:
        if timeout_s is None and dist.get_backend() == 'gloo':
            _GROUPS[key] = None
        else:
            timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
            _GROUPS[key] = dist.new_group(backend='gloo', timeout=timeout)
    return _GROUPS[key]


def _failed_ranks(failed: bool, group: Optional[dist.ProcessGroup]) -> List[int]:
    flags = [torch.zeros(1, dtype=torch.int32) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([int(failed)], dtype=torch.int32), group=group)
    return [rank for rank, flag in enumerate(flags) if flag.item()]


def _describe(error: BaseException) -> str:
    return f'{type(error).__name__}: {error}'[:_MAX_MESSAGE]


@contextlib.contextmanager
def fail_together(what: str, wait_s: Optional[float] = None) -> Iterator[None]:
    """Run the body on every rank; leave together; raise on every rank if any rank raised.

    Without a process group (or with one rank) the body simply runs.

    Args:
        what: the section, in words, for the error message (``'saving
            checkpoint iter_4.pth'``).
        wait_s: how long a rank waits for the others to finish the body;
            ``None``: the process group's timeout.

    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    error: Optional[Exception] = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every rank must hear about any failure
        error = e
    group = control_group(wait_s)
    try:
        failed = _failed_ranks(error is not None, group)
        messages: List[Optional[str]] = [None] * dist.get_world_size()
        if failed:
            dist.all_gather_object(messages, _describe(error) if error else None, group=group)
    except Exception as lost:  # noqa: BLE001 - a peer died or stalled: say so, and where
        if error is not None:
            raise error from lost
        limit = 'the process-group timeout' if wait_s is None else f'{wait_s} s'
        raise PeerFailure(f'{what}: another rank died or did not finish within {limit} '
                          f'({_describe(lost)})') from lost
    if error is not None:
        raise error
    if failed:
        detail = '; '.join(f'rank {rank}: {messages[rank]}' for rank in failed)
        raise PeerFailure(f'{what} failed on rank{"s" if len(failed) > 1 else ""} '
                          f'{", ".join(map(str, failed))} ({detail}); this rank stops too '
                          'so that no rank waits forever')
