"""Auto-wrap policies: which submodules become their own FSDP unit.

A policy is one predicate that serves FSDP1 and FSDP2 alike, with the signature
torch's FSDP1 ``auto_wrap_policy`` callables have::

    policy(module, recurse, nonwrapped_numel, **options) -> bool

``recurse=True`` asks "look inside ``module``?", ``recurse=False`` asks "make
``module`` a unit?", and ``nonwrapped_numel`` counts the parameters of
``module`` not already claimed by a unit below it. :func:`plan_units` walks a
model with the semantics of FSDP1's recursive wrapping; it is the one walk
(:meth:`mmfsdp.wrappers.base.WrapperConfig.layout`): FSDP1 wraps exactly the
units it names, FSDP2 shards them, and the sharding plan reports them.

Policies are registered in :data:`mmfsdp.registry.FSDP_WRAP_POLICIES` and named
in configs::

    auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock'])
    auto_wrap_policy=[dict(type='transformer', layer_cls=['Block']),   # any of
                      dict(type='size_based', min_num_params=100_000)]

Users register their own predicate, whose extra arguments become config keys::

    @FSDP_WRAP_POLICIES.register_module()
    def big_linears(module, recurse, nonwrapped_numel, min_params=1000):
        return recurse or (isinstance(module, nn.Linear) and nonwrapped_numel >= min_params)

FSDP2's units are merged where a parameter is shared by two of them
(:func:`merge_units_sharing_parameters`: FSDP2 gives every parameter to one
group; a tied embedding / LM head is the classic case). What is done to layers
before sharding (activation checkpointing, regional compile) is
:mod:`mmfsdp.layers`.
"""
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Sequence,
    Set,
    Tuple,
    Type,
    Union,
)

from mmengine.logging import print_log
from torch import nn

from .options import resolve_module_classes, suggest
from .registry import FSDP_WRAP_POLICIES

__all__ = ['Merge', 'ROOT', 'WrapPolicy', 'build_wrap_policy', 'merge_units_sharing_parameters',
           'module_types', 'plan_units', 'size_based', 'transformer']

#: A built policy: ``(module, recurse, nonwrapped_numel) -> bool``.
WrapPolicy = Callable[[nn.Module, bool, int], bool]

PolicyConfig = Union[None, str, Mapping[str, Any], Callable, Sequence[Any]]

#: Containers without a ``forward``: never a unit themselves, always looked into.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _resolves_options(resolver: Callable[..., Dict[str, Any]]) -> Callable:
    """Attach ``resolver(model, key, **options) -> options`` to a policy.

    It runs once, when the policy is built for a model, to check the options
    against that model and turn names into the objects the predicate uses.
    """

    def attach(policy: Callable) -> Callable:
        policy.resolve_options = resolver
        return policy

    return attach


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f'{key}: expected a positive number of parameters, got {value!r} '
                         '(a unit with no parameters shards nothing)')
    return value


@FSDP_WRAP_POLICIES.register_module()
@_resolves_options(lambda model, key, min_num_params: dict(
    min_num_params=_positive_int(min_num_params, f'{key}.min_num_params')))
def size_based(module: nn.Module, recurse: bool, nonwrapped_numel: int,
               min_num_params: int) -> bool:
    """Make a unit of every module holding ``min_num_params`` not-yet-wrapped parameters."""
    if recurse:
        return nonwrapped_numel >= min_num_params or isinstance(module, _CONTAINERS)
    return nonwrapped_numel >= min_num_params and not isinstance(module, _CONTAINERS)


@FSDP_WRAP_POLICIES.register_module()
@_resolves_options(lambda model, key, layer_cls: dict(
    layer_cls=resolve_module_classes(layer_cls, model, f'{key}.layer_cls')))
def transformer(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                layer_cls: Tuple[Type[nn.Module], ...]) -> bool:
    """Make a unit of every instance of ``layer_cls`` (e.g. the transformer block)."""
    return module_types(module, recurse, nonwrapped_numel, module_cls=layer_cls)


@FSDP_WRAP_POLICIES.register_module()
@_resolves_options(lambda model, key, module_cls: dict(
    module_cls=resolve_module_classes(module_cls, model, f'{key}.module_cls')))
def module_types(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                 module_cls: Tuple[Type[nn.Module], ...]) -> bool:
    """Make a unit of every instance of ``module_cls`` (any module classes)."""
    return recurse or isinstance(module, module_cls)


def _any_of(policies: Sequence[WrapPolicy]) -> WrapPolicy:

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return any(p(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)
                   for p in policies)

    return policy


def _build_one(cfg: Any, model: nn.Module, key: str) -> WrapPolicy:
    if isinstance(cfg, str):
        cfg = dict(type=cfg)
    if not isinstance(cfg, Mapping):
        if callable(cfg):
            return cfg
        raise TypeError(f'{key}: expected a policy name, dict(type=...), a callable or a list '
                        f'of those, got {type(cfg).__name__} {cfg!r}')
    options = {k: v for k, v in cfg.items() if k != 'type'}
    name = cfg.get('type')
    fn = name if callable(name) else FSDP_WRAP_POLICIES.get(name)
    if fn is None:
        names = sorted(FSDP_WRAP_POLICIES.module_dict)
        raise KeyError(f'{key}.type: {name!r} is not a registered wrap policy'
                       f'{suggest(name, names)}; registered policies are {names}')
    try:
        inspect.signature(fn).bind(model, True, 0, **options)
    except TypeError as e:
        params = list(inspect.signature(fn).parameters)[3:]
        raise TypeError(f'{key}: policy {name!r} {e}; its options are {params}') from None
    resolve = getattr(fn, 'resolve_options', None)
    if resolve is not None:
        options = resolve(model, key, **options)
    return functools.partial(fn, **options)


