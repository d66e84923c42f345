"""A run removes only what it wrote: a 1-process ``FSDPRunner`` in a crashed run's work dir."""
import os
import shutil

import torch
from mmengine.config import Config

from toy import runner_config


def _train(work_dir, max_iters: int, resume: bool) -> None:
    from mmfsdp import FSDPRunner
    cfg = runner_config('durable', str(work_dir), batch_size=4, max_iters=max_iters,
                        launcher='none', wrapper=dict(type='mmfsdp.MMDistributedDataParallel'))
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=2,
                                              by_epoch=False, max_keep_ckpts=1)
    cfg['resume'] = resume
    FSDPRunner.from_cfg(Config(cfg)).train()


def test_resumed_run_removes_what_the_crashed_run_left_and_nothing_else(tmp_path):
    """A crash after repointing ``last_checkpoint`` left the expired checkpoint and a
    half-written temporary; files of other runs and of the user stay."""
    _train(tmp_path, 4, resume=False)
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith('.pth')) == ['iter_4.pth']
    saved = torch.load(tmp_path / 'iter_4.pth')
    token = saved['meta']['temporary_tokens'][0]
    # the stock list, and apart the one expired but (at save time) not yet deleted
    assert saved['message_hub']['runtime_info']['keep_ckpt_ids'] == [4]
    assert saved['message_hub']['runtime_info']['expired_ckpt_ids'] == [2]
    shutil.copy(tmp_path / 'iter_4.pth', tmp_path / 'iter_2.pth')  # not deleted: the crash
    (tmp_path / f'{token}-iter_5.pth.tmp').write_text('half a file')  # a crashed save
    foreign = ['iter_1.pth', 'iter_3.pth.tmp', 'runother-iter_5.pth.tmp', 'notes.tmp']
    for name in foreign:  # an earlier run's checkpoint, other runs' and a user's files
        (tmp_path / name).write_text('not written by this run')
    _train(tmp_path, 6, resume=True)
    left = sorted(n for n in os.listdir(tmp_path) if n.startswith('iter_') or n.endswith('.tmp'))
    assert left == sorted(foreign + ['iter_6.pth'])
    assert open(tmp_path / 'last_checkpoint').read() == str(tmp_path / 'iter_6.pth')
    # iter_4 was deleted after iter_6 was saved: iter_6 names it for a crash in between
    hub = torch.load(tmp_path / 'iter_6.pth')['message_hub']['runtime_info']
    assert (hub['keep_ckpt_ids'], hub['expired_ckpt_ids']) == ([6], [4])


def test_saved_keep_ckpt_ids_are_the_stock_hooks(tmp_path):
    """A checkpoint records the ``keep_ckpt_ids`` mmengine's own hook records."""
    from mmengine.runner import Runner

    from mmfsdp import FSDPRunner
    ddp = dict(type='mmfsdp.MMDistributedDataParallel')
    for name, runner_cls, wrapper in (('stock', Runner, None), ('ours', FSDPRunner, ddp)):
        cfg = runner_config(name, str(tmp_path / name), batch_size=4, max_iters=11,
                            launcher='none', wrapper=wrapper)
        cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=1,
                                                  by_epoch=False, max_keep_ckpts=3)
        runner_cls.from_cfg(Config(cfg)).train()
    hubs = [torch.load(tmp_path / name / 'iter_11.pth', weights_only=False)['message_hub']
            for name in ('stock', 'ours')]
    stock, ours = (hub.runtime_info if hasattr(hub, 'runtime_info') else hub['runtime_info']
                   for hub in hubs)
    assert ours['keep_ckpt_ids'] == stock['keep_ckpt_ids'] == [9, 10, 11]
    kept = [sorted(n for n in os.listdir(tmp_path / name) if n.endswith('.pth'))
            for name in ('stock', 'ours')]
    assert kept[0] == kept[1] == ['iter_10.pth', 'iter_11.pth', 'iter_9.pth']


def test_a_new_run_deletes_no_earlier_checkpoint(tmp_path):
    (tmp_path / 'iter_1.pth').write_text('an earlier run (not resumed)')
    (tmp_path / 'iter_1.pth.tmp').write_text('its crashed save')
    _train(tmp_path, 4, resume=False)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith('iter_')) == [
        'iter_1.pth', 'iter_1.pth.tmp', 'iter_4.pth']
