"""Generic config helpers: strings to torch values, keys checked, "did you mean".

The wrappers only see ``torch.dtype``, enum members and dataclasses. Each
resolver names the config key, the bad value and the valid choices, so a typo
fails on every rank before any collective: ``TypeError`` for a wrong type or an
unknown keyword, ``ValueError`` for a value outside the choices. What only one
wrapper takes is resolved beside that wrapper's config (:mod:`mmfsdp.wrappers`).
"""
import difflib
import enum
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple, Type, TypeVar, Union

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision

from .compat import BATCH_NORM_BASE, fsdp1_fp32_classes

__all__ = [
    'Accumulation', 'FP32_MODULES_DEFAULT', 'Fp32Modules', 'check_fp32_modules', 'check_keys',
    'computes_in_low_precision', 'move_fp32_modules', 'option_dict', 'resolve_accumulation',
    'resolve_dtype', 'resolve_dtypes_and_flags', 'resolve_enum', 'resolve_flag',
    'resolve_init_device', 'split_fp32_modules', 'suggest', 'wrapper_options'
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
FP32_MODULES_DEFAULT: Tuple[Type[nn.Module], ...] = (BATCH_NORM_BASE, )
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
        return value, dict(fp32_modules=fsdp1_fp32_classes(value))
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


def computes_in_low_precision(param_dtype: Optional[torch.dtype]) -> bool:
    """Whether mixed precision computes below fp32, so that ``fp32_modules`` take effect."""
    return param_dtype is not None and param_dtype.itemsize < 4


def resolve_init_device(value: Optional[str]) -> Optional[str]:
    """``init_device``: ``None`` (build the model on its device) or ``'meta'``."""
    if value is None or value == 'meta':
        return value
    raise ValueError('model_wrapper_cfg.init_device: '
                     f'{value!r} is not supported{suggest(value, ["meta"])}; '
                     "valid choices are None (build the full model, then shard) and 'meta' "
                     '(build on the meta device, shard, then materialise each shard)')
