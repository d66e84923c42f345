"""Saves survive crashes on disk: fsync, rename-aside, stale temporaries and orphans removed.

Single-process tests on real files; the last one trains a real 1-process
``FSDPRunner`` into a work dir that looks like a crashed run's.
"""
import os
import shutil

import torch
from mmengine.config import Config

from mmfsdp.checkpoint.durable import (
    remove_stale_temporaries,
    replace_path,
    save_atomically,
)
from toy import runner_config


def _record_fsyncs(monkeypatch) -> list:
    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f'/proc/self/fd/{fd}'))
        return real(fd)

    monkeypatch.setattr(os, 'fsync', fsync)
    return synced


def test_file_is_synced_before_and_directory_after_the_rename(tmp_path, monkeypatch):
    synced = _record_fsyncs(monkeypatch)
    path = str(tmp_path / 'iter_2.pth')
    save_atomically(dict(x=torch.ones(2)), path)
    assert synced == [path + '.tmp', str(tmp_path)]  # the file under its temporary name
    assert os.listdir(tmp_path) == ['iter_2.pth']
    assert torch.load(path)['x'].tolist() == [1.0, 1.0]


def test_directory_is_replaced_by_rename_aside_and_synced(tmp_path, monkeypatch):
    dst, src = tmp_path / 'iter_2.pth', tmp_path / 'iter_2.pth.tmp'
    dst.mkdir()
    (dst / 'old').write_text('old')
    src.mkdir()
    (src / 'shard').write_text('new')
    synced = _record_fsyncs(monkeypatch)
    replace_path(str(src), str(dst))
    assert os.listdir(tmp_path) == ['iter_2.pth']
    assert os.listdir(dst) == ['shard']
    # every file and the directory itself before the rename, the parent after it
    assert synced[:2] == [str(src / 'shard'), str(src)]
    assert synced[-1] == str(tmp_path)


def test_stale_temporaries_are_removed_and_an_orphaned_aside_restored(tmp_path):
    (tmp_path / 'iter_1.pth.tmp').write_text('half a file')
    (tmp_path / 'iter_3.pth.tmp').mkdir()
    (tmp_path / 'iter_3.pth.tmp' / '__0_0.distcp').write_text('shard')
    (tmp_path / 'iter_4.pth.old.tmp').mkdir()  # crash between the two renames: no iter_4.pth
    (tmp_path / 'iter_5.pth').mkdir()
    (tmp_path / 'iter_5.pth.old.tmp').mkdir()  # crash before the aside was deleted
    (tmp_path / 'keep.txt').write_text('user file')
    removed = remove_stale_temporaries(str(tmp_path))
    assert removed == ['iter_1.pth.tmp', 'iter_3.pth.tmp', 'iter_5.pth.old.tmp']
    assert sorted(os.listdir(tmp_path)) == ['iter_4.pth', 'iter_5.pth', 'keep.txt']


def test_next_save_removes_orphaned_checkpoint_and_stale_temporaries(tmp_path):
    """A crash after repointing ``last_checkpoint`` but before deleting the expired one."""
    from mmfsdp import FSDPRunner

    def run(max_iters):
        cfg = runner_config('durable', str(tmp_path), batch_size=4, max_iters=max_iters,
                            launcher='none', wrapper=dict(type='mmfsdp.MMDistributedDataParallel'))
        cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=2,
                                                  by_epoch=False, max_keep_ckpts=1)
        cfg['resume'] = True
        FSDPRunner.from_cfg(Config(cfg)).train()

    run(4)
    checkpoints = sorted(n for n in os.listdir(tmp_path) if n.endswith('.pth'))
    assert checkpoints == ['iter_4.pth']
    shutil.copy(tmp_path / 'iter_4.pth', tmp_path / 'iter_2.pth')  # the orphan
    (tmp_path / 'iter_5.pth.tmp').write_text('half a file')  # a crashed save
    run(6)
    left = sorted(n for n in os.listdir(tmp_path) if n.startswith('iter_'))
    assert left == ['iter_6.pth']
    assert open(tmp_path / 'last_checkpoint').read() == str(tmp_path / 'iter_6.pth')
