"""Shared (tied) parameters and FSDP2 units: one parameter, one group.

FSDP2 (``fully_shard``) gives every parameter to exactly one group and refuses,
at the first forward, a parameter reachable from two groups (torch 2.13:
"Parameter ... is shared with a parameter already managed by another FSDP
group"). A tied embedding / LM head under a policy that makes the embedding a
unit is the classic case. FSDP1 is lenient because its flat parameters claim a
shared parameter once, wherever it is first reached.

:func:`merge_units_sharing_parameters` runs on the unit plan *before* anything
is sharded: where a parameter would belong to two units (or to a unit and the
root), those units are dropped, so the parameter's owner becomes the nearest
unit enclosing all its users (at worst the root). Nothing else changes.
"""
import logging
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Set, Tuple

from mmengine.logging import print_log
from torch import nn

__all__ = ['Merge', 'merge_units_sharing_parameters']

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
