"""Saves survive crashes on disk: fsync, rename-aside, and the clean-up of one run's temporaries.

Real files, no process.
"""
import os

import torch

from mmfsdp.checkpoint.durable import (
    publish_unpublished,
    remove_stale_temporaries,
    replace_path,
    save_atomically,
    temporary_path,
)


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


def test_only_the_given_runs_temporaries_are_removed_and_an_orphaned_aside_restored(tmp_path):
    (tmp_path / 'runa-iter_1.pth.tmp').write_text('half a file')
    (tmp_path / 'runa-iter_3.pth.tmp').mkdir()
    (tmp_path / 'runa-iter_3.pth.tmp' / '__0_0.distcp').write_text('shard')
    (tmp_path / 'runa-iter_4.pth.old.tmp').mkdir()  # crash between the two renames
    (tmp_path / 'iter_5.pth').mkdir()
    (tmp_path / 'runa-iter_5.pth.old.tmp').mkdir()  # crash before the aside was deleted
    (tmp_path / 'runb-iter_6.pth.tmp').write_text('another run, maybe still writing')
    (tmp_path / 'iter_7.pth.tmp').write_text('written by no token')
    (tmp_path / 'notes.tmp').write_text('user file')
    removed = remove_stale_temporaries(str(tmp_path), ['runa'])
    assert removed == ['runa-iter_1.pth.tmp', 'runa-iter_3.pth.tmp', 'runa-iter_5.pth.old.tmp']
    assert sorted(os.listdir(tmp_path)) == ['iter_4.pth', 'iter_5.pth', 'iter_7.pth.tmp',
                                            'notes.tmp', 'runb-iter_6.pth.tmp']
    assert remove_stale_temporaries(str(tmp_path), []) == []


def test_temporaries_carry_the_token(tmp_path):
    assert temporary_path(str(tmp_path / 'iter_2.pth'), 'runa') == str(
        tmp_path / 'runa-iter_2.pth.tmp')
    assert temporary_path(str(tmp_path / 'iter_2.pth') + '/', 'runa', '.old.tmp') == str(
        tmp_path / 'runa-iter_2.pth.old.tmp')


def _lineage(*tokens: str):
    """The ``lineage`` of :func:`publish_unpublished`: ``tokens`` for whatever checkpoint."""
    return lambda path: list(tokens)


def test_auto_resume_publishes_the_newest_complete_temporary_a_killed_run_left(tmp_path):
    """Complete, newer than ``last_checkpoint`` and of its lineage: renamed into place and
    pointed at; a cut write, an older step, a best checkpoint and a name no run of ours writes
    stay as they are."""
    (tmp_path / 'iter_2.pth').write_bytes(b'')
    (tmp_path / 'last_checkpoint').write_text(str(tmp_path / 'iter_2.pth'))
    torch.save({'step': 4}, tmp_path / 'run0123abcd-iter_4.pth.tmp')
    torch.save({'step': 6}, tmp_path / 'run0123abcd-iter_6.pth.tmp')
    cut = (tmp_path / 'run0123abcd-iter_6.pth.tmp').read_bytes()[:-30]
    (tmp_path / 'run0123abcd-iter_8.pth.tmp').write_bytes(cut)
    torch.save({}, tmp_path / 'run0123abcd-iter_1.pth.tmp')
    torch.save({}, tmp_path / 'run0123abcd-best_acc_iter_9.pth.tmp')
    torch.save({}, tmp_path / 'mine-iter_9.pth.tmp')
    lineage = _lineage('run0123abcd')
    assert publish_unpublished(str(tmp_path), 'mmengine.pth', lineage) == str(
        tmp_path / 'iter_6.pth')
    assert torch.load(tmp_path / 'iter_6.pth') == {'step': 6}
    assert (tmp_path / 'last_checkpoint').read_text() == str(tmp_path / 'iter_6.pth')
    assert sorted(os.listdir(tmp_path)) == [
        'iter_2.pth', 'iter_6.pth', 'last_checkpoint', 'mine-iter_9.pth.tmp',
        'run0123abcd-best_acc_iter_9.pth.tmp', 'run0123abcd-iter_1.pth.tmp',
        'run0123abcd-iter_4.pth.tmp', 'run0123abcd-iter_8.pth.tmp']
    assert publish_unpublished(str(tmp_path), 'mmengine.pth', lineage) is None  # none newer


def test_another_runs_complete_temporary_is_never_published(tmp_path):
    """Run ``runaaaaaaaa`` was killed after writing iter_8; run ``runbbbbbbbb`` (started with
    ``resume=False`` in the same work dir) saved iter_2, which ``last_checkpoint`` names."""
    (tmp_path / 'iter_2.pth').write_bytes(b'')
    (tmp_path / 'last_checkpoint').write_text(str(tmp_path / 'iter_2.pth'))
    torch.save({'step': 8}, tmp_path / 'runaaaaaaaa-iter_8.pth.tmp')
    assert publish_unpublished(str(tmp_path), 'mmengine.pth', _lineage('runbbbbbbbb')) is None
    assert sorted(os.listdir(tmp_path)) == ['iter_2.pth', 'last_checkpoint',
                                            'runaaaaaaaa-iter_8.pth.tmp']
    # the run that resumed run a's lineage (its checkpoint names both tokens) publishes it
    assert publish_unpublished(str(tmp_path), 'mmengine.pth',
                               _lineage('runcccccccc', 'runaaaaaaaa')) == str(
        tmp_path / 'iter_8.pth')


def test_a_complete_sharded_temporary_of_the_lineage_is_published(tmp_path):
    import torch.distributed.checkpoint as dcp
    (tmp_path / 'iter_0.pth').write_bytes(b'')
    (tmp_path / 'last_checkpoint').write_text(str(tmp_path / 'iter_0.pth'))
    tmp = tmp_path / 'run0123abcd-iter_2.pth.tmp'
    dcp.save({'w': torch.ones(3)}, checkpoint_id=str(tmp), no_dist=True)
    lineage = _lineage('run0123abcd')
    assert publish_unpublished(str(tmp_path), 'mmengine.pth', lineage) is None  # no mmengine.pth
    torch.save({'meta': {}}, tmp / 'mmengine.pth')
    assert publish_unpublished(str(tmp_path), 'mmengine.pth', lineage) == str(
        tmp_path / 'iter_2.pth')
    assert (tmp_path / 'last_checkpoint').read_text() == str(tmp_path / 'iter_2.pth')


def test_without_last_checkpoint_no_temporary_is_published(tmp_path):
    """Nothing names a lineage: the temporary may be any run's (it is left as it is)."""
    torch.save({'step': 2}, tmp_path / 'run0123abcd-iter_2.pth.tmp')
    assert publish_unpublished(str(tmp_path), 'mmengine.pth', _lineage('run0123abcd')) is None
    assert os.listdir(tmp_path) == ['run0123abcd-iter_2.pth.tmp']
