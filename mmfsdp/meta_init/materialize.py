"""Allocate a meta-built model, initialise it, and verify that every tensor was written.

:func:`materialize` runs after sharding (FSDP2: each rank allocates its shards) or
on the CPU before wrapping (FSDP1). Each tensor is first filled with a sentinel,
so "initialised" is checked, not assumed; ``init_cfg=Pretrained`` copies only
each rank's slices. docs/meta-init.md describes the steps.
"""
import contextlib
import contextvars
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from mmengine.logging import print_log
from mmengine.model import BaseDataPreprocessor, BaseModule
from mmengine.model.weight_init import PretrainedInit
from mmengine.runner.checkpoint import load_state_dict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..compat import (
    CHECKPOINT_WRAPPED_MODULE,
    FSDP_WRAPPED_MODULE,
    TorchDispatchMode,
    convert_tensors,
    direct_tensor,
    direct_tensors,
    initialiser,
    pretrained_init_calls,
    record_init_info,
)
from .build import Recorded, forget, recorded, written_values

#: ``init_cfg`` types that work on DTensor shards (mmengine's built-ins act
#: elementwise or through a tensor's global shape).
SHARD_SAFE_INIT_TYPES = ('Constant', 'Xavier', 'Normal', 'TruncNormal', 'Uniform', 'Kaiming',
                         'Caffe2Xavier', 'Pretrained')

#: Module names that FSDP1 and activation checkpointing insert.
_WRAPPER_TOKENS = frozenset({FSDP_WRAPPED_MODULE, CHECKPOINT_WRAPPED_MODULE})

_DEFERRED: contextvars.ContextVar[Optional[List['Unwritten']]] = contextvars.ContextVar(
    'mmfsdp_meta_init_deferred', default=None)


