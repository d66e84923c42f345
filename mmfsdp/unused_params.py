"""FSDP2 with parameters that some ranks do not use: detect it before the backward hangs.

FSDP2 reduce-scatters only the gradients a rank has. When one rank uses a
parameter that another does not (a head used on some ranks only, experts of
a mixture), their reduce-scatters differ and the job hangs until the
collective timeout. ``find_unused_parameters=True`` fixes it (zeros are
reduced for what a rank did not use); without it, :class:`UsageProbe` watches
the first training forward: every rank records the parameters of the modules
that ran, the ranks compare (one ``all_gather`` of 8-byte digests, details
only on a difference) and, if they differ, every rank raises the same error
naming the parameters and the option, before any backward starts.
"""
import functools
import hashlib
from typing import Dict, List, Optional, Set

import torch
import torch.distributed as dist
from torch import nn

from .together import control_group

__all__ = ['UsageProbe', 'check_same_parameters_used']

_SHOWN = 10


class UsageProbe:
    """Records which parameter-holding modules of ``module`` run, until :meth:`remove`."""

    def __init__(self, module: nn.Module) -> None:
        self._ran: Set[str] = set()
        self._module = module
        self._handles = [
            child.register_forward_hook(functools.partial(self._record, name))
            for name, child in module.named_modules()
            if any(p.requires_grad for p in child.parameters(recurse=False))]

    def _record(self, name: str, *_) -> None:
        self._ran.add(name)

    def remove(self) -> List[str]:
        """Stop recording; return the names of the trainable parameters of the modules that ran."""
        for handle in self._handles:
            handle.remove()
        used = []
        for name, child in self._module.named_modules():
            if name in self._ran:
                used += [f'{name}.{n}' if name else n
                         for n, p in child.named_parameters(recurse=False) if p.requires_grad]
        return sorted(used)


def _digest(names: List[str]) -> int:
    data = '\n'.join(names).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), 'little', signed=True)


def check_same_parameters_used(used: List[str],
                               group: Optional[dist.ProcessGroup] = None) -> None:
    """Raise the same ``RuntimeError`` on every rank if the ranks used different parameters."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    group = group if group is not None else control_group()
    world_size = dist.get_world_size()
    digests = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(digests, torch.tensor([_digest(used)], dtype=torch.int64), group=group)
    if len({d.item() for d in digests}) == 1:
        return
    everyone: List[Optional[List[str]]] = [None] * world_size
    dist.all_gather_object(everyone, used, group=group)
    users: Dict[str, List[int]] = {}
    for rank, names in enumerate(everyone):
        for name in names:
            users.setdefault(name, []).append(rank)
    partial = sorted((n, r) for n, r in users.items() if len(r) < world_size)
    shown = ', '.join(f'{name} (used on rank{"s" if len(ranks) > 1 else ""} '
                      f'{", ".join(map(str, ranks))} only)' for name, ranks in partial[:_SHOWN])
    more = f' and {len(partial) - _SHOWN} more' if len(partial) > _SHOWN else ''
    raise RuntimeError(
        f'model_wrapper_cfg.find_unused_parameters: the ranks used different parameters in '
        f'their first training forward: {shown}{more}. FSDP2 reduces only the gradients a rank '
        'has, so their gradient reductions would not match and the job would hang. Set '
        'model_wrapper_cfg.find_unused_parameters=True to reduce zeros for the parameters a '
        'rank did not use')
