"""Nothing is lost on a crash: a rank killed mid-save, a worker killed mid-training.

A checkpoint is written under a temporary name and renamed into place, and
the expired checkpoint is deleted only after ``last_checkpoint`` points at the
new one (``max_keep_ckpts=1`` here). So SIGKILL during a save leaves the
previous checkpoint and ``last_checkpoint`` intact, and ``resume=True``
continues from it with the same numbers as an uninterrupted run. The same
holds for a rank killed while its background write (``async_save=True``) runs.
"""
import os
import signal
import sys

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.runner import Runner

from harness import REPO, SUPPORT, job_env, max_abs_diff, run_distributed, run_job
from mmfsdp.checkpoint import is_sharded_checkpoint
from toy import FSDP1, runner_config

KILL_AT, TOTAL = 4, 6
TOL = 2e-5


#: work dir -> (state_dict_type, async_save); the last run's rank 0 dies after its
#: background write ended on every rank, before it was published
RUNS = {'full': ('full', False), 'sharded': ('sharded', False),
        'full-async': ('full', True), 'sharded-async': ('sharded', True),
        'sharded-async-written': ('sharded', True)}


def _config(work_dir: str, run: str, timeout: int = 60) -> Config:
    kind, background = RUNS[run]
    cfg = runner_config(f'crash-{run}', work_dir, wrapper=FSDP1, batch_size=4, max_iters=TOTAL)
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=2, by_epoch=False,
                                              max_keep_ckpts=1, state_dict_type=kind,
                                              async_save=background)
    cfg.update(resume=True, env_cfg=dict(dist_cfg=dict(timeout=timeout)))
    return Config(cfg)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _crash_during_save(work_dir: str, run: str) -> None:
    """Rank 0 dies half-way through writing the full file at KILL_AT; for
    sharded checkpoints rank 1 dies while writing its shard. With async_save
    the write, and so the kill, happens in the background writer thread."""
    import mmfsdp
    target = f'iter_{KILL_AT}.pth.tmp'
    rank = int(os.environ['RANK'])
    kind = RUNS[run][0]
    if kind == 'full' and rank == 0:
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            name = getattr(f, 'name', f)  # the background writer passes an open file
            if str(name).endswith(target):
                if isinstance(f, (str, os.PathLike)):
                    with open(f, 'wb') as partial:
                        partial.write(b'PK\x03\x04 half a checkpoint')
                else:
                    f.write(b'PK\x03\x04 half a checkpoint')
                    f.flush()
                _die()
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
    if run.endswith('-written'):
        _die_once_written(work_dir, run, rank)
        return
    if kind == 'sharded' and rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter
        real_write = FileSystemWriter.write_data

        def write_data(self, plan, planner):
            if target in str(self.path):
                _die()
            return real_write(self, plan, planner)

        FileSystemWriter.write_data = write_data
    mmfsdp.FSDPRunner.from_cfg(_config(work_dir, run, timeout=10)).train()


class _Kill(Hook):
    """Rank 0 dies at the start of the iteration after KILL_AT's save, once its background
    write ended (rank 0's ends after every rank's), before ``CheckpointHook`` publishes it."""

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        from mmfsdp.checkpoint import background
        if runner.iter == KILL_AT and runner.rank == 0:
            for write in background._IN_FLIGHT:  # the test's one look inside
                write.future.result()
            _die()


class _Start(Hook):
    def before_train(self, runner) -> None:
        self.iter = runner.iter


def _die_once_written(work_dir: str, run: str, rank: int) -> None:
    import mmfsdp
    runner = mmfsdp.FSDPRunner.from_cfg(_config(work_dir, run, timeout=10))
    runner.register_hook(_Kill(), 'NORMAL')  # before CheckpointHook's poll (VERY_LOW)
    runner.train()


def _resume(root: str) -> dict:
    import mmfsdp
    from mmfsdp.checkpoint.state import gather_full_state
    out = {}
    for run in RUNS:
        runner, start = mmfsdp.FSDPRunner.from_cfg(_config(f'{root}/{run}', run)), _Start()
        runner.register_hook(start)
        runner.train()
        out[run] = dict(state=gather_full_state(runner.model, None)[0], iter=runner.iter,
                        start=start.iter)
    return out if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope='module')
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp('crash'))


