"""Every rank must shard the same model the same way: check it before the first collective.

A rank that builds a different model (a rank-dependent config value, other
code on one node, a head sized from a dataset that differs per rank) or a
different wrap plan issues different collectives: a hang, or gloo's "size
doesn't match" abort, which says nothing about the cause. So before wrapping,
every rank describes what it is about to shard (:func:`fingerprint`) and the
descriptions are compared (:func:`check_ranks_agree`):

1. each field is hashed to 8 bytes; one ``all_gather`` of these fixed-size
   digests (same size on every rank, so it cannot mismatch) tells every rank
   whether and where they differ;
2. only then, and only for the first differing field, the ranks exchange the
   field itself, so every rank raises the same :class:`RankDisagreement`
   naming the field, the first differing entry and the ranks on each side.
"""
import dataclasses
import hashlib
import re
import sys
from typing import Any, Dict, List, Optional

import mmengine
import torch
import torch.distributed as dist
from torch import nn

from .release import __version__
from .together import control_group
from .wrappers.base import Layout
from .wrappers.builder import Wrapping

__all__ = ['FIELDS', 'RankDisagreement', 'check_ranks_agree', 'fingerprint']

#: The fields compared, in this order: the first that differs is reported (a
#: version difference explains everything after it).
FIELDS = ('versions', 'parameters', 'buffers', 'model_wrapper_cfg', 'sharding', 'unit plan')

_ADDRESS = re.compile(r' at 0x[0-9a-fA-F]+')


class RankDisagreement(RuntimeError):
    """Ranks are about to shard different models, or the same model differently."""


def _clean(value: Any) -> str:
    return _ADDRESS.sub('', repr(value))


def _wrapper_lines(wrapping: Wrapping) -> List[str]:
    lines = [f'type: {wrapping.cls.__module__}.{wrapping.cls.__qualname__}']
    lines += [f'{key}: {_clean(wrapping.options[key])}' for key in sorted(wrapping.options)]
    return lines


def fingerprint(model: nn.Module, wrapping: Wrapping, layout: Optional[Layout],
                world_size: int) -> Dict[str, List[str]]:
    """What this rank is about to shard, field by field (see :data:`FIELDS`)."""
    spec = wrapping.sharding_spec(layout, world_size) if layout is not None else None
    return {
        'versions': [f'mmfsdp {__version__}', f'torch {torch.__version__}',
                     f'mmengine {mmengine.__version__}',
                     f'python {sys.version_info.major}.{sys.version_info.minor}'],
        'parameters': [f'{name} {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}'
                       for name, p in model.named_parameters()],
        'buffers': [f'{name} {tuple(b.shape)} {b.dtype}' for name, b in model.named_buffers()],
        'model_wrapper_cfg': _wrapper_lines(wrapping),
        'sharding': [] if spec is None else [_clean(dataclasses.replace(spec, units=()))],
        'unit plan': [] if spec is None else list(spec.units),
    }


def _digest(lines: List[str]) -> int:
    data = '\n'.join(lines).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), 'little',
                          signed=True)


def _ranks(ranks: List[int]) -> str:
    return f'rank{"s" if len(ranks) > 1 else ""} {", ".join(map(str, ranks))}'


def _explain(field: str, details: List[List[str]], digests: List[int]) -> str:
    groups: Dict[int, List[int]] = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    (_, left), (_, right) = list(groups.items())[:2]
    a, b = details[left[0]], details[right[0]]
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    def entry(lines: List[str]) -> str:
        return (repr(lines[index]) if index < len(lines)
                else f'nothing (it has {len(lines)} entries)')

    others = '' if len(groups) == 2 else f' ({len(groups)} different versions in all)'
    return (f'ranks disagree on {field}{others}: at entry {index}, {_ranks(left)} '
            f'{"have" if len(left) > 1 else "has"} {entry(a)} but {_ranks(right)} '
            f'{"have" if len(right) > 1 else "has"} {entry(b)}. Every rank must build the '
            'same model with the same model_wrapper_cfg and the same mmfsdp/torch/mmengine; '
            'look for config values or code that depend on the rank, the host or local data')


def check_ranks_agree(model: nn.Module, wrapping: Wrapping, layout: Optional[Layout],
                      group: Optional[dist.ProcessGroup] = None) -> None:
    """Raise :class:`RankDisagreement` on every rank if any two ranks' fingerprints differ.

    Costs one ``all_gather`` of ``len(FIELDS)`` integers when they agree.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    group = group if group is not None else control_group()
    world_size = dist.get_world_size()
    mine = fingerprint(model, wrapping, layout, world_size)
    local = torch.tensor([_digest(mine[f]) for f in FIELDS], dtype=torch.int64)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=group)
    table = torch.stack(gathered)
    differing = [i for i in range(len(FIELDS)) if (table[:, i] != table[0, i]).any()]
    if not differing:
        return
    field = FIELDS[differing[0]]
    details: List[Optional[List[str]]] = [None] * world_size
    dist.all_gather_object(details, mine[field], group=group)
    raise RankDisagreement(_explain(field, details, table[:, differing[0]].tolist()))
