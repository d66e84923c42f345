"""Turn the strings of a config into torch values, in one place.

The wrappers only see ``torch.dtype``, enum members and dataclasses. Each
resolver names the config key, the bad value and the valid choices, so a typo
fails on every rank before any collective: ``TypeError`` for a wrong type or an
unknown keyword, ``ValueError`` for a value outside the choices.
"""
import difflib
import enum
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple, Type, TypeVar, Union

import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from torch.nn.modules.batchnorm import _BatchNorm

from .compat import HYBRID_SHARD_ZERO2

__all__ = [
    'Accumulation', 'FP32_MODULES_DEFAULT', 'FSDP1_ONLY_OPTIONS', 'MeshSpec', 'NODE',
    'check_fp32_modules', 'check_keys', 'computes_in_low_precision', 'move_fp32_modules',
    'option_dict',
    'reject_fsdp1_options', 'resolve_accumulation', 'resolve_backward_prefetch',
    'resolve_cpu_offload', 'resolve_dtype', 'resolve_dtypes_and_flags', 'resolve_enum',
    'resolve_flag', 'resolve_fp32_modules', 'resolve_init_device', 'resolve_mesh',
    'resolve_mixed_precision', 'split_fp32_modules',
    'resolve_module_classes', 'resolve_mp_policy', 'resolve_offload_policy',
    'resolve_reshard_after_forward', 'resolve_sharding_strategy', 'suggest',
    'translate_sharding_strategy', 'wrapper_options'
]

E = TypeVar('E', bound=enum.Enum)

_DTYPES = {
    'bf16': torch.bfloat16, 'bfloat16': torch.bfloat16,
    'fp16': torch.float16, 'float16': torch.float16, 'half': torch.float16,
    'fp32': torch.float32, 'float32': torch.float32, 'float': torch.float32,
}


def wrapper_options(cfg: Mapping[str, Any]) -> dict:
    """The wrapper's keywords in a ``model_wrapper_cfg``: all keys but ``type`` and ``_scope_``."""
    return {k: v for k, v in cfg.items() if k not in ('type', '_scope_')}


