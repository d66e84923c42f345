"""The private torch internals that need a process group: gloo's worker threads, by name; a
``DTensor`` built around a given local tensor (the staged copy of an asynchronous save).

The others, one test per internal, are in ``tests/unit/test_compat.py``.
"""

import pytest
import torch

from mmfsdp import compat

#: The dist smoke (tools/test_torch.sh VERSION smoke): every compat/ entry at work.
pytestmark = pytest.mark.smoke


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


def _full_precision():
    import copy
    import datetime

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import (
        FullyShardedDataParallel,
        MixedPrecision,
        MixedPrecisionPolicy,
        fully_shard,
    )

    from harness import COLLECTIVE_TIMEOUT_S
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    expected = plain(x)
    fsdp2 = copy.deepcopy(plain)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(fsdp2[1], mp_policy=policy)
    fully_shard(fsdp2, mp_policy=policy)
    fsdp1 = FullyShardedDataParallel(
        copy.deepcopy(plain), device_id=torch.device('cpu'), use_orig_params=True,
        auto_wrap_policy=lambda module, recurse, **_: recurse or module is plain[1],
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    out, seen = {}, []
    for name, model in (('fsdp2', fsdp2), ('fsdp1', fsdp1)):
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                layer.register_forward_hook(lambda m, i, o: seen.append(str(m.weight.dtype)))
        runs = []
        for mode in ('eval', 'train', 'eval'):  # FSDP2's first forward (lazy init) in eval
            model.train(mode == 'train')
            seen.clear()
            with compat.full_precision(model) if mode == 'eval' else torch.enable_grad():
                y = model(x)
            runs.append(dict(mode=mode, weights=sorted(set(seen)), output=str(y.dtype),
                             max_diff=float((y.float() - expected).abs().max())))
            if mode == 'train':
                y.float().sum().backward()
        model.eval()
        runs.append(str(model(x).dtype))  # eval outside the context: mixed precision
        out[name] = runs
    return out


def test_full_precision_gathers_and_computes_in_fp32_in_eval_and_only_inside():
    """``compat.full_precision``: FSDP2 (also when its first forward runs inside) and FSDP1
    compute an eval forward in fp32, equal to the unsharded fp32 model; outside, bf16."""
    from harness import run_distributed
    for rank in run_distributed(_full_precision, 2):
        for name, (first, train, again, outside) in rank.items():
            for run in (first, again):
                assert run['weights'] == ['torch.float32'] and run['output'] == 'torch.float32', \
                    f'{name}: {run} (mmfsdp.compat.full_precision no longer switches precision)'
                assert run['max_diff'] < 1e-6, f'{name}: {run}'
            assert train['weights'] == ['torch.bfloat16'] and outside == 'torch.bfloat16', \
                f'{name}: {train}, {outside} (full precision outlived the context)'


def _lazy_init_then_a_unit():
    import datetime

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from harness import COLLECTIVE_TIMEOUT_S
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    fully_shard(model[1])
    fully_shard(model)
    compat.fsdp2_lazy_init(model)
    model.unshard()
    with torch.no_grad():
        unit_first = model[1](model[0](torch.randn(3, 4)))  # a unit called outside the root
    model.reshard()
    return dict(unit_first=tuple(unit_first.shape), root_output=tuple(model(x).shape))


def test_fsdp2_lazy_init_makes_the_root_the_root_before_its_first_forward():
    """``compat.fsdp2_lazy_init``: after it, a unit called before the root's first forward
    runs as a unit, and the root's forward still works (without it: 'FSDP state has already
    been lazily initialized ... requires running forward through the root module first')."""
    from harness import run_distributed
    for rank in run_distributed(_lazy_init_then_a_unit, 2):
        assert rank == dict(unit_first=(3, 8), root_output=(3, 2)), \
            f'{rank} (mmfsdp.compat.fsdp2_lazy_init no longer initialises the root)'
