"""Start one torchrun job of :mod:`benchmarks.worker` and collect its results.

The orchestrator (:mod:`benchmarks.run`) never imports torch: every
measurement happens in fresh processes, so that their memory is their own.
"""
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

from .job import Job

__all__ = ['JobFailed', 'MEMORY_KINDS', 'REPO', 'preload_for', 'torchrun']

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Kinds whose results are resident-set sizes.
MEMORY_KINDS = frozenset({'memory', 'construction', 'checkpoint', 'accumulation', 'peak'})
#: glibc serves allocations above this from mmap and unmaps them when freed, so the
#: resident set follows the live tensors instead of what the heap keeps cached (by
#: default glibc raises its threshold up to 32 MiB after the first large free, and
#: freed heap memory often stays resident). 1 MiB keeps every parameter-sized tensor
#: exact while small temporaries stay on the fast heap path.
MMAP_THRESHOLD = 1 << 20
#: Variables that choose or tune the malloc of a job: none is inherited from the caller.
ALLOCATOR_VARIABLES = ('LD_PRELOAD', 'MALLOC_CONF', 'MALLOC_MMAP_THRESHOLD_', 'GLIBC_TUNABLES',
                       'TCMALLOC_RELEASE_RATE', 'TCMALLOC_AGGRESSIVE_DECOMMIT',
                       'MMFSDP_CPU_ALLOCATOR')


def preload_for(cpu_allocator: str) -> Dict[str, str]:
    """The variables the launch scripts set for ``MMFSDP_CPU_ALLOCATOR=cpu_allocator``:
    ``LD_PRELOAD`` and the allocator's own settings, if they set any.

    Runs their own chooser (``tools/cpu_allocator.sh``); an allocator that is not
    installed is an error, with the chooser's message.
    """
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
    env['MMFSDP_CPU_ALLOCATOR'] = cpu_allocator
    chooser = os.path.join(REPO, 'tools', 'cpu_allocator.sh')
    proc = subprocess.run(['bash', '-c', 'source "$1" && env -0', 'bash', chooser], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr.strip())
    chosen = dict(item.split('=', 1) for item in proc.stdout.split('\0') if '=' in item)
    return {k: v for k, v in chosen.items() if k in ALLOCATOR_VARIABLES and v}


class JobFailed(RuntimeError):
    """A torchrun job exited with an error or printed fewer results than cases."""


def torchrun(cases: List[Dict[str, Any]], nproc: int, timeout: float = 1200,
             exact_allocator: Optional[bool] = None,
             cpu_allocator: str = 'glibc') -> List[Dict[str, Any]]:
    """Run ``cases`` in one ``torchrun --standalone --nproc-per-node nproc`` job.

    ``cpu_allocator``: ``'glibc'``, or ``'jemalloc'`` / ``'tcmalloc'``, preloaded as
    the launch scripts preload it (:func:`preload_for`). Under glibc,
    ``exact_allocator`` (default: whether any case measures memory) sets
    ``MALLOC_MMAP_THRESHOLD_`` in the job's environment (see :data:`MMAP_THRESHOLD`).
    A job past ``timeout`` is killed with all its processes (:class:`~benchmarks.job.Job`),
    and so are workers left running by a torchrun that died; either error ends
    with what the job had written to stderr.
    """
    if exact_allocator is None:
        exact_allocator = any(c['kind'] in MEMORY_KINDS for c in cases)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get('PYTHONPATH')) if p))
    for name in ALLOCATOR_VARIABLES:
        env.pop(name, None)
    if cpu_allocator != 'glibc':
        env.update(preload_for(cpu_allocator))
        exact_allocator = False
    elif exact_allocator:
        env['MALLOC_MMAP_THRESHOLD_'] = str(MMAP_THRESHOLD)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node',
           str(nproc), '-m', 'benchmarks.worker', '--cases', json.dumps(cases)]
    with Job([cmd], env, REPO, merge_stderr=False) as job:
        finished = job.wait(timeout)
        stdout, stderr, code = job.stdout(), job.stderr(), job.returncodes[0]
    tail = '\n'.join(stderr.splitlines()[-300:])
    if not finished:
        raise JobFailed(f'torchrun job timed out after {timeout} s (every process killed): '
                        f'{cases}\n{tail}')
    if job.left_behind:
        raise JobFailed(f'torchrun exited ({code}) leaving {len(job.left_behind)} of its '
                        f'processes running (killed): {cases}\n{tail}')
    results = [json.loads(line[len('RESULT '):]) for line in stdout.splitlines()
               if line.startswith('RESULT ')]
    if code or len(results) != len(cases):
        ranks = [line for line in stderr.splitlines() if line.startswith('[rank')]
        raise JobFailed(f'torchrun job failed (exit {code}) for {cases}:\n' +
                        '\n'.join(ranks[-60:] or stderr.splitlines()[-60:]))
    for result in results:
        result['exact_allocator'] = exact_allocator
        result['cpu_allocator'] = cpu_allocator
    return results
