"""One torchrun job per measurement: ``torchrun`` here, the job's entry point in ``__main__``.

The scripts never measure in their own process: every case runs in a fresh
``torchrun --standalone`` job of N CPU processes (gloo), so that its memory is
its own. In the job, ``python -m benchmarks.core.launch MODULE CASES`` starts the
process group, calls ``MODULE.run_case(case)`` for each case and prints rank 0's
result as one ``RESULT <json>`` line.
"""
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: glibc serves allocations above this from mmap and unmaps them when freed, so the resident
#: set follows the live tensors instead of what the heap keeps cached (by default glibc raises
#: its threshold up to 32 MiB after the first large free). 1 MiB keeps every parameter-sized
#: tensor exact while small temporaries stay on the fast heap path.
MMAP_THRESHOLD = 1 << 20
#: Variables that choose or tune the malloc of a job: none is inherited from the caller.
ALLOCATOR_VARIABLES = ('LD_PRELOAD', 'MALLOC_CONF', 'MALLOC_MMAP_THRESHOLD_', 'GLIBC_TUNABLES',
                       'TCMALLOC_RELEASE_RATE', 'TCMALLOC_AGGRESSIVE_DECOMMIT',
                       'MMFSDP_CPU_ALLOCATOR')


class JobFailed(RuntimeError):
    """A torchrun job exited with an error, ran past its deadline or printed too few results."""


def load_average() -> float:
    """The 1-minute load average now."""
    return round(os.getloadavg()[0], 2)


def preload_for(cpu_allocator: str) -> Dict[str, str]:
    """The variables the launch scripts set for ``MMFSDP_CPU_ALLOCATOR=cpu_allocator``.

    Sources their own chooser (``tools/cpu_allocator.sh``); an allocator that is not
    installed raises :class:`JobFailed` with the chooser's message.
    """
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
    env['MMFSDP_CPU_ALLOCATOR'] = cpu_allocator
    chooser = os.path.join(REPO, 'tools', 'cpu_allocator.sh')
    proc = subprocess.run(['bash', '-c', 'source "$1" && env -0', 'bash', chooser], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise JobFailed(proc.stderr.strip())
    chosen = dict(item.split('=', 1) for item in proc.stdout.split('\0') if '=' in item)
    return {k: v for k, v in chosen.items() if k in ALLOCATOR_VARIABLES and v}


def torchrun(module: str, cases: List[Dict[str, Any]], nproc: int, timeout: float = 1800,
             memory: bool = True, env: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    """Run ``cases`` of ``benchmarks.<module>`` in one torchrun job of ``nproc`` processes.

    ``memory``: the job runs under glibc with ``MALLOC_MMAP_THRESHOLD_`` set
    (:data:`MMAP_THRESHOLD`). ``env``: extra variables. A job past ``timeout`` seconds
    is killed with every process of its session. Each result gets the load average
    before and after the job and its wall time.
    """
    job_env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
    job_env['PYTHONPATH'] = os.pathsep.join(p for p in (REPO, os.environ.get('PYTHONPATH')) if p)
    if memory:
        job_env['MALLOC_MMAP_THRESHOLD_'] = str(MMAP_THRESHOLD)
    job_env.update(env or {})
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node',
           str(nproc), '-m', 'benchmarks.core.launch', f'benchmarks.{module}', json.dumps(cases)]
    load, start = load_average(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as timed_out:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker it started
        stdout, stderr = proc.communicate()
        raise JobFailed(f'{module} job timed out after {timeout:.0f} s (killed): {cases}\n'
                        + stderr[-3000:]) from timed_out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # workers a dying torchrun left behind
        except ProcessLookupError:
            pass
    results = [json.loads(line[len('RESULT '):]) for line in stdout.splitlines()
               if line.startswith('RESULT ')]
    if proc.returncode or len(results) != len(cases):
        ranks = [line for line in stderr.splitlines() if line.startswith('[rank')]
        raise JobFailed(f'{module} job failed (exit {proc.returncode}) for {cases}:\n'
                        + '\n'.join(ranks[-40:] or stderr.splitlines()[-40:]))
    wall = round(time.perf_counter() - start, 1)
    for result in results:
        result.update(load_before=load, load_after=load_average(), job_wall_s=wall)
    return results


def error_line(error: JobFailed) -> str:
    """The last line of a failed job that names an error (for a table cell)."""
    lines = str(error).splitlines()
    return next((line.split(']:', 1)[-1].strip() for line in reversed(lines)
                 if 'Error' in line), lines[0])[:200]


def main(module: str, cases_json: str) -> None:
    """In a torchrun job: run every case of ``module``, rank 0 prints the results."""
    import faulthandler

    import torch
    import torch.distributed as dist

    from mmfsdp.dist import init_distributed, shutdown_distributed

    from .workload import threads_per_rank
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 shows where a stuck rank is
    runner = importlib.import_module(module)
    init_distributed('pytorch', dict(timeout=1800))
    torch.set_num_threads(threads_per_rank(dist.get_world_size()))
    try:
        for case in json.loads(cases_json):
            result = runner.run_case(case)
            if dist.get_rank() == 0:
                print('RESULT ' + json.dumps(result), flush=True)
            dist.barrier()
    finally:
        shutdown_distributed()


if __name__ == '__main__':
    main(*sys.argv[1:])