@contextlib.contextmanager
def _bound(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


class UnwrittenTensorsError(RuntimeError):
    """Meta init left tensors that nothing wrote: training would start from garbage."""


@dataclass(frozen=True)
class Unwritten:
    """One parameter or buffer nothing wrote, its owner's class, and why construction did not."""

    name: str
    owner: str
    why: Optional[str] = None  # Recorded.missing


# --- checks at wrap time ------------------------------------------------------------------------

def class_name(module: nn.Module) -> str:
    """The user's class of ``module`` (FSDP2 subclasses each sharded module as ``FSDP<Class>``)."""
    from torch.distributed.fsdp import FSDPModule
    cls = type(module)
    if issubclass(cls, FSDPModule):
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return cls.__name__


def _init_cfgs(init_cfg: Any) -> Iterator[Mapping]:
    for cfg in init_cfg if isinstance(init_cfg, (list, tuple)) else [init_cfg]:
        if isinstance(cfg, Mapping):
            yield cfg
            overrides = cfg.get('override') or []
            for override in overrides if isinstance(overrides, (list, tuple)) else [overrides]:
                if isinstance(override, Mapping) and 'type' in override:
                    yield override


def check_init_cfgs(model: nn.Module) -> None:
    """Raise if an ``init_cfg`` type of any module may not work on shards."""
    for name, module in model.named_modules():
        if not isinstance(module, BaseModule) or not module.init_cfg:
            continue
        for cfg in _init_cfgs(module.init_cfg):
            kind = cfg.get('type')
            kind = kind if isinstance(kind, str) else getattr(kind, '__name__', str(kind))
            if kind not in SHARD_SAFE_INIT_TYPES and kind != 'PretrainedInit':
                raise ValueError(
                    f"init_device='meta': module `{name or '(root)'}` "
                    f'({class_name(module)}) has init_cfg type {kind!r}, which is not known '
                    f'to work on sharded parameters (supported: {", ".join(SHARD_SAFE_INIT_TYPES)}'
                    '). Initialise it in `init_weights`, provide the weights via `load_from`, '
                    'or leave init_device unset to initialise the full model before sharding.')


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def check_meta_model(module: nn.Module, init_device: Optional[str], when: str) -> bool:
    """Whether ``module`` has meta tensors, which only ``init_device='meta'`` materialises.

    Raises ``ValueError`` for a meta model without that option, and for
    ``init_cfg`` entries that cannot initialise shards (:func:`check_init_cfgs`).
    ``when`` says when the wrapper materialises (``'before sharding'``).
    """
    on_meta = _has_meta(module)
    if on_meta and init_device != 'meta':
        raise ValueError('model_wrapper_cfg.init_device: the model is on the meta device; '
                         f"set init_device='meta' to materialise it {when}")
    if on_meta:
        check_init_cfgs(module)
    return on_meta


# --- sentinels: what nothing wrote ------------------------------------------------------------

def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local part of ``tensor`` (a DTensor's shard on this rank), as a plain tensor."""
    to_local = getattr(tensor, 'to_local', None)
    return to_local() if callable(to_local) else tensor


def _sentinel(dtype: torch.dtype) -> Any:
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    # Booleans have no spare value: WriteTracker sees their writes instead.
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _has_sentinel(tensor: torch.Tensor) -> bool:
    local = local_tensor(tensor).detach()
    floating = local.dtype.is_floating_point or local.dtype.is_complex
    return bool((torch.isnan(local) if floating else local == _sentinel(local.dtype)).any())


def _storage(tensor: torch.Tensor) -> int:
    return local_tensor(tensor).untyped_storage().data_ptr()


class WriteTracker(TorchDispatchMode):
    """Records the storages that operators write (in place or through ``out=``)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: Set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        for value in written_values(func, args, kwargs):
            for t in value if isinstance(value, (list, tuple)) else (value, ):
                if isinstance(t, torch.Tensor):
                    self.written.add(_storage(t))
        return func(*args, **kwargs)

    def wrote(self, tensor: torch.Tensor) -> bool:
        """Whether an operator wrote ``tensor``'s storage while tracking."""
        return _storage(tensor) in self.written


def named_tensors(model: nn.Module) -> Dict[str, Tuple[torch.Tensor, str]]:
    """``name -> (tensor, owning module class)``, under the unwrapped model's names."""
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
    """The ``candidates`` that still hold their sentinel on this rank (anywhere in the tensor)."""
    tensors = named_tensors(model)

    def left(tensor: torch.Tensor) -> bool:
        if tensor.dtype == torch.bool:
            return tracker is None or not tracker.wrote(tensor)
        return _has_sentinel(tensor)

    return [c for c in candidates if left(tensors[c.name][0])]


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


@contextlib.contextmanager
def defer_check(enabled: bool = True) -> Iterator[List[Unwritten]]:
    """Inside, materialisation hands its unwritten tensors to the yielded list.

    For a runner that loads a checkpoint after wrapping: it calls
    :func:`unwritten` and :func:`agree_on_unwritten` once the checkpoint is in.
    """
    pending: List[Unwritten] = []
    with _bound(_DEFERRED, pending if enabled else None):
        yield pending


# --- init_cfg Pretrained on shards ------------------------------------------------------------

def local_part(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The slice of ``full`` that ``target`` (a DTensor shard, or a plain tensor) holds.

    Shards follow ``torch.chunk`` along the placement's dim, as DTensor and
    FSDP2 lay them out; a view, so an mmap-backed ``full`` reads only the slice.
    """
    mesh = getattr(target, 'device_mesh', None)
    if mesh is None:
        return full
    part = full
    for mesh_dim, placement in enumerate(target.placements):
        if placement.is_shard():
            count, coordinate = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
            chunks = torch.chunk(part, count, dim=placement.dim)
            part = (chunks[coordinate] if coordinate < len(chunks)
                    else part.narrow(placement.dim, 0, 0))
        elif not placement.is_replicate():
            raise NotImplementedError(f'cannot place a full tensor as {placement}')
    return part


def _read(filename: str, cache: Dict[str, Any]) -> Mapping[str, torch.Tensor]:
    if filename not in cache:  # a local file memory-mapped: each rank pages in its slices
        from ..checkpoint.safe_io import read_checkpoint  # the switch: the runner's safe_reads
        checkpoint = read_checkpoint(filename)
        cache[filename] = checkpoint.get('state_dict', checkpoint) \
            if isinstance(checkpoint, Mapping) else checkpoint
    return cache[filename]


@torch.no_grad()
def load_pretrained(module: nn.Module, filename: str, prefix: Optional[str] = None,
                    cache: Optional[Dict[str, Any]] = None) -> None:
    """Copy each rank's slice of a pretrained checkpoint into ``module``.

    As mmengine's ``PretrainedInit`` with ``strict=False``: ``module.`` stripped,
    or only the keys under ``prefix``; missing, unexpected and mis-shaped keys
    are skipped with mmengine's warning; the module's load pre-hooks run (they
    resize position tables in mmpretrain's Swin and ViT).
    """
    state = _read(filename, {} if cache is None else cache)
    if prefix is None:
        state = {re.sub(r'^module\.', '', k): v for k, v in state.items()}
    else:
        head = prefix if prefix.endswith('.') else prefix + '.'
        state = {k[len(head):]: v for k, v in state.items() if k.startswith(head)}
        if not state:
            raise ValueError(f'init_cfg Pretrained: prefix {prefix!r} is not in the pretrained '
                             f'model {filename}')
    with sharded_loads(module):  # mmengine's loader: the module's own load hooks run too
        load_state_dict(module, state, strict=False, logger='current')


def _take_slices(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *_: Any) -> None:
    """A ``load_state_dict`` pre-hook: full tensors for ``module``'s shards become this rank's."""
    for name, target in direct_tensors(module):
        value = state_dict.get(prefix + name)
        if (hasattr(target, 'device_mesh') and isinstance(value, torch.Tensor)
                and not hasattr(value, 'device_mesh') and value.shape == target.shape):
            state_dict[prefix + name] = DTensor.from_local(
                local_part(value, target), target.device_mesh, target.placements,
                run_check=False, shape=target.shape, stride=target.stride())


@contextlib.contextmanager
def sharded_loads(model: nn.Module) -> Iterator[None]:
    """Inside, loading a state dict of full tensors into ``model`` copies each rank's slices.

    For backbones that load their own weights in ``init_weights`` (mmdet's and
    mmseg's Swin: position tables interpolated against ``self.state_dict()``,
    then ``self.load_state_dict``): each sharded parameter takes its slice of the
    full tensor after the module's own pre-hooks (mmpretrain's interpolation) ran.
    """
    with contextlib.ExitStack() as hooks:  # a handle removes its hook on exit
        for module in model.modules():
            hooks.enter_context(module.register_load_state_dict_pre_hook(_take_slices))
        yield


@contextlib.contextmanager
def _sharded_pretrained() -> Iterator[None]:
    """Inside, mmengine's ``PretrainedInit`` loads through :func:`load_pretrained`."""
    cache: Dict[str, Any] = {}

    def call(self: PretrainedInit, module: nn.Module) -> None:
        print_log(f'load {self.prefix or "model"} from {self.checkpoint} (sharded)',
                  logger='current')
        load_pretrained(module, self.checkpoint, self.prefix, cache)
        record_init_info(self, module)

    with pretrained_init_calls(call):
        yield


# --- materialisation ----------------------------------------------------------------------------

def set_preprocessor_device(model: nn.Module, device: torch.device) -> None:
    """Move every data preprocessor to ``device`` and make it cast its inputs there.

    Through ``BaseDataPreprocessor.to``: moved any other way, it keeps its old device.
    """
    for module in model.modules():
        if isinstance(module, BaseDataPreprocessor):
            module.to(device)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.is_meta:
        return torch.empty_like(tensor, device=device)
    return tensor if hasattr(tensor, 'device_mesh') or tensor.device == device \
        else tensor.to(device)


@contextlib.contextmanager
def _shard_seeded_rng(mesh: Optional[DeviceMesh], device: torch.device) -> Iterator[None]:
    """On the CPU, seed the global generator per shard coordinate; restore it afterwards.

    DTensor draws each CPU shard from the local generator, so every rank would
    draw the same numbers for different shards; replicas of a shard agree.
    """
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


def _records(model: nn.Module) -> Iterator[Tuple[str, nn.Module, str, Recorded]]:
    for module_name, module in model.named_modules():
        prefix = f'{module_name}.' if module_name else ''
        for name, entry in recorded(module).items():
            yield prefix + name, module, name, entry


@torch.no_grad()
def _restore_recorded(model: nn.Module, names: Set[str]) -> None:
    """Write the constructor values recorded at registration back (each rank its slice)."""
    for full_name, module, name, entry in _records(model):
        tensor = direct_tensor(module, name)
        if entry.value is not None and tensor is not None and full_name in names:
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

    ``model`` was built under :func:`empty_weights` (or plain ``torch.device('meta')``,
    which records no constructor values) and sharded with ``fully_shard`` over ``mesh``,
    or not at all (``mesh=None``: ranks agree only through the broadcast). At the end
    rank 0 broadcasts ``'buffers'`` (parameters were initialised per shard), ``'all'``
    (an unsharded model on the CPU) or nothing (``None``: the wrapper will, e.g.
    FSDP1's ``sync_module_states``). Raises :class:`UnwrittenTensorsError` on every
    rank, naming what nothing wrote, unless inside :func:`defer_check`.
    """
    check_init_cfgs(model)
    owners = {name: owner for name, (t, owner) in named_tensors(model).items() if t.is_meta}
    targets = {id(m) for m in model.modules() if _has_meta(m)}
    why = {full_name: entry.missing for full_name, _, _, entry in _records(model)}
    convert_tensors(model, lambda t: _to_device(t, device))
    set_preprocessor_device(model, device)
    tensors = named_tensors(model)
    with torch.no_grad():
        for name in owners:
            tensor = tensors[name][0]
            local_tensor(tensor).fill_(_sentinel(tensor.dtype))
    tracker = WriteTracker()
    with _shard_seeded_rng(mesh, device), _sharded_pretrained(), sharded_loads(model), \
            tracker:
        _restore_recorded(model, set(owners))
        forget(model)
        _reset_in_constructor_order(model, targets)
        init_weights = getattr(model, 'init_weights', None)
        if callable(init_weights):
            init_weights()
    left = unwritten(model, [Unwritten(name, owner, why.get(name))
                             for name, owner in owners.items()], tracker)
    pending = _DEFERRED.get()
    if pending is None:
        agree_on_unwritten(left)
    else:
        pending.extend(left)
    if broadcast and dist.is_initialized() and dist.get_world_size() > 1:
        tensors = model.buffers() if broadcast == 'buffers' else model.state_dict().values()
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor, src=0)
