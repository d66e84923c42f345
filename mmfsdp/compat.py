"""The torch versions mmfsdp runs on, checked when the package is imported.

The floor is set by the newest torch API in use: FSDP2's
``fully_shard(reshard_after_forward=None)`` on the root (torch 2.8), DCP's
``_fqn_modifiers`` hook that maps :class:`mmfsdp.MMFullyShard`'s names (2.7)
and ``torch.accelerator.current_accelerator(check_available=True)`` (2.7).
Failing at import with the version needed beats a ``TypeError`` deep inside
the first training step.
"""
import re
from typing import Tuple

__all__ = ['MIN_TORCH', 'check_torch_version', 'enable_cpu_huge_pages', 'parse_version']

#: The oldest torch release mmfsdp supports (also in requirements.txt and the README).
MIN_TORCH: Tuple[int, int] = (2, 8)


def parse_version(version: str) -> Tuple[int, int]:
    """``(major, minor)`` of a torch version string (``'2.11.0+cu130'`` -> ``(2, 11)``)."""
    match = re.match(r'\s*(\d+)\.(\d+)', version)
    if match is None:
        raise ValueError(f'cannot read a torch version from {version!r}')
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str) -> None:
    """Raise ``ImportError`` naming the version needed when ``version`` is older than supported."""
    if parse_version(version) < MIN_TORCH:
        needed = '.'.join(map(str, MIN_TORCH))
        raise ImportError(
            f'mmfsdp needs torch >= {needed}, found torch {version}: FSDP2 shards the root with '
            f'fully_shard(reshard_after_forward=None) (torch {needed}) and its checkpoints use '
            f"DCP's _fqn_modifiers hook (torch 2.7); install torch>={needed}")


def _check_installed_torch() -> None:
    import torch
    check_torch_version(torch.__version__)


_check_installed_torch()


def enable_cpu_huge_pages() -> bool:
    """Have torch back CPU tensors of 2 MiB and more with transparent huge pages; whether it does.

    Why private: torch has no API for it. c10's CPU allocator reads the
    environment variable ``THP_MEM_ALLOC_ENABLE`` once, at the first CPU
    allocation of the process (``c10/core/alloc_cpu.cpp``), and then aligns
    tensors of 2 MiB and more to the page size and advises the kernel to back
    them with huge pages (``madvise(MADV_HUGEPAGE)``). Set later, the variable
    is ignored; so the effect is checked, by the alignment of three fresh
    (untouched) 2 MiB tensors. A user's own setting is kept.
    """
    import os

    import torch
    os.environ.setdefault('THP_MEM_ALLOC_ENABLE', '1')
    page = os.sysconf('SC_PAGE_SIZE')
    probes = [torch.empty(2 << 20, dtype=torch.uint8) for _ in range(3)]
    return all(p.data_ptr() % page == 0 for p in probes)
