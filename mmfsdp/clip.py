"""Gradient-norm clipping of one optimizer's parameters, by their norm over all ranks.

mmengine's ``OptimWrapper`` clips with ``torch.nn.utils.clip_grad_norm_`` over
the gradients this rank holds. Under sharding that is wrong twice: the norm of
a shard is not the norm of the model, and a rank whose shard has no gradient
(FSDP1 gives ``grad=None`` to a parameter outside the rank's shard, e.g. when a
frozen backbone fills it) skips the clip altogether, while the other ranks wait
in the norm's all-reduce until the process group times out.

:func:`clip_grads_by_global_norm` takes the parameters of *one* optimizer, so
each optim wrapper of an ``OptimWrapperDict`` clips only its own, and computes
their norm with a collective that every rank enters, gradients or not:

- FSDP1 (flat shards): the local ``sum |g|^p`` (or max) of the sharded
  parameters is all-reduced over the sharding group; parameters outside any
  FSDP1 module, or under ``NO_SHARD``, are replicated and count once;
- FSDP2 (DTensor gradients): the DTensor norm, made whole with ``full_tensor``;
- anything else (DDP): gradients are replicated, the local norm is global.
"""
import math
from typing import Iterable, List, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.tensor import DTensor

__all__ = ['clip_grads_by_global_norm', 'global_grad_norm', 'is_sharded']


def global_grad_norm(model: nn.Module, params: Iterable[nn.Parameter],
                     norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm of the gradients of ``params`` over all ranks.

    Collective for a sharded ``model``: call it on every rank with the same
    parameters (an optimizer's parameters are the same on every rank), whether
    or not this rank holds gradients for them.
    """
    params = list(params)
    norm_type = float(norm_type)
    fsdp1 = FullyShardedDataParallel.fsdp_modules(model)
    if fsdp1:
        return _fsdp1_norm(fsdp1, params, norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def clip_grads_by_global_norm(model: nn.Module, params: Iterable[nn.Parameter],
                              max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global norm is at most ``max_norm``.

    Returns the norm before clipping. Collective, as :func:`global_grad_norm`.
    """
    params = list(params)
    norm = global_grad_norm(model, params, norm_type)
    with_grads = [p for p in params if p.grad is not None]
    if with_grads:
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, norm)
    return norm


def _fsdp1_norm(fsdp_modules: List[FullyShardedDataParallel], params: List[nn.Parameter],
                norm_type: float) -> torch.Tensor:
    sharded: Set[int] = set()
    for module in fsdp_modules:
        if module.sharding_strategy is not ShardingStrategy.NO_SHARD:
            sharded.update(id(p) for p in module.parameters())
    group = fsdp_modules[0].process_group
    device = fsdp_modules[0].compute_device
    local_sharded = _local_norm([p for p in params if id(p) in sharded], norm_type, device)
    replicated = _local_norm([p for p in params if id(p) not in sharded], norm_type, device)
    if math.isinf(norm_type):
        dist.all_reduce(local_sharded, op=dist.ReduceOp.MAX, group=group)
        return torch.maximum(local_sharded, replicated)
    total = local_sharded.pow(norm_type)
    dist.all_reduce(total, group=group)
    return (total + replicated.pow(norm_type)).pow(1.0 / norm_type)


def _local_norm(params: List[nn.Parameter], norm_type: float,
                device: torch.device) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
    if not grads:
        return torch.zeros((), device=device)
    return torch.nn.utils.get_total_norm(grads, norm_type).to(device, torch.float32)


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is sharded across ranks (FSDP1 or FSDP2)."""
    return bool(FullyShardedDataParallel.fsdp_modules(model)) or any(
        isinstance(p, DTensor) for p in model.parameters())
