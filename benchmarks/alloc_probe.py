"""A probe that a config imports: per-step peak resident set and step time of each rank.

Used by :mod:`benchmarks.allocator`, which launches the documented way
(``bash tools/dist_train.sh CONFIG N``) with a config that adds::

    custom_imports = dict(imports=['benchmarks.alloc_probe'], allow_failed_imports=False)
    custom_hooks = [dict(type='AllocProbeHook', out_dir=...)]

The module is imported when the config is loaded, before the process group
starts and before the model is built: the resident set then is the baseline.
The hook resets the kernel's high-water mark at the start of every training
iteration and reads it at the end (as :mod:`benchmarks.memory` does), times
the iteration (wall clock, and the process's user + system CPU time, which a
loaded machine inflates far less), notes which allocator the process runs on,
and writes one JSON file per rank when training ends.
"""
import json
import os
import resource
import time
from typing import Any, Dict, List

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from .measure import peak_rss_bytes, reset_peak_rss, rss_bytes

__all__ = ['AllocProbeHook', 'loaded_allocator']

#: The resident set when the config was loaded (imports done, nothing built yet).
BASELINE_BYTES = rss_bytes()


def loaded_allocator() -> str:
    """The malloc this process runs on: a preloaded jemalloc or tcmalloc, else ``'glibc'``."""
    with open('/proc/self/maps') as f:
        for line in f:
            for name in ('jemalloc', 'tcmalloc'):
                if f'lib{name}' in line:
                    return name
    return 'glibc'


def _cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@HOOKS.register_module()
class AllocProbeHook(Hook):
    """Per-iteration peak RSS (above the import-time baseline) and wall time, per rank."""

    priority = 'VERY_LOW'

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.records: List[Dict[str, Any]] = []

    def before_train(self, runner: Any) -> None:
        self._before_train_bytes = rss_bytes()

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self._start_bytes = reset_peak_rss()
        self._start_cpu = _cpu_seconds()
        self._start = time.perf_counter()

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        elapsed = time.perf_counter() - self._start
        cpu = _cpu_seconds() - self._start_cpu
        self.records.append(dict(time_s=elapsed, cpu_s=cpu, peak_bytes=peak_rss_bytes(),
                                 start_bytes=self._start_bytes, end_bytes=rss_bytes()))

    def after_train(self, runner: Any) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f'rank{runner.rank}.json')
        with open(path, 'w') as f:
            json.dump(dict(rank=runner.rank, world_size=runner.world_size,
                           baseline_bytes=BASELINE_BYTES,
                           before_train_bytes=self._before_train_bytes,
                           allocator=loaded_allocator(), records=self.records), f)