def suggest(value: Any, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``''``."""
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ''


def _choices(names: Iterable[str]) -> str:
    return ', '.join(repr(n) for n in names)


def _got(value: Any) -> str:
    return f'got {type(value).__name__} {value!r}'


def check_keys(given: Mapping[str, Any], valid: Iterable[str], key: str) -> None:
    """Raise ``TypeError`` if ``given``, the mapping under ``key``, has a key outside ``valid``."""
    valid = list(valid)
    unknown = [k for k in given if k not in valid]
    if unknown:
        raise TypeError(f'{key}: unknown key {unknown[0]!r}{suggest(unknown[0], valid)}; '
                        f'valid keys are {_choices(valid)}')


def option_dict(value: Any, valid: Iterable[str], key: str, expected: str) -> Mapping[str, Any]:
    """``value``, a dict of options under ``key``; ``TypeError`` naming ``expected`` otherwise."""
    if not isinstance(value, Mapping):
        raise TypeError(f'{key}: expected {expected}, {_got(value)}')
    check_keys(value, valid, key)
    return value


def resolve_dtype(value: Union[str, torch.dtype, None], key: str) -> Optional[torch.dtype]:
    """``'bf16' | 'fp16' | 'fp32'`` (or long names), a floating dtype, or ``None`` (keep own)."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ValueError(f'{key}: {value} is not a floating-point dtype')
        return value
    if not isinstance(value, str):
        raise TypeError(f'{key}: expected a dtype name or torch.dtype, {_got(value)}')
    dtype = _DTYPES.get(value.lower())
    if dtype is None:
        raise ValueError(f'{key}: {value!r} is not a dtype{suggest(value.lower(), _DTYPES)}; '
                         f'valid choices are {_choices(_DTYPES)} or a torch.dtype')
    return dtype


def resolve_enum(value: Union[str, E],
                 enum_cls: Type[E],
                 key: str,
                 aliases: Optional[Mapping[str, E]] = None) -> E:
    """A member of ``enum_cls`` by name, case-insensitively; ``aliases`` adds lower-case names."""
    if isinstance(value, enum_cls):
        return value
    aliases = dict(aliases or {})
    names = list(aliases) + [m.name for m in enum_cls]
    if not isinstance(value, str):
        raise TypeError(f'{key}: expected one of {_choices(names)} or a '
                        f'{enum_cls.__name__}, {_got(value)}')
    if value.lower() in aliases:
        return aliases[value.lower()]
    member = enum_cls.__members__.get(value.upper())
    if member is None:
        raise ValueError(f'{key}: {value!r} is not valid{suggest(value.upper(), names)}; '
                         f'valid choices are {_choices(names)}')
    return member


def resolve_flag(value: Any, key: str) -> bool:
    """A ``bool`` option; anything else (``"yes"``, ``1``) is a ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f'{key}: expected True or False, {_got(value)}')
    return value


def resolve_module_classes(value: Any, model: nn.Module, key: str) -> Tuple[Type[nn.Module], ...]:
    """Module classes, or names of classes in ``model`` (an unknown one: ``ValueError``)."""
    items = [value] if isinstance(value, (str, type)) else list(value or ())
    if not items:
        raise ValueError(f'{key}: expected at least one module class or class name')
    in_model = {type(m).__name__: type(m) for m in model.modules()}
    classes = []
    for item in items:
        if isinstance(item, type) and issubclass(item, nn.Module):
            classes.append(item)
        elif isinstance(item, str) and item in in_model:
            classes.append(in_model[item])
        elif isinstance(item, str):
            close = difflib.get_close_matches(item, sorted(in_model), n=3, cutoff=0.5)
            hint = f'close matches: {close}' if close else f'its classes are {sorted(in_model)}'
            raise ValueError(f'{key}: {type(model).__name__} has no submodule of class '
                             f'{item!r}; {hint}')
        else:
            raise TypeError(f'{key}: expected nn.Module classes or class names, got {item!r}')
    return tuple(classes)


def resolve_dtypes_and_flags(value: Mapping[str, Any], dtypes: Tuple[str, ...],
                             flags: Tuple[str, ...], key: str) -> dict:
    """Resolve a dict whose keys are dtype options or ``bool`` options (mixed precision)."""
    check_keys(value, dtypes + flags, key)
    return {name: resolve_dtype(item, f'{key}.{name}') if name in dtypes else
            resolve_flag(item, f'{key}.{name}') for name, item in value.items()}


class Accumulation(enum.Enum):
    """Where gradients live between the micro-steps of gradient accumulation.

    ``model_wrapper_cfg = dict(type='mmfsdp.MMFullyShard', accumulation='unsharded')``
    """

    #: Reduce-scatter every micro-step, accumulate into the gradient shard.
    SHARDED = 'sharded'
    #: Accumulate full local gradients (``no_sync``), reduce once per step.
    UNSHARDED = 'unsharded'
    #: Hybrid sharding (FSDP2 ``mesh``): reduce-scatter within the shard group every
    #: micro-step, all-reduce across replicas once per step.
    HYBRID = 'hybrid'


def resolve_accumulation(value: Union[str, Accumulation]) -> Accumulation:
    """``accumulation``: ``'sharded' | 'unsharded' | 'hybrid'`` (any case) or an Accumulation."""
    if isinstance(value, Accumulation):
        return value
    if not isinstance(value, str):
        raise TypeError("model_wrapper_cfg.accumulation: expected 'sharded', 'unsharded' or "
                        f"'hybrid', {_got(value)}")
    try:
        return Accumulation(value.lower())
    except ValueError:
        raise ValueError(f'model_wrapper_cfg.accumulation: {value!r} is not valid'
                         f'{suggest(value.lower(), [m.value for m in Accumulation])}; valid '
                         "choices are 'sharded' (reduce-scatter every micro-step; gradients stay "
                         "sharded), 'unsharded' (no_sync: full gradients until the last "
                         "micro-step) and 'hybrid' (hybrid sharding: reduce-scatter every "
                         'micro-step, all-reduce across replicas on the last)') from None


# ---- modules kept in fp32 under mixed precision (FSDP1 and FSDP2) ---------------------

#: ``mixed_precision.fp32_modules`` when not given: every batch norm (``SyncBatchNorm``
#: included), as FSDP1's ``MixedPrecision._module_classes_to_ignore``.
FP32_MODULES_DEFAULT: Tuple[Type[nn.Module], ...] = (_BatchNorm, )
_FP32_KEY = 'model_wrapper_cfg.mixed_precision.fp32_modules'

Fp32Modules = Tuple[Union[str, Type[nn.Module]], ...]


def split_fp32_modules(value: Any) -> Tuple[Any, Dict[str, Any]]:
    """``(mixed_precision without fp32_modules, {'fp32_modules': ...} if it gives one)``.

    An FSDP1 ``MixedPrecision`` object gives its ``_module_classes_to_ignore``.
    """
    if isinstance(value, Mapping) and 'fp32_modules' in value:
        return ({k: v for k, v in value.items() if k != 'fp32_modules'},
                dict(fp32_modules=value['fp32_modules']))
    if isinstance(value, MixedPrecision):
        # why: FSDP1 names the field privately (experimental) in its public dataclass
        return value, dict(fp32_modules=tuple(value._module_classes_to_ignore))
    return value, {}


def move_fp32_modules(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Move ``mixed_precision.fp32_modules`` to the config's own ``fp32_modules`` field."""
    if 'fp32_modules' in cfg:
        raise TypeError("model_wrapper_cfg: 'fp32_modules' is a key of mixed_precision: "
                        "write mixed_precision=dict(param_dtype=..., fp32_modules=[...])")
    if 'mixed_precision' in cfg:
        cfg['mixed_precision'], fp32 = split_fp32_modules(cfg['mixed_precision'])
        cfg.update(fp32)
    return cfg


def check_fp32_modules(value: Any) -> Fp32Modules:
    """``fp32_modules`` without the model: class names and/or ``nn.Module`` classes.

    ``[]`` keeps no module in fp32; ``None`` is refused (it would read as both
    "the default" and "off").
    """
    if value is None:
        raise TypeError(f'{_FP32_KEY}: None is ambiguous; leave the key out for the default '
                        '(every _BatchNorm), or give [] to keep no module in fp32')
    items = (value, ) if isinstance(value, (str, type)) else value
    if not isinstance(items, (list, tuple)):
        raise TypeError(f'{_FP32_KEY}: expected a list of module class names or classes, '
                        f'{_got(value)}')
    for item in items:
        if not (isinstance(item, str) or isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(f'{_FP32_KEY}: expected module class names (e.g. \'GroupNorm\') '
                            f'or nn.Module classes, got {type(item).__name__} {item!r}')
    return tuple(items)


def resolve_fp32_modules(value: Fp32Modules, model: nn.Module) -> Tuple[Type[nn.Module], ...]:
    """The classes of ``fp32_modules``, names looked up among ``model``'s classes and bases.

    A name matches a class of a submodule or any of its ``nn.Module`` bases, so
    ``'_BatchNorm'`` covers ``BatchNorm2d`` and ``SyncBatchNorm``. An unknown
    name is a ``ValueError`` with the nearest names.
    """
    known: Dict[str, Type[nn.Module]] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            if isinstance(cls, type) and issubclass(cls, nn.Module) and cls is not nn.Module:
                known.setdefault(cls.__name__, cls)
    classes = []
    for item in check_fp32_modules(value):
        if isinstance(item, type):
            classes.append(item)
        elif item in known:
            classes.append(known[item])
        else:
            close = difflib.get_close_matches(item, sorted(known), n=3, cutoff=0.5)
            hint = f'close matches: {close}' if close else f'its classes are {sorted(known)}'
            raise ValueError(f'{_FP32_KEY}: {item!r} is not the class of any submodule of '
                             f'{type(model).__name__} (nor a base of one); {hint}')
    return tuple(classes)


def computes_in_low_precision(param_dtype: Optional[torch.dtype]) -> bool:
    """Whether mixed precision computes below fp32, so that ``fp32_modules`` take effect."""
    return param_dtype is not None and param_dtype.itemsize < 4


# ---- FSDP1 ----------------------------------------------------------------------------

_FSDP1_MP_DTYPES = ('param_dtype', 'reduce_dtype', 'buffer_dtype')
_FSDP1_MP_FLAGS = ('keep_low_precision_grads', 'cast_forward_inputs', 'cast_root_forward_inputs')
_MP_KEY = 'model_wrapper_cfg.mixed_precision'


def resolve_sharding_strategy(value: Union[str, ShardingStrategy]) -> ShardingStrategy:
    """``sharding_strategy``: any ``ShardingStrategy`` name, case-insensitive."""
    return resolve_enum(value, ShardingStrategy, 'model_wrapper_cfg.sharding_strategy')


def resolve_backward_prefetch(
        value: Union[str, BackwardPrefetch, None]) -> Optional[BackwardPrefetch]:
    """``backward_prefetch``: ``'pre' | 'post' | None`` or a ``BackwardPrefetch``."""
    if value is None:
        return None
    return resolve_enum(value, BackwardPrefetch, 'model_wrapper_cfg.backward_prefetch',
                        {'pre': BackwardPrefetch.BACKWARD_PRE,
                         'post': BackwardPrefetch.BACKWARD_POST})


def resolve_mixed_precision(
        value: Union[Mapping[str, Any], MixedPrecision, None]) -> Optional[MixedPrecision]:
    """``mixed_precision``: a dict of FSDP1 ``MixedPrecision`` fields, or one.

    ``mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32', buffer_dtype='fp32')``;
    its ``fp32_modules`` key is checked by :func:`check_fp32_modules`, not here.
    """
    if value is None or isinstance(value, MixedPrecision):
        return value
    option_dict(value, _FSDP1_MP_DTYPES + _FSDP1_MP_FLAGS + ('fp32_modules', ), _MP_KEY,
                'a dict, a MixedPrecision or None')
    value, _ = split_fp32_modules(value)  # resolved against the model (the config's layout)
    return MixedPrecision(
        **resolve_dtypes_and_flags(value, _FSDP1_MP_DTYPES, _FSDP1_MP_FLAGS, _MP_KEY))


def resolve_cpu_offload(value: Union[bool, Mapping[str, Any], CPUOffload]) -> CPUOffload:
    """``cpu_offload``: ``bool``, ``dict(offload_params=...)`` or a ``CPUOffload``."""
    if isinstance(value, CPUOffload):
        return value
    if isinstance(value, bool):
        return CPUOffload(offload_params=value)
    option_dict(value, ('offload_params', ), 'model_wrapper_cfg.cpu_offload',
                'True/False, dict(offload_params=...) or a CPUOffload')
    return CPUOffload(offload_params=resolve_flag(
        value.get('offload_params', False), 'model_wrapper_cfg.cpu_offload.offload_params'))


# ---- FSDP2 ----------------------------------------------------------------------------

#: FSDP1 options that FSDP2 has no use for, and what to write instead (a config moved
#: from FSDP1 by changing its ``type`` fails with these rather than "unknown key").
FSDP1_ONLY_OPTIONS: Dict[str, str] = {
    'backward_prefetch': 'FSDP2 always prefetches the next unit in backward; remove it',
    'forward_prefetch': 'FSDP2 prefetches in forward by itself (explicit order: '
                        'set_modules_to_forward_prefetch on the sharded modules); remove it',
    'limit_all_gathers': 'FSDP2 frees all-gather buffers deterministically and needs no rate '
                         'limiter; remove it',
    'use_orig_params': 'FSDP2 always keeps the original parameters (as DTensors); remove it',
    'sync_module_states': "FSDPRunner broadcasts rank 0's weights before sharding (with "
                          "init_device='meta' they come from init_weights or load_from); "
                          'remove it',
    'cpu_offload': 'use offload=dict(cpu_offload=True, pin_memory=True)',
    'device_id': 'the device is chosen by mmfsdp (this process\'s accelerator, else the CPU); '
                 'remove it',
}

#: FSDP1 ``mixed_precision`` keys that ``MixedPrecisionPolicy`` does not have.
_FSDP1_ONLY_MP_KEYS: Dict[str, str] = {
    'buffer_dtype': 'FSDP2 does not cast buffers; they keep the dtype the model gives them',
    'keep_low_precision_grads': 'FSDP2 gives sharded gradients the dtype of the sharded '
                                'parameters; reduce_dtype sets the dtype of the reduction',
    'cast_root_forward_inputs': 'use cast_forward_inputs',
}
_FSDP2_MP_DTYPES = ('param_dtype', 'reduce_dtype', 'output_dtype')
_FSDP2_MP_FLAGS = ('cast_forward_inputs', )

#: ``mesh`` value meaning "the processes of one node" (torchrun's ``LOCAL_WORLD_SIZE``).
NODE = 'node'


def reject_fsdp1_options(cfg: Mapping[str, Any], key: str = 'model_wrapper_cfg') -> None:
    """Raise ``TypeError`` naming the FSDP2 replacement of an FSDP1-only option."""
    for name, instead in FSDP1_ONLY_OPTIONS.items():
        if name in cfg:
            raise TypeError(f'{key}: {name!r} is an FSDP1 option that mmfsdp.MMFullyShard '
                            f'(FSDP2) does not take: {instead}')


def resolve_mp_policy(
        value: Union[Mapping[str, Any], MixedPrecisionPolicy, None]) -> MixedPrecisionPolicy:
    """``mixed_precision``: a dict of ``MixedPrecisionPolicy`` fields, or one.

    ``None`` (or ``{}``) computes and reduces in the parameters' own dtype::

        mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32', cast_forward_inputs=True)

    Its ``fp32_modules`` key is checked by :func:`check_fp32_modules`, not here.
    """
    if value is None:
        return MixedPrecisionPolicy()
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, MixedPrecision):
        raise TypeError(f'{_MP_KEY}: got an FSDP1 MixedPrecision; FSDP2 takes a '
                        'MixedPrecisionPolicy or dict(param_dtype=..., reduce_dtype=..., '
                        'output_dtype=..., cast_forward_inputs=...)')
    if not isinstance(value, Mapping):
        raise TypeError(f'{_MP_KEY}: expected a dict, a MixedPrecisionPolicy or None, '
                        f'{_got(value)}')
    for name, instead in _FSDP1_ONLY_MP_KEYS.items():
        if name in value:
            raise TypeError(f'{_MP_KEY}: {name!r} is an FSDP1 key that FSDP2 does not '
                            f'take: {instead}')
    check_keys(value, _FSDP2_MP_DTYPES + _FSDP2_MP_FLAGS + ('fp32_modules', ), _MP_KEY)
    value, _ = split_fp32_modules(value)  # resolved against the model (the config's layout)
    return MixedPrecisionPolicy(
        **resolve_dtypes_and_flags(value, _FSDP2_MP_DTYPES, _FSDP2_MP_FLAGS, _MP_KEY))


def resolve_offload_policy(value: Union[bool, Mapping[str, Any], OffloadPolicy, None]
                           ) -> OffloadPolicy:
    """``offload``: ``dict(cpu_offload=bool, pin_memory=bool)``, a bool, or an ``OffloadPolicy``."""
    if isinstance(value, OffloadPolicy):
        return value
    if value is None or isinstance(value, bool):
        return CPUOffloadPolicy() if value else OffloadPolicy()
    option_dict(value, ('cpu_offload', 'pin_memory'), 'model_wrapper_cfg.offload',
                'dict(cpu_offload=..., pin_memory=...), True/False or an OffloadPolicy')
    pin_memory = resolve_flag(value.get('pin_memory', True), 'model_wrapper_cfg.offload.pin_memory')
    if not resolve_flag(value.get('cpu_offload', False), 'model_wrapper_cfg.offload.cpu_offload'):
        if 'pin_memory' in value:
            raise ValueError('model_wrapper_cfg.offload.pin_memory: '
                             'only applies with cpu_offload=True')
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=pin_memory)


