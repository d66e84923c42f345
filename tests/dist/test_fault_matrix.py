"""A job never hangs: a fault on one rank is an error naming its cause on every rank, at once.

Every case runs in one 2-process gloo group (each case leaves the group
usable for the next), injects one fault on one rank, and records on every
rank the error raised and when (``time.monotonic()`` is one clock for all
processes of this machine). The wall time from injection to the last rank's
error is printed (``pytest -s``) and must stay far below the collective
timeout of the harness (:data:`harness.COLLECTIVE_TIMEOUT_S`), so no case
passes by merely timing out.
"""
import errno
import json
import logging
import os
import signal
import time

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook

from harness import COLLECTIVE_TIMEOUT_S, run_distributed
from toy import FSDP1, FSDP2, runner_config

#: An error must reach every rank well before a collective could time out.
BOUND_S = COLLECTIVE_TIMEOUT_S / 2

_injected = {}


def _inject(case: str) -> None:
    _injected[case] = time.monotonic()


class _RaiseBeforeSave(Hook):

    def before_save_checkpoint(self, runner, checkpoint) -> None:
        if runner.rank == 0:
            _inject('before_save_checkpoint')
            raise ValueError('before_save_checkpoint boom')


def _runner(name: str, root: str, wrapper: dict, checkpoint: str = None, max_iters: int = 2,
            async_save: bool = False, **cfg):
    from mmfsdp import FSDPRunner
    config = runner_config(name, f'{root}/{name}', batch_size=4, wrapper=wrapper,
                           max_iters=max_iters)
    if checkpoint is not None:
        config['default_hooks']['checkpoint'] = dict(
            type='CheckpointHook', interval=2, by_epoch=False, state_dict_type=checkpoint)
        if async_save:
            config['default_hooks']['checkpoint']['async_save'] = True
    config.update(cfg)
    return FSDPRunner.from_cfg(Config(config))


def _outcome(case: str, fn) -> dict:
    try:
        result = fn() or {}
    except Exception as e:  # noqa: BLE001 - the test compares whatever was raised
        return dict(type=type(e).__name__, message=str(e), end=time.monotonic(),
                    injected=_injected.get(case))
    return dict(type=None, message='', end=time.monotonic(), injected=_injected.get(case),
                **result)


class _Collect(logging.Handler):

    def __init__(self) -> None:
        super().__init__()
        self.messages = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


class _Start(Hook):

    def before_train(self, runner) -> None:
        self.iter = runner.iter


