"""What a CPU host keeps resident beyond the live tensors: freed blocks its malloc keeps.

Blocks below the launch's allocator threshold (glibc's mmap threshold, jemalloc's
16 KiB, tcmalloc's 256 KiB) stay resident after backward frees them; see
``docs/plan.md``.
"""
import os
import subprocess
from typing import Mapping, Optional

__all__ = ['ALLOCATORS', 'GLIBC_MAX_MMAP_THRESHOLD', 'heap_threshold', 'launch_allocator']

#: glibc's ceiling for its dynamic mmap threshold on 64-bit systems
#: (``DEFAULT_MMAP_THRESHOLD_MAX``: 4 MiB x sizeof(long)).
GLIBC_MAX_MMAP_THRESHOLD = 32 * 2**20
#: Allocator -> blocks below this many bytes are kept for their size class when freed
#: (glibc's entry: without ``MALLOC_MMAP_THRESHOLD_``).
ALLOCATORS = {'glibc': GLIBC_MAX_MMAP_THRESHOLD, 'jemalloc': 16 * 2**10,
              'tcmalloc': 256 * 2**10}
#: The launch scripts' choice of allocator (shipped with the package as ``.mim/tools``).
_CHOOSER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '.mim',
                        'tools', 'cpu_allocator.sh')


def launch_allocator(env: Optional[Mapping[str, str]] = None) -> str:
    """The allocator ``tools/dist_train.sh`` gives its processes under ``env`` (default: ours).

    It runs the scripts' own chooser (``MMFSDP_CPU_ALLOCATOR``, an ``LD_PRELOAD``
    that names one, the installed libraries) and reads back what it preloads;
    ``'glibc'`` where it preloads nothing or cannot run; its message as a
    ``ValueError`` where it refuses (an unknown or missing ``MMFSDP_CPU_ALLOCATOR``).
    """
    env = dict(os.environ if env is None else env)
    try:
        proc = subprocess.run(
            ['bash', '-c', 'source "$1" && printf %s "${LD_PRELOAD:-}"', 'bash', _CHOOSER],
            env=env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 'glibc'
    if proc.returncode:  # the launch would refuse to start too
        raise ValueError(proc.stderr.strip())
    return next((name for name in ('jemalloc', 'tcmalloc') if name in proc.stdout), 'glibc')


def heap_threshold(device: str, cpu_allocator: str = 'glibc',
                   env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Blocks below this many bytes stay resident when freed on ``device``; ``None`` off the CPU.

    ``cpu_allocator``: one of :data:`ALLOCATORS` (``--cpu-allocator`` of
    ``python -m mmfsdp.plan``); under glibc ``MALLOC_MMAP_THRESHOLD_`` in
    ``env`` (default: ours) fixes the threshold.
    """
    if cpu_allocator not in ALLOCATORS:
        raise ValueError(f'--cpu-allocator: {cpu_allocator!r} is not one of '
                         f'{", ".join(ALLOCATORS)}')
    if device != 'cpu':
        return None
    fixed = (os.environ if env is None else env).get('MALLOC_MMAP_THRESHOLD_')
    if cpu_allocator == 'glibc' and fixed:
        try:
            return min(int(fixed), GLIBC_MAX_MMAP_THRESHOLD)
        except ValueError:
            raise ValueError(f'MALLOC_MMAP_THRESHOLD_={fixed!r} is not a number of bytes') \
                from None
    return ALLOCATORS[cpu_allocator]
