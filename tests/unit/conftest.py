"""The unit tier: no process starts and no process group forms in it.

It is what a contributor runs before a commit (``pytest tests/unit``, well under
a minute), so a test here that starts a process or a process group fails, naming
the tier it belongs in: ``tests/dist`` (spawned process groups) or ``tests/jobs``
(launched jobs).
"""
import sys

import pytest
import torch.distributed as dist

#: Audit events of a process starting; ``harness.run_distributed`` raises the last one.
PROCESS_STARTS = frozenset({'subprocess.Popen', 'os.fork', 'os.forkpty', 'os.posix_spawn',
                            'os.system', 'os.exec', 'harness.run_distributed'})
_in_unit_test = False


def _refuse_process_starts(event: str, args: tuple) -> None:
    if _in_unit_test and event in PROCESS_STARTS:
        raise RuntimeError(f'a unit test started a process ({event}): it belongs in tests/dist '
                           'or tests/jobs')


sys.addaudithook(_refuse_process_starts)


@pytest.fixture(autouse=True)
def no_process_and_no_process_group():
    global _in_unit_test
    _in_unit_test = True
    try:
        yield
    finally:
        _in_unit_test = False
    assert not dist.is_initialized(), 'a unit test left a process group: it belongs in tests/dist'
