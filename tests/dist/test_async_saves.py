"""``async_save=True``: the same checkpoints as a synchronous save, published only when written.

One 2-process gloo group trains each format (full under FSDP1; sharded under
FSDP2, and under FSDP1, whose shards are ``ShardedTensor``s) with ``EMAHook``
twice, synchronously and asynchronously, saving every 2 iterations with
``max_keep_ckpts=1``, then resumes each from its iter_4 to iter_6. The
checkpoints and the resumed runs must be equal (max abs diff 0), and an
asynchronous checkpoint must not be visible before it is published. The
faults (a write error on one rank, a full disk, SIGKILL during a background
write) are in ``test_fault_matrix.py`` and ``test_crash_recovery.py``.
"""
import os
import tempfile

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook

from harness import max_abs_diff, raised, run_distributed
from toy import FSDP1, FSDP2, runner_config

#: The dist smoke (tools/test_torch.sh VERSION smoke): every compat/ entry at work.
pytestmark = pytest.mark.smoke

EMA = dict(type='EMAHook', ema_type='ExponentialMovingAverage', momentum=0.1)
#: run -> (state_dict_type, wrapper)
KINDS = {'full': ('full', FSDP1), 'sharded': ('sharded', FSDP2),
         'sharded-fsdp1': ('sharded', FSDP1)}
SAVE_EVERY, FIRST, TOTAL = 2, 4, 6


class _Visible(Hook):
    """Right after each save (the checkpoint hook runs before it): what a reader sees."""

    priority = 'LOWEST'

    def __init__(self) -> None:
        self.seen = {}

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        step = runner.iter + 1  # the step the checkpoint hook just saved
        if step % SAVE_EVERY == 0:
            pointer = os.path.join(runner.work_dir, 'last_checkpoint')
            self.seen[step] = dict(
                exists=os.path.exists(os.path.join(runner.work_dir, f'iter_{step}.pth')),
                pointer=open(pointer).read() if os.path.exists(pointer) else None,
                in_flight=runner.checkpoint_in_flight())


def _config(work_dir: str, run: str, background: bool, max_iters: int, **extra) -> Config:
    kind, wrapper = KINDS[run]
    cfg = runner_config(os.path.basename(work_dir), work_dir, wrapper=wrapper,
                        batch_size=4, max_iters=max_iters)
    cfg['custom_hooks'] = [dict(EMA)]
    cfg['default_hooks']['checkpoint'] = dict(
        type='CheckpointHook', interval=SAVE_EVERY, by_epoch=False, max_keep_ckpts=1,
        state_dict_type=kind, async_save=background)
    cfg.update(extra)
    return Config(cfg)


def _final(runner) -> dict:
    from mmfsdp.checkpoint.state import gather_full_state
    [ema] = [h for h in runner.hooks if type(h).__name__ == 'EMAHook']
    model, optimizer = gather_full_state(runner.model, runner.optim_wrapper)
    return dict(iter=runner.iter, model=model, optimizer=optimizer['state'],
                ema=ema.averaged_state_dict(runner),
                lr=[g['lr'] for g in runner.optim_wrapper.optimizer.param_groups])


def _saved(path: str) -> dict:
    """A checkpoint's content as one full dict (a sharded one consolidated), minus run names."""
    from mmfsdp.checkpoint.safe_io import decode, load_file
    from mmfsdp.consolidate import consolidate
    if os.path.isdir(path):
        with tempfile.TemporaryDirectory() as tmp:
            consolidate(path, f'{tmp}/full.pth')
            checkpoint = decode(load_file(f'{tmp}/full.pth'))
    else:
        checkpoint = decode(load_file(path))
    info = dict(checkpoint['message_hub']['runtime_info'])
    for key in ('last_ckpt', 'cfg', 'experiment_name'):
        info.pop(key, None)
    return dict(state_dict=checkpoint['state_dict'], ema=checkpoint['ema_state_dict'],
                optimizer=checkpoint['optimizer']['state'], info=repr(sorted(info.items())),
                schedulers=repr(checkpoint.get('param_schedulers')),
                iter=checkpoint['meta']['iter'])


def _staged_tensors(tree, path: str = ''):
    """``(path, tensor)`` of every tensor a staged copy holds (a shard's local part)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _staged_tensors(value, f'{path}/{key}')
    elif callable(getattr(tree, 'local_shards', None)):  # FSDP1's ShardedTensor
        for i, shard in enumerate(tree.local_shards()):
            yield f'{path}/{i}', shard.tensor
    elif isinstance(tree, torch.Tensor):
        yield path, getattr(tree, 'to_local', lambda: tree)()


#: This process's background saves since the last run began: each one's staged tensors (kept
#: alive, so that no later copy can take their memory) by path.
STAGED: list = []


def _record_staging() -> None:
    """From now on, append each background save's staged copy to :data:`STAGED`."""
    from mmfsdp.checkpoint import runner_methods
    from mmfsdp.checkpoint.background import ShardStager
    stage, write = ShardStager.stage, runner_methods.write_file_in_background

    def recorded_stage(self, state_dict):
        copy = stage(self, state_dict)
        STAGED.append(dict(_staged_tensors(copy)))
        return copy

    def recorded_write(obj, tmp):
        STAGED.append(dict(_staged_tensors(obj)))
        return write(obj, tmp)

    ShardStager.stage, runner_methods.write_file_in_background = recorded_stage, recorded_write


