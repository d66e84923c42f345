"""Probes of one process: resident memory and its peak, bytes held by tensors, summaries.

Peak memory is the kernel's high-water mark of the resident set (``VmHWM``);
writing ``5`` to ``/proc/self/clear_refs`` resets it to the current resident
set (Linux >= 4.0), so one process can measure the peak of one training step,
then of the next, and report a median over steps.

What of the resident set is live: :func:`malloc_live_bytes`, the bytes glibc's
malloc has handed out and not had back. Between two processes running the same
work, a resident-set difference with equal live bytes is placement (free space
kept in partly used pages), not memory in use.

Model-state bytes are counted from the tensors themselves: the *storages*
behind the local parameters, gradients and optimizer state, each storage once
(FSDP1 parameters are views of one flat shard; DDP gradients are views of its
buckets; FSDP2 parameters are DTensors whose local tensors are padded shards).
"""
import ctypes
import os
import statistics
from typing import Dict, Iterable, List, Optional

import torch

__all__ = ['malloc_live_bytes', 'model_state_bytes', 'peak_rss_bytes', 'reset_peak_rss',
           'rss_bytes', 'summary']


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

    A baseline for a later :func:`peak_rss_bytes` is this return value, not an
    earlier :func:`rss_bytes`: the kernel's resident-set counters can fall
    between two reads (its per-thread counts are folded in late), so a peak
    measured against an earlier read could come out below it.
    """
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    return peak_rss_bytes()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks',
        'fordblks', 'keepcost')]


def malloc_live_bytes() -> Optional[int]:
    """Bytes glibc's malloc has handed out and not had back, every arena: heap blocks in
    use plus chunks mapped on their own (``mallinfo2``); ``None`` without glibc >= 2.33.

    Tensors (torch's CPU allocator calls ``posix_memalign``) and C++ objects are in it;
    the interpreter's small objects are not (pymalloc maps its own arenas). ``None`` too
    under a preloaded jemalloc or tcmalloc.
    """
    if any(name in os.environ.get('LD_PRELOAD', '') for name in ('jemalloc', 'tcmalloc')):
        return None  # glibc's counters would describe a malloc nothing calls
    try:
        libc = ctypes.CDLL('libc.so.6')
    except OSError:  # not glibc
        return None
    if not hasattr(libc, 'mallinfo2'):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, else the tensor."""
    return getattr(tensor, '_local_tensor', tensor)


def _storages_bytes(tensors: Iterable[torch.Tensor], seen: set) -> int:
    total = 0
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def model_state_bytes(model: torch.nn.Module,
                      optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, int]:
    """Bytes of the storages behind parameters, gradients and optimizer state on this rank."""
    seen: set = set()
    params = list(model.parameters())
    out = dict(params=_storages_bytes(params, seen),
               grads=_storages_bytes([p.grad for p in params if p.grad is not None], seen),
               optimizer=_storages_bytes(_optimizer_tensors(optimizer), seen)
               if optimizer is not None else 0)
    out['total'] = out['params'] + out['grads'] + out['optimizer']
    return out


def summary(values: Iterable[float]) -> Dict[str, float]:
    """Median, min, max and count of ``values``."""
    values = list(values)
    if not values:
        raise ValueError('summary of no values')
    return dict(median=statistics.median(values), min=min(values), max=max(values),
                n=len(values))
