"""Probes of one process: resident memory and its peak, model-state bytes, collective bytes.

Peak memory is the kernel's high-water mark of the resident set (``VmHWM``);
writing ``5`` to ``/proc/self/clear_refs`` resets it to the current resident
set (Linux >= 4.0), so one process can measure the peak of each training step.

Model-state bytes are counted from the tensors themselves: the *storages*
behind the local parameters, gradients and optimizer state, each storage once
(FSDP1 parameters are views of one flat shard; DDP gradients are views of its
buckets; FSDP2 parameters are DTensors whose local tensors are padded shards).

Collective bytes are the **send volume of the bandwidth-optimal ring algorithm**
per rank, computed from the sizes of the tensors passed to each collective (not
sniffed from the wire; gloo may pick other algorithms): all-gather and
reduce-scatter (N-1)·s for a per-rank part of s bytes, all-reduce 2(N-1)/N·s,
broadcast s.
"""
import statistics
from typing import Any, Dict, Iterable, Optional

import torch
import torch.distributed as dist


def _status_bytes(field: str) -> int:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f'/proc/self/status has no {field}')


def rss_bytes() -> int:
    """The resident set of this process now."""
    return _status_bytes('VmRSS')


def peak_rss_bytes() -> int:
    """The highest resident set since the process started or :func:`reset_peak_rss`."""
    return _status_bytes('VmHWM')


def reset_peak_rss() -> int:
    """Reset the high-water mark to the current resident set, and return it.

    Use the return value as the baseline of a later :func:`peak_rss_bytes`, not an
    earlier :func:`rss_bytes`: the kernel folds per-thread counts in late, so the
    resident set can read lower a moment later.
    """
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    return peak_rss_bytes()


def _storages_bytes(tensors: Iterable[torch.Tensor], seen: set) -> int:
    total = 0
    for tensor in tensors:
        storage = getattr(tensor, '_local_tensor', tensor).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_bytes(model: torch.nn.Module,
                      optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, int]:
    """Bytes of the storages behind parameters, gradients and optimizer state on this rank."""
    seen: set = set()
    params = list(model.parameters())
    states = [v for state in (optimizer.state.values() if optimizer is not None else ())
              for v in state.values() if isinstance(v, torch.Tensor)]
    out = dict(params=_storages_bytes(params, seen),
               grads=_storages_bytes([p.grad for p in params if p.grad is not None], seen),
               optimizer=_storages_bytes(states, seen))
    out['total'] = out['params'] + out['grads'] + out['optimizer']
    return out


def summary(values: Iterable[float]) -> Dict[str, float]:
    """Median, min, max and count of ``values``."""
    values = list(values)
    if not values:
        raise ValueError('summary of no values')
    return dict(median=statistics.median(values), min=min(values), max=max(values),
                n=len(values))


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


#: ProcessGroup method -> (index of the argument whose size counts, volume per byte of it as
#: a function of N). All-gathers count their input (one rank's part), reduce-scatters their
#: output (one rank's part).
RING_VOLUME: Dict[str, tuple] = {
    **{name: (0, lambda n: 2 * (n - 1) / n) for name in ('allreduce', 'allreduce_coalesced')},
    **{name: (1, lambda n: n - 1) for name in (
        'all_gather_single', '_allgather_base', 'allgather', 'allgather_coalesced',
        'allgather_into_tensor_coalesced')},
    **{name: (0, lambda n: n - 1) for name in (
        'reduce_scatter_single', '_reduce_scatter_base', 'reduce_scatter',
        'reduce_scatter_tensor_coalesced')},
    'broadcast': (0, lambda n: 1 if n > 1 else 0),
}


class CollectiveCounter:
    """While entered, count every collective issued through a ``ProcessGroup`` from Python.

    FSDP1 and FSDP2 call the process group from Python; DDP's reducer calls it from
    C++: register :func:`ddp_counting_hook` as its comm hook (torch's default bucket
    all-reduce, issued through Python) to count its buckets too.
    ``snapshot()``: ``dict(send_bytes, by_op={method: dict(calls, send_bytes)})``.
    """

    def __init__(self) -> None:
        self.originals: Dict[str, Any] = {}
        self.reset()

    def reset(self) -> None:
        """Forget what was counted so far."""
        self.by_op: Dict[str, Dict[str, float]] = {}

    def snapshot(self) -> Dict[str, Any]:
        """What was counted since the last :meth:`reset`."""
        ops = {k: dict(v) for k, v in sorted(self.by_op.items())}
        return dict(send_bytes=sum(v['send_bytes'] for v in ops.values()), by_op=ops)

    def __enter__(self) -> 'CollectiveCounter':
        cls = dist.ProcessGroup
        for name, (index, volume) in RING_VOLUME.items():
            original = getattr(cls, name, None)
            if original is None:
                continue
            self.originals[name] = cls.__dict__.get(name)  # None when inherited

            def counted(group: Any, *args: Any, _name: str = name, _index: int = index,
                        _volume: Any = volume, _original: Any = original, **kwargs: Any) -> Any:
                payload = _nbytes(args[_index]) if len(args) > _index else 0
                entry = self.by_op.setdefault(_name, dict(calls=0, send_bytes=0.0))
                entry['calls'] += 1
                entry['send_bytes'] += _volume(group.size()) * payload
                return _original(group, *args, **kwargs)

            setattr(cls, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self.originals.items():
            if original is None:
                delattr(dist.ProcessGroup, name)
            else:
                setattr(dist.ProcessGroup, name, original)
        self.originals.clear()


def ddp_counting_hook(state: Optional[dist.ProcessGroup],
                      bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: torch's default bucket all-reduce, issued through Python (so counted)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    return allreduce_hook(state, bucket)