def _two_ranks(root: str) -> dict:
    from mmfsdp import FSDPRunner
    out = {}
    _record_staging()
    for kind in KINDS:
        for background in (False, True):
            name = f'{kind}-{"async" if background else "sync"}'
            work_dir = f'{root}/{name}'
            runner = FSDPRunner.from_cfg(_config(work_dir, kind, background, FIRST))
            visible = _Visible()
            runner.register_hook(visible)
            STAGED.clear()
            runner.train()
            torch.distributed.barrier()
            # per save after the first: whether each tensor that kept its place and shape
            # (not the growing logs of the message hub) is in the memory of the one before
            reused = [{k: t.untyped_storage().data_ptr() == earlier[k].untyped_storage().data_ptr()
                       for k, t in later.items() if k in earlier and t.shape == earlier[k].shape}
                      for earlier, later in zip(STAGED, STAGED[1:])]
            out[name] = dict(seen=visible.seen, files=sorted(
                n for n in os.listdir(work_dir) if n.startswith('iter_') or n.endswith('.tmp')),
                pointer=open(f'{work_dir}/last_checkpoint').read(),
                saved=_saved(f'{work_dir}/iter_{FIRST}.pth') if runner.rank == 0 else None,
                staged=len(STAGED), reused=reused)
            resumed = FSDPRunner.from_cfg(_config(
                f'{work_dir}-resumed', kind, background, TOTAL,
                load_from=f'{work_dir}/iter_{FIRST}.pth', resume=True))
            resumed.train()
            out[name]['resumed'] = _final(resumed)
    out['bad value'] = raised(lambda: FSDPRunner.from_cfg(_config(
        f'{root}/bad', 'full', 'yes', FIRST)))
    return out


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    return run_distributed(_two_ranks, 2, str(tmp_path_factory.mktemp('async')), timeout=400)


@pytest.mark.parametrize('kind', list(KINDS))
def test_async_checkpoint_and_its_resume_equal_the_synchronous_ones(ranks, kind):
    sync, background = ranks[0][f'{kind}-sync']['saved'], ranks[0][f'{kind}-async']['saved']
    assert background['iter'] == sync['iter'] == FIRST
    for key in ('state_dict', 'ema', 'optimizer'):
        diff = max_abs_diff(background[key], sync[key])
        assert diff == 0, (key, diff)
    for key in ('info', 'schedulers'):
        assert background[key] == sync[key], key
    for rank in ranks:
        sync, background = rank[f'{kind}-sync'], rank[f'{kind}-async']
        got, want = background['resumed'], sync['resumed']
        assert got['iter'] == want['iter'] == TOTAL
        assert got['lr'] == want['lr']
        for key in ('model', 'optimizer', 'ema'):
            diff = max_abs_diff(got[key], want[key])
            print(f'{kind}: async vs sync resume, {key}: max abs diff {diff}')
            assert diff == 0, (key, diff)


@pytest.mark.parametrize('kind', list(KINDS))
def test_async_checkpoint_appears_at_the_next_save_and_expired_ones_go_after(ranks, kind):
    for rank in ranks:
        sync, background = rank[f'{kind}-sync'], rank[f'{kind}-async']
        work_dir = os.path.dirname(sync['pointer'])
        assert sync['seen'][2] == dict(exists=True, pointer=f'{work_dir}/iter_2.pth',
                                       in_flight=None)
        async_dir = os.path.dirname(background['pointer'])
        # right after its save: being written, not visible, last_checkpoint not yet moved
        assert background['seen'][2] == dict(exists=False, pointer=None,
                                             in_flight=f'{async_dir}/iter_2.pth')
        # at the next save iter_2 was published (and then expired: max_keep_ckpts=1)
        assert background['seen'][4] == dict(exists=False, pointer=f'{async_dir}/iter_2.pth',
                                             in_flight=f'{async_dir}/iter_4.pth')
        # the end of training published iter_4 and deleted iter_2; no temporary is left
        for run in (sync, background):
            assert run['files'] == ['iter_4.pth']
            assert run['pointer'].endswith('/iter_4.pth')


@pytest.mark.parametrize('kind', list(KINDS))
def test_the_next_async_save_copies_into_the_last_ones_staged_tensors(ranks, kind):
    """The save at iteration 4 stages into the memory of iteration 2's copy, allocating none.

    Its values are the new ones: the checkpoint and its resume equal the synchronous ones.
    """
    for rank, result in enumerate(ranks):
        run = result[f'{kind}-async']
        if kind == 'full' and rank:  # rank 0 alone stages a full checkpoint
            assert run['staged'] == 0
            continue
        assert run['staged'] == 2
        [reused] = run['reused']
        assert reused and all(reused.values()), [k for k, same in reused.items() if not same]


def test_a_bad_async_save_is_refused_at_start_up_naming_key_value_and_choices(ranks):
    for rank in ranks:
        kind, message = rank['bad value']
        assert kind == 'TypeError'
        for fragment in ('default_hooks.checkpoint.async_save', "'yes'", 'True or False'):
            assert fragment in message, (fragment, message)
