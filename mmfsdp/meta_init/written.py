"""Which tensors no initialiser, checkpoint or broadcast ever wrote: verified, not assumed.

Before initialisation every tensor that came from the meta device is filled
with a sentinel: NaN for floating point, the dtype's minimum for integers.
Afterwards a tensor is *unwritten* if any of its elements still holds the
sentinel (a partly written tensor is as wrong as an untouched one). Booleans
have no spare value; their writes are observed by a dispatch mode
(:class:`WriteTracker`) instead.

Ranks hold different shards, so each checks its own and the names are
gathered (one collective): the error, :class:`UnwrittenTensorsError`, is the
same on every rank. Under ``load_from`` / ``resume`` the check waits until the
checkpoint is loaded (:func:`defer_check`).
"""
import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..compat import (
    CHECKPOINT_WRAPPED_MODULE,
    FSDP_WRAPPED_MODULE,
    TorchDispatchMode,
    argument_names,
    direct_tensors,
    written_arguments,
)

__all__ = ['Unwritten', 'UnwrittenTensorsError', 'WriteTracker', 'agree_on_unwritten',
           'defer_check', 'deferred', 'fill_sentinel', 'local_tensor', 'unwritten']


class UnwrittenTensorsError(RuntimeError):
    """Meta init left tensors that nothing wrote: training would start from garbage."""


@dataclass(frozen=True)
class Unwritten:
    """One parameter or buffer nothing wrote."""

    name: str
    #: The class of the module that owns it.
    owner: str
    #: Why construction could not provide it (``'unset'`` / ``'too large'`` / ``None``).
    why: Optional[str] = None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local part of ``tensor`` (a DTensor's shard on this rank), as a plain tensor."""
    to_local = getattr(tensor, 'to_local', None)
    return to_local() if callable(to_local) else tensor


def _sentinel(dtype: torch.dtype) -> Any:
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    if dtype == torch.bool:
        return False
    return torch.iinfo(dtype).min


@torch.no_grad()
def fill_sentinel(tensors: Sequence[torch.Tensor]) -> None:
    """Fill each tensor (its local shard) with its dtype's sentinel."""
    for tensor in tensors:
        local_tensor(tensor).fill_(_sentinel(tensor.dtype))


def _has_sentinel(tensor: torch.Tensor) -> bool:
    local = local_tensor(tensor).detach()
    if local.dtype.is_floating_point or local.dtype.is_complex:
        return bool(torch.isnan(local).any())
    return bool((local == _sentinel(local.dtype)).any())


class WriteTracker(TorchDispatchMode):
    """Records the storages that operators write (in place or through ``out=``)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: Set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        values = dict(zip(argument_names(func), args), **kwargs)
        for name in written_arguments(func):
            value = values.get(name)
            for t in value if isinstance(value, (list, tuple)) else (value, ):
                if isinstance(t, torch.Tensor):
                    self.written.add(_storage(t))
        return func(*args, **kwargs)

    def wrote(self, tensor: torch.Tensor) -> bool:
        """Whether an operator wrote ``tensor``'s storage while tracking."""
        return _storage(tensor) in self.written


def _storage(tensor: torch.Tensor) -> int:
    return local_tensor(tensor).untyped_storage().data_ptr()


#: Module names that FSDP1 and activation checkpointing insert.
_WRAPPER_TOKENS = frozenset({FSDP_WRAPPED_MODULE, CHECKPOINT_WRAPPED_MODULE})


def class_name(module: nn.Module) -> str:
    """The user's class of ``module`` (FSDP2 subclasses each sharded module as ``FSDP<Class>``)."""
    from torch.distributed.fsdp import FSDPModule
    cls = type(module)
    if issubclass(cls, FSDPModule):
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return cls.__name__


def named_tensors(model: nn.Module) -> Dict[str, Tuple[torch.Tensor, str]]:
    """``name -> (tensor, owning module class)`` over parameters and buffers.

    Names are the unwrapped model's (FSDP1's and checkpoint wrappers' tokens removed).
    """
    out: Dict[str, Tuple[torch.Tensor, str]] = {}
    for module_name, module in model.named_modules():
        module_name = '.'.join(t for t in module_name.split('.') if t not in _WRAPPER_TOKENS)
        prefix = f'{module_name}.' if module_name else ''
        for name, tensor in direct_tensors(module):
            if tensor is not None:
                out.setdefault(prefix + name, (tensor, class_name(module)))
    return out


def unwritten(model: nn.Module, candidates: Sequence[Unwritten],
              tracker: Optional[WriteTracker] = None) -> List[Unwritten]:
    """The ``candidates`` that still hold their sentinel on this rank."""
    tensors = named_tensors(model)
    left = []
    for candidate in candidates:
        tensor = tensors[candidate.name][0]
        if tensor.dtype == torch.bool:
            if tracker is None or not tracker.wrote(tensor):
                left.append(candidate)
        elif _has_sentinel(tensor):
            left.append(candidate)
    return left


def _message(found: Sequence[Unwritten]) -> str:
    by_owner: Dict[str, List[Unwritten]] = {}
    for item in found:
        by_owner.setdefault(item.owner, []).append(item)
    lines = []
    for owner, items in by_owner.items():
        names = ', '.join(i.name + {
            'too large': ' (constructor value over the record limit)',
            'unset': ' (allocated empty by its constructor)',
            'written after registration': ' (its constructor wrote it after registering it)',
        }.get(i.why, '') for i in items[:8])
        more = f' and {len(items) - 8} more' if len(items) > 8 else ''
        lines.append(f'  {owner}: {names}{more}')
    owners = ', '.join(f'`{o}`' for o in by_owner)
    return (f"init_device='meta': {len(found)} parameters / buffers were never written by an "
            'initialiser, a checkpoint or a broadcast, so training would start from '
            'uninitialised memory:\n' + '\n'.join(lines) +
            f'\nFix: give {owners} a `reset_parameters`, set these tensors in `init_weights`, '
            'or provide them via `load_from` (or leave init_device unset to build eagerly).')


def agree_on_unwritten(local: Sequence[Unwritten]) -> None:
    """Gather every rank's unwritten tensors (collective); raise the same error on all ranks."""
    found = list(local)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, found)
        found = list({item.name: item for rank in gathered for item in rank}.values())
    if found:
        raise UnwrittenTensorsError(_message(sorted(found, key=lambda i: i.name)))


_DEFERRED: contextvars.ContextVar[Optional[List[Unwritten]]] = contextvars.ContextVar(
    'mmfsdp_meta_init_deferred', default=None)


@contextlib.contextmanager
def defer_check(enabled: bool = True) -> Iterator[List[Unwritten]]:
    """Inside, materialisation hands its unwritten tensors to the yielded list.

    For a runner that loads a checkpoint after wrapping: it calls
    :func:`unwritten` and :func:`agree_on_unwritten` once the checkpoint is in.
    """
    pending: List[Unwritten] = []
    token = _DEFERRED.set(pending if enabled else None)
    try:
        yield pending
    finally:
        _DEFERRED.reset(token)


def deferred() -> Optional[List[Unwritten]]:
    """The list of an enclosing :func:`defer_check`, or ``None`` to check now."""
    return _DEFERRED.get()
