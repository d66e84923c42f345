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
    # as mmengine's hook on resume: ids beyond max_keep_ckpts are deleted, the oldest first
    assert saved['message_hub']['runtime_info']['keep_ckpt_ids'] == [2, 4]
    shutil.copy(tmp_path / 'iter_4.pth', tmp_path / 'iter_2.pth')  # not deleted: the crash
    (tmp_path / f'{token}-iter_5.pth.tmp').write_text('half a file')  # a crashed save
    foreign = ['iter_1.pth', 'iter_3.pth.tmp', 'runother-iter_5.pth.tmp', 'notes.tmp']
    for name in foreign:  # an earlier run's checkpoint, other runs' and a user's files
        (tmp_path / name).write_text('not written by this run')
    _train(tmp_path, 6, resume=True)
    left = sorted(n for n in os.listdir(tmp_path) if n.startswith('iter_') or n.endswith('.tmp'))
    assert left == sorted(foreign + ['iter_6.pth'])
    assert open(tmp_path / 'last_checkpoint').read() == str(tmp_path / 'iter_6.pth')
    # iter_4 was deleted after iter_6 was saved: iter_6 lists it for a crash in between
    assert torch.load(tmp_path / 'iter_6.pth')['message_hub']['runtime_info'][
        'keep_ckpt_ids'] == [4, 6]


def test_a_new_run_deletes_no_earlier_checkpoint(tmp_path):
    (tmp_path / 'iter_1.pth').write_text('an earlier run (not resumed)')
    (tmp_path / 'iter_1.pth.tmp').write_text('its crashed save')
    _train(tmp_path, 4, resume=False)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith('iter_')) == [
        'iter_1.pth', 'iter_1.pth.tmp', 'iter_4.pth']
