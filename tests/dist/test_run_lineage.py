"""Auto-resume continues the run that ``last_checkpoint`` names, never another run's leftovers.

Run A (lr 1e-2) is killed after its background write of ``iter_4.pth`` ended
on every rank, before it was published: a complete ``<token A>-iter_4.pth.tmp``
stays. Run B (lr 1e-3, ``resume=False``) then trains in the same work dir and
saves ``iter_2.pth``, which ``last_checkpoint`` names; relaunched with
``resume=True``, B resumes from its own ``iter_2.pth``: A's temporary is of
another lineage (its token is not among those B's checkpoint records) and
stays untouched.
"""
import os
import signal

import pytest
from mmengine.config import Config
from mmengine.hooks import Hook

from harness import run_distributed
from toy import FSDP2, runner_config

KILL_AT = 4


def _runner(work_dir: str, lr: float, max_iters: int, **extra):
    from mmfsdp import FSDPRunner
    cfg = runner_config('lineage', work_dir, wrapper=FSDP2, batch_size=4, max_iters=max_iters,
                        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=lr)))
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=2, by_epoch=False,
                                              state_dict_type='sharded', async_save=True)
    cfg.update(extra)
    return FSDPRunner.from_cfg(Config(cfg))


class _KillOnceWritten(Hook):
    """Rank 0 dies at the iteration after KILL_AT's save, once its background write ended
    (rank 0's ends after every rank's), before ``CheckpointHook`` (VERY_LOW) publishes it."""

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if runner.iter == KILL_AT and runner.rank == 0:
            runner.checkpoint_state.in_flight.future.result()
            os.kill(os.getpid(), signal.SIGKILL)


class _Start(Hook):
    def before_train(self, runner) -> None:
        self.iter = runner.iter
        self.lr = runner.optim_wrapper.optimizer.param_groups[0]['lr']


def _run_a(work_dir: str) -> None:
    runner = _runner(work_dir, 1e-2, 6, env_cfg=dict(dist_cfg=dict(timeout=10)))
    runner.register_hook(_KillOnceWritten(), 'NORMAL')
    runner.train()


def _run_b_then_resume(work_dir: str) -> dict:
    _runner(work_dir, 1e-3, 2).train()
    start = _Start()
    runner = _runner(work_dir, 1e-3, 4, resume=True)
    runner.register_hook(start)
    runner.train()
    return dict(start=start.iter, lr=start.lr, files=sorted(os.listdir(work_dir)))


@pytest.fixture(scope='module')
def resumed(tmp_path_factory) -> dict:
    work_dir = str(tmp_path_factory.mktemp('lineage'))
    with pytest.raises((AssertionError, TimeoutError)):
        run_distributed(_run_a, 2, work_dir, timeout=180)
    left = sorted(n for n in os.listdir(work_dir) if n.endswith('-iter_4.pth.tmp'))
    assert len(left) == 1 and os.path.isfile(os.path.join(work_dir, left[0], 'mmengine.pth'))
    return dict(run_distributed(_run_b_then_resume, 2, work_dir, timeout=240)[0], left=left[0])


def test_auto_resume_continues_its_own_run_not_a_killed_runs_newer_write(resumed):
    assert resumed['start'] == 2 and resumed['lr'] == pytest.approx(1e-3), resumed


def test_another_runs_temporary_is_left_untouched(resumed):
    assert resumed['left'] in resumed['files'], resumed['files']
    assert 'iter_4.pth' in resumed['files']  # B's own, written after its resume
