"""What a CPU host keeps resident beyond the live tensors: glibc's heap under the mmap threshold.

(The other CPU term, gloo's staging copy of a unit in every all-gather and
reduce-scatter, is :attr:`.step.StepPeak.staging_bytes`.)

On an accelerator a step's peak is the most bytes alive at once
(``max_memory_allocated``). On the CPU torch takes every tensor from glibc's
``malloc``: a block of at least the *mmap threshold* is mapped on its own and
returned to the system when it is freed; a smaller one comes from the heap,
whose freed memory stays resident (a heap gives back only its top, and
``malloc_trim`` runs between iterations at most). The activations of a small
batch are such blocks (gpt-25m at batch 2 x 64 tokens: 256 KiB each), so once
forward has made them they stay resident through backward, and the gradients
that backward creates add to them instead of taking their place::

    heap-resident activations = the traced activation storages smaller than the threshold

Measured (gpt-25m, FSDP2, 2 ranks, batch 2): with the threshold at 1 MiB the
step peaks 20 MiB higher than at 64 KiB, where no activation is below it; the
trace puts 16.7 MiB of its 32.7 MiB of activations below 1 MiB.

The threshold is ``env_cfg.cpu_allocator``'s ``mmap_threshold``, or its
``cache_min_bytes`` where that is lower: mmfsdp's caching CPU allocator keeps
freed blocks for reuse but never more than the live bytes' high-water mark, so
for the peak its blocks count as returned (the default ``'cache'``: 64 KiB;
``'release'``: 1 MiB; where the cache cannot be built, ``'cache'`` falls back
to 1 MiB). glibc's own setting (``'glibc'``, or a policy that sets no
threshold) raises the threshold to the largest block freed, up to 32 MiB on
64-bit systems; the plan takes 32 MiB, what a step sees once an earlier one has
freed its gathered units. It then still leaves out that gathered units and
unsharded gradients come from the heap as well (``docs/benchmarks.md``,
section 9, "CPU allocator"): a lower bound there.
"""
from typing import Any, Optional

from ..allocator import resolve_cpu_allocator

__all__ = ['GLIBC_MAX_MMAP_THRESHOLD', 'heap_threshold']

#: glibc's ceiling for its dynamic mmap threshold on 64-bit systems
#: (``DEFAULT_MMAP_THRESHOLD_MAX``: 4 MiB x sizeof(long)).
GLIBC_MAX_MMAP_THRESHOLD = 32 * 2**20


def heap_threshold(device: str, cpu_allocator: Any = None) -> Optional[int]:
    """Blocks below this many bytes stay resident when freed on ``device``; ``None`` off the CPU.

    ``cpu_allocator`` is the config's ``env_cfg.cpu_allocator`` (``None``: the
    key is absent, mmfsdp's default); it is validated as the runner validates it.
    """
    if device != 'cpu':
        return None
    policy = resolve_cpu_allocator(cpu_allocator)
    threshold = GLIBC_MAX_MMAP_THRESHOLD if policy.mmap_threshold is None else policy.mmap_threshold
    if policy.cache_min_bytes is not None:
        threshold = min(threshold, policy.cache_min_bytes)
    return threshold
