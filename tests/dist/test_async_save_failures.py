"""``async_save=True``: a checkpoint whose write completed is never lost, whatever fails after it.

One 2-process gloo group saves in the background every 2 iterations and fails
after the save of iteration 2, one failure per format: another hook's
``after_train_iter`` (full, FSDP1), ``KeyboardInterrupt`` (sharded, FSDP2), a
failing ``after_train`` (sharded, FSDP1), all on every rank, each followed by
``resume=True``; a background write failing on rank 1 (reported within one
iteration); last, as it ends the group, a metric raising on rank 0 alone in
the validation right after the save (rank 0 then leaves, as its process would).
The exit cases (a save outside ``train()``, a stuck writer) are in
``tests/jobs/test_async_exit.py``.
"""
import concurrent.futures
import errno
import os

import pytest
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import METRICS

from harness import run_distributed
from toy import FSDP1, FSDP2, ToyMetric, runner_config

#: case -> (state_dict_type, wrapper)
CASES = {'after_train_iter': ('full', FSDP1), 'KeyboardInterrupt': ('sharded', FSDP2),
         'after_train': ('sharded', FSDP1), 'metric on rank 0': ('sharded', FSDP2)}


class _Fail(Hook):
    """Raises on every rank while the background save of iteration 2 is in flight.

    Registered with priority ``LOWEST`` (after the checkpoint hook's save of the
    same iteration), or ``NORMAL`` for ``after_train`` (before the checkpoint
    hook's publication at the end of training).
    """

    def __init__(self, case: str) -> None:
        self.case = case

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if self.case == 'after_train_iter' and runner.iter + 1 == 2:
            raise ValueError('after_train_iter boom')

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if self.case == 'KeyboardInterrupt' and runner.iter == 2:
            raise KeyboardInterrupt

    def after_train(self, runner) -> None:
        if self.case == 'after_train':
            raise ValueError('after_train boom')


@METRICS.register_module()
class FailingMetric(ToyMetric):
    """A metric whose ``compute_metrics`` (which mmengine runs on rank 0 only) raises."""

    def compute_metrics(self, results: list) -> dict:
        raise ValueError('metric boom')


class _Start(Hook):

    def before_train(self, runner) -> None:
        self.iter = runner.iter


def _runner(work_dir: str, kind: str, wrapper: dict, max_iters: int, **extra):
    from mmfsdp import FSDPRunner
    cfg = runner_config(os.path.basename(work_dir), work_dir, wrapper=wrapper, batch_size=4,
                        max_iters=max_iters, val='metric' in work_dir)
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=2, by_epoch=False,
                                              state_dict_type=kind, async_save=True)
    if 'metric' in work_dir:
        cfg.update(val_evaluator=dict(type='FailingMetric'),
                   train_cfg=dict(by_epoch=False, max_iters=max_iters, val_interval=2))
    cfg.update(extra)
    return FSDPRunner.from_cfg(Config(cfg))


def _state(work_dir: str) -> dict:
    pointer = os.path.join(work_dir, 'last_checkpoint')
    return dict(pointer=open(pointer).read() if os.path.exists(pointer) else None,
                files=sorted(n for n in os.listdir(work_dir) if n.endswith(('.pth', '.tmp'))))


def _caught(fn) -> tuple:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt is one of the cases
        return type(e).__name__, str(e)
    return None, None


class _WaitForWrite(Hook):
    """At iteration 3, before the checkpoint hook's poll: the write of iteration 2 has ended."""

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if runner.iter + 1 == 3:
            write = runner.checkpoint_state.in_flight  # the write the poll will look at
            concurrent.futures.wait([write.future] if write.future else [], timeout=30)


def _failures(root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from mmfsdp.dist import shutdown_distributed
    rank = int(os.environ['RANK'])
    out = {}
    for case, (kind, wrapper) in CASES.items():
        if case == 'metric on rank 0':
            continue
        work_dir = f'{root}/{case.replace(" ", "-")}'
        runner = _runner(work_dir, kind, wrapper, 2 if case == 'after_train' else 4)
        runner.register_hook(_Fail(case), 'NORMAL' if case == 'after_train' else 'LOWEST')
        raised = _caught(runner.train)
        dist.barrier()
        out[case] = dict(raised=raised, **_state(work_dir))
        start = _Start()
        resumed = _runner(work_dir, kind, wrapper, 4, resume=True)
        resumed.register_hook(start)
        resumed.train()
        out[case]['resumed from'] = start.iter

    # a background write that fails on rank 1: an error on every rank at the next iteration
    real_write = FileSystemWriter.write_data

    def write_data(self, plan, planner):  # in the writer thread
        if rank == 1:
            raise OSError(errno.EIO, 'Input/output error (injected)')
        return real_write(self, plan, planner)

    work_dir = f'{root}/write-fails'
    runner = _runner(work_dir, 'sharded', FSDP2, 6)
    runner.register_hook(_WaitForWrite())
    FileSystemWriter.write_data = write_data
    try:
        out['write fails'] = dict(raised=_caught(runner.train), iter=runner.iter)
    finally:
        FileSystemWriter.write_data = real_write
    dist.barrier()
    out['write fails'].update(_state(work_dir))

    # last: the metric raises on rank 0 alone; rank 0 leaves the group as its process would
    work_dir = f'{root}/metric'
    runner = _runner(work_dir, *CASES['metric on rank 0'], 4)
    raised = _caught(runner.train)
    if rank == 0:
        out['metric on rank 0'] = dict(raised=raised, **_state(work_dir))
        shutdown_distributed()
    else:
        out['metric on rank 0'] = dict(raised=raised)
    return out


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    return run_distributed(_failures, 2, str(tmp_path_factory.mktemp('failures')), timeout=300)


@pytest.mark.parametrize('case', [c for c in CASES if c != 'metric on rank 0'])
def test_a_failure_after_an_async_save_still_publishes_it_and_resume_starts_there(ranks, case):
    kind = CASES[case][0]
    for rank in ranks:
        got = rank[case]
        assert got['raised'][0] == ('KeyboardInterrupt' if case == 'KeyboardInterrupt'
                                    else 'ValueError'), got['raised']
        assert got['pointer'] is not None and got['pointer'].endswith('/iter_2.pth'), got
        assert got['files'] == ['iter_2.pth'], (kind, got['files'])  # no temporary left
        assert got['resumed from'] == 2


def test_a_metric_raising_on_rank_0_alone_still_publishes_the_save_before_it(ranks):
    got = ranks[0]['metric on rank 0']
    assert got['raised'] == ('ValueError', 'metric boom')
    assert got['pointer'].endswith('/iter_2.pth') and got['files'] == ['iter_2.pth'], got
    assert ranks[1]['metric on rank 0']['raised'][0] is not None  # rank 0 left: not a hang


def test_a_failed_background_write_is_an_error_on_every_rank_at_the_next_iteration(ranks):
    """Saved at iteration 2, reported at iteration 3 (not at the next save, iteration 4);
    nothing published, the temporary removed."""
    own, other = ranks[1]['write fails'], ranks[0]['write fails']
    assert own['raised'][0] == 'OSError' and 'injected' in own['raised'][1], own
    assert other['raised'][0] == 'PeerFailure' and 'rank 1' in other['raised'][1], other
    for rank in ranks:
        assert rank['write fails']['iter'] == 2  # the loop's index of iteration 3
        assert rank['write fails']['pointer'] is None
        assert rank['write fails']['files'] == []
