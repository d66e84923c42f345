"""Background saves at the end of a job (``async_save=True``): published at exit, never waited
for once given up.

Each test runs ``tests/support/async_exit_job.py`` under torchrun (2 processes): a save made
outside ``train()`` by a runner that is garbage-collected before the exit is still published; a
writer stuck in a hung file system does not keep the job alive once ``save_timeout`` expired
and every rank raised.
"""
import os
import sys

from harness import REPO, SUPPORT, job_env, run_job


def _job(work_dir, mode: str, timeout: float) -> str:
    return run_job([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                    '--nproc-per-node', '2', str(SUPPORT / 'async_exit_job.py'), str(work_dir),
                    mode], env=job_env(REPO, SUPPORT), timeout=timeout)


def test_a_save_outside_train_is_published_at_exit_after_its_runner_is_gone(tmp_path):
    out = _job(tmp_path, 'outside', 180)
    assert 'runners collected: [True, True]' in out, out[-3000:]
    names = sorted(os.listdir(tmp_path))
    assert 'full.pth' in names and 'sharded.pth' in names, names
    assert os.path.isfile(tmp_path / 'sharded.pth' / 'mmengine.pth')
    assert not [n for n in names if n.endswith('.tmp')], names


def test_a_job_whose_writer_hangs_exits_once_every_rank_raised(tmp_path):
    """Without daemon writer threads, the interpreter joins the stuck one at exit: no return."""
    out = _job(tmp_path, 'stuck', 120)
    assert 'rank 0 raised TimeoutError' in out and 'save_timeout=3' in out, out[-3000:]
    assert 'rank 1 raised PeerFailure' in out, out[-3000:]
    assert 'stuck.pth' not in os.listdir(tmp_path)
