"""Full checkpoints of sharded models, in a format ``torch.load`` reads safely.

mmengine's ``Runner.save_checkpoint`` runs on rank 0 alone and saves rank 0's
shards; gathering inside it deadlocks, because the other ranks never enter.
Here every rank takes part in the gather (``torch.distributed.checkpoint``'s
``get_state_dict`` API, which serves FSDP1, FSDP2, DDP and plain modules) and
rank 0 writes one ordinary mmengine checkpoint:

- ``state_dict``: the unwrapped model's keys, loadable with ``strict=True``;
- ``optimizer``: the consolidated optimizer state keyed by parameter name, so
  it loads at any world size;
- ``message_hub``: mmengine's message hub with its history buffers stored as
  tensors, so that the file needs no pickled mmengine class and loads under
  ``torch.load``'s default ``weights_only=True``.

The file is written under a temporary name and renamed into place, so a crash
mid-write never leaves a truncated checkpoint under the final name.
"""
import os
from typing import Any, Dict, Mapping, Union

import numpy as np
import torch
from mmengine.logging import HistoryBuffer, MessageHub
from mmengine.optim import OptimWrapper, OptimWrapperDict
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

__all__ = ['encode_message_hub', 'full_model_state', 'full_optimizer_state', 'save_atomically']

_BUFFER = '__history_buffer__'


def _gather_options(model: nn.Module) -> StateDictOptions:
    # Offloading while gathering keeps a single full copy on rank 0 on
    # accelerators; FSDP1's offload path crashes on CPU tensors (torch 2.13).
    params = list(model.parameters())
    on_cpu = not params or params[0].device.type == 'cpu'
    return StateDictOptions(full_state_dict=True, cpu_offload=not on_cpu)


def full_model_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The unsharded state dict under the unwrapped model's keys (collective)."""
    return get_model_state_dict(model, options=_gather_options(model))


def full_optimizer_state(model: nn.Module,
                         optim_wrapper: Union[OptimWrapper, OptimWrapperDict]) -> Dict[str, Any]:
    """The consolidated optimizer state keyed by parameter name (collective).

    For an ``OptimWrapperDict`` the result maps each wrapper's name to its state.
    Entries other than the optimizer's own (e.g. a loss scaler) are kept.
    """
    if isinstance(optim_wrapper, OptimWrapperDict):
        return {name: full_optimizer_state(model, wrapper)
                for name, wrapper in optim_wrapper.optim_wrappers.items()}
    state = dict(optim_wrapper.state_dict())
    state.update(get_optimizer_state_dict(model, optim_wrapper.optimizer,
                                          options=_gather_options(model)))
    return state


def _to_safe(value: Any) -> Any:
    """Numpy values and history buffers as tensors and plain Python types."""
    if isinstance(value, HistoryBuffer):
        history, counts = value.data
        return {_BUFFER: True, 'log': torch.from_numpy(np.asarray(history, dtype=np.float64)),
                'count': torch.from_numpy(np.asarray(counts, dtype=np.float64)),
                'max_length': value.max_length}
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _to_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_safe(v) for v in value)
    return value


def encode_message_hub(message_hub: MessageHub) -> Dict[str, Any]:
    """``message_hub.state_dict()`` with nothing ``weights_only`` loading rejects."""
    return _to_safe(message_hub.state_dict())


def save_atomically(checkpoint: Dict[str, Any], path: str) -> None:
    """``torch.save`` to ``path.tmp``, then rename onto ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f'{path}.tmp'
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)
