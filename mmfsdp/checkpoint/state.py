"""Model and optimizer state of a (possibly wrapped) model, full or sharded.

All of it goes through ``torch.distributed.checkpoint.state_dict``
(``get_*_state_dict`` / ``set_*_state_dict``), which serves FSDP1, FSDP2, DDP and
plain modules alike and keys everything by the unwrapped model's parameter
names. Gathering and scattering are collectives: every rank calls them.

Optimizer state is keyed by parameter name, so it loads at any world size and
into any wrapper. An optimizer state in torch's own format (integer keys, as
mmengine's stock Runner saves it) is converted by matching the integer ids with
this optimizer's parameters in order, which holds when the optimizer is built
by the same config.
"""
import contextlib
import enum
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from mmengine.optim import OptimWrapper
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..dist import current_device
from ..names import unwrapped_param_names
from ..optim_wrappers import AnyOptimWrapper, named_optim_wrappers
from ..options import resolve_enum

__all__ = ['StateDictType', 'full_state_on_rank0', 'gather_full_state', 'load_full_model_state',
           'load_full_optimizer_state', 'load_optimizer_extras', 'load_param_groups',
           'optimizer_extras', 'optimizer_state', 'optimizer_template',
           'resolve_state_dict_type', 'sharded_state']

#: Keys of an optimizer state that torch's optimizer owns; the rest (e.g. a
#: loss scaler) belongs to mmengine's optim wrapper.
_OPTIMIZER_KEYS = ('state', 'param_groups')


class StateDictType(enum.Enum):
    """What ``save_checkpoint(state_dict_type=...)`` writes."""

    #: One file, gathered on rank 0: loads anywhere, into anything.
    FULL = 'full'
    #: A directory with every rank's shard (``torch.distributed.checkpoint``).
    SHARDED = 'sharded'


def resolve_state_dict_type(value: Union[str, StateDictType]) -> StateDictType:
    """``state_dict_type``: ``'full'`` or ``'sharded'``."""
    return resolve_enum(value, StateDictType, 'state_dict_type',
                        {m.value: m for m in StateDictType})


def full_state_on_rank0(device: torch.device) -> bool:
    """Whether full state dicts gather to rank 0's CPU when training on ``device``.

    On an accelerator, yes: one full copy, in host memory, instead of one per
    rank on each accelerator. The training device decides, not where the
    parameters are: offloaded parameters live on the CPU while the gathering
    runs on the accelerator. On the CPU, no: FSDP1's offload path crashes on
    CPU tensors (torch 2.13).
    """
    return device.type != 'cpu'


def _options(model: nn.Module, full: bool, strict: bool = True) -> StateDictOptions:
    return StateDictOptions(full_state_dict=full,
                            cpu_offload=full and full_state_on_rank0(current_device()),
                            strict=strict)


def _per_wrapper(optim_wrapper: AnyOptimWrapper, fn) -> Any:
    """``fn(wrapper)`` for a single wrapper, ``{name: fn(wrapper)}`` for a dict of them."""
    results = {name: fn(wrapper) for name, wrapper in named_optim_wrappers(optim_wrapper)}
    return results[None] if None in results else results


def optimizer_extras(optim_wrapper: AnyOptimWrapper) -> Any:
    """The optim wrapper's own state besides the optimizer's (e.g. ``loss_scaler``)."""
    return _per_wrapper(optim_wrapper, lambda w: {
        k: v for k, v in w.state_dict().items() if k not in _OPTIMIZER_KEYS})


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    options: StateDictOptions) -> Dict[str, Any]:
    """``get_optimizer_state_dict``, without its side effect on an optimizer that has no state.

    DCP initialises an empty optimizer state by a ``step()`` with zero
    gradients at lr 0: the parameters do not move, but Adam's ``step`` count
    and moments now exist, so training after a save made before the first
    real step would differ from training without it. That state is removed
    again, and an optimizer without state is saved as ``state == {}``.
    """
    fresh = not optimizer.state
    state = get_optimizer_state_dict(model, optimizer, options=options)
    if fresh:
        optimizer.state.clear()
        state = dict(state, state={})
    return state


def gather_full_state(model: nn.Module, optim_wrapper: Optional[AnyOptimWrapper]
                      ) -> Tuple[Dict[str, torch.Tensor], Optional[Any]]:
    """The unsharded model state and name-keyed optimizer state (collective)."""
    options = _options(model, full=True)
    model_state = get_model_state_dict(model, options=options)
    if optim_wrapper is None:
        return model_state, None

    def wrapper_state(wrapper: OptimWrapper) -> Dict[str, Any]:
        state = {k: v for k, v in wrapper.state_dict().items() if k not in _OPTIMIZER_KEYS}
        state.update(optimizer_state(model, wrapper.optimizer, options))
        return state

    return model_state, _per_wrapper(optim_wrapper, wrapper_state)


def sharded_state(model: nn.Module, optim_wrapper: Optional[AnyOptimWrapper]
                  ) -> Tuple[Dict[str, Any], Optional[Any]]:
    """The model and optimizer shards of this rank, and the optimizer's param groups.

    The shards (a dict of tensors) are what ``torch.distributed.checkpoint``
    saves, and the template a sharded checkpoint is loaded into; the param
    groups (hyperparameters and parameter names, the same on every rank) are
    kept apart, as plain values, so that no pickled object enters the shards.
    An optimizer without state (SGD without momentum, or before its first
    step) has no shards.
    """
    options = _options(model, full=False)
    shards: Dict[str, Any] = dict(model=get_model_state_dict(model, options=options))
    if optim_wrapper is None:
        return shards, None
    states = {name: optimizer_state(model, w.optimizer, options)
              for name, w in named_optim_wrappers(optim_wrapper)}
    tensors = {name: dict(state=s['state']) for name, s in states.items() if s['state']}
    groups = {name: s['param_groups'] for name, s in states.items()}
    if None in states:
        if tensors:
            shards['optimizer'] = tensors[None]
        return shards, groups[None]
    if tensors:
        shards['optimizer'] = tensors
    return shards, groups


