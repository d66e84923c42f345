"""A wrapper that holds the model as ``self.module`` and answers with the model's names.

mmengine's wrapper contract is ``wrapper.module``; a wrapper that is a plain
``nn.Module`` around the model would otherwise prefix every name with
``module.``. This one reports the unwrapped model's names for
``named_parameters()``, ``state_dict()`` and
``torch.distributed.checkpoint.state_dict``, so full checkpoints move freely
between wrappers and one process.
"""
from typing import Any, Dict, Iterator, Mapping, Tuple

import torch
from torch import nn

__all__ = ['ModelHolder']


class ModelHolder(nn.Module):
    """Base of wrappers that hold the model in ``self.module`` (set by the subclass)."""

    module: nn.Module

    # The unwrapped model's names, for ``named_parameters()``, ``state_dict()`` and
    # ``torch.distributed.checkpoint.state_dict``, which maps each name to a module
    # path through ``_fqn_modifiers`` (it strips only DDP's and FSDP1's prefixes).
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

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The sharded model's state dict, under the unwrapped model's keys."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a state dict keyed like the unwrapped model."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _fqn_modifiers(self) -> Dict[str, str]:
        return {name: 'module' for name, _ in self.module.named_children()}
