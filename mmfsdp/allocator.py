"""CPU memory settings for training on the CPU, so that sharding saves resident memory.

On the CPU, torch allocates tensors with glibc's ``malloc``. With glibc's
defaults, the buffers that FSDP frees every step (gathered units, unsharded
gradients, reduce-scatter inputs) mostly stay resident: glibc raises its mmap
threshold to the size of the largest block freed (up to 32 MiB), so later
blocks of that size come from the heap, whose freed memory is only returned
when it sits at the top. Measured on gpt-25m at 2 ranks, every FSDP arm then
peaked above DDP, and the resident set grew from step to step. Mapping each
large block on its own (``'release'``) fixes the peak but makes the kernel
zero a fresh page for every 4 KiB the next step touches.

The default, ``'cache'``, routes tensors of 64 KiB and more through mmfsdp's
caching CPU allocator (:mod:`mmfsdp.cpu_cache`): a freed block stays mapped
for the next request of its size, and live + cached bytes never exceed the
most live at once in this training iteration or the one before, so the peak
is ``'release'``'s and the step reuses warm pages. This module also sets
glibc's allocator once per process (``mallopt``), and can return freed heap
memory after every training iteration (``malloc_trim``). What each choice
costs is measured in ``docs/benchmarks.md`` (section 9, "CPU allocator").

Config (``env_cfg.cpu_allocator``), read by :class:`mmfsdp.FSDPRunner`::

    env_cfg = dict(cpu_allocator='cache')     # the default
    env_cfg = dict(cpu_allocator='release')   # glibc maps blocks of 1 MiB and more on their own
    env_cfg = dict(cpu_allocator='glibc')     # opt out: glibc's defaults
    env_cfg = dict(cpu_allocator=dict(mmap_threshold=1 << 20, trim_interval=0))

The setting applies only when the process trains on the CPU on Linux with
glibc; elsewhere (CUDA, whose caching allocator owns device memory; musl;
macOS; Windows) it does nothing. Where the caching allocator cannot be built
(no C++ compiler), the runner warns and keeps the rest of the policy, which
for ``'cache'`` is ``'release'``.
"""
import ctypes
import logging
import os
import platform
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Union

from mmengine.hooks import Hook

from . import cpu_cache
from .compat import enable_cpu_huge_pages

__all__ = ['AllocatorPolicy', 'DEFAULT', 'MallocTrimHook', 'POLICIES', 'active_policy',
           'apply_policy', 'cache_in_effect', 'describe_active', 'glibc', 'log_active',
           'malloc_trim', 'resolve_cpu_allocator']

KEY = 'env_cfg.cpu_allocator'

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


@dataclass(frozen=True)
class AllocatorPolicy:
    """How glibc's malloc is set for a CPU training process.

    Attributes:
        name: The preset's name, or ``'custom'`` for a dict.
        mmap_threshold: Blocks at least this large (bytes) are mapped on their
            own and unmapped when freed (``mallopt(M_MMAP_THRESHOLD)``, which
            also stops glibc from raising the threshold). ``None``: glibc's.
        trim_threshold: Free memory at the top of the heap above this many
            bytes is returned to the system (``mallopt(M_TRIM_THRESHOLD)``).
            ``None``: glibc's.
        trim_interval: Call ``malloc_trim(0)`` (return every free page of
            every arena) after every ``trim_interval`` training iterations;
            ``0``: never.
        arena_max: At most this many malloc arenas (``mallopt(M_ARENA_MAX)``);
            threads beyond share them. ``None``: glibc's (8 per core).
        huge_pages: Back tensors of 2 MiB and more with transparent huge
            pages (torch's ``THP_MEM_ALLOC_ENABLE``, and the caching
            allocator's own blocks): a block mapped on its own then costs one
            page fault per 2 MiB instead of per 4 KiB.
        cache_min_bytes: Tensors of at least this many bytes come from
            mmfsdp's caching CPU allocator (:mod:`mmfsdp.cpu_cache`), which
            keeps freed blocks mapped for reuse within the most bytes live at
            once in this training iteration or the one before. ``None``:
            torch's allocator (glibc's ``malloc``).

    """

    name: str
    mmap_threshold: Optional[int] = None
    trim_threshold: Optional[int] = None
    trim_interval: int = 0
    arena_max: Optional[int] = None
    huge_pages: bool = False
    cache_min_bytes: Optional[int] = None

    @property
    def changes_anything(self) -> bool:
        """Whether applying the policy calls glibc at all."""
        return (self.mmap_threshold is not None or self.trim_threshold is not None
                or self.trim_interval > 0 or self.arena_max is not None or self.huge_pages
                or self.cache_min_bytes is not None)


