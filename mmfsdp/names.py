"""The unwrapped model's name of a wrapped model's parameter, by the wrappers' own prefixes.

Wrapping inserts path components between the model and its parameters: DDP
and mmengine-style wrappers hold the model as their child ``module``, FSDP1 as
``_fsdp_wrapped_module`` and activation checkpointing as
``_checkpoint_wrapped_module``. A component is dropped only where the module
that owns it is such a wrapper, so a model's own child called ``module``
(``BaseTTAModel.module``, containers, user code) keeps its name.
"""
from typing import Any, Callable, Dict, Iterator, List, Set, Tuple

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

__all__ = ['for_tta_model', 'model_state_names', 'module_tree', 'unwrapped_name',
           'unwrapped_named_parameters', 'unwrapped_param_names']



def unwrapped_name(model: nn.Module, name: str) -> str:
    """``name``, a path in the (possibly wrapped) ``model``, without the wrappers' components.

    ``name`` is a path through the modules' children (``_modules``), every
    component present, as :func:`module_tree` spells it.
    """
    *path, leaf = name.split('.')
    kept = []
    module = model
    for component in path:
        if not _inserted_by_wrapper(module, component):
            kept.append(component)
        module = registered_child(module, component)
    return '.'.join(kept + [leaf])


def module_tree(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """``(path, module)`` of every module, by the children each holds (``_modules``).

    As ``nn.Module.named_modules`` is by default; not that method itself, which
    a wrapper may override to report the unwrapped model's names
    (:class:`mmfsdp.wrappers.holder.ModelHolder`).
    """
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


def _tree_members(model: nn.Module, kind: Callable[[nn.Module], List[Tuple[str, Any]]]
                  ) -> Iterator[Tuple[str, Any]]:
    seen: Set[int] = set()
    for path, module in module_tree(model):
        for name, tensor in kind(module):
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                yield (f'{path}.{name}' if path else name), tensor


def unwrapped_named_parameters(model: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter, named as in the unwrapped model."""
    for name, param in _tree_members(model, registered_parameters):
        yield unwrapped_name(model, name), param


def unwrapped_param_names(model: nn.Module) -> Dict[int, str]:
    """``id(parameter) -> name`` of every parameter, named as in the unwrapped model."""
    return {id(p): name for name, p in unwrapped_named_parameters(model)}


def model_state_names(model: nn.Module) -> Set[str]:
    """The names of the parameters and buffers of ``model``, as the unwrapped model's."""
    buffers = (unwrapped_name(model, n) for n, _ in _tree_members(model, registered_buffers))
    return set(unwrapped_param_names(model).values()).union(buffers)


def for_tta_model(state: Dict[str, Any], names: Set[str]) -> Dict[str, Any]:
    """``state`` of a plain model, keyed for a ``BaseTTAModel`` around it if that is the model.

    ``names`` are the model's (:func:`model_state_names`). mmengine's loader
    treats ``BaseTTAModel`` as transparent: a checkpoint of the plain model
    loads into its ``module``.
    """
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
