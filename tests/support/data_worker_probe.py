"""A hook a test config imports: the memory of a rank and of its forked DataLoader workers.

At the end of training iteration ``at_iter`` the hook reads, for the rank's
process and for each of its child processes (the persistent data workers),
``/proc/PID/smaps_rollup`` (resident set, proportional set, private bytes) and
which malloc ``/proc/PID/maps`` shows loaded, and writes them as JSON.
"""
import json
import os
from typing import Any, Dict, List

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

__all__ = ['DataWorkerMemoryHook', 'process_memory']


def _children(pid: int) -> List[int]:
    """Direct child processes of ``pid`` (whichever of its threads started them)."""
    found: List[int] = []
    task_dir = f'/proc/{pid}/task'
    for tid in os.listdir(task_dir):
        with open(os.path.join(task_dir, tid, 'children')) as f:
            found += [int(c) for c in f.read().split()]
    return sorted(set(found))


def _malloc(pid: int) -> str:
    with open(f'/proc/{pid}/maps') as f:
        maps = f.read()
    return next((name for name in ('jemalloc', 'tcmalloc') if f'lib{name}' in maps), 'glibc')


def process_memory(pid: int) -> Dict[str, Any]:
    """Resident, proportional and private bytes of ``pid``, and its malloc."""
    fields: Dict[str, int] = {}
    with open(f'/proc/{pid}/smaps_rollup') as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == 'kB':
                fields[parts[0].rstrip(':')] = int(parts[1]) * 1024
    return dict(pid=pid, rss=fields['Rss'], pss=fields['Pss'],
                private=fields['Private_Clean'] + fields['Private_Dirty'], malloc=_malloc(pid))


@HOOKS.register_module()
class DataWorkerMemoryHook(Hook):
    """Writes the rank's and its data workers' memory at iteration ``at_iter`` (1-based)."""

    priority = 'LOWEST'

    def __init__(self, out_file: str, at_iter: int) -> None:
        self.out_file = out_file
        self.at_iter = at_iter

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        if runner.iter + 1 != self.at_iter:
            return
        me = os.getpid()
        with open(self.out_file, 'w') as f:
            json.dump(dict(parent=process_memory(me),
                           workers=[process_memory(c) for c in _children(me)]), f)
