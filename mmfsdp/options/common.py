"""Resolvers shared by every option: dtypes, enums, flags, keys and module classes."""
import difflib
import enum
from typing import Any, Iterable, Mapping, Optional, Tuple, Type, TypeVar, Union

import torch
from torch import nn

__all__ = ['check_keys', 'option_dict', 'resolve_dtype', 'resolve_dtypes_and_flags', 'resolve_enum',
           'resolve_flag', 'resolve_module_classes', 'suggest', 'wrapper_options']

E = TypeVar('E', bound=enum.Enum)

_DTYPES = {
    'bf16': torch.bfloat16,
    'bfloat16': torch.bfloat16,
    'fp16': torch.float16,
    'float16': torch.float16,
    'half': torch.float16,
    'fp32': torch.float32,
    'float32': torch.float32,
    'float': torch.float32,
}

#: Keys of a ``model_wrapper_cfg`` that are no keyword of the wrapper: its class, and the
#: registry scope mmengine adds to every dict with a ``type`` that a config inherits from
#: another package (``_base_ = ['mmfsdp::...']`` gives ``_scope_='mmfsdp'``).
NOT_WRAPPER_OPTIONS = ('type', '_scope_')


def wrapper_options(cfg: Mapping[str, Any]) -> dict:
    """The wrapper's keywords in a ``model_wrapper_cfg``: all keys but ``type`` and ``_scope_``."""
    return {k: v for k, v in cfg.items() if k not in NOT_WRAPPER_OPTIONS}


def suggest(value: Any, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``''``."""
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ''


def _choices(names: Iterable[str]) -> str:
    return ', '.join(repr(n) for n in names)


def check_keys(given: Mapping[str, Any], valid: Iterable[str], key: str) -> None:
    """Raise ``TypeError`` if ``given`` has a key outside ``valid``.

    Args:
        given: The user's mapping, e.g. ``mixed_precision=dict(...)``.
        valid: The accepted keys.
        key: The config key ``given`` sits under, for the message.

    """
    valid = list(valid)
    unknown = [k for k in given if k not in valid]
    if unknown:
        bad = unknown[0]
        raise TypeError(f'{key}: unknown key {bad!r}{suggest(bad, valid)}; '
                        f'valid keys are {_choices(valid)}')


def option_dict(value: Any, valid: Iterable[str], key: str, expected: str) -> Mapping[str, Any]:
    """``value``, a dict of options under ``key``; ``TypeError`` naming ``expected`` otherwise."""
    if not isinstance(value, Mapping):
        raise TypeError(f'{key}: expected {expected}, got {type(value).__name__} {value!r}')
    check_keys(value, valid, key)
    return value


def resolve_dtype(value: Union[str, torch.dtype, None], key: str) -> Optional[torch.dtype]:
    """Resolve ``'bf16' | 'bfloat16' | 'fp16' | 'float16' | 'fp32' | 'float32'``.

    ``torch.dtype`` values pass through (floating dtypes only); ``None`` stays
    ``None`` (meaning: keep the parameter's own dtype).
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ValueError(f'{key}: {value} is not a floating-point dtype')
        return value
    if not isinstance(value, str):
        raise TypeError(f'{key}: expected a dtype name or torch.dtype, '
                        f'got {type(value).__name__} {value!r}')
    dtype = _DTYPES.get(value.lower())
    if dtype is None:
        raise ValueError(f'{key}: {value!r} is not a dtype{suggest(value.lower(), _DTYPES)}; '
                         f'valid choices are {_choices(_DTYPES)} or a torch.dtype')
    return dtype


def resolve_enum(value: Union[str, E],
                 enum_cls: Type[E],
                 key: str,
                 aliases: Optional[Mapping[str, E]] = None) -> E:
    """Resolve a member of ``enum_cls`` by name, case-insensitively.

    Members pass through; ``aliases`` adds extra lower-case names.
    """
    if isinstance(value, enum_cls):
        return value
    aliases = dict(aliases or {})
    names = list(aliases) + [m.name for m in enum_cls]
    if not isinstance(value, str):
        raise TypeError(f'{key}: expected one of {_choices(names)} or a '
                        f'{enum_cls.__name__}, got {type(value).__name__} {value!r}')
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
        raise TypeError(f'{key}: expected True or False, got {type(value).__name__} {value!r}')
    return value


def resolve_module_classes(value: Any, model: nn.Module, key: str) -> Tuple[Type[nn.Module], ...]:
    """Resolve module classes given by name (or as classes) against ``model``.

    A name must be the ``__name__`` of a class used in ``model``; an unknown one
    is a ``ValueError`` listing the closest class names the model does use.
    """
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
