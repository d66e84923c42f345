"""Start one torchrun job of :mod:`benchmarks.worker` and collect its results.

The orchestrator (:mod:`benchmarks.run`) never imports torch: every
measurement happens in fresh processes, so that their memory is their own.
"""
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

__all__ = ['JobFailed', 'MEMORY_KINDS', 'REPO', 'torchrun']

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Kinds whose results are resident-set sizes.
MEMORY_KINDS = frozenset({'memory', 'construction', 'checkpoint', 'accumulation', 'peak'})
#: glibc serves allocations above this from mmap and unmaps them when freed, so the
#: resident set follows the live tensors instead of what the heap keeps cached (by
#: default glibc raises its threshold up to 32 MiB after the first large free, and
#: freed heap memory often stays resident). 1 MiB keeps every parameter-sized tensor
#: exact while small temporaries stay on the fast heap path.
MMAP_THRESHOLD = 1 << 20


class JobFailed(RuntimeError):
    """A torchrun job exited with an error or printed fewer results than cases."""


def torchrun(cases: List[Dict[str, Any]], nproc: int, timeout: float = 1200,
             exact_allocator: Optional[bool] = None) -> List[Dict[str, Any]]:
    """Run ``cases`` in one ``torchrun --standalone --nproc-per-node nproc`` job.

    ``exact_allocator`` (default: whether any case measures memory) sets
    ``MALLOC_MMAP_THRESHOLD_`` in the job's environment (see :data:`MMAP_THRESHOLD`).
    A job past ``timeout`` is killed (torchrun; its workers run in sessions of
    their own), and the error ends with what it had written to stderr.
    """
    if exact_allocator is None:
        exact_allocator = any(c['kind'] in MEMORY_KINDS for c in cases)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get('PYTHONPATH')) if p))
    env.pop('MALLOC_MMAP_THRESHOLD_', None)
    if exact_allocator:
        env['MALLOC_MMAP_THRESHOLD_'] = str(MMAP_THRESHOLD)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node',
           str(nproc), '-m', 'benchmarks.worker', '--cases', json.dumps(cases)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = e.stderr.decode(errors='replace') if isinstance(e.stderr, bytes) else e.stderr
        raise JobFailed(f'torchrun job timed out after {timeout} s: {cases}\n'
                        + '\n'.join((tail or '').splitlines()[-60:])) from e
    results = [json.loads(line[len('RESULT '):]) for line in proc.stdout.splitlines()
               if line.startswith('RESULT ')]
    if proc.returncode or len(results) != len(cases):
        ranks = [line for line in proc.stderr.splitlines() if line.startswith('[rank')]
        raise JobFailed(f'torchrun job failed (exit {proc.returncode}) for {cases}:\n' +
                        '\n'.join(ranks[-60:] or proc.stderr.splitlines()[-60:]))
    for result in results:
        result['exact_allocator'] = exact_allocator
    return results
