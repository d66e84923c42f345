"""The private torch internal that needs a process group: gloo's worker threads, by name.

The others, one test per internal, are in ``tests/unit/test_compat.py``.
"""

import torch

from mmfsdp import compat


def _gloo_workers_by_name():
    import datetime

    import torch.distributed as dist

    from harness import COLLECTIVE_TIMEOUT_S
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    dist.all_reduce(torch.ones(1))
    return len(compat.gloo_worker_threads())


def test_gloo_worker_threads_are_found_by_the_name_torch_gives_them():
    """``ProcessGroupGloo`` runs its collectives on threads named ``pt_gloo_runloop``."""
    from harness import run_distributed
    assert compat.GLOO_WORKER_THREAD == 'pt_gloo_runloop'
    assert all(n >= 1 for n in run_distributed(_gloo_workers_by_name, 2))
