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
parameters by their norm over all ranks (:mod:`mmfsdp.clip`).
"""
import functools
from typing import Any, Dict

from mmengine.optim import OptimWrapper
from torch import nn

from .clip import clip_grads_by_global_norm
from .compat import norm_clip_options, replace_grad_clipping
from .names import unwrapped_named_parameters
from .optim_wrappers import AnyOptimWrapper, optim_wrappers
from .protocol import ModelBinding

__all__ = ['bind_optim_wrappers', 'clip_by_global_norm',
           'retarget_parameters']


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
    """Tell each optim wrapper that is a :class:`~mmfsdp.protocol.ModelBinding` (AMP) its model."""
    for wrapper in optim_wrappers(optim_wrapper):
        if isinstance(wrapper, ModelBinding):
            wrapper.bind_model(model)


def clip_by_global_norm(optim_wrapper: AnyOptimWrapper, model: nn.Module) -> None:
    """Make each optim wrapper clip its own parameters by their norm over all ranks.

    See :mod:`mmfsdp.clip`. Value clipping (``type='value'``) is elementwise
    and stays as mmengine does it.
    """
    for wrapper in optim_wrappers(optim_wrapper):
        options = norm_clip_options(wrapper)
        if options is None:
            continue
        unsupported = set(options) - {'max_norm', 'norm_type'}
        if unsupported:
            raise ValueError(f'optim_wrapper.clip_grad: {sorted(unsupported)} not supported with '
                             f'{type(model).__name__}; valid keys are max_norm, norm_type')
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