@pytest.fixture(scope='module')
def crashed(root) -> dict:
    """The state of each work dir right after its crash."""
    state = {}
    for run in RUNS:
        with pytest.raises((AssertionError, TimeoutError)):
            run_distributed(_crash_during_save, 2, f'{root}/{run}', run, timeout=120)
        work_dir = f'{root}/{run}'
        state[run] = dict(files=sorted(os.listdir(work_dir)),
                          last=open(f'{work_dir}/last_checkpoint').read())
    return state


@pytest.fixture(scope='module')
def resumed(crashed, root) -> dict:
    """Both crashed work dirs, resumed with ``resume=True`` in one 2-rank group."""
    return run_distributed(_resume, 2, root)[0]


@pytest.fixture(scope='module')
def reference(tmp_path_factory) -> dict:
    """mmengine's stock Runner, one process, same global batch, uninterrupted."""
    cfg = runner_config('ref', str(tmp_path_factory.mktemp('ref')), batch_size=8,
                        max_iters=TOTAL, launcher='none')
    runner = Runner.from_cfg(Config(cfg))
    runner.train()
    return runner.model.state_dict()


@pytest.mark.parametrize('run', list(RUNS))
def test_kill_during_save_keeps_previous_checkpoint(crashed, root, run):
    files, last = crashed[run]['files'], crashed[run]['last']
    assert last == os.path.join(root, run, 'iter_2.pth')
    assert 'iter_2.pth' in files and f'iter_{KILL_AT}.pth' not in files
    if RUNS[run][0] == 'full':
        assert torch.load(last)['meta']['iter'] == 2
    else:
        assert is_sharded_checkpoint(last)


@pytest.mark.parametrize('run', list(RUNS))
def test_auto_resume_after_crash_equals_uninterrupted(resumed, reference, run):
    got = resumed[run]
    assert got['iter'] == TOTAL
    # a write that ended on every rank is published by the resuming run and resumed from
    assert got['start'] == (KILL_AT if run.endswith('-written') else 2)
    diff = max_abs_diff(got['state'], reference)
    print(f'{run}: max abs diff after crash + auto-resume {diff:.1e}')
    assert diff <= TOL


def _elastic_job(tmp_path, kill_at: int, mode: str = 'step') -> dict:
    """Run tests/support/elastic_job.py under ``torchrun --max-restarts 1``; its final state."""
    out = tmp_path / f'final-{kill_at}-{mode}.pth'
    run_job([sys.executable, '-m', 'torch.distributed.run', '--standalone',
             '--nproc-per-node', '2', '--max-restarts', '1',
             str(SUPPORT / 'elastic_job.py'), str(tmp_path / f'work-{mode}'),
             str(out), str(kill_at), mode],
            env=job_env(REPO, SUPPORT), timeout=300)
    return torch.load(out)


def test_elastic_restart_resumes_and_matches_uninterrupted(tmp_path, reference):
    final = _elastic_job(tmp_path, KILL_AT + 1)
    assert final['restarts'] == 1 and final['iter'] == TOTAL
    diff = max_abs_diff(final['state'], reference)
    print(f'elastic restart: max abs diff {diff:.1e}')
    assert diff <= TOL


@pytest.mark.slow
def test_elastic_restart_after_kill_mid_save_equals_uninterrupted_job(tmp_path):
    """Rank 0 dies half-way through writing iter_4.pth; the restarted job resumes from
    iter_2.pth and ends where the same job without the kill ends (same ranks, same order)."""
    uninterrupted = _elastic_job(tmp_path, 0, 'none')
    final = _elastic_job(tmp_path, KILL_AT, 'save')
    assert final['restarts'] == 1 and final['iter'] == uninterrupted['iter'] == TOTAL
    diff = max_abs_diff(final['state'], uninterrupted['state'])
    print(f'elastic restart after kill mid-save: max abs diff {diff:.1e}')
    assert diff <= 1e-6
