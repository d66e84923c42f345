"""Optimizers built from the unsharded model, then pointed at the wrapped one.

mmengine builds the optimizer after wrapping. Under FSDP every parameter is
then a flat 1-D shard under a prefixed name, so ``paramwise_cfg`` rules that
look at ``ndim`` (``flat_decay_mult``), at norm-layer types or at names
(``custom_keys``) silently put weights in the wrong groups. ``FSDPRunner``
instead builds the optim wrapper on the unwrapped model, exactly as one
process would, and :func:`retarget_parameters` swaps each group's parameters
for the wrapped model's parameters of the same name.

Clipping is the other half: mmengine clips with
``torch.nn.utils.clip_grad_norm_`` over the local tensors, i.e. the norm of
this rank's shard, and a rank without local gradients skips it.
:func:`clip_by_global_norm` makes each optim wrapper clip its own optimizer's
parameters by their norm over all ranks (:func:`clip_grads_by_global_norm`:
FSDP1 flat shards all-reduce their local ``sum |g|^p`` over the sharding group;
FSDP2's DTensor norm is made whole with ``full_tensor``; DDP's gradients are
replicated). Every rank enters the collective, gradients or not.
"""
import functools
import math
from typing import (
    Any,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Protocol,
    Set,
    Tuple,
    Union,
    runtime_checkable,
)

import torch
import torch.distributed as dist
from mmengine.optim import OptimWrapper, OptimWrapperDict
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.tensor import DTensor

from .compat import norm_clip_options, replace_grad_clipping
from .names import unwrapped_named_parameters

__all__ = [
    'AnyOptimWrapper', 'ModelBinding', 'bind_optim_wrappers', 'clip_by_global_norm',
    'clip_grads_by_global_norm', 'global_grad_norm', 'is_built', 'is_sharded',
    'named_optim_wrappers', 'optim_wrappers', 'retarget_parameters'
]

#: What ``runner.optim_wrapper`` holds once built.
AnyOptimWrapper = Union[OptimWrapper, OptimWrapperDict]


def named_optim_wrappers(
        optim_wrapper: AnyOptimWrapper) -> Iterator[Tuple[Optional[str], OptimWrapper]]:
    """``(None, wrapper)`` for one optim wrapper, ``(name, wrapper)`` for each of a dict."""
    if isinstance(optim_wrapper, OptimWrapperDict):
        yield from optim_wrapper.optim_wrappers.items()
    else:
        yield None, optim_wrapper


def optim_wrappers(optim_wrapper: AnyOptimWrapper) -> Iterator[OptimWrapper]:
    """Each ``OptimWrapper`` of one wrapper or of a dict of them."""
    for _, wrapper in named_optim_wrappers(optim_wrapper):
        yield wrapper


def is_built(optim_wrapper: object) -> bool:
    """Whether ``runner.optim_wrapper`` is built (mmengine holds the config dict until then)."""
    return isinstance(optim_wrapper, (OptimWrapper, OptimWrapperDict))



@runtime_checkable
class ModelBinding(Protocol):
    """An optim wrapper that needs the wrapped model it steps (e.g. AMP's scaler choice)."""

    def bind_model(self, model: nn.Module) -> None:
        """Adapt to ``model``, the wrapped model; called once wrapping is done (idempotent)."""


def retarget_parameters(optim_wrapper: AnyOptimWrapper, names: Dict[int, str],
                        wrapped: nn.Module) -> None:
    """Replace each optimizer parameter by the wrapped model's parameter of the same name.

    Args:
        optim_wrapper: Built on the unwrapped model, not stepped yet.
        names: ``id(parameter) -> name`` of the unwrapped model.
        wrapped: The wrapped model.

    """
    by_name = dict(unwrapped_named_parameters(wrapped))
    for wrapper in optim_wrappers(optim_wrapper):
        optimizer = wrapper.optimizer
        if optimizer.state:
            raise RuntimeError('cannot move an optimizer that has state to the wrapped model; '
                               'build it from a config instead of passing an instance')
        for group in optimizer.param_groups:
            try:
                group['params'] = [by_name[names[id(p)]] for p in group['params']]
            except KeyError as e:
                raise RuntimeError(f'the wrapped model has no parameter {e}; parameters of the '
                                   'optimizer must belong to the model') from None


def bind_optim_wrappers(optim_wrapper: AnyOptimWrapper, model: nn.Module) -> None:
    """Tell each optim wrapper that is a :class:`~mmfsdp.optim.ModelBinding` (AMP) its model."""
    for wrapper in optim_wrappers(optim_wrapper):
        if isinstance(wrapper, ModelBinding):
            wrapper.bind_model(model)