def build_wrap_policy(cfg: PolicyConfig, model: nn.Module,
                      key: str = 'model_wrapper_cfg.auto_wrap_policy') -> Union[WrapPolicy, None]:
    """Build the policy a config names, checked against ``model``.

    Args:
        cfg: ``None`` (no auto-wrap: the whole model is one unit), a registered
            name, ``dict(type=name, **options)``, a callable, or a list of
            those (a module is wrapped if any of them says so).
        model: The unwrapped model the policy will be applied to.
        key: The config key, for error messages.

    Raises:
        KeyError: unknown policy name (the message lists registered names).
        TypeError: unknown or missing policy option.
        ValueError: a class name the model does not contain.

    """
    if cfg is None:
        return None
    if isinstance(cfg, (list, tuple)):
        if not cfg:
            raise ValueError(f'{key}: an empty list of policies wraps nothing; use None')
        policy = _any_of([_build_one(c, model, f'{key}[{i}]') for i, c in enumerate(cfg)])
    else:
        policy = _build_one(cfg, model, key)
    return policy


def plan_units(model: nn.Module, policy: WrapPolicy) -> List[str]:
    """Names of the submodules ``policy`` makes units of, children before parents.

    Follows FSDP1's recursive wrapping: a module is looked into if the policy
    says ``recurse``; after its children, it becomes a unit if the policy
    accepts the parameters its children did not claim. The root is never in
    the list (it is always a unit). A parameter shared by several modules is
    counted once, where it is first reached.
    """
    units: List[str] = []
    seen: set = set()

    def visit(module: nn.Module, name: str, is_root: bool) -> int:
        own = [p for p in module.parameters() if id(p) not in seen]
        numel = sum(p.numel() for p in own)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        claimed = 0
        for child_name, child in module.named_children():
            claimed += visit(child, f'{name}.{child_name}' if name else child_name, False)
        if not is_root and policy(module=module, recurse=False,
                                  nonwrapped_numel=numel - claimed):
            units.append(name)
            seen.update(id(p) for p in own)
            return numel
        return claimed

    visit(model, '', True)
    return units


# ---- shared parameters: one FSDP2 group each ---------------------------------------------

#: The name that stands for the root unit (the whole model) in a :class:`Merge`.
ROOT = '<root>'


@dataclass(frozen=True)
class Merge:
    """One resolution: ``dropped`` units give their parameters to ``owner``."""

    #: Names under which the shared parameter is registered.
    parameter_names: Tuple[str, ...]
    #: The units that would have held it.
    owners: Tuple[str, ...]
    #: Units that are no longer sharded separately.
    dropped: Tuple[str, ...]
    #: The unit (or :data:`ROOT`) that holds it now.
    owner: str


def _within(name: str, ancestor: str) -> bool:
    """Whether module ``name`` is ``ancestor`` or below it (``''`` is the root)."""
    return ancestor == '' or name == ancestor or name.startswith(f'{ancestor}.')


def _owner(module_name: str, units: Set[str]) -> str:
    """The innermost unit enclosing ``module_name``, or ``''`` for the root."""
    parts = module_name.split('.') if module_name else []
    for end in range(len(parts), 0, -1):
        candidate = '.'.join(parts[:end])
        if candidate in units:
            return candidate
    return ''


def _common_ancestor(names: Iterable[str]) -> str:
    split = [n.split('.') if n else [] for n in names]
    common: List[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return '.'.join(common)


def _registrations(model: nn.Module) -> Dict[int, List[Tuple[str, str]]]:
    """``id(parameter) -> [(parameter name, module name), ...]`` over every registration."""
    found: Dict[int, List[Tuple[str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            full = f'{module_name}.{name}' if module_name else name
            found.setdefault(id(param), []).append((full, module_name))
    return found


def merge_units_sharing_parameters(model: nn.Module,
                                   units: Sequence[str]) -> Tuple[List[str], List[Merge]]:
    """Drop units so that every parameter belongs to exactly one unit or to the root.

    Args:
        model: The unsharded model.
        units: Names of the planned units, children before parents
            (:func:`mmfsdp.policies.plan_units`).

    Returns:
        The units to shard (same order, some dropped) and what was merged.
        Each merge is logged as a warning.

    """
    kept = list(units)
    merges: List[Merge] = []
    registrations = [regs for regs in _registrations(model).values() if len(regs) > 1]
    while True:
        unit_set = set(kept)
        conflict = None
        for regs in registrations:
            owners = {_owner(module_name, unit_set) for _, module_name in regs}
            if len(owners) > 1:
                conflict = regs, owners
                break
        if conflict is None:
            return kept, merges
        regs, owners = conflict
        owner = _owner(_common_ancestor(owners), unit_set)
        dropped = [u for u in kept if u != owner and _within(u, owner)
                   and any(_within(o, u) for o in owners)]
        kept = [u for u in kept if u not in dropped]
        merge = Merge(parameter_names=tuple(name for name, _ in regs),
                      owners=tuple(sorted(o or ROOT for o in owners)),
                      dropped=tuple(dropped), owner=owner or ROOT)
        merges.append(merge)
        print_log(f'FSDP2 unit plan: parameter {" = ".join(merge.parameter_names)} is shared by '
                  f'{", ".join(merge.owners)}; FSDP2 allows one group per parameter, so '
                  f'{", ".join(merge.dropped)} will not be sharded as separate units and '
                  f'their parameters join {merge.owner}', logger='current',
                  level=logging.WARNING)
