"""A wrapper that holds the model as ``self.module`` and answers with the model's names.

mmengine's wrapper contract is ``wrapper.module``; a wrapper that is a plain
``nn.Module`` around the model would otherwise prefix every name with
``module.``. The convention here: **everything named answers as the unwrapped
model does** — ``named_parameters`` / ``parameters``, ``named_buffers`` /
``buffers``, ``named_modules`` / ``modules``, ``get_submodule`` /
``get_parameter`` / ``get_buffer``, ``state_dict`` / ``load_state_dict`` and
``torch.distributed.checkpoint.state_dict`` — so a parameter name found on
``runner.model`` names the same parameter and module on the wrapper, on the
model and in a full checkpoint, which move freely between wrappers and one
process. The wrapper itself is not among its ``modules()``.

Only the structure keeps the wrapper: ``children()`` / ``named_children()``
give ``module`` (the model), because torch's recursive methods (``train``,
``to``, ``apply``, ``zero_grad``) walk children and must reach the model's own
parameters and flags; and the attribute ``wrapper.module`` is the model.
:func:`mmfsdp.names.module_tree` walks that structure.
"""
from typing import Any, Dict, Iterator, Mapping, Optional, Set, Tuple

import torch
from torch import nn

from ..compat import DCPNameHook

__all__ = ['ModelHolder']


class ModelHolder(DCPNameHook, nn.Module):
    """Base of wrappers that hold the model in ``self.module`` (set by the subclass)."""

    module: nn.Module

    # ``torch.distributed.checkpoint.state_dict`` maps each name to a module path,
    # stripping only DDP's, FSDP1's and :meth:`dropped_name_components`' prefixes.
    # With ``recurse=False`` the wrapper reports what it owns itself: nothing.

    def named_parameters(self, prefix: str = '', recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """The sharded model's parameters under the unwrapped model's names."""
        owner = self.module if recurse else super()
        return owner.named_parameters(prefix=prefix, recurse=recurse,
                                      remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = '', recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """The sharded model's buffers under the unwrapped model's names."""
        owner = self.module if recurse else super()
        return owner.named_buffers(prefix=prefix, recurse=recurse,
                                   remove_duplicate=remove_duplicate)

    def named_modules(self, memo: Optional[Set[nn.Module]] = None, prefix: str = '',
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Module]]:
        """The model's modules under the unwrapped model's names (the model itself is ``''``)."""
        return self.module.named_modules(memo=memo, prefix=prefix,
                                         remove_duplicate=remove_duplicate)

    def get_submodule(self, target: str) -> nn.Module:
        """The model's submodule of that unwrapped name (``''``: the model)."""
        return self.module.get_submodule(target)

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The sharded model's state dict, under the unwrapped model's keys."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a state dict keyed like the unwrapped model."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def dropped_name_components(self) -> Dict[str, str]:
        """Every child of the model is reached through ``module``, which names leave out."""
        return {name: 'module' for name, _ in self.module.named_children()}