def _damage(path: str, how: str) -> None:
    if how == 'truncate':
        size = os.path.getsize(path)
        with open(path, 'r+b') as f:
            f.truncate(size // 2)
    else:  # a sharded checkpoint without rank 1's shard
        os.remove(os.path.join(path, '__1_0.distcp'))


def _resume_after_damage(case: str, root: str, kind: str, damaged: list, how: str) -> dict:
    """Save iter_2 and iter_4, damage some, then auto-resume to iter_6."""
    import torch.distributed as dist
    name = case.replace(' ', '-')
    _runner(name, root, FSDP1, checkpoint=kind, max_iters=4).train()
    dist.barrier()
    if dist.get_rank() == 0:
        for step in damaged:
            _damage(f'{root}/{name}/iter_{step}.pth', how)
    dist.barrier()
    _inject(case)
    runner = _runner(name, root, FSDP1, checkpoint=kind, max_iters=6, resume=True)
    collect, start = _Collect(), _Start()
    runner.logger.addHandler(collect)
    runner.register_hook(start)
    runner.train()
    return dict(start=start.iter, end_iter=runner.iter,
                warnings=[m for m in collect.messages if 'Auto-resume' in m])


class _DiskFullBeforeSave(Hook):
    """Rank 0's full checkpoint of step 4 is written onto ``/dev/full``: the kernel's ENOSPC.

    Its temporary name becomes a symbolic link to ``/dev/full`` (every write
    there fails with ``ENOSPC``, as on a full disk) as the save of step 4
    starts, after step 2 was published (which removes the run's temporaries).
    """

    def __init__(self, case: str) -> None:
        self.case = case

    def before_save_checkpoint(self, runner, checkpoint) -> None:
        from mmfsdp.checkpoint.durable import temporary_path
        if runner.rank == 0 and checkpoint['meta']['iter'] == 4:
            os.symlink('/dev/full', temporary_path(f'{runner.work_dir}/iter_4.pth',
                                                   runner.checkpoint_state.token))
            _inject(self.case)


def _background_fault(case: str, root: str, kind: str, faulty: int, how: str) -> dict:
    """Save steps 2 and 4 in the background; rank ``faulty``'s write of step 4 fails."""
    from torch.distributed.checkpoint import FileSystemWriter

    from mmfsdp.checkpoint import META_FILE
    from mmfsdp.checkpoint.durable import find_complete_checkpoint
    name = case.replace(' ', '-')
    rank = int(os.environ['RANK'])
    real_write, real_plan = FileSystemWriter.write_data, FileSystemWriter.prepare_local_plan

    def write_data(self, plan, planner):  # runs in the background writer thread
        if rank == faulty and 'iter_4.pth' in str(self.path):
            _inject(case)
            raise OSError(errno.EIO, 'Input/output error (injected)')
        return real_write(self, plan, planner)

    def prepare_local_plan(self, plan):  # creates the directory: put the disk-full file in it
        plan = real_plan(self, plan)
        if rank == faulty and 'iter_4.pth' in str(self.path):
            os.symlink('/dev/full', os.path.join(self.path, f'__{rank}_0.distcp'))
            _inject(case)
        return plan

    runner = _runner(name, root, FSDP2, checkpoint=kind, max_iters=4, async_save=True)
    if how == 'error':
        FileSystemWriter.write_data = write_data
    elif kind == 'sharded':
        FileSystemWriter.prepare_local_plan = prepare_local_plan
    else:
        runner.register_hook(_DiskFullBeforeSave(case))
    try:
        outcome = _outcome(case, lambda: runner.train() and None)
    finally:
        FileSystemWriter.write_data, FileSystemWriter.prepare_local_plan = real_write, real_plan
    work_dir = f'{root}/{name}'
    pointer = open(f'{work_dir}/last_checkpoint').read()
    return dict(outcome, pointer=pointer,
                files=sorted(n for n in os.listdir(work_dir) if n.startswith('iter_')),
                complete=find_complete_checkpoint(pointer, META_FILE, print) == pointer)


def _faults(root: str) -> dict:
    import mmfsdp
    rank = int(os.environ['RANK'])
    out = {}

    def plan_fails():
        cls = mmfsdp.FSDPRunner
        real = cls._log_sharding_plan

        def log(self, model):
            if rank == 0:
                _inject('plan')
                raise ValueError('plan boom')
            return real(self, model)

        cls._log_sharding_plan = log
        try:
            _runner('plan', root, FSDP1).train()
        finally:
            cls._log_sharding_plan = real

    def hook_fails():
        runner = _runner('hook', root, FSDP2, checkpoint='full')
        runner.register_hook(_RaiseBeforeSave())
        runner.train()

    def save_fails(kind):
        real = torch.save

        def save(obj, f, *args, **kwargs):
            if rank == 0 and str(f).endswith('.pth.tmp'):
                _inject(f'torch.save {kind}')
                raise OSError(28, 'No space left on device (injected)')
            return real(obj, f, *args, **kwargs)

        torch.save = save
        try:
            _runner(f'save-{kind}', root, FSDP1, checkpoint=kind).train()
        finally:
            torch.save = real

    def different_model():
        runner = _runner('model', root, FSDP1,
                         model=dict(type='ToyClassifier', dim=16 if rank == 0 else 20))
        runner.train()

    def different_policy():
        wrapper = FSDP1 if rank == 0 else dict(
            FSDP1, auto_wrap_policy=dict(type='size_based', min_num_params=200))
        _runner('policy', root, wrapper).train()

    def record(name, outcome):
        out[name] = outcome
        with open(f'{root}/outcomes_{rank}.json', 'w') as f:
            json.dump(out, f)

    for name, fn in [('plan', plan_fails), ('before_save_checkpoint', hook_fails),
                     ('torch.save full', lambda: save_fails('full')),
                     ('torch.save sharded', lambda: save_fails('sharded')),
                     ('different model', different_model),
                     ('different policy', different_policy)]:
        if name in ('different model', 'different policy'):
            _inject(name)  # the fault is there from the start: time the whole construction
        record(name, _outcome(name, fn))
    for name, args in RESUME_CASES.items():
        record(name, _outcome(name, lambda n=name, a=args: _resume_after_damage(n, root, *a)))
    for name, args in BACKGROUND_FAULTS.items():
        record(name, _background_fault(name, root, *args))

    # Last, as it ends the group: rank 1 dies mid-step; rank 0 must not wait for it.
    class Die(Hook):
        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            if rank == 1 and runner.iter == 1:
                with open(f'{root}/killed_at', 'w') as f:
                    f.write(repr(time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)

    runner = _runner('sigkill', root, FSDP1, max_iters=4)
    runner.register_hook(Die())
    record('SIGKILL mid-step', _outcome('SIGKILL mid-step', runner.train))


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    """Each rank's outcome of each case (rank 1 has none for the SIGKILL case)."""
    root = str(tmp_path_factory.mktemp('faults'))
    with pytest.raises(AssertionError, match=r'ranks exited with codes \{1: -9\}'):
        run_distributed(_faults, 2, root)
    outcomes = [json.load(open(f'{root}/outcomes_{r}.json')) for r in range(2)]
    killed_at = float(open(f'{root}/killed_at').read())
    outcomes[0]['SIGKILL mid-step']['injected'] = killed_at
    return outcomes


def _wall(ranks, case) -> float:
    injected = [r[case]['injected'] for r in ranks if r.get(case, {}).get('injected')]
    wall = max(r[case]['end'] for r in ranks if case in r) - injected[0]
    print(f'fault {case!r}: injection to error on every rank {wall:.2f} s')
    return wall


#: case -> (error on the faulty rank, fragments of it; error on the other rank, fragments)
RANK0_FAULTS = {
    'plan': ('ValueError', ['plan boom'],
             ['logging the sharding plan', 'rank 0', 'ValueError: plan boom']),
    'before_save_checkpoint': ('ValueError', ['before_save_checkpoint boom'],
                               ['saving checkpoint', 'iter_2.pth', 'rank 0',
                                'before_save_checkpoint boom']),
    'torch.save full': ('OSError', ['No space left on device'],
                        ['saving checkpoint', 'iter_2.pth', 'rank 0', 'OSError',
                         'No space left on device']),
    'torch.save sharded': ('OSError', ['No space left on device'],
                           ['saving checkpoint', 'iter_2.pth', 'rank 0', 'OSError',
                            'No space left on device']),
}


@pytest.mark.parametrize('case', list(RANK0_FAULTS))
def test_rank0_failure_is_an_error_on_every_rank(ranks, case):
    own_type, own_fragments, peer_fragments = RANK0_FAULTS[case]
    assert ranks[0][case]['type'] == own_type, ranks[0][case]
    for fragment in own_fragments:
        assert fragment in ranks[0][case]['message']
    assert ranks[1][case]['type'] == 'PeerFailure', ranks[1][case]
    for fragment in peer_fragments:
        assert fragment in ranks[1][case]['message'], (fragment, ranks[1][case]['message'])
    assert _wall(ranks, case) < BOUND_S


@pytest.mark.parametrize('case, fragments', [
    ('different model', ['parameters', "'embed.weight (16, 6) torch.float32",
                         "'embed.weight (20, 6) torch.float32", 'rank 0', 'rank 1']),
    ('different policy', ['model_wrapper_cfg', 'auto_wrap_policy', "'transformer'",
                          "'size_based'", 'rank 0', 'rank 1']),
])
def test_ranks_that_disagree_raise_the_same_error_naming_the_difference(ranks, case,
                                                                        fragments):
    assert [r[case]['type'] for r in ranks] == ['RankDisagreement'] * 2, ranks[0][case]
    assert ranks[0][case]['message'] == ranks[1][case]['message']
    for fragment in fragments:
        assert fragment in ranks[0][case]['message'], (fragment, ranks[0][case]['message'])
    assert _wall(ranks, case) < BOUND_S


def test_sigkill_of_one_rank_mid_step_fails_the_other_at_once(ranks):
    outcome = ranks[0]['SIGKILL mid-step']
    assert outcome['type'] is not None and outcome['message'], outcome
    assert 'SIGKILL mid-step' not in ranks[1]
    assert _wall(ranks, 'SIGKILL mid-step') < BOUND_S


RESUME_CASES = {
    'resume truncated file': ('full', [4], 'truncate'),
    'resume missing shard': ('sharded', [4], 'remove shard'),
    'resume nothing complete': ('full', [2, 4], 'truncate'),
}


@pytest.mark.parametrize('case, defect', [('resume truncated file', 'truncated'),
                                          ('resume missing shard', 'shard file __1_0.distcp')])
def test_auto_resume_falls_back_past_an_incomplete_checkpoint(ranks, case, defect):
    for rank in ranks:
        assert rank[case]['type'] is None, rank[case]
        assert (rank[case]['start'], rank[case]['end_iter']) == (2, 6)
    [warning] = ranks[0][case]['warnings']
    for fragment in ['iter_4.pth is incomplete', defect, 'resuming from', 'iter_2.pth']:
        assert fragment in warning, (fragment, warning)


def test_auto_resume_without_a_complete_checkpoint_fails_on_every_rank(ranks):
    case = 'resume nothing complete'
    assert ranks[0][case]['type'] == 'FileNotFoundError'
    assert ranks[1][case]['type'] == 'PeerFailure'
    for rank in ranks:
        for fragment in ['iter_4.pth is incomplete', 'truncated', 'no complete earlier',
                         'resume=False']:
            assert fragment in rank[case]['message'], (fragment, rank[case]['message'])
    assert _wall(ranks, case) < BOUND_S


#: The process-group timeout of the slow-save case, and how long its save takes.
SHORT_TIMEOUT_S, SLOW_SAVE_S = 8, 16


class _SlowSave(Hook):
    """A healthy save that takes longer than the process-group timeout (a slow disk)."""

    def before_save_checkpoint(self, runner, checkpoint) -> None:
        if runner.rank == 0:
            time.sleep(SLOW_SAVE_S)  # the fault under test is slowness itself


def _slow_save(root: str) -> dict:
    from mmfsdp.dist import init_distributed
    init_distributed('pytorch', dict(timeout=SHORT_TIMEOUT_S))
    runner = _runner('slow', root, FSDP1, checkpoint='full', env_cfg=dict())
    runner.register_hook(_SlowSave())
    start = time.monotonic()
    runner.train()
    return dict(iter=runner.iter, wall=time.monotonic() - start,
                saved=os.path.isfile(f'{root}/slow/iter_2.pth'))


def test_slow_healthy_save_outlives_the_collective_timeout(tmp_path):
    results = run_distributed(_slow_save, 2, str(tmp_path))
    for result in results:
        assert result['iter'] == 2 and result['saved']
        assert result['wall'] > SLOW_SAVE_S > 2 * SHORT_TIMEOUT_S - 1


#: case -> (format, the rank whose background write of step 4 fails, how). 'full disk': the
#: write goes to /dev/full through a symbolic link (a real ENOSPC from the kernel; no tmpfs
#: with a quota is available here); 'error': DCP's write_data raises EIO.
BACKGROUND_FAULTS = {
    'background write error sharded': ('sharded', 1, 'error'),
    'background full disk full': ('full', 0, 'full disk'),
    'background full disk sharded': ('sharded', 1, 'full disk'),
}


@pytest.mark.parametrize('case', list(BACKGROUND_FAULTS))
def test_failed_background_write_is_an_error_on_every_rank_and_publishes_nothing(ranks, case):
    """Raised at the end of training (the next publication) on every rank, naming the rank and
    its error; step 4 never appears, ``last_checkpoint`` still names the complete step 2."""
    _, faulty, how = BACKGROUND_FAULTS[case]
    cause = 'No space left on device' if how == 'full disk' else 'Input/output error (injected)'
    own, other = ranks[faulty][case], ranks[1 - faulty][case]
    assert own['type'] == 'OSError' and cause in own['message'], own
    assert other['type'] == 'PeerFailure', other
    for fragment in ['saving checkpoint', 'iter_4.pth', 'written in the background',
                     f'rank {faulty}', 'OSError', cause]:
        assert fragment in other['message'], (fragment, other['message'])
    for rank in ranks:
        assert rank[case]['pointer'].endswith('/iter_2.pth') and rank[case]['complete']
        assert rank[case]['files'] == ['iter_2.pth'], rank[case]['files']
    assert _wall(ranks, case) < BOUND_S
