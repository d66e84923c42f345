"""The unit tier: no rank, job or interpreter starts and no process group forms in it.

It is what a contributor runs before a commit (``pytest tests/unit``, well under
a minute), so a test here that spawns ranks, forks, launches a Python interpreter,
torchrun or a launch script, or leaves a process group, in its body or in a fixture
of any scope, fails, naming the tier it belongs in: ``tests/dist`` (spawned process
groups) or ``tests/jobs`` (launched jobs). A tool that mmengine itself runs (the
``gcc --version`` of its environment report) is not a job and is let through.
"""
import os
import shlex
import sys

import pytest
import torch.distributed as dist

#: Audit events of a process starting; ``harness.run_distributed`` raises the last one.
PROCESS_STARTS = frozenset({'os.fork', 'os.forkpty', 'os.posix_spawn', 'os.exec',
                            'harness.run_distributed'})
#: What a command line of ``subprocess`` must not run here.
JOBS = ('python', 'torchrun', '.sh', '.py', os.path.basename(sys.executable))
_in_unit_test = False


def _is_job(event: str, args: tuple) -> bool:
    if event in PROCESS_STARTS:
        return True
    if event in ('subprocess.Popen', 'os.system'):
        command = args[1] if event == 'subprocess.Popen' else args[0]
        words = shlex.split(command) if isinstance(command, str) else [os.fsdecode(w)
                                                                        for w in command]
        return any(job in os.path.basename(w) for w in words[:3] for job in JOBS)
    return False


def _refuse_process_starts(event: str, args: tuple) -> None:
    if _in_unit_test and _is_job(event, args):
        raise RuntimeError(f'a unit test started a process ({event} {args[:2]!r}): it belongs '
                           'in tests/dist or tests/jobs')


sys.addaudithook(_refuse_process_starts)


# The setup and teardown hooks of a conftest apply to the items below it only (pytest calls
# them through ``item.ihook``), and they enclose every fixture's setup and teardown.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    global _in_unit_test
    _in_unit_test = True
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    global _in_unit_test
    try:
        return (yield)
    finally:
        _in_unit_test = False
        assert not dist.is_initialized(), (
            'a unit test left a process group: it belongs in tests/dist')