def clip_by_global_norm(optim_wrapper: AnyOptimWrapper, model: nn.Module) -> None:
    """Make each optim wrapper clip its own parameters by their norm over all ranks.

    See :func:`clip_grads_by_global_norm`. Value clipping (``type='value'``) is elementwise
    and stays as mmengine does it.
    """
    for wrapper in optim_wrappers(optim_wrapper):
        options = norm_clip_options(wrapper)
        if options is None:
            continue
        unsupported = set(options) - set(CLIP_GRAD_KEYS)
        if unsupported:
            raise ValueError(f'optim_wrapper.clip_grad: {sorted(unsupported)} not supported with '
                             f'{type(model).__name__}; valid keys are {", ".join(CLIP_GRAD_KEYS)}')
        replace_grad_clipping(wrapper, functools.partial(_clip_own_parameters, wrapper, model,
                                                          options))


def _clip_own_parameters(wrapper: OptimWrapper, model: nn.Module,
                         options: Dict[str, Any]) -> None:
    params = [p for group in wrapper.optimizer.param_groups for p in group['params']
              if p.requires_grad]
    if not params:
        return
    norm = clip_grads_by_global_norm(model, params, **options)
    wrapper.message_hub.update_scalar('train/grad_norm', float(norm))


# ---- clipping by the norm over all ranks --------------------------------------------------
#: The keys of ``clip_grad`` (``type='norm'``): ``torch.nn.utils.clip_grad_norm_``'s keywords.
CLIP_GRAD_KEYS = ('max_norm', 'norm_type', 'error_if_nonfinite', 'foreach')


def global_grad_norm(model: nn.Module, params: Iterable[nn.Parameter],
                     norm_type: float = 2.0, foreach: Optional[bool] = None) -> torch.Tensor:
    """The ``norm_type`` norm of the gradients of ``params`` over all ranks.

    Collective for a sharded ``model``: call it on every rank with the same
    parameters (an optimizer's parameters are the same on every rank), whether
    or not this rank holds gradients for them.
    """
    params = list(params)
    norm_type = float(norm_type)
    fsdp1 = FullyShardedDataParallel.fsdp_modules(model)
    if fsdp1:
        return _fsdp1_norm(fsdp1, params, norm_type, foreach)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def clip_grads_by_global_norm(model: nn.Module, params: Iterable[nn.Parameter],
                              max_norm: float, norm_type: float = 2.0,
                              error_if_nonfinite: bool = False,
                              foreach: Optional[bool] = None) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global norm is at most ``max_norm``.

    Returns the norm before clipping. Collective, as :func:`global_grad_norm`. The
    keywords mean what they mean to ``torch.nn.utils.clip_grad_norm_``; a non-finite norm
    with ``error_if_nonfinite`` raises on every rank at once, since every rank holds the
    same global norm.
    """
    params = list(params)
    norm = global_grad_norm(model, params, norm_type, foreach)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f'The total norm of order {float(norm_type)} for gradients from `parameters` (over '
            'all ranks) is non-finite, so it cannot be clipped. To disable this error and scale '
            'the gradients by the non-finite norm anyway, set '
            'optim_wrapper.clip_grad.error_if_nonfinite=False')
    with_grads = [p for p in params if p.grad is not None]
    if with_grads:
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, norm, foreach=foreach)
    return norm


def _fsdp1_norm(fsdp_modules: List[FullyShardedDataParallel], params: List[nn.Parameter],
                norm_type: float, foreach: Optional[bool]) -> torch.Tensor:
    sharded: Set[int] = set()
    for module in fsdp_modules:
        if module.sharding_strategy is not ShardingStrategy.NO_SHARD:
            sharded.update(id(p) for p in module.parameters())
    group = fsdp_modules[0].process_group
    device = fsdp_modules[0].compute_device
    local_sharded = _local_norm([p for p in params if id(p) in sharded], norm_type, device,
                                foreach)
    replicated = _local_norm([p for p in params if id(p) not in sharded], norm_type, device,
                             foreach)
    if math.isinf(norm_type):
        dist.all_reduce(local_sharded, op=dist.ReduceOp.MAX, group=group)
        return torch.maximum(local_sharded, replicated)
    total = local_sharded.pow(norm_type)
    dist.all_reduce(total, group=group)
    return (total + replicated.pow(norm_type)).pow(1.0 / norm_type)


def _local_norm(params: List[nn.Parameter], norm_type: float, device: torch.device,
                foreach: Optional[bool]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
    if not grads:
        return torch.zeros((), device=device)
    norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
    return norm.to(device, torch.float32)


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is sharded across ranks (FSDP1 or FSDP2)."""
    return bool(FullyShardedDataParallel.fsdp_modules(model)) or any(
        isinstance(p, DTensor) for p in model.parameters())
