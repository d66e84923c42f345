"""Generic config helpers: strings to torch values, keys checked, "did you mean".

The wrappers only see ``torch.dtype``, enum members and dataclasses. Each
resolver names the config key, the bad value and the valid choices, so a typo
fails on every rank before any collective: ``TypeError`` for a wrong type or an
unknown keyword, ``ValueError`` for a value outside the choices. What only one
wrapper takes is resolved beside that wrapper's config (:mod:`mmfsdp.wrappers`).
"""
import difflib
import enum
from typing import Any, Iterable, Mapping, Optional, Tuple, Type, TypeVar, Union

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision

from .compat import BATCH_NORM_BASE, fsdp1_fp32_classes

E = TypeVar('E', bound=enum.Enum)

_DTYPES = {
    'bf16': torch.bfloat16, 'bfloat16': torch.bfloat16,
    'fp16': torch.float16, 'float16': torch.float16, 'half': torch.float16,
    'fp32': torch.float32, 'float32': torch.float32, 'float': torch.float32,
}


def suggest(value: Any, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice (any case), or ``''``."""
    by_lower = {str(c).lower(): c for c in choices}
    close = difflib.get_close_matches(str(value).lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean '{by_lower[close[0]]}'?)" if close else ''


def _choices(names: Iterable[str]) -> str:
    return ', '.join(repr(n) for n in names)


def got(value: Any) -> str:
    """``got <type> <value>``, the end of a message about a value of the wrong type."""
    return f'got {type(value).__name__} {value!r}'


def one_or_many(value: Any) -> Tuple[Any, ...]:
    """A class or name given alone, or a list of them, as a tuple."""
    return (value, ) if isinstance(value, (str, type)) else tuple(value)


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
        raise TypeError(f'{key}: expected {expected}, {got(value)}')
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
        raise TypeError(f'{key}: expected a dtype name or torch.dtype, {got(value)}')
    dtype = _DTYPES.get(value.lower())
    if dtype is None:
        raise ValueError(f'{key}: {value!r} is not a dtype{suggest(value, _DTYPES)}; '
                         f'valid choices are {_choices(_DTYPES)} or a torch.dtype')
    return dtype


def resolve_enum(value: Union[str, E], enum_cls: Type[E], key: str,
                 aliases: Optional[Mapping[str, E]] = None) -> E:
    """A member of ``enum_cls`` by name (by value for string-valued enums), in any case.

    ``aliases`` adds names of its own (``'pre'`` for ``BACKWARD_PRE``).
    """
    if isinstance(value, enum_cls):
        return value
    choices = {**(aliases or {}), **{m.value if isinstance(m.value, str) else m.name: m
                                     for m in enum_cls}}
    if not isinstance(value, str):
        raise TypeError(f'{key}: expected one of {_choices(choices)} or a '
                        f'{enum_cls.__name__}, {got(value)}')
    member = {name.lower(): m for name, m in choices.items()}.get(value.lower())
    if member is None:
        raise ValueError(f'{key}: {value!r} is not valid{suggest(value, choices)}; '
                         f'valid choices are {_choices(choices)}')
    return member


def resolve_flag(value: Any, key: str) -> bool:
    """A ``bool`` option; anything else (``"yes"``, ``1``) is a ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f'{key}: expected True or False, {got(value)}')
    return value


def resolve_dtypes_and_flags(value: Mapping[str, Any], dtypes: Tuple[str, ...],
                             flags: Tuple[str, ...], key: str) -> dict:
    """Resolve a dict whose keys are dtype options or ``bool`` options (mixed precision).

    ``fp32_modules`` is accepted in the check (it is moved out before, by
    :func:`move_fp32_modules`), so that a typo of it is pointed at it.
    """
    check_keys(value, dtypes + flags + ('fp32_modules', ), key)
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


def resolve_init_device(value: Optional[str]) -> Optional[str]:
    """``init_device``: ``None`` (build the model on its device) or ``'meta'``."""
    if value is None or value == 'meta':
        return value
    raise ValueError('model_wrapper_cfg.init_device: '
                     f'{value!r} is not supported{suggest(value, ["meta"])}; '
                     "valid choices are None (build the full model, then shard) and 'meta' "
                     '(build on the meta device, shard, then materialise each shard)')


# ---- modules kept in fp32 under mixed precision (FSDP1 and FSDP2) ---------------------

#: ``mixed_precision.fp32_modules`` when not given: every batch norm (``SyncBatchNorm``
#: included), as FSDP1's ``MixedPrecision._module_classes_to_ignore``.
FP32_MODULES_DEFAULT: Tuple[Type[nn.Module], ...] = (BATCH_NORM_BASE, )
FP32_KEY = 'model_wrapper_cfg.mixed_precision.fp32_modules'


def move_fp32_modules(cfg: Mapping[str, Any]) -> dict:
    """A copy of ``cfg`` with ``mixed_precision.fp32_modules`` as its own ``fp32_modules`` key.

    An FSDP1 ``MixedPrecision`` object gives its ``_module_classes_to_ignore``.
    """
    if 'fp32_modules' in cfg:
        raise TypeError("model_wrapper_cfg: 'fp32_modules' is a key of mixed_precision: "
                        "write mixed_precision=dict(param_dtype=..., fp32_modules=[...])")
    cfg, mp = dict(cfg), cfg.get('mixed_precision')
    if isinstance(mp, Mapping) and 'fp32_modules' in mp:
        cfg['mixed_precision'] = {k: v for k, v in mp.items() if k != 'fp32_modules'}
        cfg['fp32_modules'] = mp['fp32_modules']
    elif isinstance(mp, MixedPrecision):
        cfg['fp32_modules'] = fsdp1_fp32_classes(mp)
    return cfg


def check_fp32_modules(value: Any) -> Tuple[Any, ...]:
    """``fp32_modules`` without the model: class names and/or ``nn.Module`` classes.

    ``[]`` keeps no module in fp32; ``None`` is refused (it would read as both
    "the default" and "off").
    """
    if value is None:
        raise TypeError(f'{FP32_KEY}: None is ambiguous; leave the key out for the default '
                        '(every _BatchNorm), or give [] to keep no module in fp32')
    if not isinstance(value, (str, type, list, tuple)):
        raise TypeError(f'{FP32_KEY}: expected a list of module class names or classes, '
                        f'{got(value)}')
    for item in one_or_many(value):
        if not (isinstance(item, str) or isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(f'{FP32_KEY}: expected module class names (e.g. \'GroupNorm\') '
                            f'or nn.Module classes, got {type(item).__name__} {item!r}')
    return one_or_many(value)