def optimizer_template(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer-state tensors of this rank, to load a sharded checkpoint's shards into.

    An optimizer without state gets DCP's initial state (zeros) as the
    template; loading overwrites it.
    """
    return dict(state=get_optimizer_state_dict(model, optimizer,
                                               options=_options(model, full=False))['state'])


def load_full_model_state(model: nn.Module, state: Dict[str, Any],
                          strict: bool) -> Tuple[List[str], List[str]]:
    """Load an unsharded state dict; returns the missing and unexpected keys."""
    with _buffers_beside_parameters(model):
        result = set_model_state_dict(model, state,
                                      options=_options(model, full=True, strict=strict))
    return list(result.missing_keys), list(result.unexpected_keys)


@contextlib.contextmanager
def _buffers_beside_parameters(model: nn.Module) -> Iterator[None]:
    """Within, the model's buffers are on its parameters' device (when that is one device).

    FSDP1's CPU offload keeps the parameters on the CPU and the buffers (e.g.
    BatchNorm's running statistics) on the accelerator. torch 2.13's
    ``set_model_state_dict`` with a full state dict collects the devices of
    the model's non-scalar parameters and persistent buffers and raises
    "Multiple devices found" for more than one; it uses that device only to
    hold the loaded values until ``load_state_dict`` copies them into the
    model. So the buffers wait on the parameters' device during the load and
    are moved back after it, holding the loaded values.
    """
    devices = {p.device for p in model.parameters() if p.dim() > 0 and not p.is_meta}
    moved = []
    if len(devices) == 1:
        (device,) = devices
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.dim() > 0 and not buffer.is_meta and buffer.device != device:
                    moved.append((module, name, buffer.device))
                    setattr(module, name, buffer.to(device))
    try:
        yield
    finally:
        for module, name, original in moved:
            setattr(module, name, getattr(module, name).to(original))


def _named_optimizer_state(state: Dict[str, Any], optimizer: torch.optim.Optimizer,
                           model: nn.Module) -> Dict[str, Any]:
    """Convert torch's integer-keyed optimizer state to parameter names."""
    groups = state['param_groups']
    _check_param_counts(groups, optimizer)
    if not groups or not groups[0]['params'] or isinstance(groups[0]['params'][0], str):
        return state
    names = unwrapped_param_names(model)
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g['params']]
    by_id = dict(zip((i for g in groups for i in g['params']), ordered))
    return dict(state={by_id[i]: s for i, s in state['state'].items()},
                param_groups=[dict(g, params=[by_id[i] for i in g['params']]) for g in groups])


def _check_param_counts(groups: List[Dict[str, Any]], optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer state whose param groups do not fit this optimizer's."""
    saved = [len(g['params']) for g in groups]
    own = [len(g['params']) for g in optimizer.param_groups]
    if saved != own:
        raise ValueError(
            f'the optimizer state in the checkpoint has param groups of {saved} parameters, '
            f'this optimizer has {own}: it was saved for another model or optim_wrapper '
            '(paramwise_cfg). Resume with the config that saved it, or set `resume = False` '
            'and use `load_from` to load the weights only.')


def load_param_groups(optimizer: torch.optim.Optimizer, groups: List[Dict[str, Any]]) -> None:
    """Restore hyperparameters (lr, momentum, ...) of each param group; not the parameters."""
    _check_param_counts(groups, optimizer)
    for own, saved in zip(optimizer.param_groups, groups):
        own.update({k: v for k, v in saved.items() if k != 'params'})


def load_full_optimizer_state(model: nn.Module, optim_wrapper: AnyOptimWrapper,
                              state: Any) -> None:
    """Load a full optimizer state (name-keyed, or torch's integer-keyed format)."""
    for name, wrapper in named_optim_wrappers(optim_wrapper):
        own = state if name is None else state[name]
        optimizer_state = _named_optimizer_state(
            {k: own[k] for k in _OPTIMIZER_KEYS}, wrapper.optimizer, model)
        # the hyperparameters first: DCP maps the saved groups' keys onto this optimizer's,
        # which lack those a scheduler adds (initial_lr) when resuming before train()
        load_param_groups(wrapper.optimizer, optimizer_state['param_groups'])
        if optimizer_state['state']:  # else nothing to scatter; DCP would create state
            set_optimizer_state_dict(model, wrapper.optimizer, optimizer_state,
                                     options=_options(model, full=True))
        load_optimizer_extras(wrapper, {k: v for k, v in own.items()
                                        if k not in _OPTIMIZER_KEYS})


def load_optimizer_extras(wrapper: OptimWrapper, extras: Dict[str, Any]) -> None:
    """Restore the optim wrapper's own state, e.g. an AMP loss scaler."""
    if 'loss_scaler' in extras and hasattr(wrapper, 'loss_scaler'):
        wrapper.loss_scaler.load_state_dict(extras['loss_scaler'])
    # The base values that schedulers scale (OptimWrapper.param_groups' last
    # entry), present whenever there are several param groups (paramwise_cfg).
    if extras.get('base_param_settings') is not None:
        wrapper.base_param_settings = extras['base_param_settings']