def resolve_reshard_after_forward(value: Union[bool, int]) -> Union[bool, int]:
    """``reshard_after_forward``: ``True`` (ZeRO-3), ``False`` (ZeRO-2) or a group size ≥ 2."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value < 2:
            raise ValueError('model_wrapper_cfg.reshard_after_forward: '
                             f'{value!r} is not a valid group size; '
                             'use True, False or an int >= 2 that divides the shard group size')
        return value
    raise TypeError('model_wrapper_cfg.reshard_after_forward: expected True, False or an int, '
                    f'{_got(value)}')


@dataclass(frozen=True)
class MeshSpec:
    """The data-parallel mesh: ``replicate`` groups of ``shard`` ranks (``-1``: the rest).

    ::

        model_wrapper_cfg = dict(type='mmfsdp.MMFullyShard', mesh=dict(replicate=2, shard='node'))
    """

    replicate: int = 1
    shard: Union[int, str] = -1

    def sizes(self, world_size: int, local_world_size: Optional[int] = None) -> Tuple[int, int]:
        """``(replicate, shard)`` for ``world_size`` ranks; ``ValueError`` if they do not fit."""
        shard = self.shard
        if shard == NODE:
            if local_world_size is None:
                raise ValueError("model_wrapper_cfg.mesh.shard: "
                                 "'node' needs LOCAL_WORLD_SIZE (set by torchrun); "
                                 'give the shard group size as an int instead')
            shard = local_world_size
        replicate = self.replicate
        if replicate == -1 and shard == -1:
            raise ValueError('model_wrapper_cfg.mesh: replicate and shard cannot both be -1')
        if replicate == -1:
            replicate = world_size // shard if world_size % shard == 0 else 0
        elif shard == -1:
            shard = world_size // replicate if world_size % replicate == 0 else 0
        if replicate * shard != world_size:
            raise ValueError('model_wrapper_cfg.mesh: '
                             f'replicate={self.replicate} x shard={self.shard} does not '
                             f'match the world size {world_size}; replicate * shard must '
                             'equal it (use -1 for "the rest")')
        return replicate, shard


def _mesh_size(value: Any, key: str, allow_node: bool) -> Union[int, str]:
    if allow_node and value == NODE:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        node = f" or '{NODE}' (the processes of one node)" if allow_node else ''
        raise ValueError(f'{key}: expected a positive int, -1 (the rest of the world){node}, '
                         f'got {value!r}')
    return value


def resolve_mesh(value: Union[Mapping[str, Any], MeshSpec, None]) -> MeshSpec:
    """``mesh``: ``dict(replicate=R, shard=S)``; the default shards over every rank."""
    if value is None:
        return MeshSpec()
    if isinstance(value, MeshSpec):
        return value
    option_dict(value, ('replicate', 'shard'), 'model_wrapper_cfg.mesh',
                'dict(replicate=..., shard=...)')
    return MeshSpec(
        replicate=_mesh_size(value.get('replicate', 1), 'model_wrapper_cfg.mesh.replicate', False),
        shard=_mesh_size(value.get('shard', -1), 'model_wrapper_cfg.mesh.shard', True))


def translate_sharding_strategy(value: Union[str, ShardingStrategy]) -> Tuple[bool, bool]:
    """An FSDP1 ``sharding_strategy`` as FSDP2's ``(reshard_after_forward, hybrid: 2-D mesh)``."""
    strategy = resolve_sharding_strategy(value)
    if strategy is ShardingStrategy.NO_SHARD:
        raise ValueError("model_wrapper_cfg.sharding_strategy: "
                         "'NO_SHARD' has no FSDP2 equivalent (FSDP1 itself "
                         "deprecates it for DDP); use type='mmfsdp.MMDistributedDataParallel' "
                         'to replicate without sharding')
    return {
        ShardingStrategy.FULL_SHARD: (True, False),
        ShardingStrategy.SHARD_GRAD_OP: (False, False),
        ShardingStrategy.HYBRID_SHARD: (True, True),
        HYBRID_SHARD_ZERO2: (False, True),
    }[strategy]


def resolve_init_device(value: Optional[str]) -> Optional[str]:
    """``init_device``: ``None`` (build the model on its device) or ``'meta'``."""
    if value is None or value == 'meta':
        return value
    raise ValueError('model_wrapper_cfg.init_device: '
                     f'{value!r} is not supported{suggest(value, ["meta"])}; '
                     "valid choices are None (build the full model, then shard) and 'meta' "
                     '(build on the meta device, shard, then materialise each shard)')
