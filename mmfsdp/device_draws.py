"""Random initialisers of a model staged on the CPU draw from the training device's generator.

FSDP1 on an accelerator initialises the model on the CPU, where ``normal_`` and
friends would draw other numbers than the stock Runner does on the device. Inside
:func:`draws_on`, each random fill of the model's tensors is drawn on the device
and copied back, so the weights match a one-process run::

    with draws_on(torch.device('cuda', 0), model):
        model.init_weights()
"""
import contextlib
from typing import Any, Dict, Iterator, Optional, Set, Tuple

import torch
from torch import nn

from .compat import TorchDispatchMode, storage_key

__all__ = ['RANDOM_FILLS', 'draws_on']

_aten = torch.ops.aten
#: The in-place random fills of aten (every overload of each).
RANDOM_FILLS = frozenset({
    _aten.normal_, _aten.uniform_, _aten.bernoulli_, _aten.random_, _aten.exponential_,
    _aten.geometric_, _aten.log_normal_, _aten.cauchy_,
})


class _DrawOnDevice(TorchDispatchMode):
    """Redirects the random fills of the given storages to ``device`` (or ``generator``)."""

    def __init__(self, device: torch.device, storages: Set[int],
                 generator: Optional[torch.Generator]) -> None:
        super().__init__()
        self.device, self.storages, self.generator = device, storages, generator
        self.redirected = 0

    def __torch_dispatch__(self, func: Any, types: Tuple, args: Tuple = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = dict(kwargs or {})
        target = args[0] if args else None
        if (func.overloadpacket not in RANDOM_FILLS or not isinstance(target, torch.Tensor)
                or target.numel() == 0 or storage_key(target) not in self.storages
                or kwargs.get('generator') is not None):
            return func(*args, **kwargs)
        drawn = torch.empty_strided(target.size(), target.stride(), dtype=target.dtype,
                                    device=self.device)
        if self.generator is not None:
            kwargs['generator'] = self.generator
        func(drawn, *args[1:], **kwargs)
        target.copy_(drawn)
        self.redirected += 1
        return target


@contextlib.contextmanager
def draws_on(device: torch.device, model: nn.Module,
             generator: Optional[torch.Generator] = None) -> Iterator[_DrawOnDevice]:
    """Within, random fills of ``model``'s tensors draw on ``device`` (or from ``generator``).

    Yields the mode; its ``redirected`` counts the fills it drew.
    """
    storages = {storage_key(t) for t in (*model.parameters(), *model.buffers())
                if t.numel() > 0}
    with _DrawOnDevice(torch.device(device), storages, generator) as mode:
        yield mode
