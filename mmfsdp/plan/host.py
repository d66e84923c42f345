"""What a CPU host keeps resident beyond the live tensors: freed blocks its malloc does not reuse.

(The other CPU term, gloo's staging copy of a unit in every all-gather and
reduce-scatter, is :attr:`.step.StepPeak.staging_bytes`.)

On an accelerator a step's peak is the most bytes alive at once
(``max_memory_allocated``). On the CPU torch takes every tensor from the
process's ``malloc``, which the launch chooses (``tools/dist_train.sh``
preloads jemalloc, else tcmalloc, where installed: ``tools/cpu_allocator.sh``).
Every malloc serves blocks up to some size from per-size free lists: a freed
block there is kept for the next request of its size class, so it stays
resident and makes no room for a block of another size. The activations of a
small batch are such blocks under glibc (gpt-25m at batch 2 x 64 tokens: 256
KiB each), so once forward has made them they stay resident through backward,
and the gradients that backward creates add to them instead of taking their
place::

    heap-resident activations = the traced activation storages smaller than the threshold

The threshold, per allocator:

- **glibc**: the mmap threshold. A block at least that large is mapped on its
  own and unmapped when freed; a smaller one comes from the heap, whose freed
  memory stays resident. glibc raises the threshold to the largest block freed,
  up to 32 MiB on 64-bit systems; the plan takes 32 MiB, what a step sees once
  an earlier one has freed its gathered units, unless ``MALLOC_MMAP_THRESHOLD_``
  fixes it (the benchmarks set 1 MiB). Gathered units and unsharded gradients
  come from that heap as well, which the plan leaves out: a lower bound there
  (``docs/benchmarks.md``, section 9).
- **jemalloc**: its smallest *large* size class, 16 KiB (``SC_LARGE_MINCLASS``);
  larger blocks are extents that a later request of any size reuses.
- **tcmalloc**: its largest size class, 256 KiB (``kMaxSize``); larger blocks are
  spans of pages that any later request reuses.

Measured (gpt-25m, FSDP2, 2 ranks, batch 2): under glibc with the threshold at
1 MiB the step peaks 20 MiB higher than at 64 KiB, where no activation is below
it; the trace puts 16.7 MiB of its 32.7 MiB of activations below 1 MiB.
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
