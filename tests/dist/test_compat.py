"""The private torch internals that need a process group: gloo's worker threads, by name; a
``DTensor`` built around a given local tensor (the staged copy of an asynchronous save).

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


def _dtensor_like():
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from harness import COLLECTIVE_TIMEOUT_S
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    source = distribute_tensor(torch.arange(6.0), init_device_mesh('cpu', (2,)), [Shard(0)])
    local = torch.full_like(source.to_local(), 7.0)
    staged = compat.dtensor_like(source, local)
    return dict(same_memory=staged.to_local().data_ptr() == local.data_ptr(),
                layout=(staged.device_mesh == source.device_mesh,
                        staged.placements == source.placements, staged.shape == source.shape),
                full=staged.full_tensor().tolist())


def test_dtensor_like_holds_the_given_local_tensor_in_the_sources_layout():
    """``DTensor(local, spec, requires_grad=False)``: DCP's stager builds its staged copies so."""
    from harness import run_distributed
    for rank in run_distributed(_dtensor_like, 2):
        assert rank == dict(same_memory=True, layout=(True, True, True), full=[7.0] * 6)
