"""Leaving a distributed process (mmfsdp/dist.py): groups destroyed, gloo's workers idle.

The abort this prevents is a race at interpreter exit (a gloo worker releasing
a finished collective while the interpreter finalizes); its rate before and
after was measured by ``benchmarks/exit_stress.py`` (removed since; docs/contributing.md
has its numbers), not timed here.
These tests pin what the teardown guarantees once it returns.
"""
import datetime

import torch
import torch.distributed as dist

from harness import COLLECTIVE_TIMEOUT_S, run_distributed
from mmfsdp.compat import gloo_worker_threads
from mmfsdp.dist import settle_gloo_workers, shutdown_distributed


def _init() -> None:
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _teardown_with_a_group_still_referenced():
    _init()
    held = dist.new_group([0, 1])  # as a wrapped module holds its group
    for group in (None, held):
        dist.all_reduce(torch.ones(1 << 16), group=group)
    workers_alive = len(gloo_worker_threads())
    settled = shutdown_distributed()
    return dict(workers_alive=workers_alive, settled=settled,
                initialized=dist.is_initialized(), workers_left=len(gloo_worker_threads()))


def test_shutdown_destroys_every_group_and_leaves_the_workers_idle():
    for rank in run_distributed(_teardown_with_a_group_still_referenced, 2, fresh=True):
        assert rank['workers_alive'] >= 2
        assert rank['settled'] and not rank['initialized']
        # The default group's workers were joined; the referenced group's stay, idle.
        assert 0 < rank['workers_left'] < rank['workers_alive']


def _teardown_of_unreferenced_groups():
    _init()
    dist.all_reduce(torch.ones(8))
    shutdown_distributed()
    return len(gloo_worker_threads())


def test_groups_nothing_references_take_their_workers_with_them():
    assert run_distributed(_teardown_of_unreferenced_groups, 2, fresh=True) == [0, 0]


def test_settling_without_gloo_workers_returns_at_once():
    assert gloo_worker_threads() == [] and settle_gloo_workers(timeout=0)


def _runner_in_a_group_the_caller_started(work_dir):
    from mmfsdp import FSDPRunner
    from mmfsdp.dist import registered_at_exit
    from toy import runner_config
    _init()  # the caller's group, as in a script or a notebook
    before = registered_at_exit()
    FSDPRunner.from_cfg(runner_config('caller-group', work_dir, batch_size=2)).train()
    return dict(before=before, after=registered_at_exit(), initialized=dist.is_initialized())


def test_runner_in_the_callers_group_settles_its_workers_at_exit_and_leaves_the_group(tmp_path):
    """The group is the caller's to destroy, but the gloo workers of the groups the wrapped
    model holds must be idle before the interpreter finalizes (the exit abort above)."""
    for rank in run_distributed(_runner_in_a_group_the_caller_started, 2, str(tmp_path),
                                    fresh=True):
        assert rank['before'] == [] and rank['after'] == ['settle_gloo_workers']
        assert rank['initialized']


def _registrations(runner_first: bool) -> list:
    """What this process registers at exit when wrappers are built (twice), after or without
    FSDPRunner's own registration for a group it started."""
    from mmfsdp.dist import registered_at_exit, shutdown_at_exit, teardown_at_exit
    if runner_first:
        shutdown_at_exit()
    teardown_at_exit()
    teardown_at_exit()
    return registered_at_exit()


def test_a_wrapper_registers_one_settle_at_exit_and_keeps_the_runners_teardown():
    """``teardown_at_exit`` (called by each wrapper when built) registers the settle once, and
    nothing beside the ``shutdown_distributed`` that FSDPRunner registered (it settles too)."""
    assert run_distributed(_registrations, 1, False, fresh=True) == [['settle_gloo_workers']]
    assert run_distributed(_registrations, 1, True, fresh=True) == [['shutdown_distributed']]