#: The presets a config can name.
POLICIES: Dict[str, AllocatorPolicy] = {
    'glibc': AllocatorPolicy('glibc'),
    'release': AllocatorPolicy('release', mmap_threshold=1 << 20, huge_pages=True),
    'cache': AllocatorPolicy('cache', mmap_threshold=1 << 20, huge_pages=True,
                             cache_min_bytes=64 << 10),
}
DEFAULT = 'cache'
#: ``cache_min_bytes`` may not be smaller: a cached tensor is a mapping of whole pages.
CACHE_MIN_BYTES_FLOOR = 4096
_FIELDS = ('mmap_threshold', 'trim_threshold', 'trim_interval', 'arena_max', 'huge_pages',
           'cache_min_bytes')


def resolve_cpu_allocator(value: Union[str, Mapping[str, Any], None]) -> AllocatorPolicy:
    """``env_cfg.cpu_allocator`` as a policy; ``None`` (key absent) is the default.

    Raises ``ValueError`` / ``TypeError`` naming the key and the valid values.
    """
    if value is None:
        return POLICIES[DEFAULT]
    if isinstance(value, str):
        if value not in POLICIES:
            raise ValueError(f'{KEY}: {value!r} is not a preset; choose one of '
                             f'{sorted(POLICIES)} or give dict({", ".join(_FIELDS)})')
        return POLICIES[value]
    if not isinstance(value, Mapping):
        raise TypeError(f'{KEY}: expected a preset name {sorted(POLICIES)} or a dict, '
                        f'got {value!r}')
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise TypeError(f'{KEY}: unknown keys {unknown}; valid keys: {list(_FIELDS)}')
    fields: Dict[str, Any] = {}
    for key in _FIELDS:
        item = value.get(key)
        if item is None:
            continue
        if key == 'huge_pages':
            if not isinstance(item, bool):
                raise TypeError(f'{KEY}.{key}: expected True or False, got {item!r}')
            fields[key] = item
            continue
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(f'{KEY}.{key}: expected a non-negative integer, got {item!r}')
        if key == 'cache_min_bytes' and item < CACHE_MIN_BYTES_FLOOR:
            raise ValueError(f'{KEY}.{key}: expected at least {CACHE_MIN_BYTES_FLOOR} (a page), '
                             f'got {item}: every cached tensor is mapped on its own, so '
                             'smaller ones would each hold a whole page and a kernel mapping')
        fields[key] = item
    return AllocatorPolicy('custom', **fields)


def glibc() -> Optional[ctypes.CDLL]:
    """The C library of this process when it is glibc on Linux, else ``None``."""
    if platform.system() != 'Linux':
        return None
    try:
        os.confstr('CS_GNU_LIBC_VERSION')  # raises ValueError where the libc is not glibc
    except (ValueError, OSError):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, 'mallopt') and hasattr(libc, 'malloc_trim') else None


_active: Optional[AllocatorPolicy] = None
_huge_pages = False
_cache_missing = ''  # why the policy's caching allocator is not in force ('' if it is)
_cache_kept = ''  # why one installed earlier serves this process unlike the policy says


