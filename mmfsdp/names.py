"""The unwrapped model's names: of a wrapped model's parameters, and of its checkpoints' keys.

A component is dropped only where the module that owns it is a wrapper (DDP and
mmengine-style ``module``, FSDP1's ``_fsdp_wrapped_module``, activation
checkpointing's ``_checkpoint_wrapped_module``), so a model's own child called
``module`` keeps its name.

A model's checkpoints hold the keys its own ``state_dict()`` returns
(:func:`note_checkpoint_keys`), whatever wraps it.
"""
import weakref
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Set, Tuple

import torch
from mmengine.model import is_model_wrapper
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from .compat import (
    CHECKPOINT_WRAPPED_MODULE,
    FSDP_WRAPPED_MODULE,
    ActivationWrapper,
    registered_buffers,
    registered_child,
    registered_children,
    registered_parameters,
)

__all__ = ['checkpoint_keys', 'for_tta_model', 'module_tree', 'note_checkpoint_keys',
           'unwrapped_name', 'unwrapped_named_buffers', 'unwrapped_named_parameters',
           'unwrapped_param_names']

#: The keys a model's own ``state_dict()`` returns, where its class returns fewer than
#: ``nn.Module``'s, by model (noted before wrapping: FSDP1 and DDP gather state through their
#: own module tree and never call the model's method).
_CHECKPOINT_KEYS: 'weakref.WeakKeyDictionary[nn.Module, FrozenSet[str]]' = (
    weakref.WeakKeyDictionary())


def note_checkpoint_keys(model: nn.Module) -> None:
    """Note which keys ``model``'s checkpoints hold; called on the model before it is wrapped.

    A model whose ``state_dict()`` returns a subset of its tensors (a LoRA
    fine-tune returns its adapter; the frozen base model comes from its own
    pretrained files) gets checkpoints of that subset under every wrapper, as
    mmengine's stock Runner saves ``model.state_dict()``, and loading and
    resuming expect that subset. A ``state_dict()`` that renames keys is left alone.
    """
    if type(model).state_dict is nn.Module.state_dict:
        return
    own = set(model.state_dict(keep_vars=True))
    if own < set(nn.Module.state_dict(model, keep_vars=True)):
        _CHECKPOINT_KEYS[model] = frozenset(own)


def checkpoint_keys(model: nn.Module) -> Optional[FrozenSet[str]]:
    """The keys checkpoints of ``model`` (wrapped or not) hold; ``None``: every key."""
    return _CHECKPOINT_KEYS.get(getattr(model, 'module', model))


def unwrapped_name(model: nn.Module, name: str) -> str:
    """``name``, a path through ``model``'s registered children, without the wrappers' parts."""
    *path, leaf = name.split('.')
    kept = []
    module = model
    for component in path:
        if not _inserted_by_wrapper(module, component):
            kept.append(component)
        module = registered_child(module, component)
    return '.'.join(kept + [leaf])


def module_tree(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """``(path, module)`` of every module by its registered children (not ``named_modules``)."""
    seen: Set[int] = set()
    stack = [('', model)]
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield path, module
        children = [(f'{path}.{n}' if path else n, c) for n, c in registered_children(module)
                    if c is not None]
        stack.extend(reversed(children))


def _unwrapped_members(model: nn.Module, kind: Callable[[nn.Module], List[Tuple[str, Any]]]
                       ) -> Iterator[Tuple[str, Any]]:
    seen: Set[int] = set()
    for path, module in module_tree(model):
        for name, tensor in kind(module):
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                yield unwrapped_name(model, f'{path}.{name}' if path else name), tensor


def unwrapped_named_parameters(model: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter, named as in the unwrapped model."""
    return _unwrapped_members(model, registered_parameters)


def unwrapped_named_buffers(model: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every buffer, named as in the unwrapped model."""
    return _unwrapped_members(model, registered_buffers)


def unwrapped_param_names(model: nn.Module) -> Dict[int, str]:
    """``id(parameter) -> name`` of every parameter, named as in the unwrapped model."""
    return {id(p): name for name, p in unwrapped_named_parameters(model)}


def for_tta_model(state: Dict[str, Any], names: Set[str]) -> Dict[str, Any]:
    """A plain model's ``state``, keyed for a ``BaseTTAModel`` around it (``names``: its own)."""
    if any(k in names for k in state) or not any(f'module.{k}' in names for k in state):
        return state
    return {f'module.{k}': v for k, v in state.items()}


def _inserted_by_wrapper(parent: nn.Module, child: str) -> bool:
    if child == FSDP_WRAPPED_MODULE:
        return isinstance(parent, FullyShardedDataParallel)
    if child == CHECKPOINT_WRAPPED_MODULE:
        return isinstance(parent, ActivationWrapper)
    return child == 'module' and (isinstance(parent, DistributedDataParallel)
                                  or is_model_wrapper(parent))
