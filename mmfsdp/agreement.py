"""Checks that every rank must pass together: one rank's failure is every rank's error.

A rank that fails while the others go on to the next collective leaves them
blocked until the process-group timeout; ranks that shard different models
issue different collectives and hang. Three guards, each one exchange of
fixed-size data that cannot itself mismatch:

- :func:`fail_together` closes a section that one rank does alone (rank 0's
  plan log, hooks and checkpoint writes): if any rank failed, every rank
  raises, the failing one its own exception, the others :class:`PeerFailure`
  naming the section, the rank and its error::

      with fail_together('saving checkpoint iter_4.pth', wait_s=7200):
          if rank == 0:
              torch.save(checkpoint, path)

  ``wait_s`` bounds how long the others wait for a slow but healthy rank; a
  rank that dies fails the others at once (its connections close).
- :func:`check_ranks_agree`, before wrapping: each rank hashes what it is
  about to shard (:func:`fingerprint`: versions, parameters, buffers, the
  config, the sharding, the unit plan); one ``all_gather`` of the digests
  tells whether they differ, and only then the first differing field is
  exchanged, so every rank raises the same :class:`RankDisagreement`.
- :class:`UsageProbe` (FSDP2 without ``find_unused_parameters``): the ranks
  compare which parameters their first training forward used, before the
  backward whose reduce-scatters would otherwise differ and hang.
"""
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import re
import sys
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Set, Tuple

import mmengine
import torch
import torch.distributed as dist
from torch import nn

from .compat import VERSION, compiled_modules

if TYPE_CHECKING:
    from .wrappers.base import Layout
    from .wrappers.builder import Wrapping

__all__ = ['FIELDS', 'PeerFailure', 'RankDisagreement', 'UsageProbe', 'alone',
           'check_ranks_agree', 'check_same_parameters_used', 'control_group', 'fail_together',
           'fingerprint']

#: The longest error text sent to the other ranks.
_MAX_MESSAGE = 2000


class PeerFailure(RuntimeError):
    """Another rank failed in a section that every rank leaves together."""


_GROUPS: Dict[Tuple[Any, Optional[float]], Optional[dist.ProcessGroup]] = {}


def control_group(timeout_s: Optional[float] = None) -> Optional[dist.ProcessGroup]:
    """A gloo group over all ranks for small CPU messages; ``None`` means the default group.

    With ``timeout_s``, a gloo group whose collectives wait that long (the
    default group's timeout is sized for collectives, not for a slow save).
    Groups are created at the first call, which every rank makes at the same
    point, and reused.
    """
    if not dist.is_initialized():
        raise ValueError('control_group needs the default process group: call '
                         'init_process_group first')
    default = dist.group.WORLD  # one side group per default group
    key = (default, timeout_s)
    if key not in _GROUPS:
        if timeout_s is None and dist.get_backend() == 'gloo':
            _GROUPS[key] = None
        else:
            timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
            _GROUPS[key] = dist.new_group(backend='gloo', timeout=timeout)
    return _GROUPS[key]


def _failed_ranks(failed: bool, group: Optional[dist.ProcessGroup]) -> List[int]:
    flags = [torch.zeros(1, dtype=torch.int32) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([int(failed)], dtype=torch.int32), group=group)
    return [rank for rank, flag in enumerate(flags) if flag.item()]


def _describe(error: BaseException) -> str:
    return f'{type(error).__name__}: {error}'[:_MAX_MESSAGE]


