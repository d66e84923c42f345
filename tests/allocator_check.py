"""A hook that a test config imports: does a freed 8 MiB tensor go back to the system?

Imported through ``custom_imports`` by ``tests/test_allocator.py``, in jobs
started with ``tools/dist_train.sh``. Before training, each rank:

1. allocates and frees a 20 MiB tensor: with glibc's defaults this raises the
   mmap threshold to 20 MiB (blocks below it then come from the heap);
2. allocates an 8 MiB tensor, writes it, and reads glibc's count of mapped
   bytes (``mallinfo2().hblkhd``) and the resident set;
3. frees it and reads the resident set again;
4. allocates another 8 MiB tensor: does it take the freed block's address?
   (With the caching allocator it does, and its counters show the block.)

and writes what it saw to ``OUT_DIR/rank<R>.json``.
"""
import ctypes
import json
import os
from typing import Any

import torch
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

MiB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        'arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks',
        'fordblks', 'keepcost')]


def mapped_bytes() -> int:
    """Bytes glibc serves from blocks mapped on their own (``mallinfo2().hblkhd``)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().hblkhd


def rss_bytes() -> int:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmRSS:'))


@HOOKS.register_module()
class AllocatorCheckHook(Hook):

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def before_train(self, runner: Any) -> None:
        from mmfsdp import cpu_cache
        from mmfsdp.allocator import active_policy

        def cached_live() -> int:
            stats = cpu_cache.stats()
            return 0 if stats is None else stats.live_bytes

        big = torch.ones(20 * MiB // 4)
        del big
        mapped_before, cached_before = mapped_bytes(), cached_live()
        block = torch.ones(8 * MiB // 4)
        address = block.data_ptr()
        mapped_alive, rss_alive, cached_alive = mapped_bytes(), rss_bytes(), cached_live()
        del block
        rss_freed = rss_bytes()
        again = torch.ones(8 * MiB // 4)
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f'rank{runner.rank}.json'), 'w') as f:
            json.dump(dict(policy=active_policy(), mapped=mapped_alive - mapped_before,
                           returned=rss_alive - rss_freed, cached=cached_alive - cached_before,
                           reused=again.data_ptr() == address,
                           window_hook=any(type(h).__name__ == 'CacheWindowHook'
                                           for h in runner.hooks)), f)