def apply_policy(policy: AllocatorPolicy, device_type: str) -> Optional[AllocatorPolicy]:
    """Set glibc's malloc for ``policy`` when training on the CPU; the policy now in force.

    Returns ``None`` (nothing set) off the CPU, without glibc, or for a policy
    that changes nothing. Raises ``RuntimeError`` if glibc refuses a value. A
    caching allocator that cannot be built is not an error: the rest of the
    policy applies, and :func:`log_active` warns. Nor is one that an earlier
    runner of this process installed with other settings, or where this policy
    asks for none: it stays in force (a process sets torch's CPU allocator
    once), and :func:`log_active` says so.
    """
    global _active, _huge_pages, _cache_missing, _cache_kept
    _cache_missing = _cache_kept = ''
    if device_type == 'cpu' and policy.cache_min_bytes is None and cpu_cache.installed():
        _cache_kept = (f'{policy.name!r} asks for no caching allocator, but one was installed '
                       'earlier in this process, for tensors of '
                       f'{cpu_cache.installed_min_bytes()} bytes and more; it stays in force: a '
                       "process sets torch's CPU allocator once")
    libc = glibc()
    if device_type != 'cpu' or libc is None or not policy.changes_anything:
        _active = None
        return None
    for param, value, field in ((_M_MMAP_THRESHOLD, policy.mmap_threshold, 'mmap_threshold'),
                                (_M_TRIM_THRESHOLD, policy.trim_threshold, 'trim_threshold'),
                                (_M_ARENA_MAX, policy.arena_max, 'arena_max')):
        if value is not None and libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            raise RuntimeError(f'{KEY}.{field}: glibc refused {value} (mallopt returned 0); '
                               'glibc caps the mmap threshold at 32 MiB on 64-bit systems')
    _huge_pages = policy.huge_pages and enable_cpu_huge_pages()
    if policy.cache_min_bytes is not None:
        installed = cpu_cache.install(policy.cache_min_bytes, policy.huge_pages)
        if cpu_cache.installed():
            _cache_kept = installed.reason
        else:
            _cache_missing = installed.reason
    _active = policy
    return policy


def active_policy() -> Optional[Dict[str, Any]]:
    """The policy this process applied, as a dict (``None`` if none), for logs and probes."""
    if _active is None:
        return None
    return dict(name=_active.name, mmap_threshold=_active.mmap_threshold,
                trim_threshold=_active.trim_threshold, trim_interval=_active.trim_interval,
                arena_max=_active.arena_max, huge_pages=_active.huge_pages,
                huge_pages_in_effect=_huge_pages, cache_min_bytes=_active.cache_min_bytes,
                cache_in_effect=cache_in_effect())


def cache_in_effect() -> bool:
    """Whether this process serves tensors from mmfsdp's caching CPU allocator.

    Installed by the policy in force or by an earlier one: it stays for the life
    of the process.
    """
    return cpu_cache.installed()


def describe_active() -> Optional[str]:
    """One log line for the policy in force (``None`` if none), with a warning's worth of why."""
    if _active is None:
        return None
    parts = [f'{key}={value}' for key, value in (
        ('mmap_threshold', _active.mmap_threshold), ('trim_threshold', _active.trim_threshold),
        ('arena_max', _active.arena_max)) if value is not None]
    if _active.trim_interval:
        parts.append(f'malloc_trim every {_active.trim_interval} iterations')
    if _active.huge_pages:
        parts.append('huge pages' if _huge_pages else
                     'huge pages NOT in effect: torch allocated CPU memory before the runner '
                     'started (set THP_MEM_ALLOC_ENABLE=1 in the environment instead)')
    if _active.cache_min_bytes is not None and not _cache_kept:
        parts.append(f'caching allocator for tensors of {_active.cache_min_bytes} bytes and more'
                     if not _cache_missing else
                     f'caching allocator NOT in effect: {_cache_missing}; freed blocks '
                     "are unmapped as with 'release'")
    if _cache_kept:
        parts.append(f'caching allocator NOT as configured: {_cache_kept}')
    return f"{KEY}: {_active.name!r} ({', '.join(parts)})"


def log_active(logger: logging.Logger) -> None:
    """Log :func:`describe_active`'s line, if any: a warning when a part is not in effect."""
    described = describe_active()
    if described is not None:
        missing = (_active.huge_pages and not _huge_pages) or bool(_cache_missing or _cache_kept)
        logger.log(logging.WARNING if missing else logging.INFO, described)
    elif _cache_kept:
        logger.warning(f'{KEY}: {_cache_kept}')


def malloc_trim() -> bool:
    """Return every free page of every glibc arena to the system; whether any was returned."""
    libc = glibc()
    return bool(libc is not None and libc.malloc_trim(ctypes.c_size_t(0)))


class MallocTrimHook(Hook):
    """``malloc_trim(0)`` after every ``interval`` training iterations (CPU, glibc).

    Registered by :class:`mmfsdp.FSDPRunner` when ``env_cfg.cpu_allocator``
    has a ``trim_interval``.
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        """Trim after every ``interval``-th iteration."""
        if self.every_n_train_iters(runner, self.interval):
            malloc_trim()