_ALONE: List[bool] = []


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Inside, :func:`fail_together` runs its body and exchanges nothing.

    For a rank that finishes work after another rank failed (rank 0 publishing
    a checkpoint whose write completed): the others will join no collective.
    """
    _ALONE.append(True)
    try:
        yield
    finally:
        _ALONE.pop()


@contextlib.contextmanager
def fail_together(what: str, wait_s: Optional[float] = None) -> Iterator[None]:
    """Run the body on every rank; leave together; raise on every rank if any rank raised.

    Without a process group, with one rank or inside :func:`alone` the body simply runs.

    Args:
        what: the section, in words, for the error message (``'saving
            checkpoint iter_4.pth'``).
        wait_s: how long a rank waits for the others to finish the body;
            ``None``: the process group's timeout.

    """
    if _ALONE or not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    error: Optional[Exception] = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every rank must hear about any failure
        error = e
    group = control_group(wait_s)
    try:
        failed = _failed_ranks(error is not None, group)
        messages: List[Optional[str]] = [None] * dist.get_world_size()
        if failed:
            dist.all_gather_object(messages, _describe(error) if error else None, group=group)
    except Exception as lost:  # noqa: BLE001 - a peer died or stalled: say so, and where
        if error is not None:
            raise error from lost
        limit = 'the process-group timeout' if wait_s is None else f'{wait_s} s'
        raise PeerFailure(f'{what}: another rank died or did not finish within {limit} '
                          f'({_describe(lost)})') from lost
    if error is not None:
        raise error
    if failed:
        detail = '; '.join(f'rank {rank}: {messages[rank]}' for rank in failed)
        raise PeerFailure(f'{what} failed on rank{"s" if len(failed) > 1 else ""} '
                          f'{", ".join(map(str, failed))} ({detail}); this rank stops too '
                          'so that no rank waits forever')


# ---- every rank shards the same model the same way ----

#: The fields compared, in this order: the first that differs is reported (a
#: version difference explains everything after it).
FIELDS = ('versions', 'parameters', 'buffers', 'model_wrapper_cfg', 'sharding', 'unit plan')

_ADDRESS = re.compile(r' at 0x[0-9a-fA-F]+')


class RankDisagreement(RuntimeError):
    """Ranks are about to shard different models, or the same model differently."""


def _clean(value: Any) -> str:
    return _ADDRESS.sub('', repr(value))


def _wrapper_lines(wrapping: 'Wrapping') -> List[str]:
    lines = [f'type: {wrapping.cls.__module__}.{wrapping.cls.__qualname__}']
    lines += [f'{key}: {_clean(wrapping.options[key])}' for key in sorted(wrapping.options)]
    return lines


def fingerprint(model: nn.Module, wrapping: 'Wrapping', layout: Optional['Layout'],
                world_size: int) -> Dict[str, List[str]]:
    """What this rank is about to shard, field by field (see :data:`FIELDS`)."""
    from .plan.spec import sharding_spec  # the plan imports the wrappers, which import this
    spec = sharding_spec(wrapping.config, layout, world_size) if layout is not None else None
    return {
        'versions': [f'mmfsdp {VERSION}', f'torch {torch.__version__}',
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


def check_ranks_agree(model: nn.Module, wrapping: 'Wrapping', layout: Optional['Layout'],
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


# ---- every rank used the same parameters ----

_SHOWN = 10


class UsageProbe:
    """Records which parameter-holding modules of ``module`` run, until :meth:`remove`.

    A compiled submodule (``regional_compile``) is recorded as a whole: a hook
    inside it would break its graph, or stop the compiler from taking a
    checkpointed layer at all.
    """

    def __init__(self, module: nn.Module) -> None:
        self._ran: Set[str] = set()
        self._module = module
        whole = compiled_modules(module)
        self._handles = [
            child.register_forward_hook(functools.partial(self._record, name))
            for name, child in module.named_modules()
            if not any(name.startswith(f'{w}.') for w in whole) and (
                name in whole or any(p.requires_grad for p in child.parameters(recurse=False)))]
        self._whole = whole

    def _record(self, name: str, *_) -> None:
        self._ran.add(name)

    def remove(self) -> List[str]:
        """Stop recording; return the names of the trainable parameters of the modules that ran."""
        for handle in self._handles:
            handle.remove()
        used = []
        for name, child in self._module.named_modules():
            if name in self._ran or any(name.startswith(f'{w}.') and w in self._ran
                                        for w in self._whole):
                used += [f'{name}.{n}' if name else n
                         for n, p in child.named_parameters(recurse=False) if p.requires_grad]
        return sorted(used)


def check_same_parameters_used(used: List[str],
                               group: Optional[dist.ProcessGroup] = None) -> None:
    """Raise the same ``RuntimeError`` on every rank if the ranks used different parameters."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    group = group if group is not None else control_group()
    world_size = dist.get_world_size()
    digests = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(digests, torch.tensor([_digest(used)], dtype=torch.int64), group=group)
    if len({d.item() for d in digests}) == 1:
        return
    everyone: List[Optional[List[str]]] = [None] * world_size
    dist.all_gather_object(everyone, used, group=group)
    users: Dict[str, List[int]] = {}
    for rank, names in enumerate(everyone):
        for name in names:
            users.setdefault(name, []).append(rank)
    partial = sorted((n, r) for n, r in users.items() if len(r) < world_size)
    shown = ', '.join(f'{name} (used on rank{"s" if len(ranks) > 1 else ""} '
                      f'{", ".join(map(str, ranks))} only)' for name, ranks in partial[:_SHOWN])
    more = f' and {len(partial) - _SHOWN} more' if len(partial) > _SHOWN else ''
    raise RuntimeError(
        f'model_wrapper_cfg.find_unused_parameters: the ranks used different parameters in '
        f'their first training forward: {shown}{more}. FSDP2 reduces only the gradients a rank '
        'has, so their gradient reductions would not match and the job would hang. Set '
        'model_wrapper_cfg.find_unused_parameters=True to reduce zeros for the parameters a '
        'rank did not use')
