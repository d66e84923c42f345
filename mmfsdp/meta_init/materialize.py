"""Allocate the meta tensors of a model, initialise them, and verify that all were written.

:func:`materialize` (collective), after sharding (FSDP2) or on the CPU before
wrapping (FSDP1):

1. every meta tensor is allocated on the device; parameters are DTensor
   shards by then under FSDP2, so each rank allocates only its shard. Real
   tensors (the data preprocessor's) move to the device too, and every data
   preprocessor's device becomes the training device;
2. each is filled with a sentinel (:mod:`.written`);
3. what construction would have done is replayed: the values recorded at
   registration are written back (:mod:`.build`), then ``reset_parameters()``
   (or ``_reset_parameters()``, as ``nn.MultiheadAttention`` and
   ``nn.Transformer`` have) of every module that owns meta-built tensors,
   children before parents as in their constructors; then the model's
   ``init_weights()``, with ``init_cfg`` Pretrained loading slices
   (:mod:`.pretrained`);
4. a tensor still holding its sentinel is an error on every rank
   (:class:`UnwrittenTensorsError`), or, inside :func:`defer_check`, is
   handed to the runner to check after ``load_from``;
5. buffers (unsharded: everything) are broadcast from rank 0, so replicated
   state agrees.

Random initialisation on the CPU: DTensor draws each shard from the local
generator there, so every rank would draw the *same* numbers for *different*
shards. Each shard coordinate therefore draws from its own seed, derived
from rank 0's generator (replicas of a shard agree). Accelerators keep
DTensor's own RNG tracker.
"""
import contextlib
import warnings
from typing import Iterator, Optional, Set

import torch
import torch.distributed as dist
from mmengine.model import BaseDataPreprocessor
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..compat import convert_tensors, direct_tensor, direct_tensors, initialiser
from .build import forget, recorded
from .pretrained import check_init_cfgs, local_part, sharded_pretrained
from .written import (
    Unwritten,
    WriteTracker,
    agree_on_unwritten,
    deferred,
    fill_sentinel,
    local_tensor,
    named_tensors,
    unwritten,
)

__all__ = ['materialize', 'set_preprocessor_device']


def set_preprocessor_device(model: nn.Module, device: torch.device) -> None:
    """Move every data preprocessor to ``device`` and make it cast its inputs there.

    ``BaseDataPreprocessor.to`` is the public way to set its device (a
    preprocessor moved any other way keeps casting batches to the old one).
    """
    for module in model.modules():
        if isinstance(module, BaseDataPreprocessor):
            module.to(device)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, 'device_mesh')


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.is_meta:
        return torch.empty_like(tensor, device=device)
    if _is_dtensor(tensor) or tensor.device == device:
        return tensor
    return tensor.to(device)


@contextlib.contextmanager
def _shard_seeded_rng(mesh: Optional[DeviceMesh], device: torch.device) -> Iterator[None]:
    """On the CPU, seed the global generator per shard coordinate; restore it afterwards."""
    handle = getattr(torch, device.type, None)
    if mesh is None or (device.type != 'cpu' and hasattr(handle, 'set_rng_state')):
        yield  # unsharded, or DTensor's RNG tracker gives each shard its part of one stream
        return
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='DTensor random operators may not')
        base = torch.randint(0, 2**62, (1, ), dtype=torch.int64)
        dist.broadcast(base, src=0)
        coordinate = mesh.get_local_rank(mesh.ndim - 1)
        torch.manual_seed((int(base) * 1_000_003 + coordinate) % 2**63)
        yield


def _modules_with_meta(model: nn.Module) -> Set[int]:
    """Ids of the modules with a meta tensor in their subtree."""
    found: Set[int] = set()

    def visit(module: nn.Module) -> bool:
        own = any(t is not None and t.is_meta
                  for _, t in direct_tensors(module))
        below = [visit(child) for child in module.children()]
        if own or any(below):
            found.add(id(module))
            return True
        return False

    visit(model)
    return found


@torch.no_grad()
def _restore_recorded(model: nn.Module, names: Set[str]) -> None:
    """Write the constructor values recorded at registration back (each rank its slice)."""
    for module_name, module in model.named_modules():
        prefix = f'{module_name}.' if module_name else ''
        for name, entry in recorded(module).items():
            tensor = direct_tensor(module, name)
            if entry.value is None or tensor is None or prefix + name not in names:
                continue
            local_tensor(tensor).copy_(local_part(entry.value, tensor))


def _reset_in_constructor_order(module: nn.Module, targets: Set[int]) -> None:
    """``reset_parameters()`` / ``_reset_parameters()``, children before their parent."""
    if id(module) not in targets:
        return
    for child in module.children():
        _reset_in_constructor_order(child, targets)
    reset = initialiser(module)
    if reset is not None:
        reset()


def materialize(model: nn.Module, device: torch.device, mesh: Optional[DeviceMesh] = None, *,
                broadcast: Optional[str] = 'buffers') -> None:
    """Allocate, initialise and verify the meta tensors of ``model`` (collective).

    Args:
        model: Built under :func:`mmfsdp.meta_init.empty_weights` (or plain
            ``torch.device('meta')``, which records no constructor values),
            sharded with ``fully_shard`` or not at all.
        device: The training device.
        mesh: The FSDP2 mesh, or ``None`` for an unsharded model (every rank
            draws the same numbers only if seeded alike: broadcast afterwards).
        broadcast: What to broadcast from rank 0 at the end: ``'buffers'``
            (sharded parameters are initialised per shard), ``'all'`` (an
            unsharded model on the CPU) or ``None`` (the wrapper will, e.g.
            FSDP1's ``sync_module_states`` on an accelerator).

    Raises:
        UnwrittenTensorsError: on every rank, naming the tensors that nothing
            wrote, unless inside :func:`mmfsdp.meta_init.defer_check`.

    """
    check_init_cfgs(model)
    owners = {name: owner for name, (t, owner) in named_tensors(model).items() if t.is_meta}
    targets = _modules_with_meta(model)
    why = {}
    for module_name, module in model.named_modules():
        prefix = f'{module_name}.' if module_name else ''
        why.update({prefix + n: e.missing for n, e in recorded(module).items()})
    convert_tensors(model, lambda t: _to_device(t, device))
    set_preprocessor_device(model, device)
    tensors = named_tensors(model)
    fill_sentinel([tensors[name][0] for name in owners])
    tracker = WriteTracker()
    with _shard_seeded_rng(mesh, device), sharded_pretrained(), tracker:
        _restore_recorded(model, set(owners))
        forget(model)
        _reset_in_constructor_order(model, targets)
        init_weights = getattr(model, 'init_weights', None)
        if callable(init_weights):
            init_weights()
    left = unwritten(model, [Unwritten(name, owner, why.get(name))
                             for name, owner in owners.items()], tracker)
    pending = deferred()
    if pending is None:
        agree_on_unwritten(left)
    else:
        pending.extend(left)
    if broadcast and dist.is_initialized() and dist.get_world_size() > 1:
        tensors = model.buffers() if broadcast == 'buffers' else model.state_dict().values()
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor, src=0)

