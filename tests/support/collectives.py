"""Count the bytes of the collectives a process issues.

Every ``torch.distributed`` collective called from Python (FSDP1 and FSDP2
call ``dist.all_gather_single``, ``dist.reduce_scatter_single``,
``dist.all_reduce`` ...) ends in a method of the ``ProcessGroup`` object;
:class:`CollectiveCounter` wraps those methods on the class while it is
active. DDP's reducer calls its process group from C++, past Python, so its buckets
are not counted.

Bytes per rank are the **send volume of the bandwidth-optimal ring algorithm**
for each collective over a group of N ranks, computed from the sizes of the
tensors passed (not sniffed from the wire; gloo may pick another algorithm):

- all-gather of an input of ``s`` bytes per rank: ``(N-1) * s``
- reduce-scatter to an output of ``s`` bytes per rank: ``(N-1) * s``
- all-reduce of ``s`` bytes: ``2 (N-1) / N * s`` (reduce-scatter + all-gather)
- broadcast of ``s`` bytes: ``s`` (N > 1; the root's send, pipelined)
- all-to-all of ``s`` bytes: ``(N-1) / N * s``
"""
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

__all__ = ['CollectiveCounter']


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _all_gather(n: int, s: int) -> float:
    return (n - 1) * s


def _all_reduce(n: int, s: int) -> float:
    return 2 * (n - 1) / n * s


def _broadcast(n: int, s: int) -> float:
    return s if n > 1 else 0


def _all_to_all(n: int, s: int) -> float:
    return (n - 1) / n * s


#: ProcessGroup method -> (index of the argument whose size counts, ring send volume).
#: All-gathers count their input (one rank's part), reduce-scatters their output.
RULES: Dict[str, tuple] = {
    'allreduce': (0, _all_reduce),
    'allreduce_coalesced': (0, _all_reduce),
    'all_gather_single': (1, _all_gather),
    '_allgather_base': (1, _all_gather),
    'allgather': (1, _all_gather),
    'allgather_coalesced': (1, _all_gather),
    'allgather_into_tensor_coalesced': (1, _all_gather),
    'all_gather_single_coalesced': (1, _all_gather),
    'reduce_scatter_single': (0, _all_gather),
    '_reduce_scatter_base': (0, _all_gather),
    'reduce_scatter': (0, _all_gather),
    'reduce_scatter_tensor_coalesced': (0, _all_gather),
    'reduce_scatter_single_coalesced': (0, _all_gather),
    'broadcast': (0, _broadcast),
    'alltoall_base': (1, _all_to_all),
    'all_to_all_single': (1, _all_to_all),
    'alltoall': (1, _all_to_all),
}


class CollectiveCounter:
    """While active, count every collective issued through a ``ProcessGroup``.

    ``snapshot()`` returns ``dict(send_bytes=..., by_op={method: dict(calls,
    payload_bytes, send_bytes)}, by_group={(method, group name): payload_bytes})``;
    ``reset()`` starts a new count.
    """

    def __init__(self) -> None:
        self._originals: Dict[str, Any] = {}
        self.reset()

    def reset(self) -> None:
        """Forget what was counted so far."""
        self.by_op: Dict[str, Dict[str, float]] = {}
        self.by_group: Dict[Any, int] = {}

    def snapshot(self) -> Dict[str, Any]:
        """What was counted since the last :meth:`reset`."""
        ops = {k: dict(v) for k, v in sorted(self.by_op.items())}
        return dict(send_bytes=sum(v['send_bytes'] for v in ops.values()), by_op=ops,
                    by_group=dict(self.by_group))

    def _count(self, name: str, group: Any, args: tuple, kwargs: dict) -> None:
        index, volume = RULES[name]
        payload = _nbytes(args[index]) if len(args) > index else _nbytes(list(kwargs.values()))
        entry = self.by_op.setdefault(name, dict(calls=0, payload_bytes=0, send_bytes=0.0))
        entry['calls'] += 1
        entry['payload_bytes'] += payload
        entry['send_bytes'] += volume(group.size(), payload)
        key = (name, group.group_name)
        self.by_group[key] = self.by_group.get(key, 0) + payload

    def __enter__(self) -> 'CollectiveCounter':
        cls = dist.ProcessGroup
        for name in RULES:
            function = getattr(cls, name, None)  # the unbound function, called with the group
            if function is None:
                continue
            # What the class itself holds (a pybind instancemethod, or nothing when
            # inherited), so that __exit__ restores exactly that.
            self._originals[name] = cls.__dict__.get(name)
            setattr(cls, name, self._counting(name, function))
        return self

    def _counting(self, name: str, original: Callable) -> Callable:
        def counted(group: Any, *args: Any, **kwargs: Any) -> Any:
            self._count(name, group, args, kwargs)
            return original(group, *args, **kwargs)
        return counted

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            if original is None:
                delattr(dist.ProcessGroup, name)
            else:
                setattr(dist.ProcessGroup, name, original)
        self._originals.clear()
